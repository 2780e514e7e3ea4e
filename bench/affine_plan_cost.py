# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Planning cost per parameter: pristine ``affine_transfer.py`` beside the one on ``PYTHONPATH``.

Maps only: no tensors are allocated and no ranks exist. The pristine planner is read from git and
imported under another package name, so both run in one process on identical maps. Rows whose
builders the tree on ``PYTHONPATH`` lacks are skipped, so one script serves every patch of the
series. The TP-change rows time one loading rank's plan (pieces: the two TP maps'); 0.19.8 has no
planner for them.

    PYTHONPATH=/path/to/tree python affine_plan_cost.py \\
        --pristine-git-dir /path/to/DeepSpeed/.git --pristine-commit <0.19.8 commit>

"pristine ms" runs the pristine planner under the default ``PlanBudget``; "pristine ms, budget
raised" runs it with ``max_pair_checks`` out of the way, so a refusal there is policy and the time
is what the pairwise work costs. Runs over ``--cap-seconds`` are not repeated.
"""

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time

from deepspeed.checkpoint.affine import contiguous_split_map
from deepspeed.checkpoint import affine_transfer
from deepspeed.checkpoint.affine_transfer import PlanBudget, plan_transfer

RAISED = PlanBudget(max_pair_checks=1 << 40, max_merge_checks=1 << 40)


def load_pristine(git_dir, commit):
    """Import ``affine.py`` and ``affine_transfer.py`` at ``commit`` as package ``pristine_checkpoint``."""
    root = tempfile.mkdtemp(prefix='pristine_affine_')
    package = os.path.join(root, 'pristine_checkpoint')
    os.makedirs(package)
    open(os.path.join(package, '__init__.py'), 'w').close()
    for name in ('affine.py', 'affine_transfer.py'):
        source = subprocess.run(['git', '--git-dir', git_dir, 'show', f'{commit}:deepspeed/checkpoint/{name}'],
                                check=True,
                                capture_output=True,
                                text=True).stdout
        with open(os.path.join(package, name), 'w') as handle:
            handle.write(source)
    sys.path.insert(0, root)
    return importlib.import_module('pristine_checkpoint.affine_transfer').plan_transfer


def timed(planner, repeats, cap_s):
    """Median milliseconds over up to ``repeats`` runs, stopping early once ``cap_s`` is spent."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        try:
            plan = planner()
        except Exception as error:  # a refusal is a result here, not a failure of the benchmark
            return f'refused ({str(error)[:48]})', None
        samples.append(time.perf_counter() - start)
        if sum(samples) > cap_s:
            break
    return f'{statistics.median(samples) * 1e3:.2f}', plan


def zero_partition_map(numel, world_size):
    """ZeRO-3's partition as a one-axis map, built here so that the script also runs on 0017's branch alone."""
    partition = -(-numel // world_size)
    return contiguous_split_map((numel, ),
                                [max(0, min(partition, numel - rank * partition)) for rank in range(world_size)], 0)


def tp_rows(shape, tp):
    return contiguous_split_map(shape, [shape[0] // tp + (1 if index < shape[0] % tp else 0) for index in range(tp)],
                                0)


def cases(numel):
    for source, target in ((64, 48), (512, 384), (4096, 3072)):
        yield (f'ZeRO-3 DP {source}->{target}, 1-D {numel}', zero_partition_map(numel, source),
               zero_partition_map(numel, target), None)
    if hasattr(affine_transfer, 'plan_zero3_reshard_for_rank'):
        # 0.19.8 has no planner for a TP change under ZeRO-3 (it refuses the load): "pristine" is not run there.
        shape = (4096, 4096)
        for (source_tp, source_dp), (target_tp, target_dp) in (((2, 64), (4, 48)), ((2, 512), (4, 384)), ((2, 4096),
                                                                                                          (4, 3072))):
            source_map, target_map = tp_rows(shape, source_tp), tp_rows(shape, target_tp)
            one_rank = (lambda a=source_tp, b=source_dp, c=target_tp, d=target_dp: affine_transfer.
                        plan_zero3_reshard_for_rank(tp_rows(shape, a), b, tp_rows(shape, c), d, c * d // 2 + 1))
            yield (f'ZeRO-3 TP{source_tp}xDP{source_dp}->TP{target_tp}xDP{target_dp}, 4096x4096, one rank', source_map,
                   target_map, one_rank)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--pristine-git-dir', required=True)
    parser.add_argument('--pristine-commit', required=True)
    parser.add_argument('--numel', type=int, default=4096 * 4096, help='elements of the 1-D parameter')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--cap-seconds', type=float, default=20.0, help='stop repeating a case after this long')
    parser.add_argument('--raised-max-pieces',
                        type=int,
                        default=1024,
                        help='run the raised-budget pristine column only up to this many pieces a side')
    args = parser.parse_args()

    pristine = load_pristine(args.pristine_git_dir, args.pristine_commit)
    print('| case | source pieces | target pieces | segments | pristine ms | pristine ms, budget raised | this ms |')
    print('|---|---:|---:|---:|---:|---:|---:|')
    for name, source_map, target_map, planner in cases(args.numel):
        pieces = [sum(len(pieces) for pieces in side.pieces_by_rank.values()) for side in (source_map, target_map)]
        before = raised = 'not run'
        if planner is None:
            before, _ = timed(lambda: pristine(target_map, source_map), args.repeats, args.cap_seconds)
        if planner is None and max(pieces) <= args.raised_max_pieces:
            raised, _ = timed(lambda: pristine(target_map, source_map, RAISED), args.repeats, args.cap_seconds)
        after, plan = timed(planner or (lambda: plan_transfer(target_map, source_map)), args.repeats, args.cap_seconds)
        segments = len(getattr(plan, 'segments', plan)) if plan is not None else '-'  # one rank's: a tuple
        print(f'| {name} | {pieces[0]} | {pieces[1]} | {segments} | {before} | {raised} | {after} |', flush=True)

    if hasattr(affine_transfer, 'PlanCache'):
        # 300 parameters of one size under one topology change, as one loading rank (rank 0) meets them.
        cache = affine_transfer.PlanCache()
        start = time.perf_counter()
        for _ in range(300):
            cache.zero_partition_segments(args.numel, 64, 48, 0)
        cached = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(300):
            plan_transfer(zero_partition_map(args.numel, 48), zero_partition_map(args.numel, 64))
        uncached = time.perf_counter() - start
        print(f'\n300 same-shaped parameters, DP 64->48: {cached * 1e3:.1f} ms through PlanCache '
              f'(hits {cache.hits}, misses {cache.misses}), {uncached * 1e3:.1f} ms planning each')


if __name__ == '__main__':
    main()
