#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""Patch-series tooling for the DeepSpeed fork.

The fork is pristine upstream DeepSpeed (the sdist pinned in upstream.toml) plus the patches listed,
in order, in patches/series. Upstream files are never committed: they are materialized here.

  fetch     download the pinned sdist into .cache/ and verify its sha256
  import    unpack upstream into fork/ (a git repo whose base commit is tagged `upstream`) and
            apply every patch of the series as its own commit
  export    write the commits after `upstream` back to patches/ (format-patch) and patches/series
  check     the series applies cleanly to pristine upstream, each patch also with only the patches its
            `Depends on` line needs, no patch leaves a function or class it adds without a caller outside tests
            (patchtool/callers.py), and fork/ holds nothing unexported
  pristine  unpack upstream, unpatched, into pristine/ (for A/B runs: PYTHONPATH=pristine)
  branches  in a checkout of upstream DeepSpeed, write one branch per patch, on the base plus the patches its
            `Depends on` line needs (transitively, each its own branch's commit, in series order): the patch
            commit with its tests (patches/tests.toml, plus the unit.* helpers they import) at upstream's paths
            and its updates of upstream's tests and docs (patches/upstream-tests/, upstream-docs/ NNNN.diff), the
            message being the pull request's description without fork-only lines
  readme    rewrite README.md's list of patches (between its patches markers) from patches/series; --check
            only fails if it is stale

Each command takes --fork / --patches so the tests can run it on scratch copies.
"""

import argparse
import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:  # loaded by path (a test): tools/ holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parent))

# The commands live in tools/patchtool/, one module per group; these names are what tools/ and tests import.
from patchtool.branches import cmd_branches, read_tests_manifest  # noqa: E402
from patchtool.description import BRANCH_PREFIX, branch_name  # noqa: E402
from patchtool.check import cmd_check, cmd_style, dependency_problems  # noqa: E402
from patchtool.common import ROOT, PatchError, load_toml, parse_simple_toml, pin  # noqa: E402
from patchtool.common import patch_number, read_series  # noqa: E402
from patchtool.export import cmd_export  # noqa: E402
from patchtool.fork import BEHIND, CURRENT, assess, cmd_import, materialize, replace_fork, unexported  # noqa: E402
from patchtool.readme import README_BEGIN, README_END, cmd_readme, depends_on  # noqa: E402
from patchtool.sdist import cmd_pristine, fetch, verify  # noqa: E402

__all__ = [
    "BEHIND", "BRANCH_PREFIX", "CURRENT", "PatchError", "README_BEGIN", "README_END", "assess", "branch_name",
    "depends_on", "dependency_problems", "fetch", "load_toml", "main", "materialize", "parse_simple_toml",
    "patch_number", "pin", "read_series", "read_tests_manifest", "replace_fork", "unexported", "verify"
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fork", default=str(ROOT / "fork"))
    parser.add_argument("--patches", default=str(ROOT / "patches"))
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch")
    p_import = sub.add_parser("import")
    p_import.add_argument("--3way", dest="three_way", action="store_true", help="three-way merge on conflicts")
    p_import.add_argument("--force",
                          action="store_true",
                          help="re-import even over unexported work (the old tree is kept as fork.bak-<time>)")
    p_export = sub.add_parser("export")
    p_export.add_argument("--force", action="store_true", help="export even over a newer patches/ (after a pull)")
    sub.add_parser("check")
    p_style = sub.add_parser("style", help="rewrite Python files as upstream's pre-commit hooks want them")
    p_style.add_argument("files", nargs="+")
    p_pristine = sub.add_parser("pristine")
    p_pristine.add_argument("--dest", default=str(ROOT / "pristine"))
    p_branches = sub.add_parser("branches",
                                help="write one branch per patch, on the patches it depends on, into an upstream "
                                "checkout (pull requests)")
    p_branches.add_argument("checkout", help="a git checkout of upstream DeepSpeed")
    p_branches.add_argument("--base", default="HEAD", help="the upstream commit the branches start from")
    p_branches.add_argument("--prefix", default=BRANCH_PREFIX, help="branch name prefix")
    p_branches.add_argument("--force", action="store_true", help="rewrite branches of a previous run")
    p_branches.add_argument("--source",
                            default=str(ROOT),
                            help="the repository whose tests/ (as committed at HEAD, or at a table's `at`) the "
                            "branches carry")
    p_readme = sub.add_parser("readme", help="rewrite the README's list of patches from the series")
    p_readme.add_argument("--readme", default=str(ROOT / "README.md"))
    p_readme.add_argument("--check", action="store_true", help="only fail if the list is not current")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            print(fetch())
        elif args.command == "import":
            cmd_import(args)
        elif args.command == "export":
            cmd_export(args)
        elif args.command == "check":
            return cmd_check(args)
        elif args.command == "style":
            return cmd_style(args)
        elif args.command == "pristine":
            cmd_pristine(args)
        elif args.command == "branches":
            cmd_branches(args)
        elif args.command == "readme":
            return cmd_readme(args)
    except PatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
