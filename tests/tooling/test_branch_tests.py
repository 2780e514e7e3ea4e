# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""tools/branch_tests.py: which files a pull request's branch is checked with, and which of their failures count.
Our tests' failures always count; a failure of an upstream test file the patch updates counts unless pristine
0.19.8 fails that test too (the snapshot's version skew)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import branch_tests  # noqa: E402


def test_files_to_run_are_the_manifests_and_the_upstream_updates():
    entry = {"tests": ["tests/unit/checkpoint/test_x.py"], "updates": ["tests/unit/checkpoint/test_y.py"]}
    ours, upstream = branch_tests.files_to_run(entry, "0005")
    assert ours == ["unit/checkpoint/test_x.py", "unit/checkpoint/test_y.py"]
    assert upstream == ["unit/checkpoint/test_autotp_uc_checkpoint.py"]  # patches/upstream-tests/0005.diff
    assert branch_tests.files_to_run(entry, "0001")[1] == []


def outcome(o):
    return {"outcome": o, "detail": f"{o} here", "duration": 1.0}


def test_only_upstream_failures_that_pristine_shares_are_skew(capsys):
    up = "unit/checkpoint/test_autotp_uc_checkpoint.py"
    state = {
        "pristine": {
            up: {
                f"{up}::test_skewed": outcome("failed"),
                f"{up}::test_changed": outcome("passed")
            },
            "unit/checkpoint/test_x.py": {
                "unit/checkpoint/test_x.py::test_ours": outcome("failed")
            },
        },
        "branches": {
            "0005": {
                "branch": "ds-fork/0005-x",
                "upstream_files": [up],
                "results": {
                    up: {
                        f"{up}::test_skewed": outcome("failed"),
                        f"{up}::test_changed": outcome("failed"),
                        f"{up}::test_fine": outcome("passed")
                    },
                    "unit/checkpoint/test_x.py": {
                        "unit/checkpoint/test_x.py::test_ours": outcome("timeout")
                    },
                },
            }
        },
    }
    failures = branch_tests.report(state)
    assert sorted(nodeid for _, nodeid, _ in failures) == [
        f"{up}::test_changed", "unit/checkpoint/test_x.py::test_ours"
    ]
    table = capsys.readouterr().out
    assert f"| 0005 | `{up}` | 1 | 2 | 0 | 0 | 1 |" in table
