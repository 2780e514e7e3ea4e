#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Print the validated-cells matrix (markdown) from the last test run's test-results/cells.json.

    tools/cells.py                         # every cell the tests declare, with its status
    tools/cells.py --feature resume        # one feature's rows, for a patch message
    tools/cells.py --feature resume --where stage=1,2 --where offload=none   # narrower still
    tools/cells.py --update                # rewrite the block between the cells markers in docs/cells.md
    tools/cells.py --update FILE           # ... in another file
    tools/cells.py --results test-results/cells-pristine.json   # the same tests run on pristine 0.19.8

A cell is "validated" when at least one of its tests passed and none failed, "FAILED" when any failed,
and "not run" when its tests were deselected or skipped in that run. Cells come from tests/unit/cell_manifest.py
(and `@pytest.mark.cell` markers; tests/unit/cells.py).
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from unit.cells import AXES, RESULTS_DIR  # noqa: E402

HEADERS = dict(feature="feature",
               stage="ZeRO stage",
               precision="precision",
               offload="offload",
               checkpoint="checkpoint",
               layout="layout change",
               settings="settings")
BEGIN, END = "<!-- cells:begin (tools/cells.py --update) -->", "<!-- cells:end -->"
DOC = ROOT / "docs" / "cells.md"  # where the matrix is published; --update without a file rewrites it


def cells(tests):
    """{cell tuple: [(test name, outcome)]} over the recorded tests."""
    by_cell = {}
    for nodeid, test in tests.items():
        for cell in test["cells"]:
            key = tuple(cell[axis] for axis in AXES)
            by_cell.setdefault(key, []).append((test_name(nodeid), test["outcome"]))
    return by_cell


def test_name(nodeid):
    """file::Class::test_x[param] -> Class::test_x (the parameters are the cell's own axes)."""
    return "::".join(part.split("[")[0] for part in nodeid.split("::")[1:])


def status(outcomes):
    if "failed" in outcomes:
        return "FAILED"
    return "validated" if "passed" in outcomes else "not run"


def parse_where(clauses):
    """["stage=1,2", "offload=none"] -> {"stage": {"1", "2"}, "offload": {"none"}}"""
    where = {}
    for clause in clauses or []:
        axis, _, values = clause.partition("=")
        if axis not in AXES or not values:
            raise SystemExit(f"--where {clause}: want AXIS=VALUE[,VALUE] with AXIS one of {', '.join(AXES)}")
        where[axis] = set(values.split(","))
    return where


def matrix(record, feature=None, where=None):
    rows = [f"| {' | '.join(HEADERS[a] for a in AXES)} | status | tests |", "|---" * (len(AXES) + 2) + "|"]
    for key, runs in sorted(cells(record["tests"]).items(), key=lambda item: sort_key(item[0])):
        if feature and key[0] != feature:
            continue
        if any(dict(zip(AXES, key))[axis] not in values for axis, values in (where or {}).items()):
            continue
        outcomes = [outcome for _, outcome in runs]
        names = sorted({name for name, _ in runs})
        passed = sum(o == "passed" for o in outcomes)
        rows.append(f"| {' | '.join(key)} | {status(outcomes)} | {passed}/{len(outcomes)} passed: "
                    f"{', '.join(f'`{n}`' for n in names)} |")
    rows.append(f"\nFrom the test run finished {record['finished']} against `{Path(record['deepspeed']).name}/`.")
    return "\n".join(rows)


def sort_key(key):
    return tuple((0, int(v), "") if v.isdigit() else (1, 0, v) for v in key)


def update(path, text):
    content = Path(path).read_text()
    if BEGIN not in content or END not in content:
        sys.exit(f"{path}: no '{BEGIN}' ... '{END}' block to replace")
    head, rest = content.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    Path(path).write_text(f"{head}{BEGIN}\n{text}\n{END}{tail}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=str(RESULTS_DIR / "cells.json"))
    parser.add_argument("--feature", help="only this feature's cells")
    parser.add_argument("--where", action="append", metavar="AXIS=V[,V]", help="only cells with these values")
    parser.add_argument("--update",
                        metavar="FILE",
                        nargs="?",
                        const=str(DOC),
                        help=f"replace the cells block in FILE (default {DOC.relative_to(ROOT)}) instead of printing")
    args = parser.parse_args()
    try:
        record = json.loads(Path(args.results).read_text())
    except FileNotFoundError:
        sys.exit(f"{args.results}: no test results yet; run `make test` first")
    text = matrix(record, args.feature, parse_where(args.where))
    if args.update:
        update(args.update, text)
    else:
        print(text)


if __name__ == "__main__":
    main()
