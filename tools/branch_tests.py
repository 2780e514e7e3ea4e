#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Run each pull request's tests on its own branch, under upstream's harness (after `make branches`).

For each patch of the series, in order, its branch (`ds-fork/NNNN-...` in the upstream checkout) is extracted
whole, code and tests, into one scratch folder (.cache/branch-tests/tree: one path for every branch, so that
the JIT-op cache built for the first one serves the others), its ops are built there, and pytest runs in its
tests/ (upstream's conftest.py, pytest.ini and unit/common.py) with `import deepspeed` finding that branch's
code: the patch and the patches its `Depends on` line needs, nothing else. The files run are every test file
of ours the branch carries (its own `tests` in patches/tests.toml, the `updates` it makes to its dependencies'
files, and those dependencies' own tests: a later patch can break an earlier patch's test unseen otherwise) and
the upstream test files its patches/upstream-tests/NNNN.diff changes. A file already run on the same branch
tree (the same files: `make branches` makes new commits of the same trees) keeps its result (--rerun runs it
again);
a test of those upstream files that fails also on pristine 0.19.8 in the last `make upstream-tests` results is
version skew of the snapshot, reported apart. Results in .cache/branch-tests/results.json; a torch cell other than
.venv (the Makefile's TORCH=2.10.0: .venv-torch2.10.0) keeps its own, .cache/branch-tests-torch2.10.0/, and
compares with its own cell's upstream-tests results.

    make branch-tests UPSTREAM=DIR                       # after make branches UPSTREAM=DIR
    .venv/bin/python tools/branch_tests.py --upstream DIR --only 0003 0009
    .venv/bin/python tools/branch_tests.py --report
"""

import argparse
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import upstream_tests as ut
from patches import BRANCH_PREFIX, branch_name, patch_number, read_series, read_tests_manifest

PATCHES = ut.ROOT / "patches"
TREE = "branch"


def extract_branch(checkout, branch, dest):
    """Make dest hold exactly the branch's tree. A file whose content is unchanged keeps its old mtime and a
    changed one gets a new one, so that the JIT-op builds (ninja compares mtimes) redo exactly the ops whose
    sources this branch changes (0008's shm op), and nothing else."""
    archive = subprocess.run(["git", "-C", str(checkout), "archive", branch], capture_output=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        tarfile.open(fileobj=io.BytesIO(archive.stdout)).extractall(tmp)
        sync_tree(Path(tmp), dest)


def sync_tree(src, dest):
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {p.relative_to(src) for p in src.rglob("*")}
    for path in sorted(dest.rglob("*"), reverse=True):  # children first
        rel = path.relative_to(dest)
        source = src / rel
        if (rel not in wanted or path.is_symlink() != source.is_symlink()
                or (not path.is_symlink() and path.is_dir() != source.is_dir())):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for rel in sorted(wanted):
        source, target = src / rel, dest / rel
        if source.is_symlink():
            if not target.is_symlink() or os.readlink(target) != os.readlink(source):
                target.unlink(missing_ok=True)
                os.symlink(os.readlink(source), target)
        elif source.is_dir():
            target.mkdir(exist_ok=True)
        elif not target.exists() or target.read_bytes() != source.read_bytes():
            target.unlink(missing_ok=True)
            shutil.copyfile(source, target)
            shutil.copymode(source, target)


def branch_tree(checkout, branch):
    """The branch's tree now, or None where it is gone: saved results of other files are not its results."""
    proc = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--verify", "--quiet", f"{branch}^{{tree}}"],
        capture_output=True,
        text=True)
    return proc.stdout.strip() or None


def files_to_run(manifest, number, branch_paths, own_only=False):
    """tests/-relative: the patch's own tests and the earlier tests it updates, then (unless own_only) the other
    test files of ours among branch_paths, the branch's files (its dependencies' tests), then the upstream tests
    its diff changes."""
    entry = manifest[number]
    own = entry["tests"] + entry["updates"]
    ours_anywhere = {f for e in manifest.values() for f in e["tests"]}
    carried = [] if own_only else sorted(ours_anywhere.intersection(branch_paths) - set(own))
    diff = ut.UPDATES / f"{number}.diff"
    return [f[len("tests/"):] for f in own + carried], ut.updated_files([diff]) if diff.exists() else []


def branch_files(checkout, branch):
    proc = subprocess.run(["git", "-C", str(checkout), "ls-tree", "-r", "--name-only", branch, "tests"],
                          capture_output=True,
                          text=True,
                          check=True)
    return proc.stdout.split()


def interrupted(results):
    return any(r["outcome"] in ("timeout", "error") for r in results.values())


def record(state, saved, number, branch, prefix, tree, results, upstream_files):
    """Save after every file: a stopped run keeps what it finished, and the next run starts from there."""
    state["branches"][number] = {
        "branch": branch,
        "prefix": prefix,
        "tree": tree,
        "results": results,
        "upstream_files": upstream_files
    }
    saved.write_text(json.dumps(state, indent=1))


def exception_line(detail):
    """The exception pytest reports last (`E   SomeError: ...`), the part of a failure that tells causes apart,
    with numbers masked (memory sizes, ranks and ports differ from run to run)."""
    lines = [line for line in detail.splitlines() if line.startswith("E ")] or detail.strip().splitlines()[-1:]
    return re.sub(r"(?<![\w.])\d+(?:\.\d+)?\b", "#", lines[-1].strip()) if lines else ""


def skew(pristine, test_file, nodeid, result):
    """A failure of an upstream test that pristine 0.19.8 fails too, with the same exception: the snapshot's
    version skew. A test pristine skipped, timed out on, or failed otherwise is a failure of the branch."""
    before = pristine.get(test_file, {}).get(nodeid)
    return (before is not None and before["outcome"] in ("failed", "error")
            and exception_line(before["detail"]) == exception_line(result["detail"]))


def report(state):
    pristine = state.get("pristine", {})
    print("| patch | branch tree | file | passed | failed | skipped | error+timeout | failing on pristine too |")
    print("|---|---|---|---|---|---|---|---|")
    for number, run in state["branches"].items():
        for test_file, res in run["results"].items():
            c = ut.counts(res)
            bad = [n for n, r in res.items() if r["outcome"] not in ("passed", "skipped")]
            skewed = [n for n in bad if test_file in run["upstream_files"] and skew(pristine, test_file, n, res[n])]
            cells = [
                run.get("tree", run.get("commit", "?"))[:12], f"`{test_file}`", c["passed"], c["failed"], c["skipped"]
            ]
            cells += [c["error"] + c["timeout"], len(skewed)]
            print(f"| {number} | " + " | ".join(str(x) for x in cells) + " |")
    failures = [
        (n, nodeid, r) for n, run in state["branches"].items() for f, res in run["results"].items()
        for nodeid, r in res.items()
        if r["outcome"] not in ("passed",
                                "skipped") and not (f in run["upstream_files"] and skew(pristine, f, nodeid, r))
    ]
    # A file of ours where nothing passed proves nothing (every test skipped: too few devices, a missing op).
    failures += [(n, f, {
        "outcome": "nothing passed",
        "detail": str(ut.counts(res))
    }) for n, run in state["branches"].items() for f, res in run["results"].items()
                 if f not in run["upstream_files"] and not ut.counts(res)["passed"]]
    print(f"\nfailures on their own branch: {len(failures)}")
    for number, nodeid, r in failures:
        print(f"- {number} {nodeid}: {r['outcome']}\n    " + "\n    ".join(r["detail"].splitlines()[-6:]))
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", type=Path, help="the upstream checkout `make branches` wrote into")
    parser.add_argument("--prefix", default=BRANCH_PREFIX)
    parser.add_argument("--only", nargs="+", help="patch numbers (default: every patch of the series)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test (pytest-timeout)")
    parser.add_argument("--out", type=Path, default=ut.ROOT / ".cache" / f"branch-tests{ut.CELL}")
    parser.add_argument("--report", action="store_true", help="print the saved results of the last run")
    parser.add_argument("--own-only",
                        action="store_true",
                        help="only the patch's own tests and updates, not its dependencies' tests it carries")
    parser.add_argument("--rerun", action="store_true", help="run files already run on the same branch tree")
    args = parser.parse_args()
    saved = args.out / "results.json"
    state = json.loads(saved.read_text()) if saved.exists() else {"branches": {}}
    comparison = ut.RESULTS / "results.json"  # this cell's pristine record, as the last make upstream-tests left it
    compared = json.loads(comparison.read_text())["results"] if comparison.exists() else {}
    state["pristine"] = compared.get("pristine", {})
    if args.report:
        return 1 if report(state) else 0
    if args.upstream is None:
        parser.error("--upstream is required (or --report)")
    series = read_series(PATCHES)
    manifest = read_tests_manifest(PATCHES, series)
    # Results of patches no longer in the series, or of a run of other branches, are not this series' results.
    numbers = [patch_number(p) for p in series]
    state["branches"] = {
        n: r
        for n, r in state["branches"].items() if n in numbers and r.get("prefix") == args.prefix
        and r.get("tree") == branch_tree(args.upstream, r["branch"])
    }
    tree = args.out / "tree"
    ut.TREES[TREE] = tree
    for patch in series:
        number = patch_number(patch)
        if args.only and number not in args.only:
            continue
        branch = branch_name(patch, args.prefix)
        tree_id = branch_tree(args.upstream, branch)
        ours, upstream_files = files_to_run(manifest, number, branch_files(args.upstream, branch), args.own_only)
        earlier = {} if args.rerun else state["branches"].get(number, {}).get("results", {})
        # A timeout or an error may be the machine's (a busy CPU): those files run again.
        results = {f: res for f, res in earlier.items() if not interrupted(res)}
        to_run = [f for f in ours + upstream_files if f not in results]
        print(f"{branch}: {', '.join(to_run) or 'nothing new to run'}" +
              (f" (kept from a run of this tree: {', '.join(results)})" if results else ""),
              flush=True)
        if to_run:
            with ut.cpu_lock():
                extract_branch(args.upstream, branch, tree)
                # Always load, not only where a .so is missing: an earlier branch's .so may be stale here (0008
                # changes the shm op's source), and a build inside a test would count against its timeout.
                ut.load_ops(TREE)
                for f in to_run:
                    results[f] = ut.run_file(TREE, tree, f, args.out, args.timeout)
                    record(state, saved, number, branch, args.prefix, tree_id, results, upstream_files)
        record(state, saved, number, branch, args.prefix, tree_id, results, upstream_files)
        for f, res in results.items():
            print(f"  {f}: {ut.counts(res)}", flush=True)
    return 1 if report(state) else 0


if __name__ == "__main__":
    sys.exit(main())
