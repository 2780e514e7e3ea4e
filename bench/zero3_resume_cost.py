#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Cost of a ZeRO-3 checkpoint resume per resume mode, pristine DeepSpeed 0.19.8 beside the fork, in one run.

Each tree (one subprocess; pristine via PYTHONPATH) trains one step of a bf16 TinyMLP (ZeRO-3, fp32
masters, torch Adam) and saves a rigid checkpoint, which that tree then loads once per mode, each load in
fresh rank processes (a fresh engine, so that allocator reuse and earlier peaks do not blur the numbers).
Around load_checkpoint each rank records:

- load s: wall time of load_checkpoint (max over ranks; on a shared 2-core machine +-30% is noise);
- peak RSS: VmHWM during the load minus VmRSS before it (the high-water mark is reset by
  /proc/self/clear_refs), and the peak of the anonymous part alone (RssAnon, sampled): file-backed
  pages of mmap'd shards count in RSS but are page cache the kernel can drop;
- bytes read: rchar from /proc/self/io (bytes read through read(); mmap'd reads do not count there)
  plus the pages of mmap'd files touched (the peak RssFile increase, sampled);
- the files torch.load opened (optimizer shards, how many mmap'd, their size);
- what the load left in the masters: the saved fp32 masters (exact), their bf16 rounding
  (rebuilt from the 16-bit weights), or neither; and whether the 16-bit weights equal the saved ones.

Modes: full resume, fresh optimizer (load_optimizer_states=False), fresh optimizer with
load_fp32_weights=False (fork only: 0.19.8 has no such argument) and load_module_only=True.

    .venv/bin/python bench/zero3_resume_cost.py            # ~34M params, about 2-3 minutes on 2 cores
    .venv/bin/python bench/zero3_resume_cost.py --quick    # ~4M params, under a minute

pristine/ must exist (`make pristine`); the fork is whatever `import deepspeed` finds.
"""

import argparse
import gc
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from queue import Empty

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model, configs and environment helpers
TAG = "ckpt"
MODES = ["full", "fresh", "fresh_rebuild", "module_only"]
MODE_LABEL = {
    "full": "full resume",
    "fresh": "fresh optimizer",
    "fresh_rebuild": "fresh optimizer, load_fp32_weights=False",
    "module_only": "load_module_only=True",
}
MODE_KWARGS = {
    "full": {},
    "fresh": {
        "load_optimizer_states": False
    },
    "fresh_rebuild": {
        "load_optimizer_states": False,
        "load_fp32_weights": False
    },
    "module_only": {
        "load_module_only": True
    },
}
FORK_ONLY_MODES = {"fresh_rebuild"}
TREES = ("pristine", "fork")
MB = 2**20
SPY = None  # the worker's TorchLoadSpy, inherited by the forked ranks


# ---------------------------------------------------------------- per-process measurements (Linux /proc)
def proc_fields(name):
    """/proc/self/<name> as {field: int} (status values are in kB), and the bytes read for it."""
    with open(f"/proc/self/{name}") as f:
        text = f.read()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            fields[key] = int(parts[0])
    return fields, len(text)


def reset_peak_rss():
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler(threading.Thread):
    """Peaks of VmRSS, RssAnon and RssFile (kB), sampled: VmHWM alone cannot tell anonymous memory from the
    pages of mmap'd files, and the file pages touched are the bytes an mmap'd torch.load read (rchar misses
    them)."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile")

    def __init__(self, interval_s=0.002):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.bytes_read = 0
        self.peak_kb = self.sample()
        self.stopped = threading.Event()

    def sample(self):
        status, nbytes = proc_fields("status")
        self.bytes_read += nbytes  # its own reads count in rchar: taken off the load's
        return {field: status[field] for field in self.FIELDS}

    def update(self):
        now = self.sample()
        self.peak_kb = {field: max(self.peak_kb[field], now[field]) for field in self.FIELDS}

    def run(self):
        while not self.stopped.is_set():
            self.update()
            time.sleep(self.interval_s)

    def stop(self):
        self.stopped.set()
        self.join()
        self.update()
        return self.peak_kb


class TorchLoadSpy:
    """Logs every torch.load of a path: name, size and whether it was memory-mapped."""

    def __init__(self, torch):
        self.calls = []
        self.recording = False
        original = torch.load

        def load(f, *args, **kwargs):
            if self.recording and isinstance(f, (str, os.PathLike)):
                self.calls.append({
                    "name": os.path.basename(os.fspath(f)),
                    "bytes": os.path.getsize(f),
                    "mmap": bool(kwargs.get("mmap"))
                })
            return original(f, *args, **kwargs)

        torch.load = load  # DeepSpeed calls torch.load through the module, so every caller sees this


# ---------------------------------------------------------------- the model and its fingerprints
def build_engine(args):
    import torch
    import deepspeed
    from unit.zero_tiny_models import TinyMLP, zero3_config
    config = zero3_config("bf16")
    config["zero_optimization"]["reduce_bucket_size"] = args.hidden * args.hidden
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = args.hidden * args.hidden
    torch.manual_seed(0)
    model = TinyMLP(hidden=args.hidden, nlayers=args.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine, hidden):
    import torch
    from unit.zero_tiny_models import fixed_batch
    x, y = fixed_batch(hidden=hidden, dtype=torch.bfloat16, device=engine.device)
    engine.backward(engine(x, y))
    engine.step()


def digest(tensors):
    sha = hashlib.sha1()
    for t in tensors:
        sha.update(t.detach().float().contiguous().numpy().tobytes())  # bf16 -> fp32 is exact
    return sha.hexdigest()


def fingerprints(engine):
    """Hashes of this rank's 16-bit weight partitions and fp32 masters, and of the masters' bf16 rounding."""
    import torch
    masters = engine.optimizer.fp32_partitioned_groups_flat
    return {
        "weights": digest(p.ds_tensor for p in engine.module.parameters()),
        "masters": digest(masters),
        "masters_bf16": digest(m.to(torch.bfloat16) for m in masters),
    }


def masters_state(saved, loaded):
    if loaded["masters"] == saved["masters"]:
        return "exact"
    return "bf16-rounded" if loaded["masters"] == saved["masters_bf16"] else "other"


# ---------------------------------------------------------------- one rank: save, or load in one mode
def save_rank(engine, args, rank):
    train_step(engine, args.hidden)
    engine.save_checkpoint(args.ckpt, tag=TAG)
    prints = fingerprints(engine)
    with open(os.path.join(args.ckpt, f"fingerprints_rank{rank}.json"), "w") as f:
        json.dump(prints, f)
    sizes = {path.name: path.stat().st_size for path in (Path(args.ckpt) / TAG).iterdir()}
    return {
        "files": sizes,
        "numel": sum(p.ds_numel for p in engine.module.parameters()),
        "masters_mb": sum(m.numel() * m.element_size() for m in engine.optimizer.fp32_partitioned_groups_flat) / MB,
    }


def load_rank(engine, args, rank, spy):
    import deepspeed.comm as dist
    with open(os.path.join(args.ckpt, f"fingerprints_rank{rank}.json")) as f:
        saved = json.load(f)
    gc.collect()
    dist.barrier()  # both ranks start the load together, from a settled RSS
    (io_before, _), (rss_before, _) = proc_fields("io"), proc_fields("status")
    hwm_reset = reset_peak_rss()
    sampler = RssSampler()
    sampler.start()
    spy.recording = True
    start = time.perf_counter()
    engine.load_checkpoint(args.ckpt, tag=TAG, **MODE_KWARGS[args.phase])
    seconds = time.perf_counter() - start
    spy.recording = False
    peak_kb = sampler.stop()
    (io_after, _), (rss_after, _) = proc_fields("io"), proc_fields("status")
    loaded = fingerprints(engine)
    return {
        "load_s": seconds,
        # VmHWM is exact where it could be reset, the sampled peak otherwise
        "peak_rss_mb": ((rss_after["VmHWM"] if hwm_reset else peak_kb["VmRSS"]) - rss_before["VmRSS"]) / 1024,
        "peak_anon_mb": (peak_kb["RssAnon"] - rss_before["RssAnon"]) / 1024,
        "rchar_mb": (io_after["rchar"] - io_before["rchar"] - sampler.bytes_read) / MB,
        "mmap_touched_mb": (peak_kb["RssFile"] - rss_before["RssFile"]) / 1024,
        "loads": spy.calls,
        "masters": masters_state(saved, loaded),
        "weights_restored": loaded["weights"] == saved["weights"],
    }


def set_rank_environment(rank, world_size, port):
    """What torch.distributed and the CPU accelerator read: one node of `world_size` ranks on this machine."""
    os.environ.update(MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port),
                      RANK=str(rank),
                      LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size),
                      LOCAL_SIZE=str(world_size))


def rank_main(rank, args, port, queue):
    set_rank_environment(rank, args.world_size, port)
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        engine = build_engine(args)
        row = save_rank(engine, args, rank) if args.phase == "save" else load_rank(engine, args, rank, SPY)
        queue.put((rank, row))
        deepspeed.comm.barrier()
        engine.destroy()
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


# ---------------------------------------------------------------- one tree (a subprocess): save, then each mode
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect_rows(procs, queue, timeout):
    """{rank: row}, or {"error": ...} once a rank failed, died or the timeout passed (the others may wait in a
    collective forever: the caller kills them)."""
    rows = {}
    deadline = time.monotonic() + timeout
    while len(rows) < len(procs):
        try:
            rank, row = queue.get(timeout=1)
            if "error" in row:
                return {"error": f"rank {rank} failed:\n{row['error']}"}
            rows[rank] = row
        except Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in rows]
            if dead:
                return {"error": f"ranks {dead} died (exit {procs[dead[0]].exitcode})"}
            if time.monotonic() > deadline:
                return {"error": f"timeout after {timeout}s"}
    return rows


def collect(procs, queue, timeout):
    """{rank: row} once every rank reported; exits on a failed or dead rank, or the timeout."""
    rows = collect_rows(procs, queue, timeout)
    if "error" in rows:
        sys.exit(rows["error"])
    return rows


def run_ranks(args, phase):
    """One fresh set of rank processes per phase, so that every load starts from a new process. They are forked
    from the worker, which has imported DeepSpeed once: spawning would import it again per rank and phase."""
    import torch.multiprocessing as mp
    from unit.env import remove_shm_comm_buffers
    port = free_port()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    rank_args = argparse.Namespace(**vars(args), phase=phase)
    procs = [ctx.Process(target=rank_main, args=(r, rank_args, port, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    try:
        rows = collect(procs, queue, args.timeout)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        remove_shm_comm_buffers("127.0.0.1", port)
    return [rows[r] for r in range(args.world_size)]


def import_deepspeed_once():
    """Import torch (spied on) and DeepSpeed before the ranks are forked. No thread may run yet: fork copies
    only the calling thread."""
    global SPY
    import torch
    SPY = TorchLoadSpy(torch)  # before DeepSpeed is imported
    import deepspeed  # noqa: F401
    from deepspeed.accelerator import get_accelerator
    get_accelerator()
    # deepspeed.initialize imports these lazily (Adam's and Muon's torch.compile hooks): seconds per rank
    import torch._dynamo  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    assert threading.active_count() == 1, "a thread runs before fork"


def run_worker(args):
    from unit.env import set_default_environment
    set_default_environment()  # this tree's own JIT-op cache
    import_deepspeed_once()
    modes = [m for m in args.modes if not (args.tree == "pristine" and m in FORK_ONLY_MODES)]
    args.ckpt = tempfile.mkdtemp(prefix=f"zero3_resume_cost_{args.tree}_")
    try:
        results = {"save": run_ranks(args, "save")}
        for mode in modes:
            start = time.monotonic()
            results[mode] = run_ranks(args, mode)
            print(f"{args.tree} {mode}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    finally:
        shutil.rmtree(args.ckpt, ignore_errors=True)
    print("RESULTS " + json.dumps(results))


def run_tree(tree, args):
    env = dict(os.environ)
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env["DS_ACCELERATOR"] = "cpu"
    if tree == "pristine":
        env["PYTHONPATH"] = str(ROOT / "pristine") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable, __file__, "--worker", "--tree", tree, "--world-size",
        str(args.world_size), "--hidden",
        str(args.hidden), "--layers",
        str(args.layers), "--timeout",
        str(args.timeout), "--modes", *args.modes
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout * 6)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULTS ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{tree} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULTS "):])


# ---------------------------------------------------------------- the table
def summarize(ranks):
    """One mode's per-rank rows as table values: the worst rank for costs, each rank for the shards."""
    shards = [[c for c in r["loads"] if c["name"].endswith("optim_states.pt")] for r in ranks]
    return {
        "load_s": max(r["load_s"] for r in ranks),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "peak_anon_mb": max(r["peak_anon_mb"] for r in ranks),
        "read_mb": max(r["rchar_mb"] + r["mmap_touched_mb"] for r in ranks),
        "read_split": max((r["rchar_mb"], r["mmap_touched_mb"]) for r in ranks),
        "opened_mb": max(sum(c["bytes"] for c in r["loads"]) / MB for r in ranks),
        "shards": " / ".join(f"{len(s)} ({sum(c['mmap'] for c in s)} mmap)" for s in shards),
        "masters": "/".join(sorted({r["masters"]
                                    for r in ranks})),
        "weights_restored": all(r["weights_restored"] for r in ranks),
    }


HEADER = [
    "mode", "tree", "load s", "peak RSS Δ MB", "of it anon MB", "read MB/rank: read() + mmap'd pages",
    "optim shards opened per rank", "torch.load'ed files MB/rank", "masters after load", "16-bit weights restored"
]
RATIO_COLUMNS = ["load_s", "peak_rss_mb", "peak_anon_mb", "read_mb"]


def tree_cells(v):
    read_call, mmapped = v["read_split"]
    return [
        f"{v['load_s']:.2f}", f"{v['peak_rss_mb']:.0f}", f"{v['peak_anon_mb']:.0f}",
        f"{v['read_mb']:.0f} = {read_call:.0f} + {mmapped:.0f}", v["shards"], f"{v['opened_mb']:.0f}", v["masters"],
        "yes" if v["weights_restored"] else "**NO**"
    ]


def ratio_cells(values):
    """fork / 0.19.8 per cost column; no ratio against a load that did not restore the weights."""
    if not values["pristine"]["weights_restored"]:
        return ["n/a: 0.19.8 left the weights unloaded"] + [""] * (len(HEADER) - 3)
    cells = [f"**{values['fork'][c] / values['pristine'][c]:.2f}x**" for c in RATIO_COLUMNS]
    return cells + [""] * (len(HEADER) - 2 - len(cells))


def table_rows(mode, results):
    values = {tree: summarize(results[tree][mode]) for tree in TREES if mode in results[tree]}
    rows = []
    for tree in TREES:
        label = "0.19.8" if tree == "pristine" else "fork"
        if tree in values:
            rows.append([MODE_LABEL[mode], label] + tree_cells(values[tree]))
        else:
            rows.append([MODE_LABEL[mode], label, "n/a (no load_fp32_weights argument)"] + [""] * (len(HEADER) - 3))
    if len(values) == 2:
        rows.append([MODE_LABEL[mode], "fork / 0.19.8"] + ratio_cells(values))
    return rows


def print_table(results, args):
    save = results["fork"]["save"][0]
    shard = next(size for name, size in save["files"].items() if name.endswith("optim_states.pt"))
    model_file = next(size for name, size in save["files"].items() if name.endswith("model_states.pt"))
    print(f"\nZeRO-3 resume cost per mode: CPU accelerator, {args.world_size} ranks, bf16 + fp32 masters, torch Adam, "
          f"TinyMLP hidden={args.hidden} x {args.layers} layers = {save['numel'] / 1e6:.1f}M params. Per rank: "
          f"optim shard {shard / MB:.0f} MB (fp32 masters {save['masters_mb']:.0f} MB + Adam moments), model file "
          f"{model_file / 1024:.0f} kB. Each load in fresh processes; costs are the worst rank (peak anon and "
          "mmap'd pages sampled every 2 ms), shards are listed per rank.\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for mode in args.modes:
        for row in table_rows(mode, results):
            print("| " + " | ".join(row) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="hidden 1024 x 4 layers (~4M params)")
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per set of rank processes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", choices=TREES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers = 1024, 4
    if args.worker:
        return run_worker(args)
    if not (ROOT / "pristine" / "deepspeed").is_dir():
        sys.exit("pristine/ is missing: run `make pristine` first")
    start = time.monotonic()
    results = {tree: run_tree(tree, args) for tree in TREES}
    print_table(results, args)
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
