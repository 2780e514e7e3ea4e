# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""tools/branch_tests.py: which files a pull request's branch is checked with, and which of their failures count.
Our tests' failures always count; a failure of an upstream test file the patch updates counts unless pristine
0.19.8 fails that test too (the snapshot's version skew)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import branch_tests  # noqa: E402


def test_files_to_run_are_the_manifests_and_the_upstream_updates():
    manifest = {
        "0001": {
            "tests": ["tests/unit/checkpoint/test_y.py"],
            "updates": []
        },
        "0007": {
            "tests": ["tests/unit/checkpoint/test_x.py"],
            "updates": ["tests/unit/checkpoint/test_y.py"]
        },
    }
    ours, upstream = branch_tests.files_to_run(manifest, "0007", [])
    assert ours == ["unit/checkpoint/test_x.py", "unit/checkpoint/test_y.py"]
    assert upstream == ["unit/checkpoint/test_autotp_uc_checkpoint.py"]  # patches/upstream-tests/0007.diff
    assert branch_tests.files_to_run(manifest, "0001", [])[1] == []


def test_a_branch_also_runs_the_tests_of_ours_it_carries():
    """A dependency's test file on the branch runs too (a later patch can break it); upstream's files and helpers
    that are not test files of a patch do not."""
    manifest = {
        "0001": {
            "tests": ["tests/unit/test_a.py"],
            "updates": []
        },
        "0002": {
            "tests": ["tests/unit/test_b.py"],
            "updates": []
        },
    }
    on_branch = [
        "tests/unit/test_a.py", "tests/unit/test_b.py", "tests/unit/helpers.py", "tests/unit/test_upstream.py"
    ]
    assert branch_tests.files_to_run(manifest, "0002", on_branch)[0] == ["unit/test_b.py", "unit/test_a.py"]
    assert branch_tests.files_to_run(manifest, "0002", on_branch, own_only=True)[0] == ["unit/test_b.py"]


def outcome(o, exception="AssertionError: x"):
    return {
        "outcome": o,
        "detail": f"    assert x\nE   {exception}\n\nfile.py:3: {exception.split(':')[0]}",
        "duration": 1.0
    }


def test_only_upstream_failures_that_pristine_shares_are_skew(capsys):
    up = "unit/checkpoint/test_autotp_uc_checkpoint.py"
    ours, idle = "unit/checkpoint/test_x.py", "unit/checkpoint/test_idle.py"
    state = {
        "pristine": {
            up: {
                f"{up}::test_skewed": outcome("failed"),
                f"{up}::test_changed": outcome("passed"),
                f"{up}::test_other_cause": outcome("failed", "KeyError: 'y'"),
                f"{up}::test_skipped_there": outcome("skipped"),
                f"{up}::test_other_numbers": outcome("failed", "AssertionError: allocated 1024 after offload"),
            },
            ours: {
                f"{ours}::test_ours": outcome("failed")
            },
        },
        "branches": {
            "0005": {
                "branch": "ds-fork/0005-x",
                "tree": "0123456789abcdef",
                "upstream_files": [up],
                "results": {
                    up: {
                        f"{up}::test_skewed": outcome("failed"),
                        f"{up}::test_changed": outcome("failed"),
                        f"{up}::test_other_cause": outcome("failed"),
                        f"{up}::test_skipped_there": outcome("failed"),
                        f"{up}::test_other_numbers": outcome("failed", "AssertionError: allocated 2048 after offload"),
                        f"{up}::test_fine": outcome("passed")
                    },
                    ours: {
                        f"{ours}::test_ours": outcome("timeout"),
                        f"{ours}::test_fine": outcome("passed")
                    },
                    idle: {
                        f"{idle}::test_needs_4_devices": outcome("skipped")
                    },
                },
            }
        },
    }
    failures = branch_tests.report(state)
    assert sorted(nodeid for _, nodeid, _ in failures) == sorted(
        [idle, f"{up}::test_changed", f"{up}::test_other_cause", f"{up}::test_skipped_there", f"{ours}::test_ours"])
    table = capsys.readouterr().out
    assert f"| 0005 | 0123456789ab | `{up}` | 1 | 5 | 0 | 0 | 2 |" in table


def test_a_branch_tree_keeps_the_mtimes_of_unchanged_files(tmp_path):
    """The next branch's tree replaces the previous one in place: unchanged files keep their mtime (no op
    rebuild), changed ones are rewritten (ninja rebuilds them), removed ones go, links stay links."""
    old, new, tree = tmp_path / "old", tmp_path / "new", tmp_path / "tree"
    for root, shm in ((old, "int a = 1;"), (new, "int a = 2;")):
        (root / "csrc").mkdir(parents=True)
        (root / "csrc" / "adam.cpp").write_text("adam")
        (root / "csrc" / "shm.cpp").write_text(shm)
        (root / "ops").mkdir()
        os.symlink("../csrc", root / "ops" / "csrc")
    (old / "csrc" / "gone.cpp").write_text("gone")
    branch_tests.sync_tree(old, tree)
    for name in ("adam.cpp", "shm.cpp"):
        os.utime(tree / "csrc" / name, (1, 1))
    branch_tests.sync_tree(new, tree)
    assert (tree / "csrc" / "adam.cpp").stat().st_mtime == 1
    assert (tree / "csrc" / "shm.cpp").stat().st_mtime > 1 and (tree / "csrc" / "shm.cpp").read_text() == "int a = 2;"
    assert not (tree / "csrc" / "gone.cpp").exists()
    assert os.readlink(tree / "ops" / "csrc") == "../csrc"


def test_a_file_that_becomes_a_folder_and_back(tmp_path):
    one, two, tree = tmp_path / "one", tmp_path / "two", tmp_path / "tree"
    (one / "pkg").mkdir(parents=True)
    (one / "pkg" / "mod").write_text("a file")
    (two / "pkg" / "mod").mkdir(parents=True)
    (two / "pkg" / "mod" / "__init__.py").write_text("a package")
    for src, is_dir in ((one, False), (two, True), (one, False)):
        branch_tests.sync_tree(src, tree)
        assert (tree / "pkg" / "mod").is_dir() == is_dir
    assert (tree / "pkg" / "mod").read_text() == "a file"


def test_numbers_are_masked_but_not_inside_names():
    assert branch_tests.exception_line("E   AssertionError: alloc=1024 [1]") == "E   AssertionError: alloc=# [#]"
    assert branch_tests.exception_line(
        "E   TypeError: fp16 and bf16 in stage3") == "E   TypeError: fp16 and bf16 in stage3"
