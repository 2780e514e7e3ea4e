# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`make gpu-evidence` (tools/gpu_evidence.py) assembles one table from its steps' outputs, and exits 1 when a fork row
is not ok: here on recorded outputs (a bench table, the JSON-lines logs of pytest shards), in a second, without
running a test or importing torch."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_evidence  # noqa: E402

HEADER = [
    "precision", "build", "weights", "masters", "grads", "Adam", "W+M+Adam", "analytic min W+M+Adam",
    "saved vs 0.19.8", "max RSS MiB", "allocated GiB", "peak GiB"
]
BENCH = "\n".join("| " + " | ".join(cells) + " |" for cells in [
    HEADER, ["---"] * len(HEADER), ["fp32", "0.19.8", "4", "4", "4", "8", "16", "12", "", "900", "0.313", "0.5"],
    ["fp32", "fork", "4", "0", "4", "8", "12", "12", "4", "900", "0.25", "0.438"]
])


def log_test(log, nodeid, outcome):
    """The records tools/upstream_tests_plugin.py writes for one test; a timed-out test started and never finished."""
    stages = [("setup", "passed")] + ([] if outcome == "timeout" else [("call", outcome), ("teardown", "passed")])
    records = [{
        "event": "start"
    }] + [{
        "event": stage,
        "outcome": result,
        "duration": 1.0,
        "detail": "AssertionError: stale" if result == "failed" else ""
    } for stage, result in stages] + ([] if outcome == "timeout" else [{
        "event": "finish"
    }])
    with open(log, "a") as f:
        f.writelines(json.dumps(dict(record, nodeid=nodeid)) + "\n" for record in records)


def finished(job, output="", tests=None, rc=0, collected=None):
    """A job as run_jobs leaves it: its output; for pytest its log (tests: {nodeid: outcome}) and collected ids."""
    job.out.write_text(output)
    for nodeid, outcome in (tests or {}).items():
        log_test(job.log, nodeid, outcome)
    if job.collected is not None:
        job.collected.write_text("".join(f"{n}\n" for n in (collected or tests or {})))
    job.state, job.rc, job.start, job.end = "done", rc, 0.0, 12.0


@pytest.fixture
def jobs(tmp_path):
    steps = gpu_evidence.plan(cpu=False)
    jobs = gpu_evidence.make_jobs(steps, False, None, 1, tmp_path)
    for tree in ("fork", "pristine"):
        for job in jobs[("ops", tree)]:
            finished(job, f"{job.cmd[-1]}: ready in 3 s\n")
    finished(jobs[("bench", "fork")][0], "noise\n" + BENCH)
    finished(jobs[("0001", "fork")][0],
             tests={
                 "alias.py::T::test[fp32]": "passed",
                 "alias.py::T::test[bf16]": "passed"
             })
    finished(jobs[("0001", "pristine")][0],
             tests={
                 "alias.py::T::test[fp32]": "failed",
                 "alias.py::T::test[bf16]": "passed"
             })
    for tree in ("fork", "pristine"):
        finished(jobs[("upstream", tree)][0], tests={f"up.py::T::t[{i}]": "passed" for i in range(3)})
    finished(jobs[("suite", "fork")][0], tests={"a.py::t1": "passed", "a.py::T::t2": "skipped"})
    return steps, jobs


def test_the_table_has_a_row_per_step_and_tree(jobs):
    rows, results = gpu_evidence.assemble(*jobs)
    text = gpu_evidence.table(rows)
    assert all(r["ok"] for r in rows if r["tree"] == "fork")
    assert [(r["step"], r["tree"]) for r in rows] == [("ops", "fork"), ("ops", "0.19.8"), ("bench", "0.19.8"),
                                                      ("bench", "fork"), ("0001", "fork"), ("0001", "0.19.8"),
                                                      ("upstream", "fork"), ("upstream", "0.19.8"), ("suite", "fork")]
    assert "fp32: W+M+Adam 12 B/param (analytic min 12, weights 4, masters 0), saves 4 B/param; allocated 0.25 GiB, " \
           "peak 0.438 GiB" in text
    assert "| 2 passed, 0 failed |" in text and "| 1 passed, 1 failed (the aliased cells must fail" in text
    assert "| 1 passed, 0 failed, 1 skipped | 12 s |" in text  # the suite: multi-rank tests skip on one GPU
    assert gpu_evidence.failures(results) == []  # the pristine failure is 0001's regression test, as expected


def test_a_fork_failure_a_timeout_and_a_test_never_started_make_rows_not_ok(jobs):
    steps, jobs = jobs
    upstream = jobs[("upstream", "fork")][0]
    upstream.log.unlink()
    finished(upstream,
             tests={
                 "up.py::T::t[0]": "passed",
                 "up.py::T::t[1]": "failed",
                 "up.py::T::t[2]": "timeout"
             },
             collected=["up.py::T::t[0]", "up.py::T::t[1]", "up.py::T::t[2]", "up.py::T::t[3]"])
    rows, results = gpu_evidence.assemble(steps, jobs)
    row = next(r for r in rows if (r["step"], r["tree"]) == ("upstream", "fork"))
    assert not row["ok"] and row["result"] == "1 passed, 1 failed, 1 timeout, 1 not run"
    assert "| **not ok** 1 passed, 1 failed, 1 timeout, 1 not run |" in gpu_evidence.table(rows)
    assert gpu_evidence.failures(results) == [
        "upstream (fork): 3 not passed", "- up.py::T::t[1]: failed: AssertionError: stale",
        "- up.py::T::t[2]: timeout", "- up.py::T::t[3]: not run"
    ]


def test_a_skip_where_every_test_can_run_on_one_gpu_is_not_ok(jobs):
    steps, jobs = jobs
    alias = jobs[("0001", "fork")][0]
    alias.log.unlink()
    finished(alias, tests={"alias.py::T::test[fp32]": "skipped"})
    rows, _ = gpu_evidence.assemble(steps, jobs)
    assert not next(r for r in rows if (r["step"], r["tree"]) == ("0001", "fork"))["ok"]


def test_a_failed_build_or_bench_is_named(jobs):
    steps, jobs = jobs
    finished(jobs[("ops", "fork")][0], "...\nRuntimeError: Error building extension 'fused_adam'\n", rc=1)
    finished(jobs[("bench", "fork")][0], "fork run failed (exit 1)\n", rc=1)
    rows, _ = gpu_evidence.assemble(steps, jobs)
    ops, bench = rows[0], rows[2]
    assert not ops["ok"] and ops[
        "result"] == "FusedAdamBuilder FAILED: RuntimeError: Error building extension 'fused_adam'"
    assert not bench["ok"] and bench["result"] == "FAILED: fork run failed (exit 1)"


def test_jobs_start_after_their_dependencies_and_stop_at_the_deadline(tmp_path):
    python = [sys.executable, "-c"]

    def job(step, tree, code, after=()):
        return gpu_evidence.Job(step, tree, python + [code], tmp_path, None, tmp_path / f"{step}-{tree}.out", after)

    built, broken = job("ops", "fork", "print('built')"), job("ops", "pristine", "raise SystemExit(3)")
    slow, skipped = job("0001", "fork", "import time; time.sleep(60)", [built]), job("0001", "pristine", "", [broken])
    gpu_evidence.run_jobs([built, broken, slow, skipped], parallel=2, deadline=time.monotonic() + 3)
    assert (built.state, built.rc, built.output()) == ("done", 0, "built\n") and broken.rc == 3
    assert skipped.state == "not started: ops failed for 0.19.8" and skipped.proc is None
    assert slow.state == "stopped" and slow.proc.returncode == -9


def test_list_prints_every_step_without_running_one():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_evidence.py"), "--list", "--cpu"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [line.split(":")[0] for line in result.stdout.splitlines()
            if not line.startswith(" ")] == gpu_evidence.STEPS
