# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The compatibility-matrix cell each test validates, and the pytest plugin that records, per run, which
cells passed, failed or were not run (test-results/cells.json; `tools/cells.py` prints the matrix).

A test's cell comes from unit/cell_manifest.py (keyed by test id, so the test files carry no fork-only marker and
run unchanged under upstream's harness), then from a `@pytest.mark.cell(feature=..., stage=..., ...)` marker on
the test, its class or a pytest.param (the closest wins; for tests that never leave this repository). A
parametrize argument named after an axis fills that axis, so one parametrized test covers several cells; a list
value means the test covers each of those cells (e.g. checkpoint=["rigid", "universal"])."""

import itertools
import json
import os
import time
from pathlib import Path

from unit.cell_manifest import CELLS

AXES = ("feature", "stage", "precision", "offload", "checkpoint", "layout", "settings")
# settings: the non-default DeepSpeed settings a test runs at (unit/zero_tiny_models.py SETTINGS); "defaults" is none.
DEFAULTS = dict(offload="none", checkpoint="-", layout="none", settings="defaults")
RESULTS_DIR = Path(__file__).resolve().parents[2] / "test-results"


def cells_of(item, manifest=None):
    """[{axis: value}] of the cells a collected test validates ([] for a test without a cell)."""
    entries = manifest_entries(item, CELLS if manifest is None else manifest)
    markers = list(item.iter_markers("cell"))  # closest first
    if not entries and not markers:
        return []
    cell = dict(DEFAULTS)
    for axes in entries + [marker.kwargs for marker in reversed(markers)]:
        cell.update(axes)
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        cell.update({axis: value for axis, value in callspec.params.items() if axis in AXES})
    unknown, missing = set(cell) - set(AXES), [axis for axis in AXES if axis not in cell]
    if unknown or missing:
        raise ValueError(f"{item.nodeid}: cell marker has unknown axes {sorted(unknown)} / misses {missing}")
    choices = [cell[axis] if isinstance(cell[axis], (list, tuple)) else [cell[axis]] for axis in AXES]
    return [dict(zip(AXES, map(str, values))) for values in itertools.product(*choices)]


def manifest_entries(item, manifest):
    """The manifest's axes for this test, farthest key first: every key that is the test's id relative to
    tests/ or a file, class, test or parametrization above it."""
    test_id = id_under_tests(item)
    keys = [key for key in manifest if test_id == key or test_id.startswith((key + "::", key + "["))]
    return [manifest[key] for key in sorted(keys, key=len)]


def id_under_tests(item):
    """The test's id with its file relative to the tests/ folder (unit/...), as the manifest keys it."""
    path, _, rest = item.nodeid.partition("::")
    parts = Path(path).parts
    path = "/".join(parts[parts.index("tests") + 1:]) if "tests" in parts else "/".join(parts)
    return f"{path}::{rest}" if rest else path


def results_file(deepspeed_tree):
    """cells.json for the fork (the installed tree), cells-<tree>.json for any other (pristine/, worktrees)."""
    name = "cells.json" if Path(deepspeed_tree).name == "fork" else f"cells-{Path(deepspeed_tree).name}.json"
    return RESULTS_DIR / name


class CellRecorder:
    """Records the outcome of every collected test that has a cell, deselected ones as "not run"."""

    def __init__(self, deepspeed_tree, path=None):
        self.deepspeed_tree = str(deepspeed_tree)
        self.path = Path(path) if path else results_file(deepspeed_tree)
        self.tests = {}

    def pytest_itemcollected(self, item):
        cells = cells_of(item)
        if cells:
            self.tests[item.nodeid] = dict(cells=cells, outcome="not run")

    def pytest_runtest_logreport(self, report):
        test = self.tests.get(report.nodeid)
        if test is None or test["outcome"] == "failed":
            return
        if report.failed:
            test["outcome"] = "failed"
        elif report.skipped:
            test["outcome"] = "skipped"
        elif report.when == "call":
            test["outcome"] = "passed"

    def pytest_sessionfinish(self, session):
        if session.config.option.collectonly or not self.tests:
            return
        os.makedirs(self.path.parent, exist_ok=True)
        record = dict(finished=time.strftime("%Y-%m-%d %H:%M:%S %Z"), deepspeed=self.deepspeed_tree, tests=self.tests)
        self.path.write_text(json.dumps(record, indent=1) + "\n")
