#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the content manifest costs: save_checkpoint and a full resume (load_checkpoint) of pristine DeepSpeed
0.19.8 beside the fork, whose saves write a manifest and whose loads check what they read
(checkpoint.content_validation), in one run.

Each variant runs in 2 fresh rank processes (CPU accelerator, gloo): a ZeRO-3 engine (TinyMLP, torch Adam, bf16
with fp32 masters by default) trains one step and saves once to warm up, then saves --saves times under new tags;
a second engine loads each of them (a full resume at the same size, from the page cache the save filled: where
only the CPU counts, the hardest case for checking). A time is the slowest rank's; the table gives medians.
- 0.19.8: pristine/.
- fork, no manifest: the series with the manifest writer a no-op: a save without this change (the series'
  staging folder and fsync calls, 0027, included).
- fork, xxh3_64 / fork, crc32: manifests written with that checksum. Each saved tag is loaded twice by the same
  engine, with checkpoint.content_validation "Ignore" (unverified) and "Fail" (verified, the default), in
  alternating order, so that both load times come from one process and page cache.
"in manifest" is the time a save spent in the manifest's code (hashing each file, writing the entries and the save
record, drawing the save's id), "in checks" the time a verified load spent hashing; "checked" the bytes it hashed
(the largest rank's). Save and load times of different launches on a shared VM vary by +-15%; the "in ..." columns
measure the change's own cost directly.

    .venv/bin/python bench/checkpoint_verify_cost.py                 # ~25M params, 288 MiB per save, ~3 minutes
    .venv/bin/python bench/checkpoint_verify_cost.py --hidden 512    # ~1.6M params
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model, configs and environment helpers
sys.path.insert(0, str(ROOT / "bench"))
from two_ranks import run_two_ranks  # noqa: E402

# name: (tree, manifest written with)
VARIANTS = {
    "0.19.8": ("pristine", None),
    "fork, no manifest": ("fork", None),
    "fork, xxh3_64": ("fork", "xxh3_64"),
    "fork, crc32 (stdlib fallback)": ("fork", "crc32"),
}


def timed(owner, name, spent, counted=None):
    """Wrap owner.name to add its wall time to spent[0] (and the length of its first argument to counted[0])."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
            if counted is not None:
                counted[0] += len(args[0])

    setattr(owner, name, wrapper)


def instrument(content_manifest, engine_module, checksum):
    """Counters of the manifest's cost at save and of the checks' at load; checksum None: no manifest."""
    in_manifest, in_checks, checked = [0.0], [0.0], [0]
    if checksum is None:
        content_manifest.ManifestWriter.add = lambda self, path: None
        return in_manifest, in_checks, checked
    content_manifest.DEFAULT_CHECKSUM = checksum
    for name in ("add", "add_folder", "write_save_record"):
        timed(content_manifest.ManifestWriter, name, in_manifest)
    timed(engine_module.DeepSpeedEngine, "_start_checkpoint_manifest", in_manifest)
    for name in list(content_manifest.CHECKSUMS):
        original = content_manifest.CHECKSUMS[name]

        def counted(data, original=original):
            start = time.perf_counter()
            try:
                return original(data)
            finally:
                if content_manifest.active_verifier() is not None:  # hashing at load, not at save
                    in_checks[0] += time.perf_counter() - start
                    checked[0] += len(data)

        content_manifest.CHECKSUMS[name] = counted
    return in_manifest, in_checks, checked


def rank_main(args):
    import datetime
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from unit.zero_tiny_models import TinyMLP, fixed_batch, zero3_config
    config = zero3_config(args.precision)
    counters = None
    if args.tree == "fork":
        from deepspeed.checkpoint import content_manifest
        from deepspeed.runtime import engine as engine_module
        counters = instrument(content_manifest, engine_module, args.checksum)
    in_manifest, in_checks, checked = counters or ([0.0], [0.0], [0])
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=600))

    def new_engine():
        torch.manual_seed(0)
        model = TinyMLP(hidden=args.hidden, nlayers=args.layers)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return engine

    engine = new_engine()
    x, y = fixed_batch(hidden=args.hidden, dtype=next(engine.module.parameters()).dtype)
    engine.backward(engine(x, y))
    engine.step()
    saves, manifest_times = [], []
    for i in range(args.saves + 1):
        os.sync()  # each save starts with no dirty pages of the saves before it to write back
        dist.barrier()
        in_manifest[0] = 0.0
        start = time.perf_counter()
        engine.save_checkpoint(args.save_dir, tag=f"step{i}")
        saves.append(time.perf_counter() - start)
        manifest_times.append(in_manifest[0])
    loader = new_engine()
    modes = ["IGNORE", "FAIL"] if args.checksum else [None]
    loads = {mode: [] for mode in modes}
    check_times, checked_bytes = [], []
    for i in range(args.saves + 1):
        for mode in (modes if i % 2 else modes[::-1]):
            if mode is not None:  # the bench's switch; a run sets checkpoint.content_validation in its config
                loader._config.checkpoint_content_validation = mode
            dist.barrier()
            in_checks[0], checked[0] = 0.0, 0
            start = time.perf_counter()
            loader.load_checkpoint(args.save_dir, tag=f"step{i}")
            loads[mode].append(time.perf_counter() - start)
            if mode == "FAIL":
                check_times.append(in_checks[0])
                checked_bytes.append(checked[0])
    zeros = [0.0] * (args.saves + 1)
    rows = [saves, manifest_times, loads[modes[0]], loads[modes[-1]], check_times or zeros, checked_bytes or zeros]
    result = torch.tensor([row[1:] for row in rows], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        size = sum(f.stat().st_size for f in Path(args.save_dir, "step0").iterdir() if f.is_file())
        keys = ("saves", "in_manifest", "unverified", "verified", "in_checks", "checked")
        print("RESULT " + json.dumps(dict(zip(keys, result.tolist()), bytes=size)), flush=True)


def run_variant(tree, checksum, args, workdir):
    """One launch of 2 ranks; returns their times."""
    script_args = [
        "--tree", tree, "--hidden", args.hidden, "--layers", args.layers, "--saves", args.saves, "--precision",
        args.precision
    ]
    return run_two_ranks(__file__, tree, script_args + (["--checksum", checksum] if checksum else []), workdir)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--precision", default="bf16", help="as the tests' zero3_config names it (bf16: fp32 masters)")
    parser.add_argument("--saves", type=int, default=3, help="timed saves and loads per launch (after one to warm up)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a folder under /tmp)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--checksum", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return rank_main(args)
    workdir = tempfile.mkdtemp(prefix="verify_cost_", dir=args.dir)
    keys = ("saves", "in_manifest", "unverified", "verified", "in_checks", "checked")
    results = {name: {key: [] for key in keys} for name in VARIANTS}
    size = None
    for _ in range(args.rounds):
        for name, variant in VARIANTS.items():
            result = run_variant(*variant, args, workdir)
            for key in keys:
                results[name][key] += result[key]
            size = result["bytes"]
    os.rmdir(workdir)
    median = statistics.median
    print(f"ZeRO-3 {args.precision}, 2 ranks, {size / 2**20:.0f} MiB per save, full resume at the same size from "
          f"the page cache, {args.rounds * args.saves} saves and loads per variant (medians, slowest rank)")
    print("| variant | save s | in manifest s | load s, unverified | load s, verified | verified / unverified "
          "| in checks s | checked per rank MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, values in results.items():
        cells = [
            f"{median(values['saves']):.3f}", f"{median(values['in_manifest']):.3f}" if name != "0.19.8" else "-",
            f"{median(values['unverified']):.3f}"
        ]
        if VARIANTS[name][1]:
            ratios = [v / u for v, u in zip(values["verified"], values["unverified"])]
            cells += [
                f"{median(values['verified']):.3f}", f"{median(ratios):.2f}x", f"{median(values['in_checks']):.3f}",
                f"{median(values['checked']) / 2**20:.0f}"
            ]
        else:
            cells += ["-"] * 4
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
