# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-3 repartition carried out through the planner: the sub-group layout, the plan cache and the one
segment executor, with no process group.

Expected partitions are cut straight from the full parameter the way stage 3 cuts them (``zero3_buffers``), and
source padding is NaN, so a wrong layout, a wrong plan or a copy that reads padding cannot agree with them.
"""

import types

import pytest
import torch

from deepspeed.checkpoint.affine import (contiguous_split_map, zero3_flat_layout, zero_partition_map,
                                         zero_partition_sizes)
from deepspeed.checkpoint.affine_transfer import (AffineTransferError, InvalidMapError, PlanBudget, PlanCache,
                                                  TransferSegment, UnsupportedLayoutError, copy_segments,
                                                  plan_transfer)
from unit.checkpoint.affine_plan_helpers import zero3_buffers

DEGREES = [(4, 3), (4, 2), (2, 4), (4, 8), (3, 7), (1, 5), (5, 1), (3, 3)]
NUMELS = [35, 1, 7, 0, 64 * 128, 3]  # one element leaves most ranks nothing but padding; none, nothing at all
POISON = float('nan')
SENTINEL = -7.0


def test_zero_partition_map_is_stage3_partitioning():
    from deepspeed.runtime.zero.partition_parameters import Init
    for numel in (0, 1, 3, 5, 35, 8192, 8193):
        for world_size in (1, 2, 3, 4, 5, 7, 8, 16):
            stub = types.SimpleNamespace(_partition_world_size=lambda param: world_size)
            stub._padding_size = lambda param: Init._padding_size(stub, param)
            partition = Init._aligned_size(stub, types.SimpleNamespace(ds_numel=numel)) // world_size
            sizes = zero_partition_sizes(numel, world_size)
            # _partition_param copies [r * partition, (r + 1) * partition) clipped to the parameter.
            assert sizes == [len(range(numel)[rank * partition:(rank + 1) * partition]) for rank in range(world_size)]
            built = zero_partition_map(numel, world_size)
            assert built.to_dict() == contiguous_split_map((numel, ), sizes, 0).to_dict()
            built.validate_coverage()


@pytest.mark.parametrize('numel,world_size', [(5, 0), (5, -1), (-1, 2)])
def test_zero_partition_sizes_refuses_an_impossible_partition(numel, world_size):
    with pytest.raises(ValueError, match='ZeRO-3 partition'):
        zero_partition_sizes(numel, world_size)


def _stage3_partition_numel(numel, world_size):
    """``ds_tensor.ds_numel`` as stage 3 computes it: ``Init._aligned_size`` over the world size."""
    from deepspeed.runtime.zero.partition_parameters import Init
    stub = types.SimpleNamespace(_partition_world_size=lambda param: world_size)
    stub._padding_size = lambda param: Init._padding_size(stub, param)
    return Init._aligned_size(stub, types.SimpleNamespace(ds_numel=numel)) // world_size


def _flat_partitions(fulls, world_size, fill):
    """Each rank's flat partition of one sub-group: every parameter's whole ZeRO-3 buffer, back to back."""
    per_param = [zero3_buffers(full.view(-1), world_size, fill) for full in fulls]
    return [torch.cat([buffers[rank] for buffers in per_param]) for rank in range(world_size)]


def _repartition(fulls, source_degree, target_degree, cache, dtype=torch.float32):
    """Every target rank's flat partition, filled by the executor from NaN-padded source partitions."""
    sources = _flat_partitions(fulls, source_degree, POISON)
    numels = [full.numel() for full in fulls]
    source_offsets, _ = zero3_flat_layout(numels, source_degree)
    target_offsets, target_numel = zero3_flat_layout(numels, target_degree)
    targets = []
    for rank in range(target_degree):
        flat = torch.full((target_numel, ), SENTINEL, dtype=dtype)
        for numel, source_offset, target_offset in zip(numels, source_offsets, target_offsets):
            size = -(-numel // target_degree)
            segments = cache.zero_partition_segments(numel, source_degree, target_degree, rank)

            def read(source_rank, offset=source_offset, saved_size=-(-numel // source_degree)):
                return sources[source_rank].narrow(0, offset, saved_size)

            copy_segments(segments, read, flat.narrow(0, target_offset, size), rank)
        targets.append(flat)
    return targets


def test_zero3_flat_layout_is_stage3_sub_group_layout():
    for world_size in (1, 2, 3, 4, 7, 16):
        offsets, partition_numel = zero3_flat_layout(NUMELS, world_size)
        sizes = [_stage3_partition_numel(numel, world_size) for numel in NUMELS]
        # stage 3: fp16_partitioned_groups_flat_numel = sum(p.partition_numel()), parameters in sub-group order.
        assert partition_numel == sum(sizes)
        assert offsets == [sum(sizes[:index]) for index in range(len(NUMELS))]
    assert zero3_flat_layout([], 4) == ([], 0)


@pytest.mark.parametrize('numels,world_size', [([5], 0), ([5, -1], 2)])
def test_zero3_flat_layout_refuses_an_impossible_layout(numels, world_size):
    with pytest.raises(ValueError, match='ZeRO-3 layout'):
        zero3_flat_layout(numels, world_size)


@pytest.mark.parametrize('degrees', DEGREES, ids=lambda degrees: f'{degrees[0]}to{degrees[1]}')
def test_sub_group_repartition_matches_stage3(degrees):
    source_degree, target_degree = degrees
    fulls = [torch.randn(numel) for numel in NUMELS]
    targets = _repartition(fulls, source_degree, target_degree, PlanCache())
    # Padding is SENTINEL in the targets, zeros in zero3_buffers: compare the parameters' elements and, apart,
    # that no padding was written.
    expected = _flat_partitions(fulls, target_degree, SENTINEL)
    for rank in range(target_degree):
        assert not torch.isnan(targets[rank]).any(), 'source padding reached a target'
        assert torch.equal(targets[rank], expected[rank])


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_copies_cast_to_the_target_dtype(dtype):
    fulls = [torch.randn(numel) for numel in NUMELS]
    targets = _repartition(fulls, 4, 3, PlanCache(), dtype=dtype)
    expected = _flat_partitions([full.to(dtype) for full in fulls], 3, SENTINEL)
    for rank in range(3):
        assert targets[rank].dtype == dtype and torch.equal(targets[rank], expected[rank])


def test_cache_plans_each_key_once():
    cache = PlanCache()
    first = cache.zero_partition_segments(35, 4, 3, 1)
    for _ in range(4):  # the other states of the parameter, and parameters of the same size
        assert cache.zero_partition_segments(35, 4, 3, 1) is first
    assert (cache.misses, cache.hits, len(cache)) == (1, 4, 1)
    for key in [(36, 4, 3, 1), (35, 5, 3, 1), (35, 4, 2, 1), (35, 4, 3, 2)]:
        cache.zero_partition_segments(*key)
    assert (cache.misses, cache.hits, len(cache)) == (5, 4, 5)


@pytest.mark.parametrize('degrees', DEGREES + [(64, 48), (48, 64)], ids=lambda degrees: f'{degrees[0]}to{degrees[1]}')
def test_cached_segments_are_the_rank_s_part_of_the_plan(degrees):
    source_degree, target_degree = degrees
    for numel in (1, 35, 4097):
        plan = plan_transfer(zero_partition_map(numel, target_degree), zero_partition_map(numel, source_degree))
        cache = PlanCache()
        kept = [
            cache.zero_partition_segments(numel, source_degree, target_degree, rank) for rank in range(target_degree)
        ]
        assert tuple(segment for segments in kept for segment in segments) == plan.segments
        for segments in kept:
            assert len(segments) <= -(-source_degree // target_degree) + 1


def test_cache_budget_and_refusals_are_not_cached():
    # 4096 -> 3072 is within the default budget: a rank gets at most two segments of its 3-element partition.
    segments = PlanCache().zero_partition_segments(3 * 3072, 4096, 3072, 3071)
    assert sum(segment.numel for segment in segments) == 3 and len(segments) <= 2
    # A ZeRO-3 map has one piece per rank: the pieces limit (4096 by default) follows the world sizes.
    segments = PlanCache().zero_partition_segments(6144, 8192, 6144, 6143)
    assert [(segment.source_rank, segment.source_offset, segment.numel) for segment in segments] == [(6143, 0, 1)]
    cache = PlanCache(PlanBudget(max_segments=1))
    for _ in range(2):
        with pytest.raises(AffineTransferError, match='max_segments'):
            cache.zero_partition_segments(35, 4, 3, 0)
    assert (cache.misses, len(cache)) == (2, 0)
    with pytest.raises(InvalidMapError, match='target rank 3'):
        PlanCache().zero_partition_segments(35, 4, 3, 3)


@pytest.mark.parametrize('world_size', [1, 3, 8192])
def test_an_unchanged_world_size_copies_each_rank_s_own_prefix(world_size):
    cache = PlanCache()
    for numel in (0, 1, 35, 9000):
        for rank in {0, 1 % world_size, world_size - 1}:
            size = zero_partition_sizes(numel, world_size)[rank]
            expected = (TransferSegment(rank, 0, (1, ), rank, 0, (1, ), (size, )), ) if size else ()
            assert cache.zero_partition_segments(numel, world_size, world_size, rank) == expected


def test_copies_from_parameters_build_no_graph():
    """Saved fp32 partitions load as tensors that require grad (they were Parameters): the target must stay a plain
    tensor, with no graph holding the (memory-mapped) sources alive."""
    full = torch.randn(35)
    sources = [buffer.requires_grad_() for buffer in zero3_buffers(full, 8, POISON)]
    target = copy_segments(PlanCache().zero_partition_segments(35, 8, 3, 1), sources.__getitem__, torch.zeros(12), 1)
    assert torch.equal(target, full[12:24])
    assert not target.requires_grad and target.grad_fn is None


def test_executor_reads_only_the_ranks_it_needs():
    full = torch.randn(35)
    sources = zero3_buffers(full, 8, POISON)
    read = []

    def read_source(rank):
        read.append(rank)
        return sources[rank]

    segments = PlanCache().zero_partition_segments(35, 8, 3, 1)
    target = copy_segments(segments, read_source, torch.zeros(12), 1)
    assert torch.equal(target, full[12:24])
    # Rank 1 of 3 holds elements 12..23, which ranks 2, 3 and 4 of 8 (5 elements each) saved: each read once.
    assert read == [2, 3, 4]


def test_executor_refusals():
    full = torch.randn(35)
    sources = zero3_buffers(full, 4, POISON)
    segments = PlanCache().zero_partition_segments(35, 4, 3, 1)
    with pytest.raises(InvalidMapError, match='target rank 1 was given to rank 0'):
        copy_segments(segments, sources.__getitem__, torch.zeros(12), 0)
    with pytest.raises(AffineTransferError, match='target rank 1: a segment reaches element'):
        copy_segments(segments, sources.__getitem__, torch.zeros(11), 1)
    target = torch.full((12, ), SENTINEL)
    with pytest.raises(AffineTransferError, match='source rank 2: a segment reaches element'):
        copy_segments(segments, lambda rank: sources[rank] if rank == 1 else sources[rank][:3], target, 1)
    assert (target == SENTINEL).all(), 'a refused plan wrote part of the target'
    with pytest.raises(UnsupportedLayoutError, match='non-contiguous'):
        copy_segments(segments, sources.__getitem__, torch.zeros(24)[::2], 1)
