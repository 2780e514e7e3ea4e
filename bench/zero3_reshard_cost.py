#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Cost of resuming a ZeRO-3 checkpoint at another data-parallel size, the fork beside pristine 0.19.8, in one run.

The fork loads a rigid ZeRO-3 checkpoint saved at N ranks directly at M ranks: each rank memory-maps the saved
shards and copies only the element ranges of its new partitions. 0.19.8's only route is ds_to_universal (its own
converter, one process) followed by a universal load (checkpoint.load_universal=true). Module-only loads at the
same size and at another size are compared too, with and without load_optimizer_states=False: 0.19.8 consolidates
the whole model from every shard in the latter case (zero_to_fp32).

One checkpoint per saved size (bf16 TinyMLP, ZeRO-3, fp32 masters, torch Adam, one step), saved once at 4 and at 2
ranks by the fork, is read by both trees (the series leaves the saved format unchanged). Every step runs in fresh
processes; each process records, around the step (the helpers of bench/zero3_resume_cost.py):

- wall s: wall time of the step (max over ranks; on a shared 2-core machine +-30% is noise);
- read MB: rchar from /proc/self/io (read()) plus the pages of mmap'd files touched (peak RssFile increase,
  sampled every 2 ms), per rank; "own share" is the checkpoint's optimizer shards' total bytes / M ranks. The kernel
  maps a file's pages in units of its page-cache folios (up to 2 MB here), so slices of a few MB count up to about
  twice their size;
- written MB: wchar from /proc/self/io, per rank: every write(), so a load's collectives over gloo's sockets count
  too;
- temp disk MB: the universal folder ds_to_universal leaves, plus the tmp/ folder of fragments it writes inside the
  output folder first (kept here with keep_temp_folder=True to be measured, then removed): both exist at its peak.
  It makes no other temporary files;
- peak RSS delta MB: VmHWM during the step minus VmRSS before it (mmap'd file pages included), per rank;
- what came back, compared with the saved state gathered over all ranks (sha1 of every parameter's full tensor):
  fp32 masters (exact, bf16-rounded, other), Adam moments (exact, fresh, other) and 16-bit weights.

A second table compares each of the fork's full resumes with `dd`: the load runs again from a cold page cache
(every file of the checkpoint dropped from it with posix_fadvise, no root needed), the pages it brought in are
listed (mincore, read-ahead included), dropped again, and `dd` reads exactly those byte ranges in as many
concurrent streams as the load has ranks (bench/page_cache.py). Its "load time / dd time" is the load's wall time
(slowest rank) over dd's.

    .venv/bin/python bench/zero3_reshard_cost.py            # ~34M params, about 2 minutes on 2 cores
    .venv/bin/python bench/zero3_reshard_cost.py --quick    # ~4M params, about a minute
    .venv/bin/python bench/zero3_reshard_cost.py --stage 2  # the full resumes of a ZeRO-2 checkpoint instead
    .venv/bin/python bench/zero3_reshard_cost.py --tp       # a full resume at another tensor-parallel size instead

With --stage 2 the checkpoint is ZeRO-2's (bf16, fp32 master partitions) and only the full resumes run: a
ZeRO-2 module-only load reads the whole weights from the model-states file at any size, on both trees. The
ZeRO-2 checkpoint is saved with an empty universal_checkpoint_info client state, without which 0.19.8 has no
route at all (its converter refuses the checkpoint).

With --tp the checkpoint is an AutoTP model's (residual MLP blocks, up projections split on rows, down projections
on columns, bf16, ZeRO-3), saved at TP2 x DP2 (4 ranks) and resumed at TP1 x DP4: the fork reads it directly
through the parameters' TP maps, 0.19.8 converts it with ds_to_universal (TP-aware for ZeRO-3 since #8168) and loads
the universal checkpoint. The states saved at TP2 are compared whole: each TP rank's shards, gathered over DP, are
joined over the TP group along the dimension AutoTP split.

pristine/ must exist (`make pristine`); the fork is whatever `import deepspeed` finds. The fork's worker keeps an
inherited TORCH_EXTENSIONS_DIR (e.g. a worktree on PYTHONPATH reusing fork/'s op cache); 0.19.8's always uses its
own.
"""

import argparse
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import page_cache  # bench/ is on sys.path when this script runs
import zero3_resume_cost as resume_cost
from zero3_resume_cost import (RssSampler, collect_rows, free_port, proc_fields, reset_peak_rss, set_rank_environment)

ROOT = Path(__file__).resolve().parent.parent
TAG = "ckpt"
UNIVERSAL_TAG = "ckpt_universal"
MB = 2**20
TREES = ("fork", "pristine")
TREE_LABEL = {"fork": "fork", "pristine": "0.19.8"}
# (case label, saved ranks, loading ranks, load_checkpoint kwargs). Module-only loads twice: 0.19.8 consolidates the
# model from every shard only where load_optimizer_states=False; with load_module_only=True alone it takes the
# module from the model-states files, which hold no ZeRO-3 weights.
MODULE_ONLY = {"load_module_only": True}
MODULE_ONLY_NO_OPTIM = {"load_module_only": True, "load_optimizer_states": False}
FULL_RESUMES = 2  # the first CASES, the ones --stage 2 runs
CASES = [
    ("full resume 4 -> 2", 4, 2, {}),
    ("full resume 2 -> 4", 2, 4, {}),
    ("load_module_only=True 2 -> 2", 2, 2, MODULE_ONLY),
    ("load_module_only=True, load_optimizer_states=False 2 -> 2", 2, 2, MODULE_ONLY_NO_OPTIM),
    ("load_module_only=True 4 -> 2", 4, 2, MODULE_ONLY),
    ("load_module_only=True, load_optimizer_states=False 4 -> 2", 4, 2, MODULE_ONLY_NO_OPTIM),
]
# --tp: saved at TP2 x DP2, resumed at TP1 x DP4 (4 ranks both)
TP_SAVED, TP_LOADED = 2, 1
TP_CASES = [("full resume TP2 x DP2 -> TP1 x DP4", 4, 4, {})]
ERROR_CELL_CHARS = 300


# ---------------------------------------------------------------- measuring one step in one process
def measured(call):
    """call()'s result and its cost to this process: wall time, bytes read and written, peak RSS delta."""
    gc.collect()
    (io_before, _), (rss_before, _) = proc_fields("io"), proc_fields("status")
    hwm_reset = reset_peak_rss()
    sampler = RssSampler()
    sampler.start()
    start = time.perf_counter()
    try:
        result = call()
    finally:
        seconds = time.perf_counter() - start
        peak_kb = sampler.stop()
    (io_after, _), (rss_after, _) = proc_fields("io"), proc_fields("status")
    return result, {
        "wall_s":
        seconds,
        # VmHWM is exact where it could be reset, the sampled peak otherwise
        "peak_rss_mb": ((rss_after["VmHWM"] if hwm_reset else peak_kb["VmRSS"]) - rss_before["VmRSS"]) / 1024,
        "read_mb": (io_after["rchar"] - io_before["rchar"] - sampler.bytes_read) / MB +
        (peak_kb["RssFile"] - rss_before["RssFile"]) / 1024,
        "written_mb": (io_after["wchar"] - io_before["wchar"]) / MB,
    }


def folder_mb(path):
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / MB


# ---------------------------------------------------------------- the model and the state it holds
def build_engine(args, seed, universal=False):
    import torch
    import deepspeed
    from unit.zero_tiny_models import TinyMLP, zero3_config
    config = zero3_config("bf16", stage=args.stage)
    config["zero_optimization"]["reduce_bucket_size"] = args.hidden * args.hidden
    if args.stage == 3:
        config["zero_optimization"]["stage3_prefetch_bucket_size"] = args.hidden * args.hidden
    if universal:
        config["checkpoint"] = {"load_universal": True}
    torch.manual_seed(seed)
    if args.tp:
        from unit.checkpoint.universal_zero3_helpers import MLP_PARTITION_CONFIG, TinyMLPBlocks
        if args.tp_size > 1:
            config["tensor_parallel"] = {"autotp_size": args.tp_size, "partition_config": MLP_PARTITION_CONFIG}
        model = TinyMLPBlocks(hidden=args.hidden, inner=args.hidden, nblocks=args.layers // 2)
    else:
        model = TinyMLP(hidden=args.hidden, nlayers=args.layers)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def gathered_digests(engine):
    """sha1 of every parameter's full fp32 master, its bf16 rounding, both Adam moments and the 16-bit weight,
    gathered over all ranks (collective: every rank calls it), so that states held at different sizes compare."""
    import torch
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    sha = {key: hashlib.sha1() for key in ("masters", "masters_bf16", "exp_avg", "exp_avg_sq", "weights")}
    fresh = False
    whole = tensor_parallel_joiner(engine)
    for name, param in engine.module.named_parameters():
        master = whole(name, safe_get_full_fp32_param(param))
        sha["masters"].update(master.float().contiguous().numpy().tobytes())
        sha["masters_bf16"].update(master.to(torch.bfloat16).float().contiguous().numpy().tobytes())
        for key in ("exp_avg", "exp_avg_sq"):
            try:
                state = whole(name, safe_get_full_optimizer_state(param, key))
            except KeyError:  # no state yet
                state = None
            fresh = fresh or state is None or not state.any()
            if state is not None:
                sha[key].update(state.float().contiguous().numpy().tobytes())
        with deepspeed.zero.GatheredParameters([param]):
            sha["weights"].update(whole(name, param.data).float().contiguous().numpy().tobytes())
    digests = {key: value.hexdigest() for key, value in sha.items()}
    digests["fresh_moments"] = fresh
    return digests


def tensor_parallel_joiner(engine):
    """whole(name, shard): the whole tensor of this rank's TP shard of a parameter (already gathered over DP), its TP
    group's shards joined along the dimension AutoTP split (none: replicated). Collective over the TP group; the
    identity without tensor parallelism."""
    if engine.autotp_size() <= 1:
        return lambda name, shard: shard
    import torch
    import deepspeed.comm as dist
    from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.utils import groups
    maps = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO)[AFFINE_MAP][AFFINE_MAP_PARAMS]
    group = groups.get_tensor_model_parallel_group()

    def whole(name, shard):
        shape = tuple(maps["^" + name.replace(".", "\\.") + "$"]["logical_shape"])
        shards = [torch.empty_like(shard) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(shards, shard.contiguous(), group=group)
        if tuple(shard.shape) == shape:
            return shard
        return torch.cat(shards, dim=next(d for d, (a, b) in enumerate(zip(shape, shard.shape)) if a != b))

    return whole


def compare(saved, loaded):
    """What the load left, against the saved state."""
    if loaded["masters"] == saved["masters"]:
        masters = "exact"
    else:
        masters = "bf16-rounded" if loaded["masters"] == saved["masters_bf16"] else "**other**"
    if loaded["exp_avg"] == saved["exp_avg"] and loaded["exp_avg_sq"] == saved["exp_avg_sq"]:
        moments = "exact"
    else:
        moments = "fresh" if loaded["fresh_moments"] else "**other**"
    return {
        "masters": masters,
        "moments": moments,
        "weights": "yes" if loaded["weights"] == saved["weights"] else "**NO**"
    }


def saved_dir(args, saved_ranks):
    return os.path.join(args.ckpt_root, f"saved_at_{saved_ranks}")


# ---------------------------------------------------------------- one rank: save, or load one case
def client_state(args):
    """0.19.8's ds_to_universal refuses a ZeRO-1/2 checkpoint without universal_checkpoint_info ("Required
    universal_checkpoint_info state is missing in checkpoint"), which only Megatron-style clients save; an empty
    one, as upstream's own universal-checkpoint tests save, gives the converter a checkpoint it takes."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    return {UNIVERSAL_CHECKPOINT_INFO: {}} if args.stage != 3 else {}


def save_rank(args, rank):
    import deepspeed.comm as dist
    engine = build_engine(args, seed=0)
    resume_cost.train_step(engine, args.hidden)
    engine.save_checkpoint(args.ckpt, tag=TAG, client_state=client_state(args))
    digests = gathered_digests(engine)
    if rank == 0:
        with open(os.path.join(args.ckpt, "saved_state.json"), "w") as f:
            json.dump(digests, f)
    dist.barrier()
    return engine, {}


def load_rank(args, rank):
    with open(os.path.join(args.ckpt, "saved_state.json")) as f:
        saved = json.load(f)
    engine = build_engine(args, seed=1, universal=args.universal)  # other weights: a load that misses shows
    import deepspeed.comm as dist
    dist.barrier()  # every rank starts the load together, from a settled RSS
    spy = resume_cost.SPY
    spy.calls.clear()
    spy.recording = True
    tag = UNIVERSAL_TAG if args.universal else TAG
    _, costs = measured(lambda: engine.load_checkpoint(args.ckpt, tag=tag, **args.load_kwargs))
    spy.recording = False
    costs["files"] = list(spy.calls)
    costs.update(compare(saved, gathered_digests(engine)))
    return engine, costs


def rank_main(rank, args, port, queue):
    set_rank_environment(rank, args.world_size, port)
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        engine, row = save_rank(args, rank) if args.phase == "save" else load_rank(args, rank)
        queue.put((rank, row))
        deepspeed.comm.barrier()
        engine.destroy()
    except Exception:
        queue.put((rank, {"error": traceback.format_exc()}))
        raise


# ---------------------------------------------------------------- sets of processes
def run_ranks(args, world_size, phase, **extra):
    """One fresh set of rank processes, forked from the worker that imported DeepSpeed once. Returns the rows in rank
    order, or {"error": ...}."""
    import torch.multiprocessing as mp
    from unit.env import remove_shm_comm_buffers
    port = free_port()
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    rank_args = argparse.Namespace(**{**vars(args), **extra}, phase=phase, world_size=world_size)
    procs = [ctx.Process(target=rank_main, args=(r, rank_args, port, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        rows = collect_rows(procs, queue, args.timeout)
        for p in procs:
            p.join(timeout=60 if "error" not in rows else 5)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        remove_shm_comm_buffers("127.0.0.1", port)
    return rows if "error" in rows else [rows[r] for r in range(world_size)]


def convert_main(args, queue):
    """ds_to_universal (this tree's) on a saved checkpoint, in one process, as its command line runs it."""
    try:
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        from unit.checkpoint.universal_conversion import converter_args
        output = os.path.join(args.ckpt, UNIVERSAL_TAG)
        converter = converter_args(os.path.join(args.ckpt, TAG), output)
        converter.keep_temp_folder = True  # measured below, then removed: it exists at the converter's peak
        _, costs = measured(lambda: ds_to_universal(converter))
        costs["temp_mb"] = folder_mb(output)
        shutil.rmtree(os.path.join(output, "tmp"))
        costs["universal_mb"] = folder_mb(output)
        queue.put((0, costs))
    except Exception:
        queue.put((0, {"error": traceback.format_exc()}))
        raise


def run_conversion(args, ckpt):
    import torch.multiprocessing as mp
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=convert_main, args=(argparse.Namespace(**vars(args), ckpt=ckpt), queue))
    proc.start()
    try:
        rows = collect_rows([proc], queue, args.timeout)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
    return rows if "error" in rows else [rows[0]]


# ---------------------------------------------------------------- one tree (a subprocess)
def checkpoint_sizes(ckpt):
    files = list((Path(ckpt) / TAG).iterdir())
    return {
        "optim_mb": sum(f.stat().st_size for f in files if f.name.endswith("optim_states.pt")) / MB,
        "model_mb": sum(f.stat().st_size for f in files if f.name.endswith("model_states.pt")) / MB,
    }


def save_checkpoints(args):
    """The fork saves the checkpoint at each size once; both trees read it."""
    saved = {}
    for saved_ranks in sorted({saved_ranks for _, saved_ranks, _, _ in cases(args)}, reverse=True):
        ckpt = saved_dir(args, saved_ranks)
        os.makedirs(ckpt, exist_ok=True)
        rows = run_ranks(args, saved_ranks, "save", ckpt=ckpt, universal=False, load_kwargs={}, tp_size=TP_SAVED)
        if "error" in rows:
            sys.exit(f"saving at {saved_ranks} ranks failed:\n{rows['error']}")
        saved[saved_ranks] = checkpoint_sizes(ckpt)
    return saved


def fork_steps(args, case):
    _, saved_ranks, ranks, kwargs = case
    ckpt = saved_dir(args, saved_ranks)
    return {"load": run_ranks(args, ranks, "load", ckpt=ckpt, universal=False, load_kwargs=kwargs, tp_size=TP_LOADED)}


def pristine_steps(args, case):
    """0.19.8: a module-only load reads the rigid checkpoint; a full resume at another size (or TP size) converts it
    first."""
    _, saved_ranks, ranks, kwargs = case
    ckpt = saved_dir(args, saved_ranks)
    if kwargs.get("load_module_only") or (saved_ranks == ranks and not args.tp):
        return {"load": run_ranks(args, ranks, "load", ckpt=ckpt, universal=False, load_kwargs=kwargs)}
    steps = {"ds_to_universal": run_conversion(args, ckpt)}
    if "error" not in steps["ds_to_universal"]:
        steps["universal load"] = run_ranks(args,
                                            ranks,
                                            "load",
                                            ckpt=ckpt,
                                            universal=True,
                                            load_kwargs=kwargs,
                                            tp_size=TP_LOADED)
    shutil.rmtree(os.path.join(ckpt, UNIVERSAL_TAG), ignore_errors=True)
    return steps


def cold_load_beside_dd(args, case):
    """The fork's full resume again, every file of the checkpoint dropped from the page cache first, beside `dd`
    reading the same pages (the ones that load brought in, read-ahead included) from the same files, dropped again:
    the load's throughput against the disk's."""
    _, saved_ranks, ranks, kwargs = case
    ckpt = saved_dir(args, saved_ranks)
    files = sorted((Path(ckpt) / TAG).iterdir())
    page_cache.drop(files)
    rows = run_ranks(args, ranks, "load", ckpt=ckpt, universal=False, load_kwargs=kwargs, tp_size=TP_LOADED)
    if "error" in rows:
        return {"error": rows["error"]}
    ranges = {path: page_cache.resident_ranges(path) for path in files}
    page_cache.drop(files)
    return {
        "disk_mb": sum(length for spans in ranges.values() for _, length in spans) / MB,
        "ranges": sum(len(spans) for spans in ranges.values()),
        "load_s": max(row["wall_s"] for row in rows),
        "states": sorted({row[key] for row in rows for key in ("masters", "moments", "weights")}),
        "dd_s": page_cache.dd_seconds(ranges, streams=ranks),
    }


def cases(args):
    if args.tp:
        return TP_CASES
    return CASES if args.stage == 3 else CASES[:FULL_RESUMES]


def run_worker(args):
    from unit.env import set_default_environment
    set_default_environment()  # this tree's own JIT-op cache, unless one was inherited
    resume_cost.import_deepspeed_once()
    import deepspeed.checkpoint.ds_to_universal  # noqa: F401  (imported once, not timed in the converter)
    import unit.checkpoint.universal_conversion  # noqa: F401
    results = {"saved": save_checkpoints(args) if args.tree == "fork" else None}
    steps_of = fork_steps if args.tree == "fork" else pristine_steps
    for case in cases(args):
        start = time.monotonic()
        results[case[0]] = steps_of(args, case)
        if args.tree == "fork" and not case[3]:  # a full resume
            results.setdefault("cold", {})[case[0]] = cold_load_beside_dd(args, case)
        print(f"{args.tree} {case[0]}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    print("RESULTS " + json.dumps(results))


def run_tree(tree, args):
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    if tree == "pristine":
        env.pop("TORCH_EXTENSIONS_DIR", None)  # never the fork's op cache
        env["PYTHONPATH"] = str(ROOT / "pristine") + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        sys.executable, __file__, "--worker", "--tree", tree, "--ckpt-root", args.ckpt_root, "--stage",
        str(args.stage), "--hidden",
        str(args.hidden), "--layers",
        str(args.layers), "--timeout",
        str(args.timeout)
    ] + (["--tp"] if args.tp else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout * 20)
    line = next((text for text in proc.stdout.splitlines() if text.startswith("RESULTS ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{tree} run failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    sys.stderr.write(proc.stderr[-2000:] if args.verbose else "")
    return json.loads(line[len("RESULTS "):])


# ---------------------------------------------------------------- the table
HEADER = [
    "case", "tree", "step", "ranks", "wall s", "read MB per rank: read() + mmap'd pages", "own share MB (shards / M)",
    "written MB per rank", "temp disk MB", "peak RSS Δ MB per rank",
    "files torch.load'ed per rank: optim shards (mmap) + other", "fp32 masters", "Adam moments", "16-bit weights"
]


def per_rank(rows, key, fmt="{:.0f}"):
    return " / ".join(fmt.format(row[key]) for row in rows)


def files_cell(rows):
    cells = []
    for row in rows:
        shards = [f for f in row["files"] if f["name"].endswith("optim_states.pt")]
        cells.append(f"{len(shards)} ({sum(f['mmap'] for f in shards)}) + {len(row['files']) - len(shards)}")
    return " / ".join(cells)


def error_cell(error):
    """The exception line of a traceback (the last non-empty line), as a table cell."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else error
    if lines and lines[0].startswith("rank ") and not text.startswith("rank "):
        text = lines[0].split(":")[0] + ": " + text
    return "**error**: " + text.replace("|", "\\|")[:ERROR_CELL_CHARS]


def step_row(case, tree, step, rows, share_mb):
    head = [case, TREE_LABEL[tree], step]
    if "error" in rows:
        return head + ["", error_cell(rows["error"])] + [""] * (len(HEADER) - 5)
    if step == "ds_to_universal":
        row = rows[0]
        return head + [
            "1 process", f"{row['wall_s']:.2f}", f"{row['read_mb']:.0f}", "", f"{row['written_mb']:.0f}",
            f"{row['temp_mb']:.0f} (universal folder {row['universal_mb']:.0f} + tmp/ "
            f"{row['temp_mb'] - row['universal_mb']:.0f})", f"{row['peak_rss_mb']:.0f}", "", "", "", ""
        ]
    states = [" / ".join(sorted({r[key] for r in rows})) for key in ("masters", "moments", "weights")]
    return head + [
        str(len(rows)), f"{max(r['wall_s'] for r in rows):.2f}",
        per_rank(rows, "read_mb"), f"{share_mb:.0f}",
        per_rank(rows, "written_mb", "{:.1f}"), "-",
        per_rank(rows, "peak_rss_mb"),
        files_cell(rows)
    ] + states


def print_table(results, args):
    saved = {int(k): v for k, v in results["fork"]["saved"].items()}
    numel = sum(args.hidden * args.hidden + args.hidden for _ in range(args.layers))
    sizes = ", ".join(f"saved at {n} ranks: optim shards {v['optim_mb']:.0f} MB in all, model-states files "
                      f"{v['model_mb']:.1f} MB" for n, v in sorted(saved.items(), reverse=True))
    change, model = "data-parallel size", "TinyMLP"
    if args.tp:
        change, model = "tensor-parallel size", "AutoTP MLP blocks (up rows, down columns)"
    print(
        f"\nZeRO-{args.stage} resume at another {change}: CPU accelerator, bf16 + fp32 masters, torch "
        f"Adam, {model} hidden={args.hidden} x {args.layers} layers = {numel / 1e6:.1f}M params ({sizes}). Each step "
        "in fresh processes; per-rank values are listed rank 0 / rank 1 / ...; wall s is the slowest rank.\n")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    for case, saved_ranks, ranks, _ in cases(args):
        share_mb = saved[saved_ranks]["optim_mb"] / ranks
        for tree in TREES:
            for step, rows in results[tree][case].items():
                print("| " + " | ".join(step_row(case, tree, step, rows, share_mb)) + " |")


def print_cold_table(cold):
    """The fork's full resumes from a cold page cache beside dd of the same pages."""
    print("\nThe fork's full resume from a cold page cache (the checkpoint's files dropped from it first) beside `dd` "
          "reading the same pages of the same files (those the load brought in, read-ahead included; dropped again "
          "first), in as many concurrent streams as ranks:\n")
    header = ["case", "read from disk MB (all ranks)", "ranges", "load s", "load MB/s", "dd s", "dd MB/s",
              "load time / dd time", "states"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for case, row in cold.items():
        if "error" in row:
            print(f"| {case} | {error_cell(row['error'])} |" + " |" * (len(header) - 2))
            continue
        print(f"| {case} | {row['disk_mb']:.0f} | {row['ranges']} | {row['load_s']:.2f} | "
              f"{row['disk_mb'] / row['load_s']:.0f} | {row['dd_s']:.2f} | {row['disk_mb'] / row['dd_s']:.0f} | "
              f"{row['load_s'] / row['dd_s']:.1f}x | {' / '.join(row['states'])} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, choices=(2, 3), default=3, help="ZeRO stage of the checkpoint")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="hidden 1024 x 4 layers (~4M params)")
    parser.add_argument("--tp", action="store_true", help="ZeRO-3 AutoTP, TP2 x DP2 -> TP1 x DP4, instead")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per set of processes")
    parser.add_argument("--verbose", action="store_true", help="each tree's per-case timings on stderr")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", choices=TREES, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt-root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.layers = 1024, 4
    if args.tp and args.stage != 3:
        sys.exit("--tp is a ZeRO-3 checkpoint's: leave --stage at 3")
    if args.worker:
        return run_worker(args)
    if not (ROOT / "pristine" / "deepspeed").is_dir():
        sys.exit("pristine/ is missing: run `make pristine` first")
    start = time.monotonic()
    args.ckpt_root = tempfile.mkdtemp(prefix="zero3_reshard_cost_")
    try:
        results = {tree: run_tree(tree, args) for tree in TREES}  # the fork first: it saves the checkpoints
    finally:
        shutil.rmtree(args.ckpt_root, ignore_errors=True)
    print_table(results, args)
    print_cold_table(results["fork"]["cold"])
    print(f"\n({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
