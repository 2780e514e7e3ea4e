# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Torch cells (Makefile TORCH=...): each is a venv of its own, whose upstream-tests results are kept apart and
can be shown beside the default cell's (tools/upstream_tests.py --report --cells)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import upstream_tests  # noqa: E402


def test_a_cell_is_its_venv():
    assert upstream_tests.cell_of("/repo/.venv") == ""
    assert upstream_tests.cell_of("/repo/.venv-torch2.10.0") == "-torch2.10.0"
    assert upstream_tests.cell_of("/usr") == ""


def make_dry_run(*args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    proc = subprocess.run(["make", "-n", "-B", *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_makefile_builds_a_cell_venv_with_its_torch():
    out = make_dry_run(".venv-torch2.10.0/.deps-stamp", "TORCH=2.10.0")
    assert "-m pip install --quiet torch==2.10.0 \n" in out or "-m pip install --quiet torch==2.10.0\n" in out
    assert "s/^torch==.*/torch==2.10.0/" in out and f"-r {ROOT}/requirements/" in out
    assert ".venv-torch2.10.0/bin/python -m pip install --quiet -r .venv-torch2.10.0/requirements.txt" in out
    index = make_dry_run(".venv-torch2.10.0/.deps-stamp", "TORCH=2.10.0", "TORCH_INDEX=https://example.invalid/cpu")
    assert "torch==2.10.0 --index-url https://example.invalid/cpu" in index
    stamp = make_dry_run(".venv-torch2.10.0/.upstream-tests-stamp", "TORCH=2.10.0")
    assert "--target .cache/upstream-pytest-torch2.10.0 " in stamp


def test_a_cell_install_keeps_the_forks_build_record():
    """fork/ is shared: a cell's editable install must not leave its torch's CUDA/NCCL versions in the fork's
    git_version_info_installed.py, which decide upstream's bf16 skips on the fork (pristine keeps the sdist's)."""
    out = make_dry_run("install", "TORCH=2.10.0")
    record = "fork/deepspeed/git_version_info_installed.py"
    save = out.index(f"cp {record} .venv-torch2.10.0/")
    install = out.index("-m pip install --quiet --no-build-isolation")
    assert save < install < out.index(f"cp .venv-torch2.10.0/installed-info.before {record}")
    assert record not in make_dry_run("install")


def test_the_default_cell_is_unchanged():
    out = make_dry_run(".venv/.deps-stamp")
    assert ".venv/bin/python -m pip install --quiet -r requirements/dev-cpu.txt" in out
    assert "torch==" not in out
    assert "--target .cache/upstream-pytest " in make_dry_run(".venv/.upstream-tests-stamp")


def results(folder, torch, outcomes):
    tests = {f"f.py::t{i}": {"outcome": o, "detail": "", "duration": 1.0} for i, o in enumerate(outcomes)}
    state = {
        "meta": {
            "torch": torch,
            "commit": "abc",
            "files": ["f.py"]
        },
        "results": {
            "fork": {
                "f.py": tests
            },
            "pristine": {
                "f.py": {
                    n: dict(r, outcome="passed")
                    for n, r in tests.items()
                }
            }
        }
    }
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(state))
    return folder


def test_report_shows_cells_side_by_side(tmp_path, capsys):
    one = results(tmp_path / "one", "2.13.0+cpu", ["passed", "failed"])
    two = results(tmp_path / "two", "2.10.0", ["passed", "skipped"])
    upstream_tests.report_cells([one, two, tmp_path / "none"])
    out = capsys.readouterr().out
    head = "| file | torch 2.13.0+cpu fork p/f/s/e | torch 2.13.0+cpu pristine p/f/s/e | torch 2.10.0 fork p/f/s/e "
    assert head + "| torch 2.10.0 pristine p/f/s/e |" in out
    assert "| `f.py` | 1/1/0/0 | 2/0/0/0 | 1/0/1/0 | 2/0/0/0 |" in out
    assert out.count("pass on pristine, not on the fork: 1") == 2
    assert f"{tmp_path / 'none'}/results.json: no results" in out
