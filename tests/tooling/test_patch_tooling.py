# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The patch-series tooling (tools/patches.py): the series applies to pristine upstream, the fork tree
is in sync, and the check catches work that was not exported. Runs on scratch copies."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "patches.py"


def run_tool(*args, tool=TOOL):
    return subprocess.run([sys.executable, str(tool), *args], capture_output=True, text=True)


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def scratch_tool(tmp_path_factory):
    """tools/patches.py copied into a scratch repository with the pin, the style file and the sdist cache. Its
    `check` style-checks that repository's tests/, which holds none: each scratch check does not restyle ours
    again (test_series_applies_and_fork_is_in_sync checks them)."""
    root = tmp_path_factory.mktemp("repo")
    (root / "tools").mkdir()
    shutil.copy2(TOOL, root / "tools" / TOOL.name)
    shutil.copytree(ROOT / "tools" / "patchtool",
                    root / "tools" / "patchtool",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("upstream.toml", ".style.yapf"):
        shutil.copy2(ROOT / name, root / name)
    (root / ".cache").symlink_to(ROOT / ".cache", target_is_directory=True)
    git(root, "init", "--quiet")
    return root / "tools" / TOOL.name


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, scratch_tool, series_copy):
    """A fork imported from a copy of patches/, so edits here never touch the real tree (nor depend on it). Its
    series is the first patch alone (conftest.short_series): every check restyles each file the series changes, and
    the tests below add the patches they need."""
    base = tmp_path_factory.mktemp("tooling")
    fork, patches = base / "fork", series_copy(base / "patches", count=1)
    result = run_tool("--fork", str(fork), "--patches", str(patches), "import", tool=scratch_tool)
    assert result.returncode == 0, result.stderr
    for var, value in (("user.name", "test"), ("user.email", "test@localhost")):
        git(fork, "config", var, value)
    return fork, patches


def check(fork, patches, tool):
    return run_tool("--fork", str(fork), "--patches", str(patches), "check", tool=tool)


def test_series_applies_and_fork_is_in_sync():
    result = run_tool("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "patch check ok" in result.stdout


def test_check_catches_unexported_work_until_exported(scratch, scratch_tool):
    fork, patches = scratch
    assert check(fork, patches, scratch_tool).returncode == 0

    target = fork / "deepspeed" / "runtime" / "zero" / "stage3.py"
    target.write_text(target.read_text() + "\n\n# an edit nobody exported\n")  # as yapf leaves it (make check)
    result = check(fork, patches, scratch_tool)
    assert result.returncode != 0
    assert "uncommitted: deepspeed/runtime/zero/stage3.py" in result.stderr

    # import refuses to discard the edit
    refused = run_tool("--fork", str(fork), "--patches", str(patches), "import", tool=scratch_tool)
    assert refused.returncode != 0 and "unexported work" in refused.stderr

    git(fork, "commit", "--quiet", "-am", "ZeRO-3: an unexported change\n\nDepends on: none.")
    result = check(fork, patches, scratch_tool)
    assert result.returncode != 0
    assert "unexported commit:" in result.stderr and "ZeRO-3: an unexported change" in result.stderr

    exported = run_tool("--fork", str(fork), "--patches", str(patches), "export", tool=scratch_tool)
    assert exported.returncode == 0, exported.stderr
    assert check(fork, patches, scratch_tool).returncode == 0
    series = (patches / "series").read_text().split()
    assert series[-1].endswith("zero-3-an-unexported-change.patch")

    # re-exporting an unchanged tree changes no file
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in patches.iterdir() if p.is_file()}
    assert run_tool("--fork", str(fork), "--patches", str(patches), "export", tool=scratch_tool).returncode == 0
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in patches.iterdir() if p.is_file()}
    assert after == before


def test_check_fails_when_a_patch_does_not_apply(scratch, scratch_tool, tmp_path):
    _, patches = scratch
    broken = tmp_path / "patches"
    shutil.copytree(patches, broken)
    (broken / "9999-broken.patch").write_text((ROOT / "tests" / "tooling" / "broken.patch").read_text())
    with open(broken / "series", "a") as f:
        f.write("9999-broken.patch\n")
    (broken / "upstream-docs").mkdir(exist_ok=True)
    (broken / "upstream-docs" / "0999.diff").write_text("")  # left behind by a renumbering
    result = run_tool("--fork", str(tmp_path / "no-fork"), "--patches", str(broken), "check", tool=scratch_tool)
    assert result.returncode != 0
    assert "9999-broken.patch does not apply" in result.stderr
    assert "9999-broken.patch: its message has no `Depends on:` line" in result.stderr
    assert "upstream-docs/0999.diff: patch 0999 is not in the series" in result.stderr


def test_check_names_a_dependency_a_patch_does_not_declare(scratch, scratch_tool, tmp_path):
    """A patch made on the first patch of the series, whose `Depends on` says none: the check applies it to
    pristine upstream alone, where it fails, and names the patch and the one it needs."""
    fork, patches = scratch
    first = (patches / "series").read_text().split()[0]
    made = tmp_path / "made"
    git(tmp_path, "clone", "--quiet", str(fork), str(made))
    git(made, "checkout", "--quiet", "--detach", git(fork, "rev-list", "--reverse", "upstream..HEAD").split()[0])
    changed = git(made, "diff", "--name-only", "HEAD^", "HEAD", "--", "*.py").split()[0]
    added = next(line[1:] for line in git(made, "diff", "HEAD^", "HEAD", "--", changed).splitlines()
                 if line.startswith("+") and not line.startswith("+++") and line[1:].strip())
    target = made / changed
    target.write_text(target.read_text().replace(added + "\n", added + "\n# a line next to the first patch's\n", 1))
    git(made, "-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "--quiet", "-am",
        "ZeRO-3: needs the first patch\n\nDepends on: none.")
    series = tmp_path / "patches"
    shutil.copytree(patches, series)
    (series / "9999-needs-the-first-patch.patch").write_text(
        git(made, "format-patch", "--stdout", "-1", "--zero-commit", "--full-index", "HEAD"))
    with open(series / "series", "a") as f:
        f.write("9999-needs-the-first-patch.patch\n")
    result = run_tool("--fork", str(tmp_path / "no-fork"), "--patches", str(series), "check", tool=scratch_tool)
    assert result.returncode != 0
    assert ("9999-needs-the-first-patch.patch does not apply to pristine 0.19.8 (what its `Depends on` line needs): "
            f"it needs {first[:4]} (") in result.stderr, result.stderr
    assert f"Applied patch to '{changed}' with conflicts" in result.stderr
    # named, it passes that check (the series' own lines pass it too)
    patch = series / "9999-needs-the-first-patch.patch"
    patch.write_text(patch.read_text().replace("Depends on: none.", f"Depends on: {first[:4]}."))
    result = run_tool("--fork", str(tmp_path / "no-fork"), "--patches", str(series), "check", tool=scratch_tool)
    assert "9999-needs-the-first-patch.patch does not apply to pristine" not in result.stderr
    assert "`Depends on`" not in result.stderr, result.stderr


def test_sdist_hash_mismatch_is_refused(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import patches as tool
    fake = tmp_path / "deepspeed-0.19.8.tar.gz"
    fake.write_bytes(b"not the pinned sdist")
    with pytest.raises(tool.PatchError, match="does not match the pin"):
        tool.verify(fake, tool.pin())


def test_upstream_toml_reads_without_tomllib():
    """Python 3.9/3.10 without tomli: the fallback parser reads upstream.toml and patches/tests.toml as tomllib
    does."""
    sys.path.insert(0, str(ROOT / "tools"))
    import patches as tool
    text = (ROOT / "upstream.toml").read_text()
    expected = tool.load_toml(ROOT / "upstream.toml")
    assert tool.parse_simple_toml(text) == expected and expected["deepspeed"]["version"]
    manifest = ROOT / "patches" / "tests.toml"
    assert tool.parse_simple_toml(manifest.read_text()) == tool.load_toml(manifest)
    with pytest.raises(tool.PatchError, match="beyond the TOML this tool reads"):
        tool.parse_simple_toml('[deepspeed]\nversion = 19\n')
    assert tool.parse_simple_toml('[a]\nat = { "x/y.py" = "1", "z" = "2" }  # pins\n') == {
        "a": {
            "at": {
                "x/y.py": "1",
                "z": "2"
            }
        }
    }
    for malformed in ('{ "x" = "1", }', '{ "x" = "1" "y" = "2" }', '{ "x" = "1", "x" = "2" }'):  # tomllib refuses
        with pytest.raises(tool.PatchError):
            tool.parse_simple_toml(f'[a]\nat = {malformed}\n')
