#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What patches 0027 (staged, crash-safe saves) and 0028 (content manifest checked at load) cost a save, a re-save of
the same tag, a load and a Hugging Face Trainer checkpoint: pristine DeepSpeed 0.19.8 beside the fork, one table,
one run.

Five launches of 2 fresh rank processes each (CPU accelerator, gloo, bench/two_ranks.py):
- engine (0.19.8, fork): a ZeRO-3 engine (TinyMLP, torch Adam, bf16 with fp32 masters) trains one step, then
  --repeats times (after --warmups saves): a save under a new tag, after a sync(); and two saves of one tag
  into an empty save_dir with nothing trained between (as Trainer saves a ZeRO-3 checkpoint), rank 0 sampling the
  disk that save_dir takes. The fork does both with checkpoint.sync_files true and false, alternating (the row
  "fork, sync_files false"). Then a second engine fully resumes each saved tag, from the page cache the save filled
  (warm) and after its files were dropped from it (cold, bench/page_cache.py), with checkpoint.content_validation
  "Ignore" and "Fail" in alternating order (0.19.8 checks nothing: one load each).
- Trainer (0.19.8, fork, fork with checkpoint.sync_files false): transformers.Trainer at 2 ranks with
  examples/configs/hf_trainer_zero3.json (ZeRO-3, fp32 as examples/hf_trainer.py runs on the CPU; no
  stage3_gather_16bit_weights_on_model_save, so each checkpoint calls save_checkpoint twice under one tag) on a
  random 2-layer Llama read by from_pretrained, save_steps 1; each _save_checkpoint after the first --warmups is
  timed, and rank 0 samples the disk its checkpoint-N folder takes.
Times are the slowest rank's; cells are medians over --repeats. Disk is the sum of st_blocks of distinct inodes
(hard-linked files once), sampled every --sample-ms by a background thread.

    .venv/bin/python bench/checkpoint_costs.py           # 288 MiB per save, 300 MiB per Trainer checkpoint
    .venv/bin/python bench/checkpoint_costs.py --hidden 256 --layers 2 --trainer-hidden 64 --repeats 1   # smoke

pristine/ must exist (`make pristine`). --dir sets where the checkpoints go (the file system under test; default:
a temporary folder under /tmp).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model, configs and environment helpers
sys.path.insert(0, str(ROOT / "bench"))
from two_ranks import run_two_ranks  # noqa: E402
from page_cache import drop, resident_ranges  # noqa: E402

TRAINER_CONFIG = ROOT / "examples" / "configs" / "hf_trainer_zero3.json"
# launch: (tree, what its ranks run, the Trainer's checkpoint.sync_files or None: the default); a launch prints the
# values of one or more rows (its name + a suffix)
LAUNCHES = {
    "0.19.8": ("pristine", "engine", None),
    "fork": ("fork", "engine", None),
    "0.19.8, Trainer": ("pristine", "trainer", None),
    "fork, Trainer": ("fork", "trainer", None),
    "fork, Trainer, sync_files false": ("fork", "trainer", False),
}

# ----- disk usage -----------------------------------------------------------------------------------------------


def disk_usage(folder):
    """Bytes allocated under folder, each inode once (a hard-linked file takes its blocks once)."""
    seen, total = set(), 0
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:  # renamed or removed while walking
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


class PeakDisk:
    """The largest disk_usage(folder) seen by a background thread from start to stop()."""

    def __init__(self, folder, interval):
        self.folder, self.interval, self.peak = folder, interval, disk_usage(folder)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, disk_usage(self.folder))

    def stop(self):
        self._done.set()
        self._thread.join()
        return max(self.peak, disk_usage(self.folder))


def files_under(folder):
    return [os.path.join(root, name) for root, _, files in os.walk(folder) for name in files]


def evict(folder):
    """Drop the folder's files from the page cache; returns the fraction of their bytes still resident."""
    paths = files_under(folder)
    drop(paths)
    size = sum(os.path.getsize(p) for p in paths)
    resident = sum(length for p in paths for _, length in resident_ranges(p))
    return resident / max(size, 1)


# ----- ranks ----------------------------------------------------------------------------------------------------


def slowest(dist, torch, values):
    """Each value's maximum over the ranks (a list of floats, or of lists of floats)."""
    result = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return result.tolist()


def timed_save(engine, dist, save_dir, tag):
    """Wall time of one save_checkpoint, after a sync() (no dirty pages of earlier saves left to write back)."""
    os.sync()
    dist.barrier()
    start = time.perf_counter()
    engine.save_checkpoint(save_dir, tag=tag)
    return time.perf_counter() - start


def same_tag_pair(engine, dist, folder, sample_ms):
    """Two saves of one tag into the empty save_dir `folder`: their total time and the peak disk of the folder
    (rank 0's samples; -1 elsewhere). The folder is removed after."""
    os.sync()
    dist.barrier()
    sampler = PeakDisk(folder, sample_ms / 1000) if dist.get_rank() == 0 else None
    start = time.perf_counter()
    engine.save_checkpoint(folder, tag="same")
    engine.save_checkpoint(folder, tag="same")
    elapsed = time.perf_counter() - start
    peak = sampler.stop() if sampler else -1
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder)
    return elapsed, peak


def saves_and_pairs(engine, dist, save_dir, args, sync_modes):
    """--repeats saves of new tags and same-tag pairs per checkpoint.sync_files mode (None: 0.19.8's saves), the
    modes alternating so that drift in the machine's load spreads over them. Returns {mode: times} and the tags."""
    runs = {mode: dict(save=[], pair=[], pair_peak=[]) for mode in sync_modes}
    tags = []
    for i in range(args.warmups + args.repeats):
        for mode in (sync_modes if i % 2 else sync_modes[::-1]):
            if mode is not None:  # the bench's switch; a run sets checkpoint.sync_files in its config
                engine._config.checkpoint_sync_files = mode
            tag = f"step{i}-{mode}"
            elapsed = timed_save(engine, dist, save_dir, tag)
            if i < args.warmups:
                continue
            runs[mode]["save"].append(elapsed)
            tags += [tag] if mode in (None, True) else []
            elapsed, peak = same_tag_pair(engine, dist, os.path.join(save_dir, f"pair{i}-{mode}"), args.sample_ms)
            runs[mode]["pair"].append(elapsed)
            runs[mode]["pair_peak"].append(peak)
    return runs, tags


def time_spent_in(owner, name):
    """Wrap owner.name to add its wall time to the returned counter ([seconds])."""
    original, spent = getattr(owner, name), [0.0]

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return spent


def timed_loads(loader, dist, save_dir, tags, modes, in_checks):
    """load_checkpoint of each tag: warm (the page cache the save filled) and cold (its files dropped first, by rank
    0), once per content_validation mode in alternating order. Returns {"<temperature> <mode>": times, and
    "<temperature> <mode> checks": the time of each inside in_checks}, resident fractions after the drops."""
    times = {f"{temp} {mode}{what}": [] for temp in ("warm", "cold") for mode in modes for what in ("", " checks")}
    resident = []
    for i, tag in enumerate(tags):
        for temp in ("warm", "cold"):
            for mode in (modes if i % 2 else modes[::-1]):
                if mode is not None:  # the bench's switch; a run sets checkpoint.content_validation in its config
                    loader._config.checkpoint_content_validation = mode
                if temp == "cold":
                    dist.barrier()  # the other rank is done reading before its pages are dropped
                    if dist.get_rank() == 0:
                        resident.append(evict(os.path.join(save_dir, tag)))
                dist.barrier()
                start, in_checks[0] = time.perf_counter(), 0.0
                loader.load_checkpoint(save_dir, tag=tag)
                times[f"{temp} {mode}"].append(time.perf_counter() - start)
                times[f"{temp} {mode} checks"].append(in_checks[0])
    return times, resident


def engine_rank(args):
    """Saves and same-tag pairs (the fork: with checkpoint.sync_files true and false), then loads. Prints one row's
    values per sync mode, keyed by the suffix of the row's name."""
    import datetime
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from unit.zero_tiny_models import TinyMLP, fixed_batch, zero3_config
    config = zero3_config("bf16")
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
    fork = args.tree == "fork"
    in_checks = [0.0]
    if fork:  # where a verified load's own cost goes: reading and hashing the chunks it checks
        from deepspeed.checkpoint.content_manifest import ContentVerifier
        in_checks = time_spent_in(ContentVerifier, "_verify_chunks")
    runs, tags = saves_and_pairs(engine, dist, args.save_dir, args, [True, False] if fork else [None])
    for run in runs.values():
        run.update(save=slowest(dist, torch, run["save"]), pair=slowest(dist, torch, run["pair"]))
    default = runs[True if fork else None]
    loads, default["resident"] = timed_loads(new_engine(), dist, args.save_dir, tags,
                                             ["IGNORE", "FAIL"] if fork else [None], in_checks)
    default.update({key: slowest(dist, torch, times) for key, times in loads.items()})
    if dist.get_rank() == 0:
        size = disk_usage(os.path.join(args.save_dir, tags[0]))
        for run in runs.values():
            run["bytes"] = size
        rows = {"" if mode in (None, True) else ", sync_files false": run for mode, run in runs.items()}
        print("RESULT " + json.dumps(rows), flush=True)


class SyntheticTokens:
    """Random token sequences, the same on every rank (a map-style dataset)."""

    def __init__(self, torch, vocab, samples, seq_len=8):
        self.ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return dict(input_ids=self.ids[index], labels=self.ids[index])


def trainer_rank(args):
    import torch
    import transformers
    import deepspeed
    import deepspeed.comm as dist
    deepspeed.init_distributed()  # before TrainingArguments, as examples/hf_trainer.py: accelerate then sees 2 ranks
    times, peaks, sizes = [], [], []

    class TimedTrainer(transformers.Trainer):
        """Times each checkpoint save and samples the disk its checkpoint-N folder takes meanwhile."""

        def _save_checkpoint(self, model, trial):
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            os.sync()
            dist.barrier()
            sampler = PeakDisk(folder, args.sample_ms / 1000) if dist.get_rank() == 0 else None
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            times.append(time.perf_counter() - start)
            peaks.append(sampler.stop() if sampler else -1)
            dist.barrier()
            sizes.append(disk_usage(folder))

    steps = args.warmups + args.repeats
    with open(TRAINER_CONFIG) as fd:
        config = json.load(fd)
    if args.sync_files is not None:
        config["checkpoint"] = {"sync_files": json.loads(args.sync_files)}
    training_args = transformers.TrainingArguments(output_dir=args.save_dir,
                                                   per_device_train_batch_size=2,
                                                   max_steps=steps,
                                                   save_strategy="steps",
                                                   save_steps=1,
                                                   learning_rate=1e-3,
                                                   logging_steps=10**6,
                                                   report_to=[],
                                                   use_cpu=True,
                                                   deepspeed=config,
                                                   seed=0)
    # after TrainingArguments: from_pretrained sees ZeRO-3 and builds the model under deepspeed.zero.Init
    model = transformers.LlamaForCausalLM.from_pretrained(args.model_dir)
    dataset = SyntheticTokens(torch, model.config.vocab_size, samples=2 * 2 * steps)
    trainer = TimedTrainer(model=model, args=training_args, train_dataset=dataset)
    trainer.train()
    assert trainer.model_wrapped.dp_world_size == 2, "Trainer's engine is not data-parallel over the 2 ranks"
    timed = slice(args.warmups, None)
    result = dict(trainer_save=slowest(dist, torch, times[timed]), trainer_peak=peaks[timed], trainer_bytes=sizes[-1])
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"": result}), flush=True)


# ----- driver ---------------------------------------------------------------------------------------------------


def cpu_seconds():
    """(CPU seconds the machine spent busy since boot, those of this process and its finished children)."""
    import resource
    with open("/proc/stat") as fd:
        user, nice, system, _, _, irq, softirq = (int(v) for v in fd.readline().split()[1:8])
    machine = (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")
    ours = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return machine, sum(u.ru_utime + u.ru_stime for u in ours)


def prime_disk(folder, gib=2):
    """Write and flush `gib` GiB: this VM's virtual disk writes at a third of its speed for the first GiB or so after
    an idle spell, which would slow the first launch's saves alone."""
    block = bytes(64 << 20)
    for _ in range(gib):
        path = os.path.join(folder, "prime")
        with open(path, "wb") as fd:
            for _ in range(16):
                fd.write(block)
            os.fsync(fd.fileno())
        os.unlink(path)


def write_llama(folder, hidden):
    """A random Llama for the Trainer rows (2 layers; 25M parameters at --trainer-hidden 1024), read by both trees."""
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256,
                                      hidden_size=hidden,
                                      intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=2,
                                      num_attention_heads=8,
                                      num_key_value_heads=8,
                                      max_position_embeddings=8)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


def run_launch(name, args, workdir, model_dir):
    """{row name: its values} of one launch of 2 ranks."""
    tree, kind, sync_files = LAUNCHES[name]
    script_args = ["--kind", kind, "--tree", tree, "--repeats", args.repeats, "--sample-ms", args.sample_ms]
    script_args += ["--warmups", args.warmups]
    if kind == "engine":
        script_args += ["--hidden", args.hidden, "--layers", args.layers]
    else:
        script_args += ["--model-dir", model_dir]
        script_args += ["--sync-files", json.dumps(sync_files)] if sync_files is not None else []
    rows = run_two_ranks(__file__, tree, script_args, workdir, timeout=args.timeout)
    return {name + suffix: values for suffix, values in rows.items()}


def cell(values, fmt="{:.3f}"):
    return fmt.format(statistics.median(values)) if values else "-"


def ratio_cell(numerators, denominators):
    return cell([n / d for n, d in zip(numerators, denominators)], "{:.2f}x") if numerators else "-"


def peak_cell(peaks, size):
    """Median peak in MiB and as a multiple of what the finished checkpoint takes."""
    if not peaks:
        return "-"
    peak = statistics.median(peaks)
    return f"{peak / 2**20:.0f} ({peak / size:.2f}x)"


COLUMNS = [
    ("save s", "save_checkpoint of a new tag, after a sync() (fork: checkpoint.sync_files as the row says)"),
    ("re-save pair s", "two save_checkpoint calls of one tag into an empty save_dir, nothing trained between"),
    ("re-save peak MiB", "largest disk save_dir took during that pair (x: of one finished save)"),
    ("load warm s", "full resume (load_checkpoint) from the page cache the save filled; fork: content_validation "
     "\"Ignore\" (0.19.8 checks nothing)"),
    ("load warm s, verified", "the same, content_validation \"Fail\" (the fork's default)"),
    ("warm verified / unverified", "median of the per-tag ratios of the two columns before"),
    ("load cold s", "full resume after the tag's files were dropped from the page cache (sync, "
     "POSIX_FADV_DONTNEED); fork: \"Ignore\""),
    ("load cold s, verified", "the same, \"Fail\""),
    ("cold verified / unverified", "median of the per-tag ratios of the two columns before"),
    ("resident after drop", "largest fraction of the tag's bytes still in the page cache after the drop (mincore)"),
    ("Trainer save s", "Trainer._save_checkpoint (ZeRO-3, no 16-bit gather: save_checkpoint twice, one tag; fork: "
     "checkpoint.sync_files as the row says)"),
    ("Trainer peak MiB", "largest disk the checkpoint-N folder took during it (x: of the finished folder)"),
]


def row_cells(result):
    r = result
    unverified = "IGNORE" if "warm IGNORE" in r else "None"  # 0.19.8's loads check nothing
    return [
        cell(r.get("save", [])),
        cell(r.get("pair", [])),
        peak_cell(r.get("pair_peak", []), r.get("bytes", 1)),
        cell(r.get(f"warm {unverified}", [])),
        cell(r.get("warm FAIL", [])),
        ratio_cell(r.get("warm FAIL", []), r.get("warm IGNORE", [])),
        cell(r.get(f"cold {unverified}", [])),
        cell(r.get("cold FAIL", [])),
        ratio_cell(r.get("cold FAIL", []), r.get("cold IGNORE", [])),
        f"{max(r['resident']):.1%}" if r.get("resident") else "-",
        cell(r.get("trainer_save", [])),
        peak_cell(r.get("trainer_peak", []), r.get("trainer_bytes", 1)),
    ]


def print_table(results, args):
    r = results["fork"]
    trainer_bytes = results["fork, Trainer"]["trainer_bytes"]
    print(f"2 ranks; engine rows: ZeRO-3 bf16 TinyMLP {args.layers} x {args.hidden}, {r['bytes'] / 2**20:.0f} MiB "
          f"per save; Trainer rows: ZeRO-3 fp32 Llama, {trainer_bytes / 2**20:.0f} MiB per checkpoint; "
          f"medians of {args.repeats}, slowest rank")
    print("| row | " + " | ".join(name for name, _ in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for name, result in results.items():
        print(f"| {name} | " + " | ".join(row_cells(result)) + " |")
    print()
    for name, meaning in COLUMNS:
        print(f"- {name}: {meaning}")
    print(
        f"The fork's verified loads spent {cell(r['warm FAIL checks'])} s (warm) and {cell(r['cold FAIL checks'])} s "
        "(cold) in the check pass (ContentVerifier._verify_chunks: mapping, reading and hashing what they check).")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--trainer-hidden", type=int, default=1024, help="the Trainer's Llama's hidden size")
    parser.add_argument("--repeats", type=int, default=9, help="timed saves, pairs and loads per row")
    parser.add_argument("--warmups", type=int, default=3, help="untimed saves first, per row")
    parser.add_argument("--sample-ms", type=float, default=2.0, help="disk sampling interval")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a launch may take before it is killed")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a folder under /tmp)")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--kind", "--tree", "--model-dir", "--save-dir", "--sync-files"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        return engine_rank(args) if args.kind == "engine" else trainer_rank(args)
    start, (busy, ours) = time.perf_counter(), cpu_seconds()
    workdir = tempfile.mkdtemp(prefix="checkpoint_costs_", dir=args.dir)
    model_dir = os.path.join(workdir, "llama")
    results = {}
    try:
        write_llama(model_dir, args.trainer_hidden)
        prime_disk(workdir)
        for name in LAUNCHES:
            results.update(run_launch(name, args, workdir, model_dir))
    finally:
        shutil.rmtree(workdir)
    print_table(results, args)
    # times move with what else the machine runs: say how busy the rest of it was
    wall, (busy_end, ours_end) = time.perf_counter() - start, cpu_seconds()
    others = (busy_end - busy - (ours_end - ours)) / wall
    print(f"\n({wall:.0f} s; other processes, kernel writeback included, kept {others:.2f} of {os.cpu_count()} cores "
          "busy on average)")


if __name__ == "__main__":
    main()
