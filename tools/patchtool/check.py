# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`check` and `style`: the series applies to pristine upstream, each patch also on only what its `Depends on`
needs, its files in upstream's style, nothing it adds without a caller (callers.py), each pull request description
within 1,000 words; fork/ holds nothing unexported."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .callers import uncalled_definitions
from .description import BRANCH_PREFIX, pr_description
from .common import (PatchError, ROOT, TESTS_MANIFEST, UPSTREAM_DIFFS, UPSTREAM_TAG, git, load_toml, patch_number, pin,
                     read_series, series_message)
from .sdist import init_upstream_repo, unpack
from .fork import apply_series, unexported

# Upstream's pre-commit hooks (its .pre-commit-config.yaml): yapf 0.40.0 with its .style.yapf (ours has the same
# settings), and scripts/check-license.py, which wants an SPDX line and "# DeepSpeed Team" in every Python file.
YAPF_STYLE = ROOT / ".style.yapf"
LICENSE_LINE = "# SPDX-License-Identifier: Apache-2.0\n"
SPDX_LINE = re.compile(r"(?m)^# SPDX-License-Identifier: Apache-2\.0( AND BSD-3-Clause)?$")  # as check-license.py
TEAM_LINE = "# DeepSpeed Team\n"


def in_upstream_style(text):
    """A Python file as upstream's pre-commit hooks leave it: formatted by yapf in upstream's style, with the
    license lines check-license.py looks for (our header gains "# DeepSpeed Team" after its SPDX line)."""
    from yapf.yapflib.yapf_api import FormatCode  # imported here: only check and branches need it
    if TEAM_LINE not in text and LICENSE_LINE in text:
        text = text.replace(LICENSE_LINE, LICENSE_LINE + "\n" + TEAM_LINE, 1)
    return FormatCode(text, style_config=str(YAPF_STYLE))[0]


def style_problems(tree, paths, edit_in=""):
    """The Python files among paths (relative to tree) that upstream's pre-commit hooks would change or reject;
    edit_in: the folder, relative to the repository, where they are edited (fork/ for the series' files)."""
    problems = []
    for rel in sorted(p for p in paths if p.endswith(".py") and (Path(tree) / p).exists()):
        text = (Path(tree) / rel).read_text()
        if not SPDX_LINE.search(text):
            problems.append(f"{rel} has no `{LICENSE_LINE.strip()}` line (upstream's check-license.py wants it)")
        elif text != in_upstream_style(text):
            problems.append(f"{rel} is not in upstream's style (yapf 0.40.0 with its .style.yapf, or the license "
                            f"lines): run `.venv/bin/python tools/patches.py style {edit_in}{rel}`")
    return problems


def cmd_style(args):
    """Rewrite files in upstream's style (in_upstream_style)."""
    for rel in args.files:
        path = Path(rel)
        text = path.read_text()
        styled = in_upstream_style(text)
        if styled != text:
            path.write_text(styled)
            print(f"restyled {rel}")
    return 0


def cmd_check(args):
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "tree"
        unpack(scratch)
        init_upstream_repo(scratch)
        try:
            apply_series(scratch, args.patches)
        except PatchError as err:
            problems.append(f"series does not apply to pristine {pin()['version']}: {err}")
        else:
            problems += uncalled_definitions(scratch, [p.name for p in read_series(args.patches)])
        problems += dependency_problems(scratch, read_series(args.patches))
        changed = set().union(*(changed_paths(Path(args.patches, p).read_text()) for p in read_series(args.patches)))
        problems += style_problems(scratch, changed, edit_in="fork/")
    tests = subprocess.run(["git", "-C", str(ROOT), "ls-files", "tests"], capture_output=True, text=True).stdout
    problems += style_problems(ROOT, tests.split())
    problems += [f"{diff}: {why}" for diff, why in stray_diffs(args.patches, read_series(args.patches))]
    problems += long_descriptions(args.patches, read_series(args.patches))
    fork = Path(args.fork)
    if fork.exists():
        problems += unexported(fork, args.patches)
    if problems:
        print("patch check FAILED:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    print(
        f"patch check ok: {len(read_series(args.patches))} patches apply to pristine {pin()['version']}, each "
        f"also on it with only the patches its `Depends on` needs, and each leaves nothing it adds without a caller" +
        ("; fork/ is in sync" if fork.exists() else ""))
    return 0


def apply_cached(repo, patch, env):
    """git apply of one patch or diff to the scratch index env names: git's error text, empty when it applies.
    Three-way, as `git am -3` applies it on a branch: a patch whose context lines were written after a patch it does
    not need (an unrelated change a few lines away) applies, one that conflicts does not. Never with --check, which
    git answers with success for a three-way apply that conflicts: the caller's scratch index is read afresh for each
    patch anyway."""
    cmd = ["git", "-C", str(repo), "apply", "--cached", "--3way"]
    proc = subprocess.run(cmd + [str(Path(patch).resolve())],
                          capture_output=True,
                          text=True,
                          env=dict(os.environ, **env))
    return "" if proc.returncode == 0 else (proc.stderr.strip() or f"git apply exited {proc.returncode}")


def changed_paths(patch_text):
    return set(re.findall(r"(?m)^diff --git a/(\S+) b/", patch_text))


def dependency_problems(repo, series, pristine=UPSTREAM_TAG):
    """Each patch checked (git apply --3way, in a scratch index) on pristine upstream (the commit `pristine` in repo)
    plus exactly the patches its `Depends on` line needs, applied in series order: a wrong line names the patch and
    the dependency it misses (the first earlier patch that, added with what it needs, makes it apply), and an
    unreadable line is named."""
    numbers = [patch_number(p) for p in series]
    by_number = dict(zip(numbers, series))
    problems = []
    closures = dependency_closures(series, problems)
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}

        def error_on(below, patch):
            """git's error applying patch on upstream + below (series order); None if one of below fails."""
            git(repo, "read-tree", pristine, env=env)
            if any(apply_cached(repo, by_number[n], env) for n in below):
                return None
            return apply_cached(repo, patch, env)

        for patch in series:
            number, needed = patch_number(patch), closures[patch_number(patch)]
            if needed is None:
                continue
            error = error_on(needed, patch)
            if error is None:
                problems.append(f"{patch.name}: not checked on its dependencies ({', '.join(needed)}): one of them "
                                f"does not apply on the others (see its own line)")
                continue
            if not error:
                continue
            missing = None
            for other in numbers[:numbers.index(number)]:
                if other in needed or closures[other] is None:
                    continue
                trial = [n for n in numbers if n in set(needed) | {other, *closures[other]}]
                if error_on(trial, patch) == "":
                    missing = other
                    break
            on = f"pristine {pin()['version']}" + (f" + {', '.join(needed)}" if needed else "")
            if missing:
                why = (f"it needs {missing} ({series_message(by_number[missing]).splitlines()[0]}), which its "
                       f"`Depends on` does not name" + (" (nor do the patches it names)" if needed else ""))
            else:
                failed_or_conflicting = re.findall(r"(?m)^(?:error: (?:patch failed: )?([^:\s]+)|U (\S+))", error)
                failing = {a or b for a, b in failed_or_conflicting}
                touching = [
                    n for n in numbers[:numbers.index(number)]
                    if n not in needed and changed_paths(by_number[n].read_text())
                    & (failing or changed_paths(patch.read_text()))
                ]
                why = ("no single earlier patch makes it apply; it may need several of " + ", ".join(touching) +
                       " (they change the files it fails on)" if touching else "no earlier patch makes it apply")
            problems.append(f"{patch.name} does not apply to {on} (what its `Depends on` line needs): {why}\n    " +
                            "\n    ".join(error.splitlines()[:3]))
    return problems


DEPENDS_ON = re.compile(r"(?ms)^Depends on:(.*?)(?:\n\s*\n|\Z)")


def declared_dependencies(patch, numbers):
    """The patches a patch's message names in its `Depends on:` paragraph, in series order: `none` (or a paragraph
    starting with it) names none; otherwise the 4-digit numbers of series patches (other numbers are not patches).
    A missing paragraph, one that names no patch of the series, or one naming a patch that is not before it in the
    series is an error."""
    name, number = Path(patch).name, patch_number(patch)
    found = DEPENDS_ON.search(series_message(patch))
    if not found:
        raise PatchError(f"{name}: its message has no `Depends on:` line; name the patches it needs by number "
                         f"(`Depends on: 0002 (why)`), or write `Depends on: none`")
    text = found.group(1).strip()
    if re.match(r"none\b", text, re.I):
        return []
    named = set(re.findall(r"\b(\d{4})\b", text)) & set(numbers) - {number}
    later = sorted(n for n in named if numbers.index(n) > numbers.index(number))
    if later:
        raise PatchError(f"{name}: `Depends on` names {', '.join(later)}, after it in the series: a patch can "
                         f"depend only on patches before it (reorder the series, or correct the line)")
    if not named:
        raise PatchError(f"{name}: `Depends on: {text.splitlines()[0]}` names no patch of the series; write "
                         f"`Depends on: none` if it applies to upstream alone")
    return [n for n in numbers if n in named]


def dependency_closures(series, problems=None):
    """{number: the numbers of every patch it needs, its declared dependencies and theirs, in series order}. An
    unreadable `Depends on` raises; given a list `problems`, it is added there instead, and that patch and those
    that depend on it get None."""
    numbers = [patch_number(p) for p in series]
    closures = {}
    for patch in series:
        try:
            deps = declared_dependencies(patch, numbers)
        except PatchError as err:
            if problems is None:
                raise
            problems.append(str(err))
            deps = None
        if deps is None or any(closures[d] is None for d in deps):
            closures[patch_number(patch)] = None
            continue
        needed = set()
        for dep in deps:
            needed |= {dep, *closures[dep]}
        closures[patch_number(patch)] = [n for n in numbers if n in needed]
    return closures


def stray_diffs(patches_dir, series):
    """(path, why) for each file in patches/upstream-tests/ and patches/upstream-docs/ that is not NNNN.diff for a
    patch of the series (a diff left behind by a renumbering would silently be applied to no branch)."""
    numbers = [patch_number(p) for p in series]
    stray = []
    for folder, _ in UPSTREAM_DIFFS:
        for path in sorted((Path(patches_dir) / folder).glob("*.diff")):
            if not re.fullmatch(r"\d{4}\.diff", path.name):
                stray.append((path, "not named NNNN.diff after the patch whose branch it belongs to"))
            elif path.stem not in numbers:
                stray.append((path, f"patch {path.stem} is not in the series (renumbered? rename the file after "
                              f"its patch's number)"))
    return stray


MAX_DESCRIPTION_WORDS = 1000  # what a reviewer upstream reads in about five minutes


def long_descriptions(patches_dir, series):
    """Each pull request whose description, as `branches` writes it (the message without fork-only lines, plus the
    legend of what its branch builds on), runs over MAX_DESCRIPTION_WORDS."""
    manifest = Path(patches_dir) / TESTS_MANIFEST  # only its titles: `branches` checks the rest of it
    tables = load_toml(manifest) if manifest.exists() else {}
    titles = {patch_number(patch): (tables.get(patch_number(patch)) or {}).get("title") for patch in series}
    closures = dependency_closures(series, [])
    problems = []
    for patch in series:
        number = patch_number(patch)
        if closures[number] is None:
            continue  # its `Depends on` problem is reported already
        words = len(pr_description(series_message(patch), number, series, BRANCH_PREFIX, titles, closures).split())
        if words > MAX_DESCRIPTION_WORDS:
            problems.append(f"{patch.name}: its pull request description (the message and the legend `branches` "
                            f"adds) is {words} words; keep it to {MAX_DESCRIPTION_WORDS}")
    return problems
