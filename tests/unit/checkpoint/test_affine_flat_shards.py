# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Flat (one-axis) shards of multi-axis parameters: ZeRO-3 under tensor parallelism.

Expected buffers are cut from a full tensor the way AutoTP and ZeRO-3 cut it, with global ranks
numbered as DeepSpeed's own TP group construction numbers them (checked against
``groups._init_tp_groups_with_new_group`` below), never through a map.
"""

import math

import pytest
import torch

from deepspeed.checkpoint.affine import (AffinePiece, ParamAffineMap, contiguous_split_map, replicated_map,
                                         sub_param_map, zero_partition_of_shards, _flat_range_boxes)
from deepspeed.checkpoint.affine_transfer import (AffineTransferError, UnsupportedLayoutError,
                                                  plan_zero3_data_parallel_reshard, plan_transfer)
from unit.checkpoint.affine_plan_helpers import apply_plan, zero3_buffers

POISON = float('nan')


def _even_split(size, parts):
    base, extra = divmod(size, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def _tp_zero3_buffers(full, tp_dim, tp_degree, dp_degree, fill):
    """ZeRO-3 under AutoTP: global rank ``dp_rank * tp_degree + tp_rank`` holds ZeRO-3 partition
    ``dp_rank`` of TP shard ``tp_rank`` (file ``zero_pp_rank_{dp_rank}_mp_rank_{tp_rank:02d}``)."""
    buffers = {}
    for tp_rank, shard in enumerate(torch.split(full, _even_split(full.shape[tp_dim], tp_degree), dim=tp_dim)):
        for dp_rank, buffer in enumerate(zero3_buffers(shard.contiguous().view(-1), dp_degree, fill)):
            buffers[dp_rank * tp_degree + tp_rank] = buffer
    return buffers


def test_rank_numbering_is_deepspeeds(monkeypatch):
    """The DP group of TP rank t is {t, t + tp, t + 2 tp, ...}: global rank = dp_rank * tp + tp_rank."""
    from deepspeed.utils import groups
    made = []
    monkeypatch.setattr(groups.dist, 'get_world_size', lambda *args, **kwargs: 6)
    monkeypatch.setattr(groups.dist, 'get_rank', lambda *args, **kwargs: 0)
    monkeypatch.setattr(groups.dist, 'new_group', lambda ranks: made.append(list(ranks)) or tuple(ranks))
    for name in ('_DATA_PARALLEL_GROUP', '_MODEL_PARALLEL_GROUP', '_TENSOR_MODEL_PARALLEL_GROUP'):
        monkeypatch.setattr(groups, name, None)
    groups._init_tp_groups_with_new_group(tensor_model_parallel_size=2, data_parallel_size=3)
    data_parallel_groups, tensor_parallel_groups = made[:2], made[2:]
    built = zero_partition_of_shards(contiguous_split_map((4, 3), [2, 2], 0), 3)
    for tp_rank, ranks in enumerate(data_parallel_groups):
        for dp_rank, rank in enumerate(ranks):
            assert rank == dp_rank * 2 + tp_rank
            # TP rank t's rows are rows 2t, 2t + 1; DP rank d holds elements [2d, 2d + 2) of them.
            assert built.pieces_by_rank[rank][0].source_offset == tp_rank * 6 + dp_rank * 2
            assert sum(piece.numel for piece in built.pieces_by_rank[rank]) == 2
    assert tensor_parallel_groups == [[0, 1], [2, 3], [4, 5]]


TP_CASES = [
    ((8, 6), (2, 2), (1, 3)),
    ((9, 4), (2, 3), (3, 2)),
    ((37, 20), (4, 3), (2, 5)),
    ((64, 128), (2, 4), (4, 3)),
    ((12, 10), (2, 4), (2, 3)),
]


@pytest.mark.parametrize('tp_dim', [0, 1])
@pytest.mark.parametrize('shape,source,target', TP_CASES, ids=lambda case: str(case))
def test_zero3_under_tp_reshard_is_exact(shape, source, target, tp_dim):
    (source_tp, source_dp), (target_tp, target_dp) = source, target
    full = torch.randn(shape)
    source_map = zero_partition_of_shards(contiguous_split_map(shape, _even_split(shape[tp_dim], source_tp), tp_dim),
                                          source_dp)
    target_map = zero_partition_of_shards(contiguous_split_map(shape, _even_split(shape[tp_dim], target_tp), tp_dim),
                                          target_dp)
    source_map.validate_coverage()
    target_map.validate_coverage()
    # A DP range of a flattened TP shard is at most a partial row, full rows and a partial row.
    assert max(len(pieces) for pieces in source_map.pieces_by_rank.values()) <= 3

    sources = _tp_zero3_buffers(full, tp_dim, source_tp, source_dp, POISON)
    expected = _tp_zero3_buffers(full, tp_dim, target_tp, target_dp, 0.0)
    targets = {rank: torch.zeros_like(buffer) for rank, buffer in expected.items()}
    plan = plan_transfer(target_map, source_map)
    apply_plan(plan, sources, targets)
    for rank, buffer in expected.items():
        assert torch.equal(targets[rank], buffer), f'target rank {rank}'
    assert plan.moved_elements == full.numel()

    if source_tp == target_tp:
        # The same move planned per TP shard through the sweep: same result, fewer segments.
        per_shard = plan_zero3_data_parallel_reshard(
            contiguous_split_map(shape, _even_split(shape[tp_dim], source_tp), tp_dim), source_dp, target_dp)
        again = apply_plan(per_shard, _tp_zero3_buffers(full, tp_dim, source_tp, source_dp, POISON), {
            rank: torch.zeros_like(buffer)
            for rank, buffer in expected.items()
        })
        for rank, buffer in expected.items():
            assert torch.equal(again[rank], buffer), f'target rank {rank}'
        assert len(per_shard.segments) <= len(plan.segments)
        assert len(per_shard.segments) <= source_tp * (source_dp + target_dp - 1)


@pytest.mark.parametrize('tp,source,target', [(2, 128, 96), (8, 64, 48), (2, 512, 384)])
def test_per_tp_shard_plan_scales_under_the_default_budget(tp, source, target):
    shard_map = contiguous_split_map((4096, 4096), _even_split(4096, tp), 0)
    plan = plan_zero3_data_parallel_reshard(shard_map, source, target)
    assert plan.moved_elements == 4096 * 4096
    assert len(plan.segments) <= tp * (source + target - 1)
    assert {segment.source_rank % tp == segment.target_rank % tp for segment in plan.segments} == {True}


def test_replicated_pieces_with_one_layout_are_partitioned_on_every_holder():
    """A LayerNorm or row-parallel bias under AutoTP: every TP rank holds the whole of it."""
    full = torch.randn(6, 4)
    source_map = zero_partition_of_shards(replicated_map((6, 4), 2), 3)
    source_map.validate_coverage()
    for rank, pieces in source_map.pieces_by_rank.items():
        for piece in pieces:
            assert piece.locations == {rank - rank % 2, rank - rank % 2 + 1}
    sources = {}
    for dp_rank, buffer in enumerate(zero3_buffers(full.view(-1), 3, POISON)):
        sources[dp_rank * 2] = buffer
        sources[dp_rank * 2 + 1] = buffer.clone()
    for target_tp, target_dp in ((1, 2), (2, 5), (3, 4)):
        target_map = zero_partition_of_shards(replicated_map((6, 4), target_tp), target_dp)
        targets = {rank: torch.zeros(-(-24 // target_dp)) for rank in target_map.shard_shapes}
        apply_plan(plan_transfer(target_map, source_map), sources, targets)
        for dp_rank, buffer in enumerate(zero3_buffers(full.view(-1), target_dp, 0.0)):
            for tp_rank in range(target_tp):
                assert torch.equal(targets[dp_rank * target_tp + tp_rank][:buffer.numel()], buffer)


def test_replicas_laid_out_differently_are_refused():
    different = ParamAffineMap((2, 4), {
        0: (2, 4),
        1: (2, 4)
    }, {
        0: [AffinePiece((2, 4), 0, (4, 1), 0, (4, 1), [0, 1])],
        1: [AffinePiece((1, 4), offset, (4, 1), offset, (4, 1), [0, 1]) for offset in (0, 4)]
    })
    with pytest.raises(ValueError, match='lays it out differently'):
        zero_partition_of_shards(different, 2)


def test_partition_of_shards_refuses_what_it_cannot_describe():
    fused = sub_param_map((4, 6), [3, 3], [[2, 1], [1, 2]], 1)
    with pytest.raises(ValueError, match='not contiguous'):
        zero_partition_of_shards(fused, 2)
    gapped = ParamAffineMap((4, 4), {0: (2, 4), 2: (2, 4)}, {0: [], 2: []})
    with pytest.raises(ValueError, match='tensor parallel ranks'):
        zero_partition_of_shards(gapped, 2)
    with pytest.raises(AffineTransferError, match='tensor parallel ranks'):
        plan_zero3_data_parallel_reshard(gapped, 2, 3)


def test_flat_shard_piece_must_be_dense_in_its_own_shape():
    whole = contiguous_split_map((4, 6), [4], 0)
    flat = zero_partition_of_shards(whole, 2)
    assert plan_transfer(whole, flat).moved_elements == 24
    (piece, ) = flat.pieces_by_rank[0]
    assert piece.shape == (2, 6) and piece.dest_strides == (6, 1)
    # Same elements, but the rows 7 apart: not one run of the flat shard.
    flat.pieces_by_rank[0] = [AffinePiece((2, 6), 0, (6, 1), 0, (7, 1), [0])]
    with pytest.raises(UnsupportedLayoutError, match='dest axis 0 strides 7, expected 6'):
        plan_transfer(whole, flat)


def test_a_flat_shard_is_planned_and_a_shard_of_other_rank_is_refused():
    """The updated form of #8623's ``test_a_shard_described_with_the_wrong_rank_is_refused``."""
    flat = ParamAffineMap(logical_shape=(4, 4),
                          shard_shapes={0: (16, )},
                          pieces_by_rank={0: [AffinePiece((4, 4), 0, (4, 1), 0, (4, 1), [0])]})
    plan = plan_transfer(replicated_map((4, 4), 1), flat)
    assert plan.moved_elements == 16
    strided = ParamAffineMap(logical_shape=(4, 4),
                             shard_shapes={0: (16, )},
                             pieces_by_rank={0: [AffinePiece((4, 4), 0, (4, 1), 0, (1, 4), [0])]})
    with pytest.raises(UnsupportedLayoutError, match='dest axis 0 strides 1, expected 4'):
        plan_transfer(replicated_map((4, 4), 1), strided)
    two_axes = ParamAffineMap(logical_shape=(2, 2, 4),
                              shard_shapes={0: (4, 4)},
                              pieces_by_rank={0: [AffinePiece((2, 2, 4), 0, (8, 4, 1), 0, (8, 4, 1), [0])]})
    with pytest.raises(UnsupportedLayoutError, match='number of axes'):
        plan_transfer(replicated_map((2, 2, 4), 1), two_axes)


def test_flat_range_boxes_tile_each_range_in_order():
    shape = (3, 4, 5)
    numel = math.prod(shape)
    strides = (20, 5, 1)
    for start in range(numel):
        for stop in range(start + 1, numel + 1):
            boxes = _flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            cursor = start
            for origin, extent in boxes:
                assert sum(at * stride for at, stride in zip(origin, strides)) == cursor
                last = [at + size - 1 for at, size in zip(origin, extent)]
                assert sum(at * stride for at, stride in zip(last, strides)) == cursor + math.prod(extent) - 1
                cursor += math.prod(extent)
            assert cursor == stop
