# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""The pinned upstream sdist: fetched and verified, unpacked, committed as the `upstream` base; `pristine`."""

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .common import GIT_ENV, PatchError, ROOT, UPSTREAM_TAG, git, pin


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sdist_path():
    return ROOT / ".cache" / f"deepspeed-{pin()['version']}.tar.gz"


def fetch():
    """Return the verified sdist, downloading it with pip (PyPI) the first time."""
    p = pin()
    path = sdist_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest", tmp,
                f"deepspeed=={p['version']}"
            ]
            # Inside pip's isolated build environment (the build backend) PYTHONPATH hides this interpreter's pip.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            found = list(Path(tmp).glob(f"deepspeed-{p['version']}.tar.gz"))
            if proc.returncode != 0 or not found:
                reason = (proc.stderr.strip().splitlines() or ["no sdist in its output"])[-1]
                raise PatchError(f"could not download the pinned deepspeed=={p['version']} sdist with pip: {reason}\n"
                                 f"Offline? Put deepspeed-{p['version']}.tar.gz (sha256 {p['sha256']}, from "
                                 f"https://pypi.org/project/deepspeed/{p['version']}/#files) at {path} and retry.")
            verify(found[0], p)
            shutil.move(found[0], path)
    verify(path, p)
    return path


def verify(path, p):
    actual = sha256_of(path)
    if actual != p["sha256"]:
        raise PatchError(f"refusing {path}: sha256 {actual} does not match the pin {p['sha256']} in "
                         f"upstream.toml. Delete the file and fetch again (or put PyPI's "
                         f"deepspeed-{p['version']}.tar.gz there); if PyPI really serves another file for "
                         f"deepspeed=={p['version']}, review it before changing the pin.")


def unpack(dest):
    """Unpack the pinned sdist into dest (which must not exist)."""
    sdist = fetch()
    dest = Path(dest)
    if dest.exists():
        raise PatchError(f"{dest} already exists")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(sdist) as tar:
            extract_all(tar, tmp)
        top = Path(tmp) / f"deepspeed-{pin()['version']}"
        # Build products shipped in the sdist: setuptools regenerates them on install.
        shutil.rmtree(top / "deepspeed.egg-info", ignore_errors=True)
        top.rename(dest)


def extract_all(tar, dest):
    # The "data" filter refuses links and paths out of dest; Pythons before 3.9.17 lack it, and the sdist's
    # sha256 was verified, so extracting without it there is safe.
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
    else:
        tar.extractall(dest)


def init_upstream_repo(tree):
    git(tree, "init", "--quiet", "--initial-branch=main")
    # Upstream's own ignore rules stay out of the way: the fork tree tracks every sdist file.
    (Path(tree) / ".git" / "info" / "exclude").write_text("__pycache__/\n*.pyc\n*.egg-info/\nbuild/\n*.so\n")
    git(tree, "add", "--all", "--force", ".")
    git(tree,
        "commit",
        "--quiet",
        "--no-verify",
        "-m",
        f"upstream: deepspeed {pin()['version']} (PyPI sdist)",
        env=GIT_ENV)
    git(tree, "tag", UPSTREAM_TAG)
    # `pip install -e` rewrites this file with build info; it is not part of any patch.
    git(tree, "update-index", "--skip-worktree", "deepspeed/git_version_info_installed.py")


def cmd_pristine(args):
    dest = Path(args.dest)
    if dest.exists():
        if (dest / "version.txt").read_text().strip() == pin()["version"]:
            print(f"{dest}: pristine {pin()['version']} already present")
            return
        shutil.rmtree(dest)
    unpack(dest)
    print(f"{dest}: pristine {pin()['version']}")
