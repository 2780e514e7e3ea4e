# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""When a walkthrough step fails, its report shows the failing rank's own last lines (each rank logs to
its own file), not only the launcher's."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_LOG = """\
[INFO] [launch.py:245:main] process 101 spawned with command: ['python', '-u', 'train.py', '--local_rank=0']
[INFO] [launch.py:245:main] process 102 spawned with command: ['python', '-u', 'train.py', '--local_rank=1']
[INFO] [launch.py:285:main] Process 102 exits successfully.
[ERROR] [launch.py:259:sigkill_handler] ['python', '-u', 'train.py', '--local_rank=0'] exits with return code = -6
"""


@pytest.fixture(scope="module")
def walkthrough():
    spec = importlib.util.spec_from_file_location("example_walkthrough", ROOT / "examples" / "walkthrough.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_shows_the_failing_ranks_own_error(walkthrough, tmp_path):
    log, ranks = tmp_path / "step.log", tmp_path / "step.ranks"
    log.write_text(LAUNCHER_LOG)
    ranks.mkdir()
    (ranks / "20261130120000_rank0.log").write_text("step 2 loss 4.55\nterminate called without an active exception\n")
    (ranks / "20261130120000_rank1.log").write_text("step 2 loss 4.55\n")
    report = walkthrough.failure_report("autocast-fork", 250, log, ranks)
    assert report.splitlines()[0] == "autocast-fork exited with 250 (rank 0 failed)"
    assert "----- rank 0," in report and "terminate called without an active exception" in report
    assert "----- rank 1," not in report
    assert report.rstrip().endswith("exits with return code = -6")


def test_every_rank_is_shown_when_the_launcher_names_none(walkthrough, tmp_path):
    log, ranks = tmp_path / "step.log", tmp_path / "step.ranks"
    log.write_text("Traceback (most recent call last):\nOSError: launcher failed\n")
    report = walkthrough.failure_report("autocast-fork", 1, log, ranks)
    assert "(ranks 0, 1 failed)" in report.splitlines()[0]
    assert report.count("(no output)") == 2
