#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Cost per ZeRO load of the ranks agreeing on the outcome of the pre-load checks.

The fork's first agreement gathered every rank's outcome with one all_gather_object over the world group (a
pickle per rank, sizes exchanged first). The agreement it ships now reduces two integers with one all_reduce per
process group of the engine (data parallel, then model parallel where the engine has it); the reasons are
gathered only when some rank refused or must rebuild the masters, which is not timed here. Both are run in the
same ranks, one after the other, on the CPU accelerator's backend (gloo), and timed per call over many calls
(median and 95th percentile, the slowest rank's).

    .venv/bin/python bench/zero_load_agreement.py                # world sizes 2 and 4
    .venv/bin/python bench/zero_load_agreement.py --world-sizes 2 4 8 --calls 500
"""

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as tdist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_outcomes():
    """The earlier agreement: every rank's (refusal, rebuild reason) pair, pickled, gathered over the world."""
    outcomes = [None] * tdist.get_world_size()
    tdist.all_gather_object(outcomes, (None, None))
    return outcomes


def reduce_outcome(groups):
    """The agreement shipped: MAX of (someone refused, someone rebuilds) over each group in turn."""
    outcome = torch.tensor([0, 0], dtype=torch.int32)
    for group in groups:
        tdist.all_reduce(outcome, op=tdist.ReduceOp.MAX, group=group)
    return outcome.tolist()


def timed(call, calls):
    """Seconds per call, each call between barriers (so that a late rank does not count in the next)."""
    times = []
    for _ in range(calls):
        tdist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def model_parallel_groups(world_size, tp):
    """Data-parallel and tensor-parallel groups of a TP x DP grid (consecutive ranks share a TP group)."""
    rank = tdist.get_rank()
    dp_group = tp_group = None
    for first in range(tp):
        group = tdist.new_group(list(range(first, world_size, tp)))
        if rank % tp == first:
            dp_group = group
    for first in range(0, world_size, tp):
        group = tdist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            tp_group = group
    return dp_group, tp_group


def worker(rank, world_size, port, calls, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    tdist.init_process_group("gloo", rank=rank, world_size=world_size)
    cases = {"all_gather_object, world (before)": gather_outcomes}
    dp_group = tdist.new_group(list(range(world_size)))
    cases["all_reduce int32[2], data-parallel group"] = lambda: reduce_outcome([dp_group])
    if world_size % 2 == 0 and world_size > 2:
        tp_dp, tp = model_parallel_groups(world_size, 2)
        cases["all_reduce int32[2], DP then TP group (TP2)"] = lambda: reduce_outcome([tp_dp, tp])
    for name, call in cases.items():
        timed(call, 20)  # warm-up
        times = timed(call, calls)
        per_rank = [None] * world_size
        tdist.all_gather_object(per_rank, times)
        if rank == 0:
            slowest = [max(ts) for ts in zip(*per_rank)]
            results.append((world_size, name, statistics.median(slowest),
                            sorted(slowest)[int(0.95 * len(slowest))]))
    tdist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    rows = []
    for world_size in args.world_sizes:
        with mp.Manager() as manager:
            results = manager.list()
            mp.spawn(worker, args=(world_size, free_port(), args.calls, results), nprocs=world_size, join=True)
            rows.extend(results)
    print(f"Agreement of a ZeRO load's pre-load checks, per load (gloo, {os.cpu_count()} CPUs, "
          f"{args.calls} calls, slowest rank)")
    print("| ranks | agreement | median us | p95 us |")
    print("|---|---|---|---|")
    for world_size, name, median, p95 in rows:
        print(f"| {world_size} | {name} | {median * 1e6:.0f} | {p95 * 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
