#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""One run on a single-GPU node, the evidence upstream's `skip-gpu-test` label asks for, printed as one table.

Steps (docs/gpu-evidence.md):
  ops       JIT-build FusedAdam and CPUAdam for each tree, before any test's timeout runs
  bench     bench/zero3_master_memory.py --cuda --world-size 1: bytes per parameter, allocated and peak GiB,
            pristine 0.19.8 beside the fork
  0001      tests/unit/v1/zero/test_zero3_master_alias.py at 1 rank: the offload/reload round trips (on CUDA
            .to('cpu') really copies), identity, parity and GatheredParameters; fork and 0.19.8 (where the
            aliased cells must fail: they are 0001's regression tests)
  upstream  upstream's TestDynamicOffloadStatesZero3 (tests/unit/v1/zero/test_offload_states.py, 48 cells) at 1
            rank, fork and 0.19.8, from .cache/upstream-tests/tests-upstream/ (`make upstream-tests` or
            `--upstream DIR` fills it; never committed)
  suite     our tests/unit and tests/examples on the fork; their multi-rank tests skip on one GPU

Steps run side by side (the pytest ones in shards, several processes on the one GPU) within --budget seconds;
whatever is still running then is stopped and counted as timed out or not run. The table is printed whatever
fails; the exit status is 1 when a fork row is not ok.

    make gpu-evidence                      # on a single-GPU node (python3 with CUDA torch)
    make gpu-evidence CPU=1                # the same steps in miniature on the CPU accelerator, in .venv
    make gpu-evidence-prepare UPSTREAM=DIR # here, for a node without network: upstream's tests and wheels
    python3 tools/gpu_evidence.py --list   # the steps and their commands, running nothing
"""

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tools"))

from unit.env import extensions_dir  # noqa: E402
from upstream_tests import counts, extract_tests, outcomes_from_log  # noqa: E402

PY = sys.executable
TREES = {"fork": ROOT / "fork", "pristine": ROOT / "pristine"}
TREE_LABEL = {"fork": "fork", "pristine": "0.19.8"}
# The folder `make upstream-tests` extracts upstream's tests/ into (its default cell); upstream files stay ignored.
UPSTREAM_TESTS = ROOT / ".cache" / "upstream-tests" / "tests-upstream"
WORK = ROOT / ".cache" / "gpu-evidence"
WHEELS = WORK / "wheels"  # `--prepare`: DeepSpeed's requirements for a node without network
SITE = WORK / "site"  # where those wheels are installed there (on PYTHONPATH)
# DeepSpeed's runtime requirements (fork/requirements/requirements.txt), by module name.
REQUIRED = ["einops", "hjson", "msgpack", "ninja", "numpy", "packaging", "psutil", "cpuinfo", "pydantic", "tqdm"]
# The distributions --prepare downloads, at this venv's versions: those requirements (and their own) that the lent
# H200 image lacks (docs/gpu-evidence.md).
WHEEL_DISTS = ["hjson", "pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions"]
OPS = ["FusedAdamBuilder", "CPUAdamBuilder"]  # FusedAdam: offload_states; CPUAdam: static optimizer offload
ALIAS = "tests/unit/v1/zero/test_zero3_master_alias.py"
OFFLOAD = "unit/v1/zero/test_offload_states.py::TestDynamicOffloadStatesZero3"
STEPS = ["ops", "bench", "0001", "upstream", "suite"]
HARNESS_TIMEOUT_S = 240  # per test, our harness and upstream's (the budget stops the rest)


def plan(cpu):
    """The steps, each {key, what, trees, ...}: on CUDA in full, on the CPU accelerator in miniature."""
    if cpu:
        bench = ["--world-size", "1", "--hidden", "64", "--layers", "2", "--precisions", "fp32", "bf16"]
        alias = [
            f"{ALIAS}::TestMasterPartitionIdentity::test_aliased[fp32]",
            f"{ALIAS}::TestOffloadReloadRoundTrips::test_round_trips_are_exact[fp32-hp-then-lp-defaults]"
        ]
        offload = [f"{OFFLOAD}::test_dynamic_offload_states_zero3[True-False-False-optim_states]"]
    else:
        bench = ["--cuda", "--world-size", "1", "--hidden", "2048", "--layers", "4"]
        alias, offload = [ALIAS], [OFFLOAD]
    return [
        dict(key="ops", what="JIT-build " + ", ".join(OPS), trees=["fork", "pristine"]),
        dict(key="bench", what="memory bench " + " ".join(bench), trees=["fork", "pristine"], args=bench),
        dict(key="0001",
             what="0001 alias tests at 1 rank: offload/reload round trips, identity, parity, GatheredParameters",
             trees=["fork", "pristine"],
             targets=alias,
             cwd=ROOT,
             world_size=1,
             strict=True,
             note={"pristine": " (the aliased cells must fail: 0001's regression tests)"}),
        dict(key="upstream",
             what="upstream TestDynamicOffloadStatesZero3 at 1 rank",
             trees=["fork", "pristine"],
             targets=offload,
             cwd=UPSTREAM_TESTS / "tests",
             world_size=1,
             strict=True,
             upstream=True),
        dict(key="suite",
             what="our tests/unit tests/examples on one GPU" + (" (one simulated)" if cpu else ""),
             trees=["fork"],
             targets=["tests/unit", "tests/examples"],
             cwd=ROOT,
             one_gpu=cpu),
    ]


class Job:
    """One process of a step: started when its `after` jobs have finished well, stopped at the deadline."""

    def __init__(self, step, tree, cmd, cwd, env, out, after=(), log=None, collected=None):
        self.step, self.tree, self.cmd, self.cwd, self.env, self.out = step, tree, cmd, cwd, env, out
        self.after, self.log, self.collected = list(after), log, collected
        self.proc, self.start, self.end, self.rc, self.state = None, None, None, None, "pending"

    def launch(self):
        for path in (self.out, self.log, self.collected):
            if path is not None and path.exists():
                path.unlink()
        self.start = time.monotonic()
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(self.cmd,
                                         cwd=self.cwd,
                                         env=self.env,
                                         stdout=out,
                                         stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.state = "running"

    def poll(self):
        if self.proc.poll() is not None:
            self.rc, self.end, self.state = self.proc.returncode, time.monotonic(), "done"
        return self.state == "done"

    def stop(self):
        kill_session(self.proc.pid)
        self.proc.wait()
        self.rc, self.end, self.state = None, time.monotonic(), "stopped"

    def output(self):
        return self.out.read_text(errors="replace") if self.out.exists() else ""


def kill_session(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_jobs(jobs, parallel, deadline):
    """Run the jobs, at most `parallel` at once, each after its `after` jobs; stop everything at the deadline."""
    pending, running = list(jobs), []
    while pending or running:
        running = [job for job in running if not job.poll()]
        if time.monotonic() > deadline:
            for job in running:
                job.stop()
            for job in pending:
                job.state = "not started: out of --budget"
            break
        for job in list(pending):
            if any(dep.state in ("pending", "running") for dep in job.after):
                continue
            failed = [dep for dep in job.after if dep.state != "done" or dep.rc != 0]
            if failed:
                job.state = f"not started: {failed[0].step} failed for {TREE_LABEL[failed[0].tree]}"
            elif len(running) < parallel:
                job.launch()
                running.append(job)
            else:
                break
            pending.remove(job)
        time.sleep(0.2)
    for job in jobs:  # what a finished job left behind (each job is a session of its own)
        if job.proc is not None:
            kill_session(job.proc.pid)


def tree_env(tree, cpu, site):
    """The environment in which `import deepspeed` finds this tree, with the tree's own JIT-op cache."""
    env = dict(os.environ)
    path = [str(TREES[tree]), str(ROOT / "tools")] + ([str(site)] if site else [])
    ops_cache = extensions_dir(TREES[tree])  # beside the interpreter, as the tests keep it; else under .cache
    if not os.access(sys.prefix, os.W_OK):
        ops_cache = str(WORK / "torch_extensions" / Path(ops_cache).name)
    env.update(PYTHONPATH=os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               TORCH_EXTENSIONS_DIR=ops_cache,
               DS_ACCELERATOR="cpu" if cpu else "cuda",
               DS_TEST_EXEC_TIMEOUT=str(HARNESS_TIMEOUT_S),
               DS_UNITTEST_TIMEOUT=str(HARNESS_TIMEOUT_S),
               PYTHONUNBUFFERED="1")
    return env


OPS_CODE = """import sys, time
from deepspeed.accelerator import get_accelerator
for name in sys.argv[1:]:
    start = time.time()
    builder = get_accelerator().create_op_builder(name)
    builder.load(verbose=False)
    print(f"{builder.NAME}: ready in {time.time() - start:.0f} s", flush=True)
"""


def make_jobs(steps, cpu, site, shards, run_dir):
    """The jobs of every step, keyed (step, tree); the tests of a tree wait for its ops."""
    jobs = {}
    for step in steps:
        for tree in step["trees"]:
            env = tree_env(tree, cpu, site)
            out = run_dir / f"{step['key']}-{tree}"
            if step["key"] == "ops":  # one process per op: the builds run side by side
                jobs[("ops", tree)] = [
                    Job("ops", tree, [PY, "-c", OPS_CODE, op], ROOT, env, out.with_suffix(f".{op}.out")) for op in OPS
                ]
            elif step["key"] == "bench":
                if tree == "fork":  # one run, both trees (the bench puts pristine/ first on PYTHONPATH itself)
                    cmd = [PY, "bench/zero3_master_memory.py"] + step["args"] + ["--timeout", "300"]
                    jobs[("bench", "fork")] = [Job("bench", tree, cmd, ROOT, env, out.with_suffix(".out"))]
            else:
                # The suite's tests that can run on one GPU load no op; the others wait for their tree's ops.
                count, after = (1, []) if step["key"] == "suite" else (shards, jobs.get(("ops", tree), []))
                shard_jobs = [pytest_job(step, tree, env, run_dir, index, count, after) for index in range(count)]
                jobs[(step["key"], tree)] = shard_jobs
    return jobs


def pytest_job(step, tree, env, run_dir, index, count, after):
    name = f"{step['key']}-{tree}.{index}"
    log, collected = run_dir / f"{name}.jsonl", run_dir / f"{name}.collected"
    env = dict(env, UPSTREAM_TESTS_LOG=str(log), GPU_EVIDENCE_COLLECTED=str(collected))
    if count > 1:
        env["GPU_EVIDENCE_SHARD"] = f"{index}/{count}"
    if step.get("world_size"):
        env["GPU_EVIDENCE_WORLD_SIZE"] = str(step["world_size"])
    if step.get("one_gpu"):
        env["GPU_EVIDENCE_ONE_GPU"] = "1"
    cmd = [PY, "-m", "pytest"] + step["targets"] + ["-p", "upstream_tests_plugin", "-p", "gpu_evidence_plugin"]
    cmd += ["-p", "no:cacheprovider", "-q"]
    # Upstream's marker filter off (as tools/upstream_tests.py runs it); ours: no cells record (test-results/ keeps
    # the last suite run's).
    cmd += ["-o", "addopts="] if step.get("upstream") else ["-p", "no:cells"]
    return Job(step["key"], tree, cmd, step["cwd"], env, run_dir / f"{name}.out", after, log, collected)


# --- the table -------------------------------------------------------------------------------------------------


def seconds(jobs):
    started = [job.start for job in jobs if job.start is not None]
    if not started:
        return ""
    return f"{max(job.end or job.start for job in jobs) - min(started):.0f} s"


def not_started(jobs):
    return next((job.state for job in jobs if job.state.startswith("not started")), None)


def ops_row(step, tree, jobs):
    failed = [job for job in jobs if job.state != "done" or job.rc != 0]
    if failed:
        why = not_started(failed) or f"{failed[0].cmd[-1]} FAILED: " + last_line(failed[0].output(), failed[0])
        return row(step, tree, why, seconds(jobs), ok=False)
    ready = [line for job in jobs for line in job.output().splitlines() if ": ready in " in line]
    return row(step, tree, "; ".join(ready), seconds(jobs), ok=True)


def last_line(text, job):
    if job.state == "stopped":
        return "stopped at the --budget deadline"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else f"exit {job.rc}"


def bench_rows(step, jobs):
    """One row per precision and tree, from the bench's markdown table."""
    job = jobs[0]
    if job.state != "done" or job.rc != 0:
        why = not_started(jobs) or "FAILED: " + last_line(job.output(), job)
        return [row(step, tree, why, seconds(jobs), ok=False) for tree in step["trees"]]
    rows = parse_bench(job.output())
    if not rows:
        return [row(step, "fork", "FAILED: no table in its output", seconds(jobs), ok=False)]
    out = []
    for i, cells in enumerate(rows):
        tree = "fork" if cells["build"] == "fork" else "pristine"
        result = (f"{cells['precision']}: W+M+Adam {cells['W+M+Adam']} B/param (analytic min "
                  f"{cells['analytic min W+M+Adam']}, weights {cells['weights']}, masters {cells['masters']})")
        if cells.get("saved vs 0.19.8"):
            result += f", saves {cells['saved vs 0.19.8']} B/param"
        if "peak GiB" in cells:
            result += f"; allocated {cells['allocated GiB']} GiB, peak {cells['peak GiB']} GiB"
        out.append(row(step, tree, result, seconds(jobs) + " (both trees)" if i == 0 else "", ok=True))
    return out


def parse_bench(text):
    """The rows of the bench's markdown table, as {header: cell}."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    rows = [cells for cells in rows if not all(set(cell) <= set("-:") for cell in cells)]  # the |---| line
    return [dict(zip(rows[0], cells)) for cells in rows[1:]]


def outcomes_of(jobs):
    """nodeid -> {outcome, detail} over the shards; collected tests that never started are 'not run'."""
    results, collected = {}, set()
    for job in jobs:
        if job.log is not None:
            results.update(outcomes_from_log(job.log))
        if job.collected is not None and job.collected.exists():
            collected.update(job.collected.read_text().splitlines())
    for nodeid in collected - set(results):
        results[nodeid] = {"outcome": "not run", "detail": "", "duration": 0.0}
    return results


def pytest_row(step, tree, jobs):
    if not_started(jobs):
        return row(step, tree, not_started(jobs), "", ok=False), {}
    results = outcomes_of(jobs)
    c = counts(results)
    c["not run"] = sum(r["outcome"] == "not run" for r in results.values())
    result = ", ".join(f"{n} {o}" for o, n in c.items() if n or o in ("passed", "failed"))
    # A skip is no evidence where every test can run on one GPU (strict): it counts as not ok there.
    bad = c["failed"] + c["error"] + c["timeout"] + c["not run"] + (c["skipped"] if step.get("strict") else 0)
    if not results:
        result = f"FAILED: nothing ran ({last_line(jobs[0].output(), jobs[0])})"
    ok = bool(results) and not bad
    return row(step, tree, result + step.get("note", {}).get(tree, ""), seconds(jobs), ok), results


def row(step, tree, result, time_s, ok):
    return dict(step=step["key"], what=step["what"], tree=TREE_LABEL[tree], result=result, time=time_s, ok=ok)


def table(rows):
    lines = ["| step | what ran | tree | result | time |", "|---|---|---|---|---|"]
    last = None
    for r in rows:
        what = r["what"] if (r["step"], r["what"]) != last else ""
        last = (r["step"], r["what"])
        mark = "" if r["ok"] or r["tree"] != "fork" else "**not ok** "
        lines.append(f"| {r['step'] if what else ''} | {what} | {r['tree']} | {mark}{r['result']} | {r['time']} |")
    return "\n".join(lines)


def failures(results_by_run, limit=10):
    """The fork's tests that did not pass, with the last line of their detail."""
    lines = []
    for (key, tree), results in results_by_run.items():
        bad = [(n, r) for n, r in sorted(results.items()) if r["outcome"] not in ("passed", "skipped")]
        if tree != "fork" or not bad:
            continue
        lines.append(f"{key} ({TREE_LABEL[tree]}): {len(bad)} not passed")
        for nodeid, r in bad[:limit]:
            detail = [line for line in r["detail"].splitlines() if line.strip()]
            lines.append(f"- {nodeid}: {r['outcome']}" + (f": {detail[-1][:200]}" if detail else ""))
    return lines


def assemble(steps, jobs):
    """The table's rows, and each pytest run's per-test results."""
    rows, results_by_run = [], {}
    for step in steps:
        if step["key"] == "bench":
            rows += bench_rows(step, jobs[("bench", "fork")])
            continue
        for tree in step["trees"]:
            if step["key"] == "ops":
                rows.append(ops_row(step, tree, jobs[("ops", tree)]))
            else:
                r, results = pytest_row(step, tree, jobs[(step["key"], tree)])
                rows.append(r)
                results_by_run[(step["key"], tree)] = results
    return rows, results_by_run


# --- setting up ------------------------------------------------------------------------------------------------


def series_digest():
    """Which series the fork is: the number of patches and a digest of their files."""
    import hashlib
    names = [n for n in (ROOT / "patches" / "series").read_text().split() if not n.startswith("#")]
    digest = hashlib.sha256()
    for name in names:
        digest.update((ROOT / "patches" / name).read_bytes())
    return f"{len(names)} patches, digest {digest.hexdigest()[:12]}"


def environment(cpu):
    """The table's first lines: the machine, the trees."""
    import torch
    where = "CPU accelerator, in miniature" if cpu else f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    commit = UPSTREAM_TESTS / "COMMIT"
    upstream = commit.read_text().strip() if commit.exists() else "(commit not recorded)"
    return [
        f"GPU evidence: {where}; torch {torch.__version__}" + ("" if cpu else f" (CUDA {torch.version.cuda})") +
        f", python {sys.version.split()[0]}", f"fork: {series_digest()}; upstream's tests: {upstream}"
    ]


def requirements_site():
    """Make DeepSpeed's requirements importable: from the carried wheels where missing. Returns a folder for
    PYTHONPATH (or None) and what was done."""
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if not missing:
        return None, None
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        sys.exit(f"DeepSpeed needs {missing}: install them, or carry {WHEELS} (make gpu-evidence-prepare)")
    shutil.rmtree(SITE, ignore_errors=True)
    cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", str(SITE)]
    subprocess.run(cmd + [str(w) for w in wheels], check=True)
    sys.path.insert(0, str(SITE))
    importlib.invalidate_caches()
    still = [m for m in missing if importlib.util.find_spec(m) is None]
    if still:
        sys.exit(f"DeepSpeed needs {still}, which {WHEELS} does not hold")
    return SITE, f"installed from {WHEELS.relative_to(ROOT)}: {', '.join(missing)}"


def fill_upstream_tests(upstream):
    """Upstream's tests/ into the folder `make upstream-tests` uses, and the commit they came from."""
    commit = extract_tests(upstream.resolve(), UPSTREAM_TESTS)
    (UPSTREAM_TESTS / "COMMIT").write_text(f"{commit}\n")
    print(f"{UPSTREAM_TESTS.relative_to(ROOT)}: upstream tests at {commit}", flush=True)


def prepare(upstream, python_version):
    """Here, with network: upstream's tests and the wheels a node without network needs."""
    if upstream:
        fill_upstream_tests(upstream)
    from importlib.metadata import version
    pins = [f"{dist}=={version(dist)}" for dist in WHEEL_DISTS]
    shutil.rmtree(WHEELS, ignore_errors=True)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    cmd = [PY, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", python_version]
    cmd += ["--implementation", "cp", "-d", str(WHEELS)] + [a for p in platforms for a in ("--platform", p)]
    subprocess.run(cmd + pins, check=True)
    print(f"{WHEELS.relative_to(ROOT)}: " + ", ".join(sorted(w.name for w in WHEELS.glob("*.whl"))))


def ensure_trees():
    """pristine/ from the pinned sdist (no git, no network when .cache holds it); fork/ as imported here. Returns
    why pristine/ is missing, if it is."""
    if not (TREES["fork"] / "deepspeed").is_dir():
        sys.exit("fork/ is missing: `make setup` (tools/patches.py import) here, and carry it to a GPU node")
    if not (TREES["pristine"] / "deepspeed").is_dir():
        made = subprocess.run([PY, str(ROOT / "tools" / "patches.py"), "pristine"], capture_output=True, text=True)
        print(made.stdout + made.stderr, end="", flush=True)
        if made.returncode != 0:
            return "not started: tools/patches.py pristine failed (.cache/ needs the pinned sdist offline)"
    return None


def list_steps(steps, shards):
    for step in steps:
        trees = ", ".join(TREE_LABEL[t] for t in step["trees"])
        print(f"{step['key']}: {step['what']} [{trees}]")
        if step["key"] == "ops":
            print(f"    python -c <load {' '.join(OPS)}>, per tree, TORCH_EXTENSIONS_DIR of the tree")
        elif step["key"] == "bench":
            print(f"    python bench/zero3_master_memory.py {' '.join(step['args'])}")
        else:
            count = 1 if step["key"] == "suite" else shards
            where = Path(step["cwd"]).relative_to(ROOT)
            ranks = f", world size {step['world_size']}" if step.get("world_size") else ""
            print(f"    cd {where} && python -m pytest {' '.join(step['targets'])} ({count} shard(s) per tree{ranks})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same steps in miniature on the CPU accelerator")
    parser.add_argument("--list", action="store_true", help="print the steps and their commands; run nothing")
    parser.add_argument("--only",
                        nargs="+",
                        choices=STEPS,
                        help="run only these steps (and ops where 0001 or upstream runs: they need it)")
    parser.add_argument("--budget", type=int, default=390, help="seconds for everything; then what runs is stopped")
    parser.add_argument("--jobs", type=int, help="processes at once (default: CUDA min(12, cores - 4), CPU 1)")
    parser.add_argument("--out", type=Path, default=WORK / "out", help="table.md, results.json, output.log")
    parser.add_argument("--upstream",
                        type=Path,
                        help="an upstream DeepSpeed checkout or git dir: extract its tests "
                        f"into {UPSTREAM_TESTS.relative_to(ROOT)} first")
    parser.add_argument("--prepare",
                        action="store_true",
                        help="only extract --upstream's tests and download the "
                        f"wheels of DeepSpeed's requirements into {WHEELS.relative_to(ROOT)} (for a node offline)")
    parser.add_argument("--wheel-python", default="3.12", help="with --prepare: the GPU node's Python")
    args = parser.parse_args()
    begin = time.monotonic()
    if args.prepare:
        return prepare(args.upstream, args.wheel_python)
    parallel = args.jobs or (1 if args.cpu else max(2, min(12, (os.cpu_count() or 8) - 4)))
    shards = max(1, parallel // 3)  # per step and tree: 4 x 4 for 12 processes at once
    only = set(args.only or STEPS) | ({"ops"} if {"0001", "upstream"} & set(args.only or STEPS) else set())
    steps = [s for s in plan(args.cpu) if s["key"] in only]
    if args.list:
        return list_steps(steps, shards)
    if args.upstream:
        fill_upstream_tests(args.upstream)
    site, installed = requirements_site()
    import torch
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device here: `make gpu-evidence CPU=1` runs the steps in miniature on the CPU accelerator")
    no_pristine = ensure_trees()
    run_dir = WORK / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    jobs = make_jobs(steps, args.cpu, site, shards, run_dir)
    no_upstream = None if (UPSTREAM_TESTS / "tests" / OFFLOAD.split("::")[0]).exists() else (
        f"not started: no {UPSTREAM_TESTS.relative_to(ROOT)} (make gpu-evidence-prepare UPSTREAM=DIR)")
    for (key, tree), group in jobs.items():
        why = (no_pristine if tree == "pristine" else None) or (no_upstream if key == "upstream" else None)
        for job in group if why else []:
            job.state = why
    # The fork's jobs first: where the processes are all busy, pristine's wait (and the budget cuts those first).
    runnable = sorted((job for group in jobs.values() for job in group if job.state == "pending"),
                      key=lambda job: job.tree != "fork")
    run_jobs(runnable, parallel, begin + args.budget)
    rows, results = assemble(steps, jobs)
    head = environment(args.cpu) + [
        f"{time.monotonic() - begin:.0f} s in all (--budget {args.budget}), {parallel} process(es) at once" +
        (f"; DeepSpeed's requirements {installed}" if installed else "")
    ]
    report = "\n".join(head + ["", table(rows)] + ([""] + failures(results) if failures(results) else []))
    print("\n" + report)
    save(args.out, report, results, jobs)
    return 0 if all(r["ok"] for r in rows if r["tree"] == "fork") else 1


def save(out, report, results, jobs):
    """table.md, results.json (every test's outcome) and output.log (every job's output) under out."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(report + "\n")
    (out / "results.json").write_text(
        json.dumps({
            f"{key} {TREE_LABEL[tree]}": res
            for (key, tree), res in results.items()
        }, indent=1))
    with open(out / "output.log", "w") as log:
        for group in jobs.values():
            for job in group:
                log.write(f"===== {job.step} {TREE_LABEL[job.tree]}: {' '.join(job.cmd[:3])} ... ({job.state}, "
                          f"exit {job.rc})\n{job.output()}\n")


if __name__ == "__main__":
    sys.exit(main())
