#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""The main job (`make demo`): examples/train.py under the deepspeed launcher, 2 ranks, showing each fix.

1. ZeRO-3 fp32 + torch autocast: the fp32 masters share the weight partitions. Persistent state per
   parameter on the fork, on pristine 0.19.8 (same run) and the analytic minimum.
2. bf16 weights with fp32 masters: save at step N, resume with a fresh optimizer. The masters equal the
   saved ones bit for bit and the loss of step N+1 equals the uninterrupted run's (0.19.8, for contrast,
   rebuilds the masters from the bf16 weights).
3. Convert that checkpoint with ds_to_universal and resume it under AutoTP, tensor-parallel size 2: every
   rank's fp32 weights, both Adam moments and the step counts equal its share of the saved ones bit for
   bit, and the losses of the following steps match the uninterrupted run's.

One line per check, a summary table at the end, exit status 1 if any check failed. Logs of every run go
to --workdir. Runs on the CPU accelerator unless a GPU is found.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the environment helpers shared with the tests and benchmarks
sys.path.insert(0, str(ROOT))

from bench.zero3_master_memory import analytic_minimum  # noqa: E402
from unit.env import deepspeed_tree, extensions_dir, remove_shm_comm_buffers, set_default_environment  # noqa: E402

TRAIN = ROOT / "examples" / "train.py"
CONFIGS = ROOT / "examples" / "configs"
PRISTINE = ROOT / "pristine"
SAVE_STEP, LAST_STEP, GLOBAL_BATCH = 3, 5, 8
LOSS_RTOL = 1e-3  # TP2 sums the matmuls in another order: the same math, not the same bits
MOMENTS = ("exp_avg", "exp_avg_sq")


class Walkthrough:

    def __init__(self, workdir, port):
        self.workdir = Path(workdir).resolve()  # the launcher runs with cwd=workdir
        self.port = port
        self.results = []  # (check, passed, detail)

    # -- running things -------------------------------------------------------------------------------
    def launch(self, name, config, *train_args, pristine=False):
        """examples/train.py on 2 ranks; returns its per-step metrics {step: record}."""
        metrics = self.workdir / f"{name}.jsonl"
        metrics.unlink(missing_ok=True)
        tree = PRISTINE if pristine else deepspeed_tree()
        env = dict(os.environ, TORCH_EXTENSIONS_DIR=extensions_dir(tree))
        if pristine:
            env["PYTHONPATH"] = str(PRISTINE)
        rank_logs = self.workdir / f"{name}.ranks"  # one log per rank, so a failure shows that rank's own error
        shutil.rmtree(rank_logs, ignore_errors=True)
        command = [
            str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
            str(self.port), "--enable_each_rank_log",
            str(rank_logs),
            str(TRAIN), "--deepspeed_config",
            str(CONFIGS / config), "--global-batch",
            str(GLOBAL_BATCH), "--metrics",
            str(metrics), *map(str, train_args)
        ]
        print(
            f"  $ {'PYTHONPATH=pristine ' if pristine else ''}deepspeed ... train.py "
            f"--deepspeed_config {config} {' '.join(map(str, train_args))}",
            flush=True)
        log = self.workdir / f"{name}.log"
        start = time.perf_counter()
        with open(log, "w") as out:
            rc = subprocess.run(command, cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
        remove_shm_comm_buffers("127.0.0.1", self.port)
        for line in rank_logs_found(rank_logs).get(0, "").splitlines():
            if line.startswith(("step ", "resumed ")):
                print(f"    {line}", flush=True)
        print(
            f"    ({name}: {time.perf_counter() - start:.0f} s, logs {os.path.relpath(log, ROOT)}, "
            f"{os.path.relpath(rank_logs, ROOT)}/)",
            flush=True)
        if rc != 0:
            raise RuntimeError(failure_report(name, rc, log, rank_logs))
        return {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines())}

    def convert_to_universal(self, checkpoint, tag):
        command = [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
            str(checkpoint / tag), "--output_folder",
            str(checkpoint / f"{tag}_universal")
        ]
        print(
            f"  $ python -m deepspeed.checkpoint.ds_to_universal --input_folder {tag} "
            f"--output_folder {tag}_universal",
            flush=True)
        with open(self.workdir / "convert.log", "w") as out:
            subprocess.run(command, cwd=self.workdir, stdout=out, stderr=subprocess.STDOUT, check=True)

    def check(self, name, passed, detail):
        self.results.append((name, bool(passed), detail))
        print(f"[{'PASS' if passed else 'FAIL'}] {name}: {detail}", flush=True)

    # -- the three parts ------------------------------------------------------------------------------
    def master_sharing(self):
        print("\n1. ZeRO-3 fp32 + autocast: masters share the weight partitions", flush=True)
        fork = self.launch("autocast-fork", "zero3_autocast.json", "--steps", 2)[2]["bytes_per_param"]
        pristine = self.launch("autocast-pristine", "zero3_autocast.json", "--steps", 2,
                               pristine=True)[2]["bytes_per_param"]
        minimum = sum(analytic_minimum("autocast").values())
        self.check("persistent state per parameter", fork == minimum and pristine > fork,
                   f"fork {fork:.2f} B/param = analytic minimum {minimum}; 0.19.8 {pristine:.2f} B/param")

    def fresh_optimizer_resume(self, checkpoint):
        print(f"\n2. bf16 + fp32 masters: save at step {SAVE_STEP}, resume with a fresh optimizer", flush=True)
        uninterrupted = self.launch("uninterrupted", "zero3_bf16.json", "--steps", LAST_STEP, "--save-dir", checkpoint,
                                    "--save-at", SAVE_STEP, "--dump-state", "state")
        saved = self.dump(f"saved-step{SAVE_STEP}", rank=0)
        resumed = self.launch("fresh-optimizer-fork", "zero3_bf16.json", "--steps", SAVE_STEP + 1, "--resume",
                              checkpoint, "--resume-mode", "fresh-optimizer", "--dump-state", "state/fork")
        loaded = self.dump(f"fork/loaded-step{SAVE_STEP}", rank=0)
        self.check("fresh-optimizer resume: masters", all_equal(loaded, saved, "fp32"),
                   f"{len(saved)} parameters equal the saved fp32 masters bit for bit")
        self.check("fresh-optimizer resume: optimizer", all(e[k] is None for e in loaded.values() for k in MOMENTS),
                   "Adam moments start fresh")
        want, got = uninterrupted[SAVE_STEP + 1]["loss"], resumed[SAVE_STEP + 1]["loss"]
        self.check(f"fresh-optimizer resume: loss of step {SAVE_STEP + 1}", got == want,
                   f"{got!r} (uninterrupted {want!r})")
        self.launch("fresh-optimizer-pristine",
                    "zero3_bf16.json",
                    "--steps",
                    SAVE_STEP + 1,
                    "--resume",
                    checkpoint,
                    "--resume-mode",
                    "fresh-optimizer",
                    "--dump-state",
                    "state/pristine",
                    pristine=True)
        pristine = self.dump(f"pristine/loaded-step{SAVE_STEP}", rank=0)
        lost = sum(not torch.equal(pristine[n]["fp32"], saved[n]["fp32"]) for n in saved)
        rounded = {n: {"fp32": e["fp32"].to(torch.bfloat16).float()} for n, e in saved.items()}
        self.check(
            "0.19.8, for contrast", all_equal(pristine, rounded, "fp32"),
            f"its masters are the bf16 rounding of the saved ones ({lost} of {len(saved)} parameters lost "
            "fp32 bits)")
        return uninterrupted

    def universal_autotp_resume(self, checkpoint, uninterrupted):
        print(f"\n3. Universal checkpoint of step {SAVE_STEP}, resumed under AutoTP TP2", flush=True)
        self.convert_to_universal(checkpoint, f"global_step{SAVE_STEP}")
        resumed = self.launch("universal-tp2", "zero3_bf16.json", "--steps", LAST_STEP, "--resume", checkpoint,
                              "--universal", "--tp", 2, "--dump-state", "state/tp2")
        saved = self.dump(f"saved-step{SAVE_STEP}", rank=0, steps=True)
        shards = [self.dump(f"tp2/loaded-step{SAVE_STEP}", rank=r, steps=True) for r in (0, 1)]
        exact, split = restored_tp_shards(saved, shards)
        self.check(
            "TP2 resume: weights, both moments, steps", exact,
            f"every rank's fp32 weights, exp_avg and exp_avg_sq equal its share of the saved ones bit for bit "
            f"({split} of {len(saved['params'])} parameters split across the 2 TP ranks); step counts "
            f"{shards[0]['optimizer_steps'][0]:.0f} as saved")
        diffs = {
            s: abs(resumed[s]["loss"] - uninterrupted[s]["loss"]) / uninterrupted[s]["loss"]
            for s in range(SAVE_STEP + 1, LAST_STEP + 1)
        }
        self.check(
            "TP2 resume: training continues",
            max(diffs.values()) <= LOSS_RTOL,
            ", ".join(f"step {s} loss {resumed[s]['loss']:.5f} vs {uninterrupted[s]['loss']:.5f}"
                      for s in diffs) + f" (relative difference <= {LOSS_RTOL})")

    def dump(self, label, rank, steps=False):
        state = torch.load(self.workdir / "state" / f"{label}.rank{rank}.pt", weights_only=False)
        return state if steps else state["params"]

    def summary(self):
        print("\n| check | result | detail |\n|---|---|---|")
        for name, passed, detail in self.results:
            print(f"| {name} | {'pass' if passed else 'FAIL'} | {detail} |")
        failed = [name for name, passed, _ in self.results if not passed]
        print(f"\n{len(self.results) - len(failed)} of {len(self.results)} checks passed" +
              (f"; failed: {', '.join(failed)}" if failed else ""))
        return not failed


def rank_logs_found(rank_logs):
    """{rank: text} of every rank's own log (the launcher names the files <start time>_rank<r>.log)."""
    logs = {}
    for path in sorted(Path(rank_logs).glob("*_rank*.log")):  # sorted: a rank's newest log wins
        rank = re.fullmatch(r".*_rank(\d+)\.log", path.name)
        if rank:
            logs[int(rank.group(1))] = path.read_text(errors="replace")
    return logs


def looks_failed(text):
    return "Traceback" in text or "Error" in text


def failure_report(name, rc, log, rank_logs, lines=25):
    """Every rank's own last lines, those that show an error first, then the launcher's. The launcher's
    "exits with return code" line is not parsed: it prints the last spawned rank's command, whichever failed."""
    logs = rank_logs_found(rank_logs)
    order = sorted(logs, key=lambda r: (not looks_failed(logs[r]), r))
    erred = [r for r in order if looks_failed(logs[r])]
    header = f"{name} exited with {rc}"
    if erred:
        header += f" (error in the log of rank{'s' if len(erred) > 1 else ''} {', '.join(map(str, erred))})"
    parts = [header]
    for rank in order:
        parts.append(f"----- rank {rank}, last lines of {rank_logs}/*_rank{rank}.log -----")
        parts += logs[rank].splitlines()[-lines:] or ["(no output)"]
    if not logs:
        parts.append(f"----- no rank logs in {rank_logs} -----")
    parts.append(f"----- launcher, last lines of {log} -----")
    parts += log.read_text(errors="replace").splitlines()[-5:]
    return "\n".join(parts)


def all_equal(got, want, key):
    return got.keys() == want.keys() and all(torch.equal(got[n][key], want[n][key]) for n in want)


def restored_tp_shards(saved, shards):
    """Whether each TP rank holds exactly its contiguous block of every saved tensor (AutoTP splits along
    the one dimension that differs) and the saved step counts; and how many parameters are split."""
    split, exact = 0, True
    for shard in shards:
        exact &= set(shard["optimizer_steps"]) == set(saved["optimizer_steps"])
        for name, entry in saved["params"].items():
            for key in ("fp32", ) + MOMENTS:
                full, mine = entry[key], shard["params"][name][key]
                dims = [d for d, (a, b) in enumerate(zip(full.shape, mine.shape)) if a != b]
                want = full.chunk(shard["tp_size"], dim=dims[0])[shard["tp_rank"]] if dims else full
                exact &= torch.equal(mine, want)
            split += shard["tp_rank"] == 0 and entry["fp32"].shape != shard["params"][name]["fp32"].shape
    return exact, split


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=str(ROOT / ".cache" / "demo"), help="logs, checkpoints, state dumps")
    parser.add_argument("--master-port", type=int, default=29511)
    args = parser.parse_args()
    if not (PRISTINE / "deepspeed").is_dir():
        sys.exit("pristine/ is missing: run `make pristine` (or `make demo`, which does)")
    # The launcher runs with cwd=workdir, so every path handed to it must be absolute.
    args.workdir = Path(args.workdir).resolve()
    set_default_environment()
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    walk = Walkthrough(args.workdir, args.master_port)
    start = time.perf_counter()
    checkpoint = args.workdir / "checkpoints"
    try:
        walk.master_sharing()
        uninterrupted = walk.fresh_optimizer_resume(checkpoint)
        walk.universal_autotp_resume(checkpoint, uninterrupted)
    except (RuntimeError, subprocess.CalledProcessError, OSError) as error:
        walk.check("walkthrough ran to the end", False, str(error).splitlines()[0])
        print(error, file=sys.stderr)
    ok = walk.summary()
    print(f"walkthrough: {time.perf_counter() - start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
