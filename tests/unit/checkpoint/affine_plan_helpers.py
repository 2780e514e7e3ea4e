# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Scaffolding shared by the affine planner tests, never a production path: the buffers ZeRO-3 holds, cut
directly from the full parameter, and a transfer plan executed over tensors."""

import torch


def zero3_buffers(flat, world_size, fill):
    """What ZeRO-3 holds: ``ceil(numel / N)`` elements per rank, the tail past the parameter set to ``fill``."""
    partition = -(-flat.numel() // world_size)
    padded = torch.full((partition * world_size, ), fill, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return [padded[rank * partition:(rank + 1) * partition].clone() for rank in range(world_size)]


def apply_plan(plan, sources, targets):
    """Copy every segment of `plan` from sources[rank] into targets[rank]; offsets count from each tensor's first
    element, so views (a parameter's slice of a flat partition) work. Returns targets."""
    for segment in plan.segments:
        source, target = sources[segment.source_rank], targets[segment.target_rank]
        read = torch.as_strided(source, segment.shape, segment.source_strides,
                                source.storage_offset() + segment.source_offset)
        torch.as_strided(target, segment.shape, segment.target_strides,
                         target.storage_offset() + segment.target_offset).copy_(read)
    return targets
