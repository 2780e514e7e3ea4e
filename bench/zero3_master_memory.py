#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Per-rank persistent ZeRO-3 training state, pristine DeepSpeed 0.19.8 beside the fork, in one run.

For each precision it builds the same model, trains one step (so gradients and Adam states exist),
and counts the bytes of the distinct storages that the engine holds per rank: weights (the
ds_tensor partitions), masters (fp32_partitioned_groups_flat, where not the weights' storage),
gradients and optimizer states. Bytes per parameter divide by the rank's partition size. The
analytic minimum is printed beside it. With CUDA it also reports memory_allocated between steps
and the peak.

    make bench                       # or: .venv/bin/python bench/zero3_master_memory.py
    python bench/zero3_master_memory.py --world-size 1 --hidden 2048   # on a GPU node

pristine/ must exist (`make pristine`); the fork is whatever `import deepspeed` finds.
"""

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model, configs and environment helpers
PRECISIONS = ["fp32", "autocast", "bf16_master", "bf16"]
DESCRIPTION = {
    "fp32": "fp32",
    "autocast": "fp32 + autocast(bf16)",
    "bf16_master": "bf16 + bf16 master + bf16 optim",
    "bf16": "bf16 + fp32 master",
}


def analytic_minimum(precision):
    """Bytes per parameter: weights, masters (0 when they can share the weights), Adam moments."""
    weight = 2 if precision in ("bf16", "bf16_master") else 4
    master = 4 if precision == "bf16" else 0
    moments = 2 * (2 if precision == "bf16_master" else 4)
    return {"weights": weight, "masters": master, "optim": moments}


def config_for(precision, hidden):
    from unit.zero_tiny_models import zero3_config
    config = zero3_config(precision)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    config["zero_optimization"]["reduce_bucket_size"] = hidden * hidden
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = hidden * hidden
    return config


def storage_key(tensor):
    return tensor.untyped_storage().data_ptr(), tensor.device


class StorageCounter:
    """Adds each distinct storage's bytes once, to the first category that holds it."""

    def __init__(self):
        self.seen = set()
        self.bytes = {}

    def add(self, category, tensors):
        total = self.bytes.setdefault(category, 0)
        for tensor in tensors:
            if tensor is None or tensor.numel() == 0:
                continue
            key = storage_key(tensor)
            if key not in self.seen:
                self.seen.add(key)
                total += tensor.untyped_storage().nbytes()
        self.bytes[category] = total


def measure_engine(engine):
    import torch
    optimizer = engine.optimizer
    counter = StorageCounter()
    counter.add("weights", [p.ds_tensor for p in engine.module.parameters()])
    counter.add("masters", optimizer.fp32_partitioned_groups_flat)
    counter.add("grads",
                [optimizer.grad_partitions_flat_buffer] + [m.grad for m in optimizer.fp32_partitioned_groups_flat])
    states = [v for s in optimizer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counter.add("optim", [t for t in states if t.numel() > 1])
    numel = sum(p.ds_tensor.numel() for p in engine.module.parameters())
    return {k: v / numel for k, v in counter.bytes.items()}, numel


def rank_main(rank, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(args.world_size),
                      LOCAL_SIZE=str(args.world_size))
    import torch
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from unit.zero_tiny_models import TinyMLP, fixed_batch, model_dtype
    accelerator = get_accelerator()
    on_cuda = accelerator.device_name() == "cuda"
    if on_cuda:
        accelerator.set_device(rank)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name() if on_cuda else "gloo")
    results = []
    for precision in args.precisions:
        torch.manual_seed(0)
        model = TinyMLP(hidden=args.hidden, nlayers=args.layers)
        if on_cuda:
            torch.cuda.reset_peak_memory_stats()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=config_for(precision, args.hidden))
        x, y = fixed_batch(hidden=args.hidden, dtype=model_dtype(precision), device=engine.device)
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
        per_param, numel = measure_engine(engine)
        row = {
            "precision": precision,
            "rank": rank,
            "numel": numel,
            "bytes_per_param": per_param,
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        }
        if on_cuda:
            row["allocated_gib"] = torch.cuda.memory_allocated() / 2**30
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        results.append(row)
        engine.destroy()
        del engine, model
    if rank == 0:
        queue.put(results)
    deepspeed.comm.barrier()


def run_worker(args):
    import torch.multiprocessing as mp
    from unit.env import remove_shm_comm_buffers, set_default_environment
    set_default_environment()  # this build's own JIT-op cache
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    while True:  # wait for rank 0's results; a dead rank or the timeout ends the run
        try:
            results = queue.get(timeout=1)
            break
        except Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                remove_shm_comm_buffers("127.0.0.1", port)
                sys.exit(f"ranks {dead} failed" if dead else f"timeout after {args.timeout}s")
    for p in procs:
        p.join(timeout=60)
    remove_shm_comm_buffers("127.0.0.1", port)
    print("RESULTS " + json.dumps(results))


def run_impl(name, args):
    env = dict(os.environ)
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env.setdefault("DS_ACCELERATOR", "cuda" if args.cuda else "cpu")
    if name == "pristine":
        env["PYTHONPATH"] = str(ROOT / "pristine") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable, __file__, "--worker", "--world-size",
        str(args.world_size), "--hidden",
        str(args.hidden), "--layers",
        str(args.layers), "--precisions", *args.precisions
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout + 120)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULTS ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{name} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return {row["precision"]: row for row in json.loads(line[len("RESULTS "):])}


def fmt(value):
    return f"{value:.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else str(value)


def print_table(results, args):
    print(f"\nZeRO-3 persistent state per rank, bytes per parameter (rank 0 of {args.world_size}, "
          f"TinyMLP hidden={args.hidden} x {args.layers} layers, {results['fork'][args.precisions[0]]['numel']} "
          f"params per rank, after 2 steps)\n")
    header = [
        "precision", "build", "weights", "masters", "grads", "Adam", "W+M+Adam", "analytic min W+M+Adam",
        "saved vs 0.19.8", "max RSS MiB"
    ]
    if args.cuda:
        header += ["allocated GiB", "peak GiB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for precision in args.precisions:
        minimum = sum(analytic_minimum(precision).values())
        base = results["pristine"][precision]["bytes_per_param"]
        for build in ("pristine", "fork"):
            row = results[build][precision]
            b = row["bytes_per_param"]
            wma = b["weights"] + b["masters"] + b["optim"]
            saved = (base["weights"] + base["masters"] + base["optim"]) - wma
            cells = [
                DESCRIPTION[precision], "0.19.8" if build == "pristine" else "fork",
                fmt(b["weights"]),
                fmt(b["masters"]),
                fmt(b["grads"]),
                fmt(b["optim"]),
                fmt(wma),
                fmt(float(minimum)),
                fmt(saved) if build == "fork" else "", f"{row['max_rss_mib']:.0f}"
            ]
            if args.cuda:
                cells += [f"{row['allocated_gib']:.3f}", f"{row['peak_gib']:.3f}"]
            print("| " + " | ".join(cells) + " |")


def check_one_gpu_per_rank(world_size):
    """Each rank binds GPU <rank>: refuse up front what would fail in set_device (or share a GPU)."""
    import torch
    if torch.cuda.device_count() < world_size:
        sys.exit(f"--cuda runs one rank per GPU: --world-size {world_size} needs {world_size} GPUs, this node has "
                 f"{torch.cuda.device_count()} (pass --world-size {max(torch.cuda.device_count(), 1)})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--precisions", nargs="+", default=PRECISIONS, choices=PRECISIONS)
    parser.add_argument("--cuda", action="store_true", help="run on CUDA (DS_ACCELERATOR=cuda) and report allocations")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return run_worker(args)
    if not (ROOT / "pristine" / "deepspeed").is_dir():
        sys.exit("pristine/ is missing: run `make pristine` first")
    if args.cuda:
        check_one_gpu_per_rank(args.world_size)
    results = {build: run_impl(build, args) for build in ("pristine", "fork")}
    print_table(results, args)


if __name__ == "__main__":
    main()
