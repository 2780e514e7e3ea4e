#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Time of save_checkpoint, pristine DeepSpeed 0.19.8 beside 0.19.8 with patch 0027 alone (the pull request's
branch), with and without its fsync calls, in one run.

Each variant runs in 2 fresh rank processes (CPU accelerator, gloo): a ZeRO-3 fp32 TinyMLP (torch Adam) trains
one step, saves once to warm up, then saves --saves times under new tags, each after a sync(); a save's time is
the slowest rank's wall time of save_checkpoint, and the table gives the median and the range, and the time
spent inside os.fsync (the slowest rank's; 0.19.8 calls none). "+ 0027, fsync off" is the patched tree with
os.fsync replaced by a no-op in its ranks: the difference to "+ 0027" is what making the files, the folders and
`latest` durable costs; the difference to 0.19.8 also holds the staging folder, its renames and three barriers.
The variants run in turn, --rounds times, so that drift in the machine's load spreads over all of them.

    .venv/bin/python bench/checkpoint_save_cost.py                  # ~25M params (300 MB per save), ~2 minutes
    .venv/bin/python bench/checkpoint_save_cost.py --hidden 512     # ~1.6M params

pristine/ must exist (`make pristine`); the patched tree is made beside it, in .cache/pristine+0027/, by `git
apply` of patches/0027-*.patch. --dir sets where the checkpoints go (the file system under test; default: a
temporary folder under /tmp).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model, configs and environment helpers
sys.path.insert(0, str(ROOT / "bench"))
from two_ranks import run_two_ranks  # noqa: E402

PATCHED = ".cache/pristine+0027"
VARIANTS = {
    "0.19.8": ("pristine", False),
    "0.19.8 + 0027": (PATCHED, False),
    "0.19.8 + 0027, fsync off": (PATCHED, True)
}


def rank_main(args):
    import datetime
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from unit.zero_tiny_models import TinyMLP, fixed_batch, zero3_config
    in_fsync = [0.0]
    if args.fsync_off:
        os.fsync = lambda fd: None
    else:
        real_fsync = os.fsync

        def timed_fsync(fd):
            start = time.perf_counter()
            real_fsync(fd)
            in_fsync[0] += time.perf_counter() - start

        os.fsync = timed_fsync
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model = TinyMLP(hidden=args.hidden, nlayers=args.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zero3_config())
    x, y = fixed_batch(hidden=args.hidden)
    engine.backward(engine(x, y))
    engine.step()
    times, fsync_times = [], []
    for i in range(args.saves + 1):
        os.sync()  # each save starts with no dirty pages of the saves before it to write back
        dist.barrier()
        in_fsync[0] = 0.0
        start = time.perf_counter()
        engine.save_checkpoint(args.save_dir, tag=f"step{i}")
        elapsed = torch.tensor([time.perf_counter() - start, in_fsync[0]])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed[0].item())
        fsync_times.append(elapsed[1].item())
    if dist.get_rank() == 0:
        size = sum(f.stat().st_size for f in Path(args.save_dir, "step0").iterdir())
        print("RESULT " + json.dumps(dict(times=times[1:], fsync=fsync_times[1:], bytes=size)), flush=True)


def make_patched_tree():
    """0.19.8 with patch 0027 alone, at a fixed path (its JIT-op cache stays valid across runs)."""
    tree = ROOT / PATCHED
    subprocess.run(["rm", "-rf", str(tree)], check=True)
    subprocess.run(["cp", "-r", str(ROOT / "pristine"), str(tree)], check=True)
    patch = next((ROOT / "patches").glob("0027-*.patch"))
    subprocess.run(["git", "apply", "--directory", PATCHED, str(patch)], cwd=ROOT, check=True)


def run_variant(tree, fsync_off, args, workdir):
    """One launch of 2 ranks on `tree`; returns its save times and the bytes of one save."""
    script_args = ["--hidden", args.hidden, "--layers", args.layers, "--saves", args.saves]
    return run_two_ranks(__file__, tree, script_args + (["--fsync-off"] if fsync_off else []), workdir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=4, help="timed saves per launch (after one to warm up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a folder under /tmp)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fsync-off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    make_patched_tree()
    workdir = tempfile.mkdtemp(prefix="save_cost_", dir=args.dir)
    times, fsync, size = {name: [] for name in VARIANTS}, {name: [] for name in VARIANTS}, None
    for _ in range(args.rounds):
        for name, (tree, fsync_off) in VARIANTS.items():
            result = run_variant(tree, fsync_off, args, workdir)
            times[name] += result["times"]
            fsync[name] += result["fsync"]
            size = result["bytes"]
    os.rmdir(workdir)
    print(f"save_checkpoint, ZeRO-3 fp32, 2 ranks, {size / 2**20:.0f} MiB per save, "
          f"{args.rounds * args.saves} saves per variant")
    print("| variant | save, median s | save, min-max s | in os.fsync, median s |")
    print("|---|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f}-{max(values):.3f} | "
              f"{statistics.median(fsync[name]):.3f} |")


if __name__ == "__main__":
    main()
