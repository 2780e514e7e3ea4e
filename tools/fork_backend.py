# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""The build backend of `pip install .` / `pip install -e .` at the repository root (pyproject.toml).

Every hook first makes fork/ what the series describes (tools/patches.py materialize: fetch and verify the
pinned sdist, import upstream and apply patches/series into a scratch tree, swapped in once complete; a fork/
that holds the series is kept, and built as it is with a warning (`pip install -v` shows it) when it also holds
unexported work; one imported from an older series is re-imported when it holds nothing of its own, the old
tree kept as fork.bak-<time>, and refused when it does), then hands the hook to setuptools inside fork/, so
DeepSpeed's own setup.py builds it: the same package, console scripts and JIT ops as `pip install fork`.
An editable install maps `deepspeed` to fork/deepspeed, so edits there take effect without reinstalling.

Torch is not a build requirement: DeepSpeed's setup.py only needs it to precompile ops (DS_BUILD_OPS=1)
and to record the torch it was built with; JIT-built ops need neither, and a torch in the isolated build
environment would be a second, multi-GB download. Install with --no-build-isolation to build against the
environment's own torch (and setuptools). Either way pip keeps the environment's torch, which satisfies
DeepSpeed's `torch` requirement.

A failure to materialize fork/ (offline without the sdist, a wrong sdist, work a re-import would lose) ends
the build with one message naming the way out, not a traceback.
"""

import contextlib
import os
from pathlib import Path

import patches  # tools/patches.py: pyproject.toml's backend-path puts tools/ on sys.path

ROOT = Path(__file__).resolve().parent.parent
FORK, PATCHES = ROOT / "fork", ROOT / "patches"


def _fork_ready():
    """Materialize fork/ once per backend process; exit with the way out on failure."""
    if getattr(_fork_ready, "done", False):
        return FORK
    try:
        patches.materialize(FORK, PATCHES)
    except patches.PatchError as err:
        raise SystemExit(f"error: cannot prepare {FORK} for the build: {err}") from None
    _fork_ready.done = True
    return FORK


@contextlib.contextmanager
def _in_fork():
    fork = _fork_ready()
    previous = os.getcwd()
    os.chdir(fork)
    try:
        yield
    finally:
        os.chdir(previous)


def _setuptools():
    # The legacy backend puts setup.py's folder on sys.path, as DeepSpeed's `from op_builder import ...` needs
    # (pip uses it for DeepSpeed's own sdist, which has no pyproject.toml).
    from setuptools.build_meta import __legacy__
    return __legacy__


def _absolute(directory):
    return os.path.abspath(directory) if directory else directory


def _delegate(hook, *directories, **kwargs):
    """Run setuptools' hook of that name inside fork/ (output directories made absolute first)."""
    directories = [_absolute(d) for d in directories]
    with _in_fork():
        return getattr(_setuptools(), hook)(*directories, **kwargs)


def get_requires_for_build_wheel(config_settings=None):
    return _delegate("get_requires_for_build_wheel", config_settings=config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _delegate("get_requires_for_build_editable", config_settings=config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _delegate("get_requires_for_build_sdist", config_settings=config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _delegate("prepare_metadata_for_build_wheel", metadata_directory, config_settings=config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _delegate("prepare_metadata_for_build_editable", metadata_directory, config_settings=config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _delegate("build_wheel",
                     wheel_directory,
                     config_settings=config_settings,
                     metadata_directory=_absolute(metadata_directory))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _delegate("build_editable",
                     wheel_directory,
                     config_settings=config_settings,
                     metadata_directory=_absolute(metadata_directory))


def build_sdist(sdist_directory, config_settings=None):
    """An sdist of the patched tree (DeepSpeed's own layout, so it builds without this repository)."""
    return _delegate("build_sdist", sdist_directory, config_settings=config_settings)
