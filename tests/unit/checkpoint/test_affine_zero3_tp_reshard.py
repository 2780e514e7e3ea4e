# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One rank's ZeRO-3 partition across a tensor- and data-parallel change, planned for that rank alone.

Expected partitions are cut from the full tensor the way AutoTP and ZeRO-3 cut it -- torch.split of the TP
dimension (of each fused block for a fused parameter), the whole tensor on every TP rank for a replicated
one, then ZeRO-3 over the flattened shard with global rank ``dp_rank * tp_size + tp_rank`` -- never through
a map. Saved partitions carry NaN padding, so a copy that reads padding cannot go unnoticed.
"""

import math
import random

import pytest
import torch

from deepspeed.checkpoint.affine import (AffinePiece, ParamAffineMap, block_gather_map, contiguous_split_map,
                                         replicated_map, segmented_map, sub_param_map)
from deepspeed.checkpoint.affine_transfer import (AffineTransferError, InvalidMapError, PlanBudget, PlanCache,
                                                  UnsupportedLayoutError, _flat_range_boxes, copy_segments,
                                                  plan_zero3_reshard_for_rank)
from unit.checkpoint.affine_plan_helpers import zero3_buffers

POISON = float('nan')
LAYOUTS = ('rows', 'columns', 'replicated', 'fused_rows', 'fused_columns')


def _even_split(size, parts):
    base, extra = divmod(size, parts)
    return [base + (1 if index < extra else 0) for index in range(parts)]


def _split_dim(layout):
    return 0 if layout.endswith('rows') else 1


def _tp_shards(full, layout, tp_size):
    """AutoTP's shards: an even split of rows or columns; for a fused parameter, an even split of each of its
    three blocks, a rank's parts concatenated; or the whole tensor on every rank."""
    if layout == 'replicated':
        return [full.clone() for _ in range(tp_size)]
    dim = _split_dim(layout)
    if layout.startswith('fused'):
        blocks = [torch.split(block, _even_split(block.shape[dim], tp_size), dim) for block in full.chunk(3, dim)]
        return [torch.cat([parts[rank] for parts in blocks], dim) for rank in range(tp_size)]
    return list(torch.split(full, _even_split(full.shape[dim], tp_size), dim))


def _tp_map(shape, layout, tp_size):
    if layout == 'replicated':
        return replicated_map(shape, tp_size)
    dim = _split_dim(layout)
    if layout.startswith('fused'):
        block = shape[dim] // 3
        return sub_param_map(shape, [block] * 3, [_even_split(block, tp_size)] * 3, dim)
    return contiguous_split_map(shape, _even_split(shape[dim], tp_size), dim)


def _zero3_partitions(full, layout, tp_size, dp_size, fill):
    """Global rank -> its ZeRO-3 buffer, ``ceil(numel / dp_size)`` elements of its flattened TP shard."""
    partitions = {}
    for tp_rank, shard in enumerate(_tp_shards(full, layout, tp_size)):
        for dp_rank, buffer in enumerate(zero3_buffers(shard.contiguous().view(-1), dp_size, fill)):
            partitions[dp_rank * tp_size + tp_rank] = buffer
    return partitions


def _assert_every_rank_is_exact(full, layout, source, target):
    (source_tp, source_dp), (target_tp, target_dp) = source, target
    saved = _zero3_partitions(full, layout, source_tp, source_dp, POISON)
    expected = _zero3_partitions(full, layout, target_tp, target_dp, 0.0)
    source_map, target_map = _tp_map(full.shape, layout, source_tp), _tp_map(full.shape, layout, target_tp)
    for rank, want in expected.items():
        segments = plan_zero3_reshard_for_rank(source_map, source_dp, target_map, target_dp, rank)
        got = copy_segments(segments, saved.__getitem__, torch.zeros_like(want), rank)
        assert torch.equal(got, want), (layout, source, target, rank)


CHANGES = [
    ((2, 1), (1, 2)),
    ((1, 2), (2, 1)),
    ((2, 2), (1, 4)),
    ((2, 3), (4, 1)),
    ((4, 3), (2, 5)),
    ((2, 2), (2, 3)),
    ((3, 1), (3, 1)),
]


@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('shape', [(12, 15), (6, 3)], ids=str)
@pytest.mark.parametrize('source,target', CHANGES, ids=lambda layout: 'TP{}xDP{}'.format(*layout))
def test_every_rank_is_exact(shape, layout, source, target):
    """(6, 3) at TP4 leaves a rank of a column split, and of each fused column block, with an empty shard."""
    _assert_every_rank_is_exact(torch.randn(shape), layout, source, target)


@pytest.mark.parametrize('source,target', CHANGES, ids=lambda layout: 'TP{}xDP{}'.format(*layout))
def test_one_axis_parameters_are_exact(source, target):
    for layout in ('rows', 'replicated'):
        _assert_every_rank_is_exact(torch.randn(10), layout, source, target)


def test_random_layouts_are_exact():
    chooser = random.Random(0)
    for _ in range(60):
        layout = chooser.choice(LAYOUTS)
        shape = (3 * chooser.randint(1, 5), 3 * chooser.randint(1, 4))
        source, target = [(chooser.randint(1, 4), chooser.randint(1, 4)) for _ in range(2)]
        _assert_every_rank_is_exact(torch.randn(shape), layout, source, target)


def _saved_ranks_read(layout, source, target):
    (source_tp, source_dp), (target_tp, target_dp) = source, target
    shape = (8, 6)
    return [
        sorted({
            segment.source_rank
            for segment in plan_zero3_reshard_for_rank(_tp_map(shape, layout, source_tp), source_dp,
                                                       _tp_map(shape, layout, target_tp), target_dp, rank)
        }) for rank in range(target_tp * target_dp)
    ]


@pytest.mark.parametrize('layout,source,target,reads', [
    ('rows', (2, 1), (1, 2), [[0], [1]]),
    ('columns', (2, 1), (1, 2), [[0, 1], [0, 1]]),
    ('replicated', (2, 1), (1, 2), [[0], [0]]),
    ('rows', (1, 2), (2, 1), [[0], [1]]),
    ('columns', (1, 2), (2, 1), [[0, 1], [0, 1]]),
    ('replicated', (1, 2), (2, 1), [[0, 1], [0, 1]]),
    ('replicated', (2, 1), (2, 2), [[0], [1], [0], [1]]),
])
def test_each_rank_reads_only_the_saved_partitions_it_needs(layout, source, target, reads):
    """The saved ranks a loading rank's copies name are the files it opens. A replica comes from the saved TP
    rank equal to the loading TP rank where there is one, so the TP ranks of a DP rank read different files."""
    assert _saved_ranks_read(layout, source, target) == reads


def test_replicas_laid_out_differently_are_planned():
    """Replicas whose DP partitions do not line up: per rank each is read from one holder, with that holder's own
    layout: TP rank 1 of the target reads saved TP rank 1, which holds the vector's halves swapped."""
    length, half = 7, 3
    pieces = {
        0: [
            AffinePiece((half, ), 0, (1, ), 0, (1, ), [0, 1]),
            AffinePiece((length - half, ), half, (1, ), half, (1, ), [0, 1])
        ],
        1: [
            AffinePiece((half, ), 0, (1, ), length - half, (1, ), [0, 1]),
            AffinePiece((length - half, ), half, (1, ), 0, (1, ), [0, 1])
        ]
    }
    swapped_halves = ParamAffineMap((length, ), {0: (length, ), 1: (length, )}, pieces)
    full = torch.randn(length)
    shards = [full, torch.cat([full[half:], full[:half]])]
    for source_dp, target_dp in ((2, 3), (3, 2), (2, 1)):
        saved = {
            dp_rank * 2 + tp_rank: buffer
            for tp_rank, shard in enumerate(shards)
            for dp_rank, buffer in enumerate(zero3_buffers(shard, source_dp, POISON))
        }
        read = set()
        for dp_rank, want in enumerate(zero3_buffers(full, target_dp, 0.0)):
            for tp_rank in range(2):
                rank = dp_rank * 2 + tp_rank
                segments = plan_zero3_reshard_for_rank(swapped_halves, source_dp, replicated_map((length, ), 2),
                                                       target_dp, rank)
                assert {segment.source_rank % 2 for segment in segments} <= {tp_rank}
                read |= {segment.source_rank for segment in segments}
                assert torch.equal(copy_segments(segments, saved.__getitem__, torch.zeros_like(want), rank), want)
        assert read == set(saved)


def _partitions_by_extract(full, tp_map, dp_size, fill):
    """ZeRO-3 buffers of each TP shard as the map itself defines the shard (``ParamAffineMap.extract``)."""
    partitions = {}
    for tp_rank in range(len(tp_map.shard_shapes)):
        shard = tp_map.extract(full, tp_rank).reshape(-1)
        for dp_rank, buffer in enumerate(zero3_buffers(shard, dp_size, fill)):
            partitions[dp_rank * len(tp_map.shard_shapes) + tp_rank] = buffer
    return partitions


OTHER_LAYOUTS = {
    # a fused QKV whose query rows are split and whose key/value rows every rank holds whole
    'segmented': (lambda tp: segmented_map((12, 5), [(8, False), (4, True)], 0, tp, [_even_split(8, tp)]), (12, 5)),
    # each rank holds non-adjacent blocks of rows
    'block_gather': (lambda tp: block_gather_map((12, 5), {rank: list(range(rank, 4, tp))
                                                           for rank in range(tp)}, 3, 0), (12, 5)),
    'three_axes': (lambda tp: contiguous_split_map((4, 6, 5), _even_split(6, tp), 1), (4, 6, 5)),
}


@pytest.mark.parametrize('layout', sorted(OTHER_LAYOUTS))
@pytest.mark.parametrize('source,target', [((2, 3), (1, 2)), ((1, 2), (2, 3)), ((2, 16), (1, 1)), ((1, 1), (2, 16))],
                         ids=lambda layout: 'TP{}xDP{}'.format(*layout))
def test_other_builders_are_exact(layout, source, target):
    """Expected shards come from the builders' own extract here; DP 16 -> 1 cuts every copy many times."""
    build, shape = OTHER_LAYOUTS[layout]
    (source_tp, source_dp), (target_tp, target_dp) = source, target
    full = torch.randn(shape)
    source_map, target_map = build(source_tp), build(target_tp)
    saved = _partitions_by_extract(full, source_map, source_dp, POISON)
    for rank, want in _partitions_by_extract(full, target_map, target_dp, 0.0).items():
        segments = plan_zero3_reshard_for_rank(source_map, source_dp, target_map, target_dp, rank)
        assert torch.equal(copy_segments(segments, saved.__getitem__, torch.zeros_like(want), rank), want)


def test_large_grids_plan_per_rank_under_the_default_budget():
    """TP2 x DP96 -> TP4 x DP64 (192 saved ranks): each of the 256 loading ranks plans its own copies from the TP
    maps alone, under the default budget."""
    shape = (4096, 1024)
    source_map, target_map = _tp_map(shape, 'rows', 2), _tp_map(shape, 'rows', 4)
    partition = shape[0] * shape[1] // 4 // 64
    for rank in range(4 * 64):
        segments = plan_zero3_reshard_for_rank(source_map, 96, target_map, 64, rank)
        assert sum(segment.numel for segment in segments) == partition
        # 16384 elements meet at most two saved partitions of 21846, each in a partial row, full rows, a partial row.
        assert len(segments) <= 6
    # Exact on a few ranks against partitions cut directly (each a 16384-element range of 4096 x 1024).
    full = torch.randn(shape)
    saved = _zero3_partitions(full, 'rows', 2, 96, POISON)
    expected = _zero3_partitions(full, 'rows', 4, 64, 0.0)
    for rank in (0, 101, 255):
        segments = plan_zero3_reshard_for_rank(source_map, 96, target_map, 64, rank)
        assert torch.equal(copy_segments(segments, saved.__getitem__, torch.zeros_like(expected[rank]), rank),
                           expected[rank])


def test_the_cache_plans_each_distinct_question_once():
    cache = PlanCache()
    source_map, target_map = _tp_map((12, 15), 'columns', 2), _tp_map((12, 15), 'columns', 3)
    first = cache.zero3_reshard_segments(source_map, 2, target_map, 3, 4)
    assert first == plan_zero3_reshard_for_rank(source_map, 2, target_map, 3, 4)
    assert cache.zero3_reshard_segments(_tp_map((12, 15), 'columns', 2), 2, target_map, 3, 4) is first
    assert (cache.hits, cache.misses) == (1, 1)
    cache.zero3_reshard_segments(source_map, 2, target_map, 3, 5)
    cache.zero3_reshard_segments(source_map, 2, _tp_map((12, 15), 'rows', 3), 3, 4)
    cache.zero3_reshard_segments(source_map, 2, target_map, 2, 4)
    assert (cache.hits, cache.misses, len(cache)) == (1, 4, 4)


def test_the_cache_tells_maps_apart_by_their_empty_shards():
    """A TP1 map and a TP2 map whose rank 1 holds nothing have the same pieces but number the saved ranks
    differently (dp * tp_size + tp)."""
    whole = contiguous_split_map((4, 3), [4], 0)
    with_empty_rank = ParamAffineMap((4, 3), {0: (4, 3), 1: (0, 3)}, {0: whole.pieces_by_rank[0], 1: []})
    target_map = replicated_map((4, 3), 1)
    cache = PlanCache()
    assert {segment.source_rank for segment in cache.zero3_reshard_segments(whole, 2, target_map, 1, 0)} == {0, 1}
    assert {segment.source_rank
            for segment in cache.zero3_reshard_segments(with_empty_rank, 2, target_map, 1, 0)} == {0, 2}
    assert (cache.hits, cache.misses) == (0, 2)


def test_the_cache_refuses_a_malformed_map_as_the_planner_does():
    piece = AffinePiece((4, ), 0, (1, ), 0, (1, ), [0])
    no_shard_shape = ParamAffineMap((4, ), {0: (4, )}, {0: [piece], 1: [piece]})
    for plan in (plan_zero3_reshard_for_rank, PlanCache().zero3_reshard_segments):
        with pytest.raises(InvalidMapError):
            plan(no_shard_shape, 1, replicated_map((4, ), 1), 1, 0)


def test_what_cannot_be_planned_is_refused():
    shape = (12, 15)
    source_map, target_map = _tp_map(shape, 'rows', 2), _tp_map(shape, 'rows', 1)
    with pytest.raises(InvalidMapError, match='target rank 2 is not one of TP1 x DP2 ranks'):
        plan_zero3_reshard_for_rank(source_map, 1, target_map, 2, 2)
    with pytest.raises(InvalidMapError, match='data parallel sizes must be positive'):
        plan_zero3_reshard_for_rank(source_map, 0, target_map, 2, 0)
    with pytest.raises(InvalidMapError, match='source describes'):
        plan_zero3_reshard_for_rank(_tp_map((12, 14), 'rows', 2), 1, target_map, 2, 0)
    with pytest.raises(UnsupportedLayoutError, match='scale 0.5'):
        plan_zero3_reshard_for_rank(replicated_map(shape, 2, scale=0.5), 1, target_map, 2, 0)
    gap = ParamAffineMap(shape, {0: shape, 2: shape}, {0: [], 2: []})
    with pytest.raises(InvalidMapError, match='source tensor parallel ranks must be 0..1'):
        plan_zero3_reshard_for_rank(gap, 1, target_map, 2, 0)
    with pytest.raises(AffineTransferError, match='exceeds max_segments 1'):  # the TP maps' own plan
        plan_zero3_reshard_for_rank(_tp_map(shape, 'columns', 2), 1, target_map, 2, 0, PlanBudget(max_segments=1))
    vector = replicated_map((12, ), 1)  # one TP copy, cut into four by the saved DP partitions
    with pytest.raises(AffineTransferError, match=r'more than 2 segments \(max_segments\) for target rank 0'):
        plan_zero3_reshard_for_rank(vector, 4, vector, 1, 0, PlanBudget(max_segments=2))
    with pytest.raises(AffineTransferError, match='over max_plan_bytes 100'):
        plan_zero3_reshard_for_rank(vector, 4, vector, 1, 0, PlanBudget(max_plan_bytes=100))


def test_flat_range_boxes_tile_each_range_in_order():
    """The boxes a DP range of a flattened TP shard falls into: each one run of the shard, in order, covering the
    range exactly, at most 2 * ndim - 1 of them."""
    shape = (3, 4, 5)
    numel = math.prod(shape)
    strides = (20, 5, 1)
    for start in range(numel):
        for stop in range(start + 1, numel + 1):
            boxes = _flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            cursor = start
            for origin, extent in boxes:
                assert all(0 <= at and at + size <= dim for at, size, dim in zip(origin, extent, shape))
                assert sum(at * stride for at, stride in zip(origin, strides)) == cursor
                last = [at + size - 1 for at, size in zip(origin, extent)]
                assert sum(at * stride for at, stride in zip(last, strides)) == cursor + math.prod(extent) - 1
                cursor += math.prod(extent)
            assert cursor == stop


def test_rank_numbering_is_deepspeeds(monkeypatch):
    """AutoTP's groups number global rank dp_rank * tp + tp_rank (the DP group of TP rank t is {t, t + tp, ...}),
    and the planner fills that rank with DP partition dp_rank of TP shard tp_rank."""
    from deepspeed.utils import groups
    made = []
    monkeypatch.setattr(groups.dist, 'get_world_size', lambda *args, **kwargs: 6)
    monkeypatch.setattr(groups.dist, 'get_rank', lambda *args, **kwargs: 0)
    monkeypatch.setattr(groups.dist, 'new_group', lambda ranks: made.append(list(ranks)) or tuple(ranks))
    for name in ('_DATA_PARALLEL_GROUP', '_MODEL_PARALLEL_GROUP', '_TENSOR_MODEL_PARALLEL_GROUP'):
        monkeypatch.setattr(groups, name, None)
    groups._init_tp_groups_with_new_group(tensor_model_parallel_size=2, data_parallel_size=3)
    data_parallel_groups, tensor_parallel_groups = made[:2], made[2:]
    assert tensor_parallel_groups == [[0, 1], [2, 3], [4, 5]]
    full = torch.randn(4, 3)
    tp_map = _tp_map((4, 3), 'rows', 2)
    saved = _zero3_partitions(full, 'rows', 2, 3, POISON)
    for tp_rank, ranks in enumerate(data_parallel_groups):
        for dp_rank, rank in enumerate(ranks):
            assert rank == dp_rank * 2 + tp_rank
            segments = plan_zero3_reshard_for_rank(tp_map, 3, tp_map, 3, rank)
            assert {segment.source_rank for segment in segments} == {rank}  # an unchanged layout reads its own file
            # TP rank t holds rows 2t and 2t + 1; DP rank d holds elements [2d, 2d + 2) of them.
            want = full[2 * tp_rank:2 * tp_rank + 2].reshape(-1)[2 * dp_rank:2 * dp_rank + 2]
            assert torch.equal(copy_segments(segments, saved.__getitem__, torch.zeros(2), rank), want)
