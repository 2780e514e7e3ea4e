# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`pip install -e .` / `pip install .` at the repository root (pyproject.toml, tools/fork_backend.py) install
the patched DeepSpeed into an environment that has torch, and keep that torch.

Each test installs a scratch copy of the repository (so fork/ here is never touched) into a scratch venv
that sees this venv's packages (torch included) through a .pth file, so nothing large is downloaded."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SDIST = ROOT / ".cache" / "deepspeed-0.19.8.tar.gz"
MATERIALIZED = {".venv", "fork", "pristine", ".cache"}  # symlinks in a worktree are not ignored as folders


def run(*command, cwd=None, env=None, check=True):
    proc = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        shown = " ".join(map(str, command))
        pytest.fail(f"{shown} exited {proc.returncode}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc


def scratch_repo(dest, sdist=SDIST):
    """The repository's committed and new files, without fork/, plus the pinned sdist (no download)."""
    listed = run("git", "-C", ROOT, "ls-files", "--cached", "--others", "--exclude-standard").stdout.split()
    for name in listed:
        source = ROOT / name
        if name.split("/")[0] in MATERIALIZED or not source.is_file():
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)
    if sdist is not None:
        (dest / ".cache").mkdir()
        shutil.copy2(sdist, dest / ".cache" / SDIST.name)
    return dest


def scratch_venv(dest):
    """A venv without pip that sees this environment's packages (torch) after its own."""
    run(sys.executable, "-m", "venv", "--without-pip", dest)
    python = dest / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(site, "zz_with_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def pip_install(python, repo, *args, env=None, check=True):
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-input"]
    return run(*pip, *args, cwd=repo, env=env, check=check)


def python_prints(python, code, env):
    return run(python, "-c", code, env=env).stdout.strip()


@pytest.fixture
def ds_env():
    """DS_ACCELERATOR=cpu so ds_report and the import need no GPU."""
    return dict(os.environ, DS_ACCELERATOR="cpu")


def test_editable_install_at_the_root_gives_the_patched_tree(tmp_path, ds_env):
    if not SDIST.exists():
        pytest.fail(f"{SDIST} is missing: run `make setup` (tools/patches.py fetch) first")
    repo, python = scratch_repo(tmp_path / "repo"), scratch_venv(tmp_path / "venv")
    which_torch = "import torch; print(torch.__file__, torch.__version__)"
    torch_before = python_prints(python, which_torch, ds_env)

    pip_install(python, repo, "-e", ".")  # with build isolation, as users type it

    fork = (repo / "fork").resolve()
    assert (fork / ".git").is_dir() and "upstream" in run("git", "-C", fork, "tag").stdout.split()
    imported = python_prints(python, "import deepspeed; print(deepspeed.__file__)", ds_env)
    assert Path(imported).resolve().is_relative_to(fork / "deepspeed")
    assert python_prints(python, which_torch, ds_env) == torch_before, "the install replaced the environment's torch"
    report = run(tmp_path / "venv" / "bin" / "ds_report", env=ds_env).stdout
    assert str(fork / "deepspeed") in report
    for script in ("deepspeed", "ds_report", "ds", "dsr", "ds_bench"):
        assert (tmp_path / "venv" / "bin" / script).exists(), script

    # an edit in fork/ takes effect without reinstalling
    (fork / "deepspeed" / "edit_probe.py").write_text("VALUE = 'edited'\n")
    assert python_prints(python, "import deepspeed.edit_probe as p; print(p.VALUE)", ds_env) == "edited"


def test_install_without_build_isolation_and_not_editable(tmp_path, ds_env):
    repo, python = scratch_repo(tmp_path / "repo"), scratch_venv(tmp_path / "venv")
    pip_install(python, repo, "--no-build-isolation", "--no-deps", ".")
    imported = python_prints(python, "import deepspeed; print(deepspeed.__file__)", ds_env)
    assert Path(imported).parent.parent == Path(
        python_prints(python, "import site; print(site.getsitepackages()[0])", ds_env))
    # without isolation the build saw the environment's torch, and recorded it
    torch_version = python_prints(python, "import torch; print('.'.join(torch.__version__.split('.')[:2]))", ds_env)
    report = run(tmp_path / "venv" / "bin" / "ds_report", env=ds_env).stdout
    assert f"compiled w. ...... torch {torch_version}" in report


def refused(tmp_path, env):
    """Install a scratch copy whose fork/ cannot be materialized; return pip's output."""
    python = scratch_venv(tmp_path / "venv")
    proc = pip_install(python, tmp_path / "repo", "--no-build-isolation", "--no-deps", "-e", ".", env=env, check=False)
    assert proc.returncode != 0
    return proc.stdout + proc.stderr


def test_wrong_sdist_fails_with_the_way_out(tmp_path):
    repo = scratch_repo(tmp_path / "repo", sdist=None)
    (repo / ".cache").mkdir()
    (repo / ".cache" / SDIST.name).write_bytes(b"not the pinned sdist")
    output = refused(tmp_path, os.environ)
    assert "does not match the pin" in output and str(repo / ".cache" / SDIST.name) in output
    assert "Traceback" not in output


def test_offline_fails_with_the_way_out(tmp_path):
    repo = scratch_repo(tmp_path / "repo", sdist=None)
    offline = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_EXTRA_INDEX_URL="")
    output = refused(tmp_path, offline)
    assert "could not download the pinned deepspeed==0.19.8 sdist" in output
    assert f"at {repo / '.cache' / SDIST.name} and retry" in output
    assert "Traceback" not in output
