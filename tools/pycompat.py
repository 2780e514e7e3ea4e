#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""The Python versions we promise, checked mechanically with vermin (no other interpreter needed).

  ours     every Python file committed here (tooling, tests, examples, benchmarks) runs on Python 3.9+
  fork     no DeepSpeed file the patch series touches needs a newer Python than upstream's own copy of it
           (or than 3.8, DeepSpeed 0.19.8's oldest supported Python, for a file the series adds)

`--only ours|fork` runs one. Exits 1 and names each offending file with the feature that needs the newer
version. A line vermin misreads (a guarded import of a newer module) takes a `# novermin` comment saying why.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# --feature union-types: without it vermin 1.9 does not flag `X | None` annotations (3.10).
VERMIN = [
    sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())", "--no-tips", "--eval-annotations",
    "--feature", "union-types"
]
OUR_MINIMUM = (3, 9)
UPSTREAM_MINIMUM = (3, 8)
UPSTREAM_TAG = "upstream"  # tools/patches.py tags the pristine commit of fork/ with it


def vermin(paths):
    """{path: minimum (major, minor)} for Python 3, from vermin's parsable per-file lines."""
    proc = subprocess.run(VERMIN + ["--format", "parsable"] + [str(p) for p in paths], capture_output=True, text=True)
    minimums = {}
    for line in proc.stdout.splitlines():
        path, line_number, _, _, py3, _ = (line.rsplit(":", 5) + [""] * 6)[:6]
        if path and not line_number and py3.lstrip("~")[:1].isdigit():
            minimums[Path(path).resolve()] = version(py3)
    missing = [p for p in paths if Path(p).resolve() not in minimums]
    if missing:
        raise RuntimeError(f"vermin gave no verdict for {missing}:\n{proc.stdout[-2000:]}{proc.stderr}")
    return minimums


def version(text):
    """(major, minor) of a vermin verdict; "~3" (no version-specific feature found) counts as 3.0."""
    parts = [int(part) for part in text.lstrip("~").split(".")[:2]]
    return tuple(parts + [0] * (2 - len(parts)))


def explain(path, target):
    """vermin's own lines for the features of path that need more than target."""
    proc = subprocess.run(VERMIN + ["--violations", f"-t={fmt(target)}-", str(path)], capture_output=True, text=True)
    return "\n".join(f"    {line.strip()}" for line in proc.stdout.splitlines() if "requires" in line)


def our_files():
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "*.py"], capture_output=True, text=True, check=True)
    return [ROOT / name for name in listed.stdout.split() if (ROOT / name).is_file()]


def check_ours():
    problems = []
    for path, needs in sorted(vermin(our_files()).items()):
        if needs > OUR_MINIMUM:
            problems.append(f"{path.relative_to(ROOT)} needs Python {fmt(needs)}:\n{explain(path, OUR_MINIMUM)}")
    return problems


def touched_files(fork):
    """The Python files the series adds or modifies; --no-renames so a renamed file counts as added."""
    changed = subprocess.run(
        ["git", "-C", str(fork), "diff", "--name-only", "--no-renames", "--diff-filter=AM", UPSTREAM_TAG],
        capture_output=True,
        text=True,
        check=True)
    return [name for name in changed.stdout.splitlines() if is_python(Path(fork) / name)]


def is_python(path):
    """A *.py file, or a script (fork/bin/deepspeed, deepspeed.pt) whose shebang names python."""
    if not path.is_file():
        return False
    if path.suffix == ".py":
        return True
    with open(path, "rb") as f:
        first = f.readline()
    return first.startswith(b"#!") and b"python" in first


def pristine_copies(fork, names, dest):
    """Upstream's copy of each name under dest ({name: path}); names the series adds are left out."""
    copies = {}
    for name in names:
        shown = subprocess.run(["git", "-C", str(fork), "show", f"{UPSTREAM_TAG}:{name}"], capture_output=True)
        if shown.returncode == 0:
            copies[name] = Path(dest) / name
            copies[name].parent.mkdir(parents=True, exist_ok=True)
            copies[name].write_bytes(shown.stdout)
    return copies


def check_fork(fork):
    names = touched_files(fork)
    if not names:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        copies = pristine_copies(fork, names, tmp)
        upstream = vermin(list(copies.values())) if copies else {}
        allowed = {n: max(UPSTREAM_MINIMUM, upstream[Path(p).resolve()]) for n, p in copies.items()}
    problems = []
    patched = vermin([Path(fork) / n for n in names])
    for name in names:
        needs, limit = patched[(Path(fork) / name).resolve()], allowed.get(name, UPSTREAM_MINIMUM)
        if needs > limit:
            problems.append(f"fork/{name} needs Python {fmt(needs)}, upstream's copy {fmt(limit)}:\n"
                            f"{explain(Path(fork) / name, limit)}")
    return problems


def fmt(v):
    return ".".join(map(str, v))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("ours", "fork"), help="run one of the two checks (default: both)")
    parser.add_argument("--fork", default=str(ROOT / "fork"))
    args = parser.parse_args(argv)
    what = [args.only] if args.only else ["ours", "fork"]
    problems = []
    if "ours" in what:
        problems += check_ours()
    if "fork" in what:
        if not (Path(args.fork) / ".git").is_dir():
            sys.exit(f"{args.fork} is missing: run `make setup` (tools/patches.py import) first")
        problems += check_fork(args.fork)
    if problems:
        print("Python version check FAILED:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    print(f"Python version check ok: our files run on Python {fmt(OUR_MINIMUM)}+"
          f"{'; the series raises no DeepSpeed file above upstream' if 'fork' in what else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
