#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Run upstream DeepSpeed's own test files against pristine 0.19.8 and against the fork, and compare.

Upstream's tests are not in the sdist, so they come from an upstream checkout or git directory (--upstream):
its tests/ is extracted into a scratch folder (.cache/upstream-tests/). Each chosen file runs in its own pytest
process, once with pristine/ on PYTHONPATH and once with the fork, with a per-test timeout; the CPU lock
/tmp/cpu.lock (flock; the machine's 2 cores are shared) is taken for one file at a time, both trees. The result
is a per-file table and the list of tests that pass on pristine and fail on the fork: each of those is either a
fork defect or a behaviour a patch changes on purpose, whose updated test lives in
patches/upstream-tests/NNNN.diff: those diffs are applied to a second copy, where the fork's failing tests of the
files they change run again. Results are kept in
.cache/upstream-tests/results.json (per-test JSON lines and pytest output beside it).

A torch cell is a venv: the one this runs under (`make upstream-tests TORCH=2.10.0` runs it under
.venv-torch2.10.0). Each cell keeps its results apart (.venv: .cache/upstream-tests/; .venv-torch2.10.0:
.cache/upstream-tests-torch2.10.0/), and the report names its cell and torch version; --cells shows several
cells' results side by side.

    make upstream-tests UPSTREAM=/path/to/DeepSpeed          # or a git directory (bare) of it
    .venv/bin/python tools/upstream_tests.py --upstream DIR --files unit/checkpoint/test_pipeline.py
    .venv/bin/python tools/upstream_tests.py --upstream DIR --quick    # pristine runs only the fork's failures
    .venv/bin/python tools/upstream_tests.py --report                  # print the last results again
    .venv/bin/python tools/upstream_tests.py --report --cells .cache/upstream-tests .cache/upstream-tests-torch2.10.0
"""

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from unit.env import extensions_dir  # noqa: E402

PY = sys.executable
LOCK = "/tmp/cpu.lock"
DEVICES = 4  # the most ranks a chosen file's test uses
HANG_MARGIN_S = 300  # beyond a test's own timeout, how long a run may show no progress before it is ended
TREES = {"pristine": ROOT / "pristine", "fork": ROOT / "fork"}
UPDATES = ROOT / "patches" / "upstream-tests"


def cell_of(prefix):
    """The torch cell of a venv: its name after `.venv` ('' for .venv, '-torch2.10.0' for .venv-torch2.10.0, the
    Makefile's TORCH=2.10.0)."""
    name = Path(prefix).name
    return name[len(".venv"):] if name.startswith(".venv") else ""


# This interpreter's cell; the results of each cell go to their own folder.
CELL = cell_of(sys.prefix)
RESULTS = ROOT / ".cache" / f"upstream-tests{CELL}"
# Upstream's pytest pin, installed apart (requirements/upstream-tests.txt), one per cell (Makefile): first on
# PYTHONPATH for these runs.
UPSTREAM_PYTEST = ROOT / ".cache" / f"upstream-pytest{CELL}"
# The areas the series touches: checkpointing (0002-0007), ZeRO-3 and ZeRO-1/2 (0001, 0003, 0006, 0007),
# NVMe offload (0007).
DEFAULT_FILES = [  # smallest first, so that a run stopped early has covered the most files
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_pipeline.py",
    "unit/checkpoint/test_moe_checkpoint.py",
    "unit/runtime/zero/test_nvme_checkpointing.py",
    "unit/checkpoint/test_autotp_uc_checkpoint.py",
    "unit/v1/zero/test_zero_autocast.py",
    "unit/checkpoint/test_zero_optimizer.py",
    "unit/v1/zero/test_zero.py",
    "unit/v1/zero/test_offload_states.py",
    "unit/checkpoint/test_universal_checkpoint.py",
]
# Ops the files load, built once per tree before any test's timeout runs (async_io alone takes minutes).
OPS = {
    "ShareMemCommBuilder": "deepspeed_shm_comm",
    "FusedAdamBuilder": "fused_adam",
    "CPUAdamBuilder": "cpu_adam",
    "PinMemoryBuilder": "pin_memory",
    "AsyncIOBuilder": "async_io"
}
OUTCOMES = ("passed", "failed", "skipped", "error", "timeout")


def extract_tests(upstream, dest):
    """Copy upstream's tests/ into dest; return the commit it came from (None for a plain folder)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    commit = None
    rev = subprocess.run(["git", "-C", str(upstream), "rev-parse", "HEAD"], capture_output=True, text=True)
    if rev.returncode == 0:
        commit = rev.stdout.strip()
    if (upstream / "tests").is_dir():  # a checkout: take its tests as they are, edits included
        shutil.copytree(upstream / "tests", dest / "tests")
    else:  # a git directory without a work tree
        archive = subprocess.run(["git", "-C", str(upstream), "archive", "HEAD", "tests"],
                                 capture_output=True,
                                 check=True)
        tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(dest)
    return commit


def apply_updates(dest):
    """Apply every patches/upstream-tests/*.diff (the upstream tests the series updates) at dest."""
    diffs = sorted(UPDATES.glob("*.diff"))
    # A repository of its own: inside this checkout's, git apply would take the paths as ours and skip them.
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    for diff in diffs:
        subprocess.run(["git", "apply", str(diff)], cwd=dest, check=True)
    return diffs


def updated_files(diffs):
    """The test files (relative to tests/) that the diffs change."""
    files = []
    for diff in diffs:
        for line in diff.read_text().splitlines():
            if line.startswith("+++ b/tests/"):
                files.append(line[len("+++ b/tests/"):])
    return sorted(set(files))


def tree_env(tree, log, timeout):
    """The environment that makes `import deepspeed` find this tree, with its own JIT-op cache."""
    env = dict(os.environ)
    path = [str(ROOT / "tools")]  # the plugin
    if UPSTREAM_PYTEST.is_dir():
        path.insert(0, str(UPSTREAM_PYTEST))
    if tree != "fork":
        path.insert(0, str(TREES[tree]))  # before the editable install of fork/
    env.update({
        "PYTHONPATH": os.pathsep.join(path),
        "DS_ACCELERATOR": "cpu",
        # The CPU accelerator counts LOCAL_SIZE devices (else one per NUMA node, here 1), and DistributedTest
        # skips a test that has more ranks than devices: without it every multi-rank test would be skipped.
        "LOCAL_SIZE": str(DEVICES),
        "TORCH_EXTENSIONS_DIR": extensions_dir(TREES[tree]),
        "UPSTREAM_TESTS_LOG": str(log),
        # DistributedTest's own hang check ends the whole session and can then hang closing its pool; let
        # pytest-timeout act first.
        "DS_UNITTEST_TIMEOUT": str(2 * timeout),
    })
    return env


def build_ops(tree):
    cache = Path(extensions_dir(TREES[tree]))
    if all((cache / name / f"{name}.so").exists() for name in OPS.values()):
        return  # built: no need to wait for the CPU lock
    with cpu_lock():
        load_ops(tree)


def load_ops(tree):
    """Load (JIT-building where needed) the ops the files use, in the tree's own cache; the caller holds the lock."""
    code = ("import sys; from deepspeed.accelerator import get_accelerator as a\n"
            "for n in sys.argv[1:]:\n"
            "    b = a().create_op_builder(n)\n"
            "    if b is not None and b.is_compatible(verbose=False): b.load(verbose=False)\n")
    subprocess.run([PY, "-c", code] + list(OPS),
                   env=tree_env(tree, os.devnull, 0),
                   check=True,
                   stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def cpu_lock():
    """The lock that flock(1) takes on /tmp/cpu.lock: other runs on this machine wait while it is held."""
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def outcomes_from_log(log):
    """nodeid -> outcome from the plugin's log; a test that started and never finished timed out."""
    results = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        rec = json.loads(line)
        node = results.setdefault(rec["nodeid"], {"outcome": "timeout", "detail": "", "duration": 0.0})
        if rec["event"] == "setup" and rec["outcome"] == "passed":
            node["outcome"] = "passed"
        elif rec["event"] in ("setup", "call", "teardown") and rec["outcome"] != "passed":
            bad = "error" if rec["event"] != "call" and rec["outcome"] == "failed" else rec["outcome"]
            if node["outcome"] in ("passed", "timeout") or bad == "error":
                node["outcome"], node["detail"] = bad, rec["detail"]
        if rec["event"] in ("setup", "call", "teardown"):
            node["duration"] = round(node["duration"] + rec["duration"], 1)
        node["finished"] = node.get("finished", False) or rec["event"] == "finish"
    for node in results.values():
        if not node.pop("finished"):
            node["outcome"] = "timeout"
    return results


def run_file(label, scratch, test_file, out, timeout, only=None):
    """Run one test file (or only those of its tests) in its own pytest process; after a timeout (the process
    is killed) run the rest."""
    tree = label.split("+")[0]
    log = out / f"{label}.{test_file.replace('/', '.')}.jsonl"
    log.unlink(missing_ok=True)
    log.with_suffix(".out").unlink(missing_ok=True)
    while True:
        done = outcomes_from_log(log)
        # Upstream's addopts deselect markers (e.g. `sequential`, the NVMe file): run every test of the file.
        cmd = [PY, "-m", "pytest"] + (only or [test_file])
        cmd += ["-p", "upstream_tests_plugin", "-p", "no:cacheprovider", "-o", "addopts=", "-q"]
        cmd += [f"--timeout={timeout}", "--timeout-method=thread"]
        cmd += [f"--deselect={nodeid}" for nodeid in done]
        out_file = log.with_suffix(".out")  # pytest's own output, for the tracebacks
        start = out_file.stat().st_size if out_file.exists() else 0
        with open(out_file, "a") as out_stream:
            # A new session, so that the ranks of a test killed by the timeout can be ended with it.
            proc = subprocess.Popen(cmd,
                                    cwd=scratch / "tests",
                                    env=tree_env(tree, log, timeout),
                                    start_new_session=True,
                                    stdout=out_stream,
                                    stderr=subprocess.STDOUT)
            try:
                wait_while_active(proc, log, idle_limit=timeout + HANG_MARGIN_S)
            finally:  # also when this runner is stopped: the test's process group has a session of its own
                kill_group(proc.pid)
        with open(out_file, "rb") as f:  # the offset is in bytes
            f.seek(start)
            output = f.read().decode(errors="replace")
        now = outcomes_from_log(log)
        if all(now[n]["outcome"] != "timeout" for n in set(now) - set(done)):  # ran to the end
            if not now:  # collection failed: the whole file counts as one error
                now = {test_file: {"outcome": "error", "detail": output[-2000:], "duration": 0.0}}
            return now
        print(f"  {tree}: a test timed out; running the rest of {test_file}", flush=True)


def wait_while_active(proc, log, idle_limit):
    """Wait for pytest to end; give up when its log has not moved for idle_limit seconds: pytest-timeout ends a
    hung test, not a hang in collection, a fixture's teardown or the worker pool's shutdown."""
    last_change = time.time()
    seen = None
    while proc.poll() is None:
        stamp = log.stat().st_mtime if log.exists() else None
        if stamp != seen:
            seen, last_change = stamp, time.time()
        elif time.time() - last_change > idle_limit:
            print(f"  no progress for {idle_limit} s outside any test's timeout: ending pytest", flush=True)
            return
        time.sleep(5)


def kill_group(pgid):
    try:
        os.killpg(pgid, 9)
    except ProcessLookupError:
        pass


def counts(results):
    return {o: sum(r["outcome"] == o for r in results.values()) for o in OUTCOMES}


def table(all_results, files, trees):
    """Markdown table: per file, passed/failed/skipped/error(+timeout) per tree."""
    head = "| file | " + " | ".join(f"{t} p/f/s/e" for t in trees) + " |"
    rows = [head, "|---|" + "---|" * len(trees)]
    for f in files:
        cells = []
        for t in trees:
            res = all_results.get(t, {}).get(f)
            if res is None:
                cells.append("not run")
                continue
            c = counts(res)
            cells.append(f"{c['passed']}/{c['failed']}/{c['skipped']}/{c['error'] + c['timeout']}")
        rows.append(f"| `{f}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def regressions(all_results, files, base="pristine", new="fork"):
    """Tests that pass on base and do not pass on new (skipped on new counts too: it hides a change)."""
    found = []
    for f in files:
        old, cur = all_results.get(base, {}).get(f, {}), all_results.get(new, {}).get(f, {})
        for nodeid, r in sorted(cur.items()):
            # A file that new cannot even collect is keyed by the file alone: it counts where base passed any test.
            passed_before = (old.get(nodeid, {}).get("outcome") == "passed" if "::" in nodeid else any(
                o["outcome"] == "passed" for o in old.values()))
            if passed_before and r["outcome"] != "passed":
                found.append((nodeid, r))
    return found


def cell_name(meta):
    return f"torch {meta.get('torch', '?')} ({meta.get('venv', '?')})"


def report(all_results, files, trees, meta):
    print(f"\nupstream tests from {meta.get('upstream')} at {meta.get('commit')}, cell {cell_name(meta)}")
    print(table(all_results, files, trees))
    if meta.get("quick"):
        print("pristine ran only the tests the fork does not pass (--quick) in: " + ", ".join(meta["quick"]))
    if "pristine" in trees and "fork" in trees:
        regs = regressions(all_results, files)
        print(f"\npass on pristine, not on the fork: {len(regs)}")
        for nodeid, r in regs:
            print(f"- {nodeid}: {r['outcome']}\n    " + "\n    ".join(r["detail"].splitlines()[-6:]))
    if "fork+updated" in trees:
        print("\nupdated tests (patches/upstream-tests) on the fork:")
        for f, res in all_results["fork+updated"].items():
            for nodeid, r in sorted(res.items()):
                if r["outcome"] != "passed" and all_results.get("pristine", {}).get(f, {}).get(
                        nodeid, {}).get("outcome") == "passed":
                    print(f"- {nodeid}: {r['outcome']}")
            print(f"  {f}: {counts(res)}")


def report_cells(folders):
    """One table of several cells' saved results (each a results folder), their columns side by side."""
    merged, files, names = {}, [], []
    for folder in folders:
        saved = folder / "results.json"
        if not saved.exists():
            print(f"{saved}: no results")
            continue
        state = json.loads(saved.read_text())
        name = f"torch {state['meta'].get('torch', '?')}"
        names.append(f"{name}: {folder}, upstream {state['meta'].get('commit')}")
        files += [f for f in state["meta"].get("files", []) if f not in files]
        for tree, res in state["results"].items():
            merged[f"{name} {tree}"] = res
        if "pristine" in state["results"] and "fork" in state["results"]:
            regs = regressions(state["results"], state["meta"].get("files", []))
            names[-1] += f"; pass on pristine, not on the fork: {len(regs)}"
    print("\n".join(["cells:"] + [f"- {n}" for n in names]))
    print(table(merged, files, list(merged)))


def run_tree(args, state, tree, scratch, test_file):
    only = None
    # The updated copy only needs to fix the fork's failures; with --quick, pristine only needs to tell which of
    # them are the fork's.
    if tree == "fork+updated" or (args.quick and tree == "pristine"):
        fork = state["results"].get("fork", {}).get(test_file, {})
        only = sorted(n for n, r in fork.items() if r["outcome"] not in ("passed", "skipped") and "::" in n)
        uncollected = any("::" not in n for n in fork)  # the fork could not collect it: run it whole
        if uncollected:
            only = None
        elif not only:
            return
    print(f"{tree}: {test_file}" + (f" ({len(only)} tests the fork does not pass)" if only else ""), flush=True)
    res = run_file(tree, scratch, test_file, args.out, args.timeout, only)
    state["results"].setdefault(tree, {})[test_file] = res
    if tree == "pristine":  # the files whose pristine totals cover only the fork's failures
        quick = set(state["meta"].get("quick", [])) - {test_file}
        state["meta"]["quick"] = sorted(quick | ({test_file} if only else set()))
    print(f"  {counts(res)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, help="an upstream DeepSpeed checkout or git directory")
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="test files, relative to tests/")
    parser.add_argument("--trees", nargs="+", choices=list(TREES), default=list(TREES))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    parser.add_argument("--out",
                        type=Path,
                        default=RESULTS,
                        help="results folder (default: this venv's cell's, %(default)s)")
    parser.add_argument("--no-updated",
                        dest="updated",
                        action="store_false",
                        help="skip the fork run of the test files that patches/upstream-tests/*.diff update")
    parser.add_argument("--quick",
                        action="store_true",
                        help="run pristine only on the tests the fork does not pass (the fork runs first): finds "
                        "every pristine-pass/fork-fail test at about half the cost, without pristine's totals")
    parser.add_argument("--report", action="store_true", help="print the saved results of the last run")
    parser.add_argument("--cells",
                        nargs="+",
                        type=Path,
                        help="with --report: the results folders of several cells, shown in one table")
    args = parser.parse_args()
    if args.cells:
        report_cells(args.cells)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that run_file's cleanup runs on kill
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "results.json"
    state = json.loads(saved.read_text()) if saved.exists() else {"meta": {}, "results": {}}
    if args.report:
        files = state["meta"].get("files", DEFAULT_FILES)
        report(state["results"], files, list(state["results"]), state["meta"])
        return
    if args.upstream is None:
        parser.error("--upstream is required (or --report)")
    commit = extract_tests(args.upstream.resolve(), args.out / "tests-upstream")
    known = state["meta"].get("files", [])  # a run of some files keeps the others' saved results
    import torch  # the cell: which torch this venv runs the tests with
    state["meta"] = {
        "upstream": str(args.upstream),
        "commit": commit,
        "torch": torch.__version__,
        "venv": Path(sys.prefix).name,
        "quick": state["meta"].get("quick", []),
        "files": known + [f for f in args.files if f not in known]
    }
    changed = []
    if args.updated and "fork" in args.trees:
        extract_tests(args.upstream.resolve(), args.out / "tests-updated")
        changed = updated_files(apply_updates(args.out / "tests-updated"))
    for tree in args.trees:
        build_ops(tree)
    # File by file, both trees in turn, so that a run stopped early still compares the files it ran.
    for test_file in args.files:
        runs = [(tree, args.out / "tests-upstream") for tree in sorted(args.trees)]  # fork first (--quick)
        if test_file in changed:
            runs.append(("fork+updated", args.out / "tests-updated"))
        with cpu_lock():
            for tree, scratch in runs:
                run_tree(args, state, tree, scratch, test_file)
                saved.write_text(json.dumps(state, indent=1))  # after each file: a partial run still reports
    report(state["results"], state["meta"]["files"], list(state["results"]), state["meta"])


if __name__ == "__main__":
    main()
