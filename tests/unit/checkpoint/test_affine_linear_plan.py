# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The O(N + M) sweep ``plan_transfer`` takes for one-axis maps, and the ZeRO-3 maps that need it.

The sweep claims to return the pairwise path's plan, and to refuse where that path refuses. Both are
checked by running the two paths on the same maps -- the pairwise one by switching the sweep off --
over hand-built ZeRO maps, a seeded random generator of valid and deliberately broken maps, and each
``PlanBudget`` field at its limit and one over it. Expected ZeRO-3 buffers are cut straight from a
full tensor the way stage 3 cuts them, so a wrong map and a wrong plan cannot agree and pass.
"""

import random

import pytest
import torch

from deepspeed.checkpoint import affine_transfer
from deepspeed.checkpoint.affine import AffinePiece, ParamAffineMap, contiguous_split_map, replicated_map
from deepspeed.checkpoint.affine_transfer import (AffineTransferError, InvalidMapError, PlanBudget,
                                                  UnsupportedLayoutError, plan_transfer)
from unit.checkpoint.affine_plan_helpers import apply_plan, zero3_buffers

SHAPES = [(7, 5), (64, 128), (5, ), (3, 1)]
DEGREES = [(4, 3), (4, 2), (2, 4), (4, 8), (3, 7), (1, 5)]
POISON = float('nan')


def _comparable(plan):
    statistics = plan.statistics
    return (plan.segments, plan.logical_shape, plan.moved_elements, statistics.source_pieces, statistics.target_pieces,
            statistics.segments_before_merge, statistics.segments, statistics.plan_bytes)


def _outcome(target_map, source_map, limits=None, general=False):
    """The plan, or the type of the refusal, with the sweep on or switched off."""
    sweep = affine_transfer._plan_intervals
    if general:
        affine_transfer._plan_intervals = lambda *args: None
    try:
        return 'plan', _comparable(plan_transfer(target_map, source_map, limits))
    except Exception as error:  # the comparison is of error classes, whichever they are
        return 'refused', type(error)
    finally:
        affine_transfer._plan_intervals = sweep


def _sweep_taken(target_map, source_map, limits=None):
    try:
        return affine_transfer._plan_intervals(target_map, source_map, limits or PlanBudget()) is not None
    except AffineTransferError:
        return True


# ZeRO-3 maps.


def zero3_map(numel, world_size):
    """A ZeRO-3 partition as a one-axis map: ``ceil(numel / N)`` elements per rank from rank 0 on, the last
    ranks short or empty (``zero3_buffers`` cuts the buffers the same way)."""
    partition = -(-numel // world_size)
    sizes = [max(0, min(partition, numel - rank * partition)) for rank in range(world_size)]
    return contiguous_split_map((numel, ), sizes, 0)


@pytest.mark.parametrize('degrees', [(4, 3), (3, 4), (1, 5)], ids=str)
def test_an_empty_parameter_plans_to_nothing(degrees):
    plan = plan_transfer(zero3_map(0, degrees[1]), zero3_map(0, degrees[0]))
    assert plan.segments == () and plan.moved_elements == 0
    assert _outcome(zero3_map(0, degrees[1]), zero3_map(0, degrees[0]), general=True)[0] == 'plan'


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('degrees', DEGREES, ids=lambda degrees: f'{degrees[0]}to{degrees[1]}')
@pytest.mark.parametrize('shape', SHAPES, ids=str)
def test_zero3_reshard_matches_direct_partition(shape, degrees, dtype):
    source_degree, target_degree = degrees
    full = torch.randn(shape).to(dtype)
    numel = full.numel()
    sources = dict(enumerate(zero3_buffers(full.view(-1), source_degree, POISON)))
    targets = {
        rank: torch.zeros_like(buffer)
        for rank, buffer in enumerate(zero3_buffers(full.view(-1), target_degree, 0))
    }

    plan = plan_transfer(zero3_map(numel, target_degree), zero3_map(numel, source_degree))
    apply_plan(plan, sources, targets)

    expected = zero3_buffers(full.view(-1), target_degree, 0)
    for rank in range(target_degree):
        assert not torch.isnan(targets[rank]).any(), 'source padding reached a target'
        assert torch.equal(targets[rank], expected[rank])
    assert plan.moved_elements == numel
    assert len(plan.segments) <= source_degree + target_degree - 1


# The sweep against the pairwise path.

FAST_CASES = [(numel, source, target) for numel in (1, 5, 35, 97) for source, target in DEGREES + [(64, 48), (7, 7)]]


def _split_pieces(numel, world_size):
    """A ZeRO-3 map whose ranks each hold their run as two adjacent pieces, so coalescing has work."""
    built = zero3_map(numel, world_size)
    for rank, pieces in built.pieces_by_rank.items():
        if pieces and pieces[0].numel > 1:
            piece, half = pieces[0], pieces[0].numel // 2
            built.pieces_by_rank[rank] = [
                AffinePiece((piece.numel - half, ), piece.source_offset + half, (1, ), half, (1, ), [rank]),
                AffinePiece((half, ), piece.source_offset, (1, ), 0, (1, ), [rank]),
            ]
    return built


@pytest.mark.parametrize('split', [False, True])
@pytest.mark.parametrize('numel,source,target', FAST_CASES)
def test_fast_path_gives_the_general_paths_plan(numel, source, target, split):
    build = _split_pieces if split else zero3_map
    source_map, target_map = build(numel, source), build(numel, target)
    assert _sweep_taken(target_map, source_map)
    fast = plan_transfer(target_map, source_map)
    statistics = fast.statistics
    assert statistics.pair_checks <= statistics.source_pieces + statistics.target_pieces - 1
    assert statistics.plan_bytes == affine_transfer._plan_bytes(fast.segments, fast.logical_shape)
    assert ('plan', _comparable(fast)) == _outcome(target_map, source_map, general=True)


def test_fast_path_leaves_invalid_and_replicated_maps_to_the_general_path():
    gap = zero3_map(10, 2)
    gap.pieces_by_rank[1] = [AffinePiece((4, ), 6, (1, ), 1, (1, ), [1])]
    with pytest.raises(InvalidMapError):
        plan_transfer(zero3_map(10, 3), gap)
    assert affine_transfer._intervals(gap, PlanBudget()) is None
    replicated = replicated_map((10, ), 2)
    assert affine_transfer._intervals(replicated, PlanBudget()) is None
    plan = plan_transfer(zero3_map(10, 3), replicated)
    assert plan.statistics.pair_checks == 3, 'a replicated source must be planned by the general path'


@pytest.mark.parametrize('degrees', [(512, 384), (4096, 3072), (3072, 4096)], ids=str)
def test_large_data_parallel_degrees_plan_under_the_default_budget(degrees):
    source, target = degrees
    numel = 1 << 22
    plan = plan_transfer(zero3_map(numel, target), zero3_map(numel, source))
    assert plan.moved_elements == numel
    assert len(plan.segments) <= source + target - 1
    cursor = 0
    for segment in sorted(plan.segments, key=lambda segment: (segment.source_rank, segment.source_offset)):
        assert segment.source_rank * -(-numel // source) + segment.source_offset == cursor
        cursor += segment.numel
    assert cursor == numel


def _random_map(rng, numel):
    """A valid one-axis map: the parameter cut in runs, each run on a random rank, a rank's runs in
    random shard order, pieces listed in random order, some zero-length pieces and empty ranks."""
    ranks = rng.randint(1, 6)
    cuts = sorted(rng.sample(range(1, numel), min(numel - 1, rng.randint(0, 8)))) if numel > 1 else []
    bounds = [0] + cuts + [numel]
    held = {rank: [] for rank in range(ranks)}
    for start, stop in zip(bounds, bounds[1:]):
        if stop > start:
            held[rng.randrange(ranks)].append((start, stop))
    shard_shapes, pieces_by_rank = {}, {}
    for rank, runs in held.items():
        rng.shuffle(runs)
        pieces, cursor = [], 0
        for start, stop in runs:
            pieces.append(AffinePiece((stop - start, ), start, (1, ), cursor, (1, ), [rank]))
            cursor += stop - start
        if rng.random() < 0.2:
            pieces.append(AffinePiece((0, ), rng.randint(0, numel), (1, ), cursor, (1, ), [rank]))
        rng.shuffle(pieces)
        shard_shapes[rank] = (cursor, )
        if pieces or rng.random() < 0.5:
            pieces_by_rank[rank] = pieces
    return ParamAffineMap((numel, ), shard_shapes, pieces_by_rank)


def _replace(piece, **fields):
    values = dict(shape=piece.shape,
                  source_offset=piece.source_offset,
                  source_strides=piece.source_strides,
                  dest_offset=piece.dest_offset,
                  dest_strides=piece.dest_strides,
                  locations=piece.locations,
                  scale=piece.scale)
    values.update(fields)
    return AffinePiece(**values)


CORRUPTIONS = {
    'source offset +1': lambda p, rng: _replace(p, source_offset=p.source_offset + 1),
    'source offset -1': lambda p, rng: _replace(p, source_offset=p.source_offset - 1),
    'dest offset +1': lambda p, rng: _replace(p, dest_offset=p.dest_offset + 1),
    'longer': lambda p, rng: _replace(p, shape=(p.shape[0] + 1, )),
    'shorter': lambda p, rng: _replace(p, shape=(max(0, p.shape[0] - 1), )),
    'source stride': lambda p, rng: _replace(p, source_strides=(2, )),
    'dest stride': lambda p, rng: _replace(p, dest_strides=(rng.choice([0, 2, -1]), )),
    'two axes': lambda p, rng: _replace(p, shape=(1, ) + p.shape, source_strides=(1, 1), dest_strides=(1, 1)),
    'another holder': lambda p, rng: _replace(p, locations=set(p.locations) | {rng.randint(0, 6)}),
    'wrong holder': lambda p, rng: _replace(p, locations=[rng.randint(0, 6)]),
    'no holder': lambda p, rng: _replace(p, locations=[]),
    'scaled': lambda p, rng: _replace(p, scale=2.0),
}
MAP_CORRUPTIONS = ['shard +1', 'shard -1', 'duplicate piece', 'drop piece', 'drop shard shape', 'extra rank']


def _corrupt(map_, rng):
    shard_shapes = dict(map_.shard_shapes)
    pieces_by_rank = {rank: list(pieces) for rank, pieces in map_.pieces_by_rank.items()}
    holders = [rank for rank, pieces in pieces_by_rank.items() if pieces]
    how = rng.choice(sorted(CORRUPTIONS) + MAP_CORRUPTIONS)
    if not holders:
        how = 'extra rank'
    rank = rng.choice(holders) if holders else 0
    index = rng.randrange(len(pieces_by_rank[rank])) if holders else 0
    if how in CORRUPTIONS:
        pieces_by_rank[rank][index] = CORRUPTIONS[how](pieces_by_rank[rank][index], rng)
    elif how.startswith('shard'):
        shard_shapes[rank] = (max(0, shard_shapes[rank][0] + (1 if how == 'shard +1' else -1)), )
    elif how == 'duplicate piece':
        pieces_by_rank[rank].append(pieces_by_rank[rank][index])
    elif how == 'drop piece':
        del pieces_by_rank[rank][index]
    elif how == 'drop shard shape':
        del shard_shapes[rank]
    else:
        shard_shapes[7] = (1, )
    return how, ParamAffineMap(map_.logical_shape, shard_shapes, pieces_by_rank)


def _random_budget(rng, plan):
    """A budget with every field but ``max_pair_checks`` drawn around where this plan needs it."""
    if plan is None or rng.random() < 0.4:
        return None
    _, (segments, _, _, sources, targets, before, after, plan_bytes) = plan
    return PlanBudget(max_ndim=rng.choice([0, 1, 8]),
                      max_pieces_per_map=rng.choice([max(sources, targets) - 1,
                                                     max(sources, targets) + 2, 1 << 12]),
                      max_pair_checks=1 << 40,
                      max_segments=rng.choice([after - 1, after, 1 << 16]),
                      max_merge_passes=rng.choice([0, 1, 2, 8]),
                      max_plan_bytes=rng.choice([plan_bytes - 1, plan_bytes, 1 << 24]),
                      max_merge_checks=rng.choice([0, 1, 2, 3, 5, 8, 1 << 18]))


def test_sweep_and_general_path_agree_on_random_valid_and_broken_maps():
    """Seeded: identical plans, or refusals of the identical class, with and without the sweep."""
    rng = random.Random(8623)
    taken = refused = 0
    for trial in range(1500):
        numel = rng.choice([0, 1, 2, 3, 7, 16, 40])
        source_map, target_map = _random_map(rng, numel), _random_map(rng, numel)
        if rng.random() < 0.1:
            source_map = replicated_map((numel, ), rng.randint(1, 3))
        how = 'valid'
        if rng.random() < 0.5:
            how, broken = _corrupt(source_map if rng.random() < 0.5 else target_map, rng)
            source_map, target_map = (broken, target_map) if rng.random() < 0.5 else (source_map, broken)
        limits = _random_budget(rng, _outcome(target_map, source_map, general=True) if how == 'valid' else None)
        general = _outcome(target_map, source_map, limits, general=True)
        fast = _outcome(target_map, source_map, limits)
        assert fast == general, f'trial {trial} ({how}, {limits})'
        taken += _sweep_taken(target_map, source_map, limits)
        refused += fast[0] == 'refused'
    assert taken > 400 and refused > 400, (taken, refused)


# Every budget field at its limit and one over, on both paths.


def _merge_heavy_maps():
    """Source rank 0 holds [0, 8) as four runs in shard order 0, 2, 6, 4; rank 1 holds [8, 12).

    Against a two-rank ZeRO-3 target ([0, 6) and [6, 12)) the copies into target rank 0 are source
    offsets 0, 2, 6 for target offsets 0, 2, 4: ``_coalesce``'s first pass checks 0 + 1 + 1 (the
    second joins the first, the third joins nothing), and because something joined, a second pass
    over the two copies left checks 1 more. The other two groups hold one copy each: 3 in all.
    """
    runs = [(0, 0), (2, 2), (4, 6), (6, 4)]
    source = ParamAffineMap((12, ), {
        0: (8, ),
        1: (4, )
    }, {
        0: [AffinePiece((2, ), start, (1, ), offset, (1, ), [0]) for start, offset in runs],
        1: [AffinePiece((4, ), 8, (1, ), 0, (1, ), [1])]
    })
    return source, zero3_map(12, 2)


def _budget(**field):
    return PlanBudget(**{'max_pair_checks': 1 << 40, **field})


def _smallest_passing(field, target_map, source_map, general):
    for value in range(0, 4096):
        if _outcome(target_map, source_map, _budget(**{field: value}), general)[0] == 'plan':
            return value
    raise AssertionError(field)


@pytest.mark.parametrize('path', ['sweep', 'general'])
def test_every_budget_field_at_its_limit_and_one_over(path):
    general = path == 'general'
    source_map, target_map = _merge_heavy_maps()
    assert _sweep_taken(target_map, source_map)
    _, plan = _outcome(target_map, source_map, general=general)
    segments, _, _, _, _, before, after, plan_bytes = plan
    assert (before, after) == (5, 4)
    exact = {
        'max_ndim': 1,
        'max_pieces_per_map': 5,
        'max_segments': after,
        'max_plan_bytes': plan_bytes,
        'max_merge_checks': 3,
    }
    for field, limit in exact.items():
        assert _outcome(target_map, source_map, _budget(**{field: limit}), general) == ('plan', plan), field
        refusal = UnsupportedLayoutError if field == 'max_ndim' else AffineTransferError
        assert _outcome(target_map, source_map, _budget(**{field: limit - 1}), general) == ('refused', refusal), field
    with pytest.raises(AffineTransferError, match='max_merge_checks 2'):
        plan_transfer(target_map, source_map, _budget(max_merge_checks=2))

    # max_merge_passes refuses nothing: it bounds how much is joined. One pass joins everything here,
    # and with none nothing is joined, on both paths alike.
    assert _outcome(target_map, source_map, _budget(max_merge_passes=1), general) == ('plan', plan)
    unmerged = _outcome(target_map, source_map, _budget(max_merge_passes=0), general)
    assert unmerged[1][6] == before
    assert _outcome(target_map, source_map, _budget(max_merge_passes=0), not general) == unmerged
    # With one pass there is no second pass to count: 2 checks fit.
    assert _outcome(target_map, source_map, _budget(max_merge_passes=1, max_merge_checks=2), general)[0] == 'plan'

    # max_pair_checks bounds each path's own work: the sweep's intersections, the pairwise
    # path's products. Both refuse one under their limit and name the field.
    limit = _smallest_passing('max_pair_checks', target_map, source_map, general)
    assert limit == (25 if general else before)
    with pytest.raises(AffineTransferError, match='max_pair_checks'):
        if general:
            affine_transfer._plan_intervals, saved = (lambda *args: None), affine_transfer._plan_intervals
        try:
            plan_transfer(target_map, source_map, PlanBudget(max_pair_checks=limit - 1))
        finally:
            if general:
                affine_transfer._plan_intervals = saved


def test_the_sweep_counts_pair_checks_as_it_goes():
    """Refused on the first intersection past the limit, not after building every copy."""
    source_map, target_map = zero3_map(1 << 20, 4096), zero3_map(1 << 20, 3072)
    with pytest.raises(AffineTransferError, match='intersections exceed max_pair_checks 10'):
        plan_transfer(target_map, source_map, PlanBudget(max_pair_checks=10))
