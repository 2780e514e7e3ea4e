# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""When a walkthrough step fails, its report shows every rank's own last lines (each rank logs to its own
file), those with an error first, then the launcher's. The launcher's "exits with return code" line names
the last spawned rank's command whichever rank failed, so the report must not trust it."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Rank 0 failed, but the launcher prints the stale command of the last rank it spawned (rank 1).
LAUNCHER_LOG = """\
[INFO] [launch.py:245:main] process 101 spawned with command: ['python', '-u', 'train.py', '--local_rank=0']
[INFO] [launch.py:245:main] process 102 spawned with command: ['python', '-u', 'train.py', '--local_rank=1']
[ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=1'] exits with return code = 1
"""


@pytest.fixture(scope="module")
def walkthrough():
    spec = importlib.util.spec_from_file_location("example_walkthrough", ROOT / "examples" / "walkthrough.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_step(tmp_path, rank_texts, launcher=LAUNCHER_LOG):
    log, ranks = tmp_path / "step.log", tmp_path / "step.ranks"
    log.write_text(launcher)
    ranks.mkdir()
    for rank, text in rank_texts.items():
        (ranks / f"20261130120000_rank{rank}.log").write_text(text)
    return log, ranks


def test_the_erring_rank_comes_first_whatever_the_launcher_names(walkthrough, tmp_path):
    log, ranks = write_step(tmp_path, {
        0: "step 2 loss 4.55\nTraceback (most recent call last):\nRuntimeError: boom\n",
        1: "step 2 loss 4.55\n"
    })
    report = walkthrough.failure_report("autocast-fork", 1, log, ranks)
    lines = report.splitlines()
    assert lines[0] == "autocast-fork exited with 1 (error in the log of rank 0)"
    assert lines[1].startswith("----- rank 0,") and "RuntimeError: boom" in report
    assert report.index("----- rank 0,") < report.index("----- rank 1,")  # every rank is shown
    assert report.rstrip().endswith("exits with return code = 1")


def test_every_rank_is_shown_in_rank_order_when_none_shows_an_error(walkthrough, tmp_path):
    log, ranks = write_step(tmp_path, {1: "step 2\nterminate called\n", 0: ""})
    report = walkthrough.failure_report("autocast-fork", 250, log, ranks)
    assert report.splitlines()[0] == "autocast-fork exited with 250"
    assert report.index("----- rank 0,") < report.index("----- rank 1,")
    assert "(no output)" in report and "terminate called" in report


def test_no_rank_logs_is_said_not_invented(walkthrough, tmp_path):
    log, ranks = write_step(tmp_path, {}, launcher="Traceback (most recent call last):\nOSError: launcher failed\n")
    report = walkthrough.failure_report("autocast-fork", 1, log, ranks)
    assert "no rank logs in" in report and "----- rank" not in report
    assert report.rstrip().endswith("OSError: launcher failed")


def test_a_relative_workdir_is_made_absolute(walkthrough, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert walkthrough.Walkthrough("demo", 29511).workdir == tmp_path.resolve() / "demo"
