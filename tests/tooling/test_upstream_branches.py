# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`tools/patches.py branches`: one stacked branch per patch in an upstream checkout, each holding the patch, its
tests at upstream's paths with the helpers they import, and its update of upstream's tests, with the pull-request
description as the message; a patch that conflicts stops the export by name. On a small synthetic upstream (no
network, no sdist)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "patches.py"
ENV = dict(os.environ,
           GIT_AUTHOR_NAME="t",
           GIT_AUTHOR_EMAIL="t@localhost",
           GIT_COMMITTER_NAME="t",
           GIT_COMMITTER_EMAIL="t@localhost")
FORMAT_PATCH = ("format-patch", "--stdout", "-1", "--zero-commit", "--no-signature", "--no-numbered", "--keep-subject",
                "--no-stat", "--full-index")
PREFIX = "pr/"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=ENV).stdout.strip()


def write(root, files):
    for rel, text in files.items():
        path = Path(root) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def commit(repo, message, files):
    write(repo, files)
    git(repo, "add", "--all")
    git(repo, "commit", "--quiet", "-m", message)
    return git(repo, "rev-parse", "HEAD")


UPSTREAM = {
    "deepspeed/engine.py": "".join(f"line {i}\n" for i in range(1, 21)),
    "deepspeed/stage3.py": "a = 1\n",
    # the sdist copies csrc/ into deepspeed/ops/csrc/, where upstream's git has a symbolic link
    "csrc/shm.cpp": "int a = 1;\n",
    "deepspeed/ops/csrc/shm.cpp": "int a = 1;\n",
    "tests/unit/common.py": "# upstream's harness\n",
    "tests/unit/checkpoint/test_upstream.py": "def test_old():\n    assert 'old' == 'old'\n",
}
MESSAGES = {
    "0001":
    "ZeRO-3: first fix\n\nDepends on: none.\n\nSummary\nFixes engine line 2.\n\nValidated\n"
    "Generated: tools/cells.py --feature first\n| feature | status |\n|---|---|\n| first | validated |\n\n"
    "On the previous version of this patch: test_x failed\n  with an old error.\nAll pass with the patch.\n\n"
    "From the test run finished 2026-11-30 14:14:15 UTC against `fork/`.\n",
    "0002":
    "ZeRO-3: second fix\n\nDepends on: 0001 (its engine change).\n\nSummary\nFixes stage3; refresh with "
    "tools/cells.py --feature second.\n",
}


@pytest.fixture
def scratch(tmp_path):
    """A pristine upstream (fork/ with its `upstream` tag), a two-patch series made on it, our tests and manifest,
    and an upstream checkout that moved on (a commit on engine.py's last line) since the pinned release."""
    fork, patches, source, checkout = (tmp_path / n for n in ("fork", "patches", "source", "checkout"))
    fork.mkdir()
    git(fork, "init", "--quiet", "--initial-branch=main")
    commit(fork, "upstream", UPSTREAM)
    git(fork, "tag", "upstream")
    engine = UPSTREAM["deepspeed/engine.py"].replace("line 2\n", "line 2 fixed\n")
    patch_files = {
        "0001": {
            "deepspeed/engine.py": engine
        },
        "0002": {
            "deepspeed/stage3.py": "a = 2\n",
            "csrc/shm.cpp": "int a = 2;\n",
            "deepspeed/ops/csrc/shm.cpp": "int a = 2;\n"
        }
    }
    patches.mkdir()
    names = []
    for number, files in patch_files.items():
        commit(fork, MESSAGES[number], files)
        name = f"{number}-{'first' if number == '0001' else 'second'}-fix.patch"
        (patches / name).write_text(git(fork, *FORMAT_PATCH, "HEAD") + "\n")
        names.append(name)
    (patches / "series").write_text("".join(n + "\n" for n in names))
    git(patches, "init", "--quiet")
    (patches / "tests.toml").write_text('[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\n\n'
                                        '[0002]\ntests = [\n    "tests/unit/checkpoint/test_second.py",\n]\n'
                                        'title = "ZeRO-3: second fix, whole scope"\n')
    (patches / "upstream-tests").mkdir()
    (patches / "upstream-tests" / "0002.diff").write_text(
        "--- a/tests/unit/checkpoint/test_upstream.py\n+++ b/tests/unit/checkpoint/test_upstream.py\n"
        "@@ -1,2 +1,2 @@\n def test_old():\n-    assert 'old' == 'old'\n+    assert 'new' == 'new'\n")
    write(
        source, {
            "tests/unit/v1/zero/test_first.py": "from unit.common import DistributedTest\n"
            "from unit.tiny_helpers import model  # noqa\n",
            "tests/unit/tiny_helpers.py": "from unit.checkpoint import deeper_helpers  # noqa\nmodel = 1\n",
            "tests/unit/checkpoint/deeper_helpers.py": "x = 1\n",
            "tests/unit/checkpoint/test_second.py": "from unit.tiny_helpers import (model)  # noqa\n",
            "tests/unit/common.py": "# our harness: never exported\n",
        })
    git(source, "init", "--quiet")
    commit(source, "our tests", {})
    write(source, {"tests/unit/tiny_helpers.py": "work in progress, not committed: never exported\n"})
    git(tmp_path, "clone", "--quiet", str(fork), str(checkout))
    git(checkout, "checkout", "--quiet", "-B", "master", "upstream")
    moved_on = UPSTREAM["deepspeed/engine.py"].replace("line 20\n", "line 20 upstream\n")
    commit(checkout, "upstream moved on", {"deepspeed/engine.py": moved_on})
    return fork, patches, source, checkout


def branches(fork, patches, source, checkout, *extra, commit_series=True):
    """Run the verb; the series folder is committed first (the verb takes the series as committed)."""
    if commit_series:
        git(patches, "add", "--all")
        git(patches, "commit", "--quiet", "--allow-empty", "-m", "series")
    return subprocess.run([
        sys.executable,
        str(TOOL), "--fork",
        str(fork), "--patches",
        str(patches), "branches",
        str(checkout), "--source",
        str(source), "--prefix", PREFIX, *extra
    ],
                          capture_output=True,
                          text=True,
                          env=ENV)


def show(checkout, rev, path):
    return git(checkout, "show", f"{rev}:{path}")


def test_one_stacked_branch_per_patch(scratch):
    fork, patches, source, checkout = scratch
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    first, second = PREFIX + "0001-first-fix", PREFIX + "0002-second-fix"
    assert git(checkout, "for-each-ref", "--format=%(refname:short)",
               f"refs/heads/{PREFIX}").split() == [first, second]
    # stacked in series order, one commit each, on the checkout's HEAD (3-way merged over upstream's new commit)
    assert git(checkout, "rev-parse", f"{first}^") == git(checkout, "rev-parse", "master")
    assert git(checkout, "rev-parse", f"{second}^") == git(checkout, "rev-parse", first)
    assert show(checkout, first, "deepspeed/engine.py").splitlines()[1::18] == ["line 2 fixed", "line 20 upstream"]
    assert show(checkout, second, "deepspeed/stage3.py") == "a = 2"
    # tests at upstream's paths, with the helpers they import (transitively), on the first branch needing them
    files = git(checkout, "diff", "--name-only", f"{first}^", first).split()
    assert files == [
        "deepspeed/engine.py", "tests/unit/checkpoint/deeper_helpers.py", "tests/unit/tiny_helpers.py",
        "tests/unit/v1/zero/test_first.py"
    ]
    assert show(checkout, first, "tests/unit/common.py") == "# upstream's harness"
    assert "never exported" not in show(checkout, first, "tests/unit/tiny_helpers.py")  # as committed
    # the upstream-test update on its own patch's branch only
    files = git(checkout, "diff", "--name-only", f"{second}^", second).split()
    assert files == [
        "csrc/shm.cpp", "deepspeed/ops/csrc/shm.cpp", "deepspeed/stage3.py", "tests/unit/checkpoint/test_second.py",
        "tests/unit/checkpoint/test_upstream.py"
    ]
    assert "'new'" in show(checkout, second, "tests/unit/checkpoint/test_upstream.py")
    assert "'old'" in show(checkout, first, "tests/unit/checkpoint/test_upstream.py")
    # the message is the PR description: fork-only lines out, the stack and the patches it names explained
    first_text, second_text = (git(checkout, "log", "-1", "--format=%B", b) for b in (first, second))
    assert first_text.splitlines()[0] == "ZeRO-3: first fix"
    assert second_text.splitlines()[0] == "ZeRO-3: second fix, whole scope"  # the title from tests.toml
    assert "| first | validated |" in first_text
    for text in (first_text, second_text):
        assert "tools/cells.py" not in text and "From the test run" not in text and "fork/" not in text
        assert "previous version" not in text and "old error" not in text
    assert "All pass with the patch." in first_text
    assert "stack" not in first_text
    assert f"Stacked on `{first}`" in second_text and f"- 0001: `{first}`" in second_text
    # authored and signed off by the one sending them (upstream checks DCO sign-offs)
    for branch, text in ((first, first_text), (second, second_text)):
        assert text.rstrip().endswith("Signed-off-by: t <t@localhost>")
        assert git(checkout, "log", "-1", "--format=%an <%ae>", branch) == "t <t@localhost>"
    # the user's checkout is as it was, and a second run needs --force
    assert git(checkout, "status", "--porcelain") == "" and git(checkout, "rev-parse", "--abbrev-ref",
                                                                "HEAD") == "master"
    again = branches(*scratch)
    assert again.returncode != 0 and "--force" in again.stderr
    assert branches(*scratch, "--force").returncode == 0


def test_a_conflict_stops_at_the_patch_naming_its_files(scratch):
    fork, patches, source, checkout = scratch
    commit(checkout, "upstream rewrote stage3", {"deepspeed/stage3.py": "a = 3\n"})
    result = branches(*scratch)
    assert result.returncode != 0
    assert "0002-second-fix.patch does not apply on" in result.stderr
    assert "conflicts in deepspeed/stage3.py" in result.stderr
    refs = git(checkout, "for-each-ref", "--format=%(refname:short)", f"refs/heads/{PREFIX}").split()
    assert refs == [PREFIX + "0001-first-fix"]
    assert git(checkout, "worktree", "list").count("\n") == 0  # the scratch worktree is gone


def test_a_patch_upstream_already_has_is_refused(scratch):
    fork, patches, source, checkout = scratch
    commit(checkout, "upstream took the second fix", {
        "deepspeed/stage3.py": "a = 2\n",
        "csrc/shm.cpp": "int a = 2;\n",
        "deepspeed/ops/csrc/shm.cpp": "int a = 2;\n"
    })
    result = branches(*scratch)
    assert result.returncode != 0 and "0002-second-fix.patch changes nothing" in result.stderr


def test_a_patch_without_a_tests_entry_is_refused(scratch):
    fork, patches, source, checkout = scratch
    (patches / "tests.toml").write_text('[0001]\ntests = []\n')
    result = branches(*scratch)
    assert result.returncode != 0 and "no table for 0002" in result.stderr


def test_a_helper_that_collides_with_upstream_is_refused(scratch):
    fork, patches, source, checkout = scratch
    commit(source, "a test named as upstream's", {"tests/unit/checkpoint/test_upstream.py": "x = 1\n"})
    (patches / "tests.toml").write_text('[0001]\ntests = ["tests/unit/checkpoint/test_upstream.py"]\n\n'
                                        '[0002]\ntests = []\n')
    result = branches(*scratch)
    assert result.returncode != 0 and "exists in upstream's tree" in result.stderr


def test_a_later_patch_updates_an_earlier_patchs_tests(scratch):
    """0001 takes its tests as committed before a later change (`at`); 0002, which made that change, carries it
    (`updates`). Both carry HEAD's version of the helper (one version of it in every pull request, so that two
    independent ones never add it in two versions): 0001's branch adds it, 0002's finds it there."""
    fork, patches, source, checkout = scratch
    before = git(source, "rev-parse", "HEAD")
    commit(
        source, "0002 retires a test of 0001", {
            "tests/unit/v1/zero/test_first.py": "from unit.common import DistributedTest\n"
            "from unit.tiny_helpers import model  # noqa\n# the refusal test retired\n",
            "tests/unit/tiny_helpers.py": "from unit.checkpoint import deeper_helpers  # noqa\nmodel = 2\n",
        })
    (patches / "tests.toml").write_text(f'[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\nat = "{before}"\n\n'
                                        '[0002]\ntests = ["tests/unit/checkpoint/test_second.py"]\n'
                                        'updates = ["tests/unit/v1/zero/test_first.py"]\n')
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    first, second = PREFIX + "0001-first-fix", PREFIX + "0002-second-fix"
    assert "retired" not in show(checkout, first, "tests/unit/v1/zero/test_first.py")
    assert show(checkout, first, "tests/unit/tiny_helpers.py").endswith("model = 2")
    assert "retired" in show(checkout, second, "tests/unit/v1/zero/test_first.py")
    assert show(checkout, second, "tests/unit/tiny_helpers.py").endswith("model = 2")
    files = git(checkout, "diff", "--name-only", f"{second}^", second).split()
    assert files == [
        "csrc/shm.cpp", "deepspeed/ops/csrc/shm.cpp", "deepspeed/stage3.py", "tests/unit/checkpoint/test_second.py",
        "tests/unit/checkpoint/test_upstream.py", "tests/unit/v1/zero/test_first.py"
    ]
    # an update of a file no patch it depends on carries is a manifest mistake, named
    (patches / "tests.toml").write_text('[0001]\ntests = []\n\n[0002]\ntests = []\n'
                                        'updates = ["tests/unit/v1/zero/test_first.py"]\n')
    result = branches(*scratch, "--force")
    assert result.returncode != 0 and "which no patch it depends on" in result.stderr


def test_a_change_to_a_linked_copy_goes_to_the_real_file_only(scratch):
    """Upstream's git has deepspeed/ops/csrc as a link to ../../csrc where the sdist has a copy: the branch changes
    csrc/ alone (the patch's hunks for the copy would not apply over a link)."""
    fork, patches, source, checkout = scratch
    git(checkout, "rm", "--quiet", "-r", "deepspeed/ops/csrc")
    (checkout / "deepspeed" / "ops").mkdir(exist_ok=True)  # git rm took the emptied folder
    os.symlink("../../csrc", checkout / "deepspeed" / "ops" / "csrc")
    git(checkout, "add", "deepspeed/ops/csrc")
    git(checkout, "commit", "--quiet", "-m", "upstream links the csrc copy")
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    second = PREFIX + "0002-second-fix"
    files = git(checkout, "diff", "--name-only", f"{second}^", second).split()
    assert "csrc/shm.cpp" in files and "deepspeed/ops/csrc/shm.cpp" not in files
    assert show(checkout, second, "csrc/shm.cpp") == "int a = 2;"
    assert git(checkout, "ls-tree", second, "deepspeed/ops/csrc").startswith("120000 ")


@pytest.mark.parametrize("manifest, error", [
    ('[0001]\ntest = ["tests/unit/v1/zero/test_first.py"]\n\n[0002]\ntests = []\n', "unknown keys test"),
    ('[0001]\ntitle = "x"\n\n[0002]\ntests = []\n', "[0001]: no `tests`"),
    ('[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\n\n[0002]\ntests = ["tests/unit/v1/zero/test_first.py"]\n',
     "list it under `updates`"),
    ('[0001]\ntests = ["tests/unit/v1/zero/test_gone.py"]\n\n[0002]\ntests = []\n', "test_gone.py is not committed"),
    ('[0001]\ntests = []\nat = "0123456789abcdef"\n\n[0002]\ntests = []\n', "is not a commit of"),
])
def test_a_manifest_mistake_is_named(scratch, manifest, error):
    fork, patches, source, checkout = scratch
    (patches / "tests.toml").write_text(manifest)
    result = branches(*scratch)
    assert result.returncode != 0 and error in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_an_uncommitted_series_is_refused(scratch):
    fork, patches, source, checkout = scratch
    assert branches(*scratch).returncode == 0  # committed
    (patches / "tests.toml").write_text((patches / "tests.toml").read_text() + "# edited\n")
    result = branches(*scratch, "--force", commit_series=False)
    assert result.returncode != 0 and "uncommitted changes" in result.stderr and "tests.toml" in result.stderr


def test_a_change_to_a_linked_copy_alone_is_refused(scratch):
    """A change made only to the sdist's copy would vanish upstream, where the copy is a link: refused, named."""
    fork, patches, source, checkout = scratch
    patch = next(patches.glob("0002-*.patch"))
    text = patch.read_text()
    real = text.index("diff --git a/csrc/shm.cpp")
    copy = text.index("diff --git a/deepspeed/ops/csrc/shm.cpp")
    patch.write_text(text[:real] + text[copy:])  # the copy's change only
    git(checkout, "rm", "--quiet", "-r", "deepspeed/ops/csrc")
    (checkout / "deepspeed" / "ops").mkdir(exist_ok=True)
    os.symlink("../../csrc", checkout / "deepspeed" / "ops" / "csrc")
    git(checkout, "add", "deepspeed/ops/csrc")
    git(checkout, "commit", "--quiet", "-m", "upstream links the csrc copy")
    result = branches(*scratch)
    assert result.returncode != 0
    assert "deepspeed/ops/csrc/shm.cpp, under a path upstream's git has as a symbolic link" in result.stderr


# ---- branches follow `Depends on`: each sits on the base plus exactly the patches it needs ----


def set_depends(patches, number, line):
    """Rewrite the `Depends on` line in a patch file's message (None: drop it)."""
    patch = next(patches.glob(f"{number}-*.patch"))
    text = patch.read_text()
    patch.write_text(re.sub(r"(?m)^Depends on: .*\n\n", "" if line is None else line + "\n\n", text, count=1))


def add_third(scratch, depends):
    """A third patch, made on the fork after the other two: it fixes engine.py's line 3, next to 0001's fix of line
    2 (its context), so it needs 0001 and not 0002."""
    fork, patches, source, checkout = scratch
    engine = UPSTREAM["deepspeed/engine.py"].replace("line 2\n", "line 2 fixed\n")
    commit(fork, f"ZeRO-3: third fix\n\nDepends on: {depends}\n\nSummary\nFixes engine line 3.\n",
           {"deepspeed/engine.py": engine.replace("line 3\n", "line 3 fixed\n")})
    (patches / "0003-third-fix.patch").write_text(git(fork, *FORMAT_PATCH, "HEAD") + "\n")
    with open(patches / "series", "a") as f:
        f.write("0003-third-fix.patch\n")
    with open(patches / "tests.toml", "a") as f:
        f.write("\n[0003]\ntests = []\n")


FIRST, SECOND, THIRD = PREFIX + "0001-first-fix", PREFIX + "0002-second-fix", PREFIX + "0003-third-fix"


def test_a_patch_that_depends_on_none_sits_on_the_base(scratch):
    """Its branch is the base and its one commit, without the earlier patches, and carries the helpers its tests
    import itself (the earlier branch that also carries them is not below it)."""
    fork, patches, source, checkout = scratch
    set_depends(patches, "0002", "Depends on: none (touches no file of 0001).")
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    assert git(checkout, "rev-parse", f"{SECOND}^") == git(checkout, "rev-parse", "master")
    assert show(checkout, SECOND, "deepspeed/engine.py").splitlines()[1] == "line 2"  # no 0001 below it
    files = git(checkout, "diff", "--name-only", f"{SECOND}^", SECOND).split()
    assert "tests/unit/tiny_helpers.py" in files and "tests/unit/checkpoint/deeper_helpers.py" in files
    text = git(checkout, "log", "-1", "--format=%B", SECOND)
    assert f"Depends on no other pull request: its branch `{SECOND}` is one commit on upstream." in text
    assert "Stacked" not in text and "Carries" not in text
    # the legend follows the `Depends on` paragraph and lists the patch the text names
    paragraphs = text.split("\n\n")
    at = next(i for i, p in enumerate(paragraphs) if p.startswith("Depends on"))
    assert paragraphs[at + 1].startswith("Depends on no other pull request")
    assert f"- 0001: `{FIRST}`" in paragraphs[at + 1]
    assert f"{SECOND}: 0002-second-fix.patch on HEAD + " in result.stdout  # the default base


def test_a_dependent_patch_sits_on_its_dependency_alone(scratch):
    """0003 needs 0001 only: stacked on 0001's branch, without 0002 (before it in the series)."""
    fork, patches, source, checkout = scratch
    set_depends(patches, "0002", "Depends on: none.")
    add_third(scratch, "0001 (the engine fix next to this one).")
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    assert git(checkout, "rev-parse", f"{THIRD}^") == git(checkout, "rev-parse", FIRST)
    engine = show(checkout, THIRD, "deepspeed/engine.py").splitlines()
    assert engine[1:3] == ["line 2 fixed", "line 3 fixed"] and engine[-1] == "line 20 upstream"
    assert show(checkout, THIRD, "deepspeed/stage3.py") == "a = 1"  # 0002 is not below it
    text = git(checkout, "log", "-1", "--format=%B", THIRD)
    assert (f"Stacked on `{FIRST}` (patch 0001, its own pull request); until merged they show here too: review only "
            "the top commit.") in text


def test_a_patch_that_depends_on_independent_patches_carries_their_commits(scratch):
    """0003 needs 0001 and 0002, which do not depend on each other: its branch is the base, 0001's own commit,
    0002's commit (the same change, message and author, on 0001), then 0003. 0001 takes its tests at an older
    commit, but both carry HEAD's version of the helper, so that their pull requests do not conflict there."""
    fork, patches, source, checkout = scratch
    before = git(source, "rev-parse", "HEAD")
    commit(source, "a newer helper",
           {"tests/unit/tiny_helpers.py": "from unit.checkpoint import deeper_helpers  "
            "# noqa\nmodel = 2\n"})
    (patches / "tests.toml").write_text(f'[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\nat = "{before}"\n\n'
                                        '[0002]\ntests = ["tests/unit/checkpoint/test_second.py"]\n')
    set_depends(patches, "0002", "Depends on: none.")
    add_third(scratch, "0001 (the engine fix next to this one) and 0002 (to be tested with it).")
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    assert git(checkout, "rev-parse", f"{THIRD}~3") == git(checkout, "rev-parse", "master")
    assert git(checkout, "rev-parse", f"{THIRD}~2") == git(checkout, "rev-parse", FIRST)  # 0001's own commit
    picked = f"{THIRD}~1"
    assert git(checkout, "rev-parse", picked) != git(checkout, "rev-parse", SECOND)
    assert git(checkout, "log", "-1", "--format=%B%an", picked) == git(checkout, "log", "-1", "--format=%B%an", SECOND)
    own = ("deepspeed", "csrc", "tests/unit/checkpoint/test_second.py", "tests/unit/checkpoint/test_upstream.py")
    assert git(checkout, "diff", f"{picked}^", picked, "--", *own) == git(checkout, "diff", f"{SECOND}^", SECOND, "--",
                                                                          *own)
    assert show(checkout, THIRD, "deepspeed/stage3.py") == "a = 2"
    assert show(checkout, THIRD, "deepspeed/engine.py").splitlines()[1:3] == ["line 2 fixed", "line 3 fixed"]
    assert show(checkout, FIRST, "tests/unit/tiny_helpers.py").endswith("model = 2")
    assert show(checkout, SECOND, "tests/unit/tiny_helpers.py").endswith("model = 2")
    assert show(checkout, THIRD, "tests/unit/tiny_helpers.py").endswith("model = 2")
    assert "note:" not in result.stdout
    text = git(checkout, "log", "-1", "--format=%B", THIRD)
    assert ("Carries the commits of patches 0001 and 0002, each its own pull request, then its own; until merged "
            "they show here too: review only the top commit.") in text
    assert f"- 0002: `{SECOND}`" in text


def test_updates_and_tests_follow_the_dependencies(scratch):
    """`updates` names a file of a patch it depends on; a file listed under `tests` of a patch it does not depend
    on would be added by two pull requests: both refused, named."""
    fork, patches, source, checkout = scratch
    set_depends(patches, "0002", "Depends on: none.")
    (patches / "tests.toml").write_text('[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\n\n[0002]\ntests = []\n'
                                        'updates = ["tests/unit/v1/zero/test_first.py"]\n')
    result = branches(*scratch)
    assert result.returncode != 0 and "[0002] updates tests/unit/v1/zero/test_first.py, which no patch it depends" \
        in result.stderr, result.stderr
    (patches / "tests.toml").write_text('[0001]\ntests = ["tests/unit/v1/zero/test_first.py"]\n\n'
                                        '[0002]\ntests = ["tests/unit/v1/zero/test_first.py"]\n')
    result = branches(*scratch)
    assert result.returncode != 0 and "a patch 0002 does not depend on" in result.stderr, result.stderr
    assert git(checkout, "for-each-ref", f"refs/heads/{PREFIX}") == ""  # refused before any branch is written


def test_a_wrong_depends_on_is_refused_naming_the_missing_dependency(scratch):
    """0003 needs 0001's change as context but says it depends on none: `git am -3` could merge it anyway, so the
    branches refuse it, as the check does, naming the patch and the dependency it misses."""
    fork, patches, source, checkout = scratch
    set_depends(patches, "0002", "Depends on: none.")
    add_third(scratch, "none.")
    result = branches(*scratch)
    assert result.returncode != 0
    assert ("0003-third-fix.patch does not apply to pristine 0.19.8 (what its `Depends on` line needs): it needs "
            "0001 (ZeRO-3: first fix), which its `Depends on` does not name") in result.stderr, result.stderr
    assert "Applied patch to 'deepspeed/engine.py' with conflicts" in result.stderr
    assert git(checkout, "for-each-ref", f"refs/heads/{PREFIX}") == ""
    # the function `make check` runs, on the pristine tree the fork is imported on
    sys.path.insert(0, str(ROOT / "tools"))
    import patches as tool
    series = tool.read_series(patches)
    problems = tool.dependency_problems(fork, series)
    assert len(
        problems) == 1 and "0003-third-fix.patch does not apply" in problems[0] and "it needs 0001" in problems[0]
    set_depends(patches, "0003", "Depends on: 0001.")
    assert tool.dependency_problems(fork, tool.read_series(patches)) == []
    # a dependency named through another patch counts: 0002 depends on 0001, 0003 on 0002
    set_depends(patches, "0002", "Depends on: 0001.")
    set_depends(patches, "0003", "Depends on: 0002 (its stage3 fix).")
    assert tool.dependency_problems(fork, tool.read_series(patches)) == []


@pytest.mark.parametrize("line, error", [
    (None, "0002-second-fix.patch: its message has no `Depends on:` line"),
    ("Depends on: 0099 (gone).", "`Depends on: 0099 (gone).` names no patch of the series"),
    ("Depends on: 0003.", "`Depends on` names 0003, after it in the series"),
])
def test_an_unreadable_depends_on_is_named(scratch, line, error):
    fork, patches, source, checkout = scratch
    add_third(scratch, "0001.")
    set_depends(patches, "0002", line)
    result = branches(*scratch)
    assert result.returncode != 0 and error in result.stderr, result.stderr
    sys.path.insert(0, str(ROOT / "tools"))
    import patches as tool
    assert any(error in p for p in tool.dependency_problems(fork, tool.read_series(patches)))


# ---- patches/upstream-docs/NNNN.diff: a patch's update of upstream's docs, on its branch ----

DOCS_DIFF = ("--- a/docs/checkpointing.md\n+++ b/docs/checkpointing.md\n@@ -1,2 +1,3 @@\n # Checkpointing\n"
             "+A new argument.\n Resume with load_checkpoint.\n")


def docs_upstream(checkout):
    commit(checkout, "upstream docs", {"docs/checkpointing.md": "# Checkpointing\nResume with load_checkpoint.\n"})


def test_an_upstream_docs_update_goes_on_its_patchs_branch(scratch):
    fork, patches, source, checkout = scratch
    docs_upstream(checkout)
    (patches / "upstream-docs").mkdir()
    (patches / "upstream-docs" / "0001.diff").write_text(DOCS_DIFF)
    result = branches(*scratch)
    assert result.returncode == 0, result.stderr
    assert "A new argument." in show(checkout, FIRST, "docs/checkpointing.md")
    assert "docs/checkpointing.md" in git(checkout, "diff", "--name-only", f"{FIRST}^", FIRST).split()
    assert "patches/upstream-docs/0001.diff" in result.stdout
    assert "docs/checkpointing.md" not in git(checkout, "diff", "--name-only", f"{SECOND}^", SECOND).split()


@pytest.mark.parametrize("name, text, error", [
    ("0007.diff", DOCS_DIFF, "upstream-docs/0007.diff: patch 0007 is not in the series"),
    ("docs.diff", DOCS_DIFF, "upstream-docs/docs.diff: not named NNNN.diff"),
    ("0002.diff", DOCS_DIFF.replace("Resume with", "Restart with"), "upstream-docs/0002.diff (upstream's docs "
     "updated by patch 0002) does not apply to the base + the diffs of 0001"),
])
def test_an_upstream_docs_diff_that_cannot_be_placed_is_refused(scratch, name, text, error):
    fork, patches, source, checkout = scratch
    docs_upstream(checkout)
    (patches / "upstream-docs").mkdir()
    (patches / "upstream-docs" / name).write_text(text)
    result = branches(*scratch)
    assert result.returncode != 0 and error in result.stderr, result.stderr
    assert git(checkout, "for-each-ref", f"refs/heads/{PREFIX}") == ""  # before any branch is written
