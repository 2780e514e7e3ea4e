# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Python 3.9+ for everything we ship, and no DeepSpeed file raised above upstream's minimum by the
series (tools/pycompat.py, vermin). Newer syntax is caught on scratch copies."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "pycompat.py"
NEEDS_3_10 = "def f(x):\n    match x:\n        case 1:\n            return 1\n"

sys.path.insert(0, str(ROOT / "tools"))
import pycompat  # noqa: E402


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def test_our_files_and_the_series_keep_their_python_minimum():
    result = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "our files run on Python 3.9+" in result.stdout


def test_newer_syntax_in_our_files_is_caught(tmp_path, monkeypatch):
    newer = tmp_path / "newer.py"
    newer.write_text(NEEDS_3_10)
    monkeypatch.setattr(pycompat, "ROOT", tmp_path)
    monkeypatch.setattr(pycompat, "our_files", lambda: [newer])
    problems = pycompat.check_ours()
    assert len(problems) == 1 and "newer.py needs Python 3.10" in problems[0] and "pattern matching" in problems[0]


def test_a_patch_that_raises_a_deepspeed_file_above_upstream_is_caught(tmp_path):
    if not (ROOT / "fork" / ".git").is_dir():
        pytest.fail("fork/ is missing: run `make setup` (tools/patches.py import) first")
    fork = tmp_path / "fork"
    git(tmp_path, "clone", "--quiet", "--shared", str(ROOT / "fork"), str(fork))
    git(fork, "fetch", "--quiet", "origin", "refs/tags/*:refs/tags/*")
    assert pycompat.check_fork(fork) == []
    target = fork / "deepspeed" / "runtime" / "zero" / "stage3.py"
    target.write_text(target.read_text() + "\n\n" + NEEDS_3_10)
    problems = pycompat.check_fork(fork)
    assert len(problems) == 1 and "fork/deepspeed/runtime/zero/stage3.py needs Python 3.10" in problems[0]


def test_a_union_type_annotation_is_caught(tmp_path, monkeypatch):
    # vermin 1.9 flags `X | None` only with --feature union-types.
    newer = tmp_path / "union.py"
    newer.write_text("def f(x: int | None):\n    return x\n")
    monkeypatch.setattr(pycompat, "ROOT", tmp_path)
    monkeypatch.setattr(pycompat, "our_files", lambda: [newer])
    problems = pycompat.check_ours()
    assert len(problems) == 1 and "union.py needs Python 3.10" in problems[0]


def test_a_file_with_no_version_specific_feature_counts_as_3_0(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    assert pycompat.vermin([plain]) == {plain.resolve(): (3, 0)}


def test_renamed_and_extensionless_python_scripts_are_checked(tmp_path):
    # A scratch fork: a renamed module and a bin/ script without .py must both be listed; a shell script not.
    fork = tmp_path / "fork"
    (fork / "bin").mkdir(parents=True)
    (fork / "old_name.py").write_text("import os\n\n\ndef g():\n    return os.sep\n" * 5)
    (fork / "bin" / "tool").write_text("#!/usr/bin/env python3\nprint(1)\n")
    (fork / "bin" / "shell").write_text("#!/bin/bash\necho 1\n")
    git(fork, "init", "--quiet")
    git(fork, "add", ".")
    git(fork, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "upstream")
    git(fork, "tag", pycompat.UPSTREAM_TAG)
    git(fork, "mv", "old_name.py", "new_name.py")
    for name in ("new_name.py", "bin/tool", "bin/shell"):
        (fork / name).write_text((fork / name).read_text() + "\n# changed\n")
    git(fork, "add", ".")
    git(fork, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "series")
    assert sorted(pycompat.touched_files(fork)) == ["bin/tool", "new_name.py"]
    (fork / "bin" / "tool").write_text("#!/usr/bin/env python3\n" + NEEDS_3_10)
    git(fork, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-am", "newer")
    problems = pycompat.check_fork(fork)
    assert len(problems) == 1 and "fork/bin/tool needs Python 3.10" in problems[0]
