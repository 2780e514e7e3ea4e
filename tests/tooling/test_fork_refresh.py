# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""How `pip install -e .` and `make sync` (tools/patches.py materialize / import) treat an existing fork/
after patches/ changed: re-import only what loses nothing, into a scratch tree swapped in once complete (the
old tree kept as fork.bak-<time>); refuse a fork/ that predates the series and holds work, without advising
`make export`; build a fork/ that holds the series plus local work as it is, with a warning. Scratch repos only."""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import patches as tool  # noqa: E402
import patchtool.fork  # noqa: E402  (where replace_fork looks up fetch)


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def head(fork):
    return git(fork, "rev-parse", "HEAD").strip()


@pytest.fixture
def scratch(tmp_path, series_copy):
    """patches/ (its first patches: conftest.short_series) copied to tmp_path, a fork imported from it, git
    identity set."""
    patches = series_copy(tmp_path / "patches")
    return import_fork(tmp_path / "fork", patches), patches


def import_fork(fork, patches, drop_last=0):
    series = (patches / "series").read_text()
    (patches / "series").write_text("".join(series.splitlines(keepends=True)[:len(series.splitlines()) - drop_last]))
    tool.replace_fork(fork, patches)
    (patches / "series").write_text(series)
    for var, value in (("user.name", "test"), ("user.email", "test@localhost")):
        git(fork, "config", var, value)
    return fork


def revise_first_patch(patches):
    """What a pull that revises (not only appends to) the series does: patch 1's message changes."""
    first = patches / (patches / "series").read_text().split()[0]
    text = first.read_text()
    first.write_text(text.replace("\n---\n", "\n\nRevised after review.\n---\n", 1))  # the message ends at ---


def commit_own_work(fork):
    (fork / "mine.txt").write_text("my own work\n")
    git(fork, "add", "mine.txt")
    git(fork, "commit", "--quiet", "-m", "my own work")


def backups(fork):
    return sorted(fork.parent.glob(f"{fork.name}.bak-*"))


def test_behind_the_series_is_reimported_and_the_old_tree_kept(tmp_path, series_copy):
    patches = series_copy(tmp_path / "patches")
    fork = import_fork(tmp_path / "fork", patches, drop_last=1)
    assert any(p.startswith(tool.BEHIND) for p in tool.unexported(fork, patches))
    assert tool.materialize(fork, patches) is True
    assert tool.unexported(fork, patches) == []
    assert len(backups(fork)) == 1 and (backups(fork)[0] / ".git").is_dir()


def test_a_revised_series_is_reimported_when_fork_holds_nothing_of_its_own(scratch):
    fork, patches = scratch
    revise_first_patch(patches)
    problems = tool.unexported(fork, patches)
    assert len(problems) == 1 and "older revision" in problems[0] and "do not `make export`" in problems[0]
    assert tool.materialize(fork, patches) is True and tool.unexported(fork, patches) == []


def test_a_revised_series_over_own_work_is_refused_without_advising_export(scratch):
    fork, patches = scratch
    commit_own_work(fork)
    revise_first_patch(patches)
    before = head(fork)
    with pytest.raises(tool.PatchError) as refused:
        tool.materialize(fork, patches)
    message = str(refused.value)
    assert "imported from an older patch series" in message and "unexported commit:" in message
    assert "Do not `make export`" in message and "make sync FORCE=1" in message and "drops fork/'s own" in message
    assert head(fork) == before and not backups(fork)


@pytest.mark.parametrize("kind", ["stash", "branch", "tag", "untracked", "whitespace amend"])
def test_work_git_log_does_not_show_counts_as_local(scratch, capsys, kind):
    fork, patches = scratch
    stage3 = fork / "deepspeed" / "runtime" / "zero" / "stage3.py"
    if kind == "stash":
        stage3.write_text(stage3.read_text() + "# stashed\n")
        git(fork, "stash", "--quiet")
    elif kind in ("branch", "tag"):
        git(fork, kind, "keep-me", "HEAD")
    elif kind == "untracked":
        (fork / "notes.py").write_text("x = 1\n")
    else:  # the same commit with one trailing space: git < 2.40's patch-id would not see it
        touched = git(fork, "show", "--name-only", "--format=", "HEAD").split()[0]
        path = fork / touched
        path.write_text(path.read_text().replace("\n", " \n", 1))
        git(fork, "commit", "--quiet", "--amend", "--no-edit", "-a")
    own, relation, _ = tool.assess(fork, patches)
    assert own and relation == tool.CURRENT, own
    # Not behind: the build keeps fork/ as it is and names what is unexported.
    assert tool.materialize(fork, patches) is False
    assert "warning: building" in capsys.readouterr().err
    # After a pull the same work blocks the automatic re-import.
    revise_first_patch(patches)
    with pytest.raises(tool.PatchError, match="older patch series"):
        tool.materialize(fork, patches)


def test_a_failed_fetch_leaves_fork_in_place(tmp_path, series_copy, monkeypatch):
    patches = series_copy(tmp_path / "patches")
    fork = import_fork(tmp_path / "fork", patches, drop_last=1)
    before = head(fork)

    def offline():
        raise tool.PatchError("offline")

    monkeypatch.setattr(patchtool.fork, "fetch", offline)
    with pytest.raises(tool.PatchError, match="offline"):
        tool.materialize(fork, patches)
    assert head(fork) == before and not backups(fork)


def test_a_patch_that_fails_leaves_fork_in_place(scratch):
    fork, patches = scratch
    shutil.copy(ROOT / "tests" / "tooling" / "broken.patch", patches / "9999-broken.patch")
    with open(patches / "series", "a") as f:
        f.write("9999-broken.patch\n")
    before = head(fork)
    with pytest.raises(tool.PatchError, match="is unchanged"):
        tool.replace_fork(fork, patches)
    assert head(fork) == before and not backups(fork)


def test_export_refuses_to_overwrite_a_newer_series(scratch):
    fork, patches = scratch
    commit_own_work(fork)
    revise_first_patch(patches)
    revised = {p.name: p.read_text() for p in patches.iterdir() if p.is_file()}
    args = argparse.Namespace(fork=str(fork), patches=str(patches), force=False)
    with pytest.raises(tool.PatchError, match="Do not `make export`"):
        tool.cmd_export(args)
    assert {p.name: p.read_text() for p in patches.iterdir() if p.is_file()} == revised
