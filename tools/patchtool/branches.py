# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""`branches`: one branch per patch, on the patches it depends on, in an upstream checkout, ready to push as PRs."""

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from .common import (GIT_ENV, PatchError, SERIES, TESTS_MANIFEST, UPSTREAM_DIFFS, UPSTREAM_TAG, git, has_ref,
                     load_toml, patch_number, pin, read_series, series_message)
from .sdist import init_upstream_repo, unpack
from .check import apply_cached, dependency_closures, dependency_problems, in_upstream_style, stray_diffs
from .description import branch_name, pr_description, stacked_on

MANIFEST_KEYS = ("tests", "updates", "at", "title")
# Upstream's own harness: the exported tests import these and run under upstream's copies, never ours.
UPSTREAM_HARNESS = ("tests/unit/common.py", "tests/unit/util.py", "tests/unit/__init__.py")
UNIT_IMPORT = re.compile(r"^\s*(?:from\s+(unit(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]*)|import\s+(unit(?:\.\w+)+))",
                         re.M)


def read_tests_manifest(patches_dir, series):
    """{patch number: {"tests": [test files], "updates": [test files], "at": commit, "title": optional pull-request
    title}} from patches/tests.toml, one table per patch of the series (tests = [] for a patch without tests of its
    own). A patch without a table, or a table without a patch, is an error."""
    path = Path(patches_dir) / TESTS_MANIFEST
    if not path.exists():
        raise PatchError(f"{path} is missing: it lists the tests each patch's pull request carries")
    manifest = load_toml(path)
    numbers = [patch_number(p) for p in series]
    for number, table in manifest.items():
        unknown_keys = sorted(set(table) - set(MANIFEST_KEYS))
        if unknown_keys or "tests" not in table:
            raise PatchError(f"{path} [{number}]: " +
                             (f"unknown keys {', '.join(unknown_keys)} " if unknown_keys else "no `tests` ") +
                             f"(a table has {', '.join(MANIFEST_KEYS)}; "
                             f"`tests` is required, `tests = []` for none)")
    missing = [n for n in numbers if n not in manifest]
    unknown = [n for n in manifest if n not in numbers]
    if missing or unknown:
        raise PatchError(f"{path} does not match {Path(patches_dir) / SERIES}: " +
                         (f"no table for {', '.join(missing)} (add `[NNNN]` with `tests = [...]`, or `tests = []`)"
                          if missing else "") + ("; " if missing and unknown else "") +
                         (f"tables for patches not in the series: {', '.join(unknown)}" if unknown else ""))
    return {
        n:
        dict(manifest[n],
             tests=list(manifest[n]["tests"]),
             updates=list(manifest[n].get("updates", [])),
             at=manifest[n].get("at", "HEAD"))
        for n in numbers
    }


def committed_text(source, rel, rev="HEAD"):
    """A file as committed at rev (HEAD: work in progress does not travel) in the source repository, or None."""
    proc = subprocess.run(["git", "-C", str(source), "show", f"{rev}:{rel}"], capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def imported_helpers(test_files, source, rev="HEAD"):
    """The repository files under tests/ that test_files import as `unit.*`, transitively (the tests' own
    helpers), in a stable order; upstream's harness modules are left to upstream."""
    found, queue = [], list(test_files)
    while queue:
        rel = queue.pop(0)
        text = committed_text(source, rel, rev)
        if text is None:
            raise PatchError(f"{rel} is not committed in {source} at {rev}")
        for package, names, module in UNIT_IMPORT.findall(text):
            candidates = [module] if module else [package] + [
                f"{package}.{name.strip()}" for name in names.replace("(", " ").replace(")", " ").split(",")
            ]
            for dotted in candidates:
                rel = "tests/" + dotted.replace(".", "/") + ".py"
                if committed_text(source, rel,
                                  rev) is not None and rel not in found + list(test_files) + list(UPSTREAM_HARNESS):
                    found.append(rel)
                    queue.append(rel)
    return found


def ensure_series_objects(checkout, fork, patches_dir):
    """Give the checkout every blob the series was made against, for `git am -3`: the pristine upstream commit
    (fork/'s `upstream` tag, else one built from the pinned sdist) and, from patches/ applied to it in a scratch
    index, the tree after each patch. Kept reachable under refs/ds-fork/; returns the pristine commit's ref."""
    ref = f"refs/ds-fork/pristine-{pin()['version']}"
    if Path(fork, ".git").is_dir() and has_ref(fork, f"refs/tags/{UPSTREAM_TAG}"):
        git(checkout, "fetch", "--quiet", "--no-tags", str(Path(fork).resolve()), f"+refs/tags/{UPSTREAM_TAG}:{ref}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "pristine"
            unpack(tree)
            init_upstream_repo(tree)
            git(checkout, "fetch", "--quiet", "--no-tags", str(tree), f"+refs/tags/{UPSTREAM_TAG}:{ref}")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(GIT_ENV, GIT_INDEX_FILE=str(Path(tmp) / "index"))
        git(checkout, "read-tree", ref, env=env)
        commit = git(checkout, "rev-parse", ref)
        for patch in read_series(patches_dir):
            git(checkout, "apply", "--cached", str(Path(patch).resolve()), env=env)
            tree = git(checkout, "write-tree", env=env)
            commit = git(checkout, "commit-tree", tree, "-p", commit, "-m", Path(patch).name, env=env)
        git(checkout, "update-ref", "refs/ds-fork/series", commit)
    return ref


def file_revisions(entry, number, source):
    """{own test file: the commit its branch takes it at}: `at` is one commit for every file of the table, or a
    table {file: commit} (files it leaves out at HEAD)."""
    own = entry["tests"] + entry["updates"]
    at = entry["at"]
    if not isinstance(at, (str, dict)) or isinstance(at, dict) and not all(isinstance(v, str) for v in at.values()):
        raise PatchError(f"patches/tests.toml [{number}]: `at` is a commit, or a table {{\"file\" = \"commit\"}}")
    revs = {rel: at.get(rel, "HEAD") for rel in own} if isinstance(at, dict) else {rel: at for rel in own}
    unknown = sorted(set(at) - set(own)) if isinstance(at, dict) else []
    if unknown:
        raise PatchError(f"patches/tests.toml [{number}]: `at` names {', '.join(unknown)}, not under its `tests` or "
                         f"`updates`")
    for rev in set(revs.values()) | (set() if isinstance(at, dict) else {at}):
        if subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                capture_output=True).returncode != 0:
            raise PatchError(f"patches/tests.toml [{number}]: at = \"{rev}\" is not a commit of {source}")
    return revs


def branch_test_files(entry, number, placed, source, listed=None):
    """{path: text} of the test files one branch adds or changes: its own tests and its dependencies' tests it
    updates (`updates`), at its table's commit (`at`, default HEAD; file_revisions), and the unit.* helpers they
    import, at HEAD, that no dependency's branch placed. `placed` holds what the branches of the patches it depends
    on carry (its base); `listed` {test file: patch number} the `tests` of every earlier patch."""
    revs = file_revisions(entry, number, source)
    again = [f for f in entry["tests"] if f in placed]
    if again:
        raise PatchError(f"patches/tests.toml [{number}] lists {', '.join(again)} under `tests`, which the branch "
                         f"of a patch it depends on already carries: list it under `updates` to carry this patch's "
                         f"change")
    listed = listed or {}
    elsewhere = [f"{f} (under `tests` of [{listed[f]}] too)" for f in entry["tests"] if f in listed]
    if elsewhere:
        raise PatchError(f"patches/tests.toml [{number}] lists {', '.join(elsewhere)}, a patch {number} does not "
                         f"depend on: both pull requests would add the file. Add that patch to its `Depends on` and "
                         f"list the file under `updates`, or give it another name")
    not_placed = [f for f in entry["updates"] if f not in placed]
    if not_placed:
        raise PatchError(f"patches/tests.toml [{number}] updates {', '.join(not_placed)}, which no patch it depends "
                         f"on (its `Depends on`, transitively) carries: name it under `tests`, or add the patch "
                         f"whose tests list it to its `Depends on`")
    own = entry["tests"] + entry["updates"]
    helpers = []
    for rel in own:
        helpers += [h for h in imported_helpers([rel], source, revs[rel]) if h not in own + helpers]
    # Every pull request carries HEAD's version of a shared helper, so that two independent ones that both add it
    # add the same file; tests taken at an older `at` run with it (make branch-tests shows that they do).
    helpers += [h for h in imported_helpers(helpers, source) if h not in helpers + own]
    texts = {}
    for rel in own + helpers:
        text = committed_text(source, rel, revs.get(rel, "HEAD"))  # imported_helpers refused uncommitted
        text = in_upstream_style(text) if rel.endswith(".py") else text  # an `at` older than the restyle
        if placed.get(rel) != text:
            texts[rel] = text
    return texts


def place_tests(worktree, base, texts):
    """Write our files at the same paths in the worktree; one that upstream already has at the base is a name
    collision, not an update."""
    for rel, text in texts.items():
        if git(worktree, "ls-tree", "--name-only", base, "--", rel):
            raise PatchError(f"{rel} exists in upstream's tree: rename our helper so that it cannot collide")
        target = Path(worktree) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    if texts:
        git(worktree, "add", "--", *texts)


def apply_upstream_updates(worktree, patches_dir, number):
    """Apply the patch's updates of upstream's tests and docs (patches/upstream-tests/, upstream-docs/ NNNN.diff)
    to the worktree and its index; returns the diffs applied."""
    applied = []
    for folder, what in UPSTREAM_DIFFS:
        diff = Path(patches_dir) / folder / f"{number}.diff"
        if not diff.exists():
            continue
        proc = subprocess.run(["git", "-C", str(worktree), "apply", "--index",
                               str(diff.resolve())],
                              capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise PatchError(f"{diff} ({what} updated by patch {number}) does not apply:\n{proc.stderr}")
        applied.append(diff)
    return applied


def check_upstream_updates(checkout, base, patches_dir, series, closures):
    """Before any branch is written: each patch's diffs of upstream's tests and docs apply to the base plus those
    of the patches it depends on (series order), in a scratch index; the series' code patches do not touch
    upstream's tests/ and docs/."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        for patch in series:
            number = patch_number(patch)
            own = [Path(patches_dir) / folder / f"{number}.diff" for folder, _ in UPSTREAM_DIFFS]
            if not any(d.exists() for d in own):
                continue
            git(checkout, "read-tree", base, env=env)
            for n in closures[number] + [number]:
                for folder, what in UPSTREAM_DIFFS:
                    diff = Path(patches_dir) / folder / f"{n}.diff"
                    error = apply_cached(checkout, diff, env) if diff.exists() else ""
                    if error:
                        on = "the base" + (f" + the diffs of {', '.join(closures[number])}"
                                           if closures[number] else "")
                        raise PatchError(f"{diff} ({what} updated by patch {n}) does not apply to {on} (patch "
                                         f"{number}'s branch):\n{error}")


def symlinks(worktree, rev):
    """The paths that are symbolic links in upstream's tree at rev (deepspeed/ops/csrc -> ../../csrc, ...)."""
    entries = git(worktree, "ls-tree", "-r", rev).splitlines()
    return [e.split("\t", 1)[1] for e in entries if e.startswith("120000 ")]


def without_linked_copies(patch_text, links):
    """The patch without the changes to files under a path upstream's git has as a symbolic link: the sdist the
    series is made on holds copies there (deepspeed/ops/csrc/... besides csrc/...), upstream only the link, so
    the change to the real file is the whole change."""
    head, *sections = re.split(r"(?m)^(?=diff --git )", patch_text)

    def under_a_link(section):
        paths = re.match(r"diff --git a/(\S+) b/(\S+)", section).groups()
        return any(p == link or p.startswith(link + "/") for p in paths for link in links)

    kept = [sec for sec in sections if not under_a_link(sec)]
    for dropped in (sec for sec in sections if under_a_link(sec)):
        if hunks(dropped) not in [hunks(sec) for sec in kept]:
            path = re.match(r"diff --git a/(\S+)", dropped).group(1)
            raise PatchError(f"the patch changes {path}, under a path upstream's git has as a symbolic link, "
                             f"without the same change to the file the link points to: make the change there")
    return head + "".join(kept)  # split at line starts: every kept section still ends its last line


def hunks(section):
    """A file's change without its header lines (paths, index), to tell a copy's change from the original's."""
    at = section.find("\n@@")
    return section[at:] if at >= 0 else section


def am_three_way(worktree, patch, base):
    """Apply one patch as a commit, signed off by the checkout's identity (upstream checks DCO sign-offs); on a
    conflict, abort and name the patch and its conflicting files."""
    text = without_linked_copies(Path(patch).read_text(), symlinks(worktree, "HEAD"))
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as f:
        f.write(text)
    try:
        proc = subprocess.run(["git", "-C", str(worktree), "am", "--quiet", "-3", "--keep-cr", f.name],
                              capture_output=True,
                              text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode == 0:
        return
    conflicts = git(worktree, "diff", "--name-only", "--diff-filter=U", check=False).split()
    git(worktree, "am", "--abort", check=False)
    raise PatchError(f"{Path(patch).name} does not apply on {base}" +
                     (f": conflicts in {', '.join(conflicts)}" if conflicts else "") + f"\n{proc.stdout}{proc.stderr}"
                     f"Rebase the series onto this upstream (import it into fork/ with --3way, resolve, export), or "
                     f"pass --base with an upstream commit it applies to.")


def uncommitted_series(patches_dir):
    """`git status` of the series folder in its own repository (the branches take patches and tests as committed);
    a folder outside any repository counts as uncommitted as a whole."""
    proc = subprocess.run(["git", "-C", str(patches_dir), "status", "--porcelain", "--", "."],
                          capture_output=True,
                          text=True)
    return proc.stdout.strip() if proc.returncode == 0 else f"{patches_dir} is not in a git repository"


def require_identity(checkout):
    """The one who sends the pull requests authors and signs off their commits: refuse a checkout without a name
    and email (git config, or GIT_AUTHOR_/GIT_COMMITTER_ variables) rather than invent one."""
    for role, key in (("AUTHOR", "NAME"), ("AUTHOR", "EMAIL"), ("COMMITTER", "NAME"), ("COMMITTER", "EMAIL")):
        if not (os.environ.get(f"GIT_{role}_{key}") or git(checkout, "config", f"user.{key.lower()}", check=False)):
            raise PatchError(f"{checkout} has no git identity: set yours (git -C {checkout} config user.name ...; "
                             f"git -C {checkout} config user.email ...); it authors and signs off every branch's "
                             f"commit")


def build_branch(worktree, patch, tip, on, files, args):
    """The branch of one patch: the patch commit on `tip` (described as `on`), with its tests and its updates of
    upstream's tests and docs folded in and the pull-request description as its message. Returns what was added."""
    number = patch_number(patch)
    git(worktree, "checkout", "--quiet", "--detach", tip)
    am_three_way(worktree, patch, f"{on} ({tip[:12]})")
    if git(worktree, "rev-parse", "HEAD") == git(worktree, "rev-parse", tip):
        raise PatchError(f"{Path(patch).name} changes nothing on {tip}: upstream already has it (drop it from the "
                         f"series), or pass --base with an upstream commit before it")
    place_tests(worktree, args.base_ref, files)
    diffs = apply_upstream_updates(worktree, args.patches, number)
    message = pr_description(series_message(patch), number, read_series(args.patches), args.prefix, args.titles,
                             args.closures)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(message)
    try:
        # The one sending the pull request authors and signs off its commit (upstream checks DCO sign-offs).
        git(worktree, "commit", "--quiet", "--amend", "--no-verify", "--reset-author", "--signoff", "-F", f.name)
    finally:
        os.unlink(f.name)
    name = branch_name(patch, args.prefix)
    git(worktree, "branch", "--force", name, "HEAD")
    return name, diffs


def branch_base(worktree, patch, closures, built, args):
    """(commit, description) a patch's branch starts from: the base with exactly the patches it depends on, in
    series order, each the commit of its own branch (its patch, tests and updates, its description): that commit
    itself where it already sits on what comes before it (so a chain of dependencies is the last one's branch),
    else the same commit cherry-picked (author and message kept; a test file that two dependencies, neither
    depending on the other, carry in different versions takes the later one's, as placed_by plans)."""
    number = patch_number(patch)
    tip = args.base_ref
    for dep in closures[number]:
        commit = built[dep]
        if git(worktree, "rev-parse", f"{commit}^") == tip:
            tip = commit
            continue
        git(worktree, "checkout", "--quiet", "--detach", tip)
        proc = subprocess.run(["git", "-C", str(worktree), "cherry-pick", commit], capture_output=True, text=True)
        conflicts = git(worktree, "diff", "--name-only", "--diff-filter=U", check=False).split()
        if proc.returncode != 0 and conflicts and set(conflicts) <= args.test_files:
            # Test files two independent dependencies carry in different versions: the later one's, as planned
            # (placed_by); its commit keeps its message and author.
            git(worktree, "checkout", "--theirs", "--", *conflicts)
            git(worktree, "add", "--", *conflicts)
            git(worktree, "commit", "--quiet", "--no-verify", "-C", commit)
            git(worktree, "cherry-pick", "--quit", check=False)
        elif proc.returncode != 0:
            git(worktree, "cherry-pick", "--abort", check=False)
            raise PatchError(f"patch {number} depends on {', '.join(closures[number])}, whose branches' commits do "
                             f"not combine: {dep}'s does not apply after " +
                             ", ".join(closures[number][:closures[number].index(dep)]) +
                             (f" (conflicts in {', '.join(conflicts)})" if conflicts else "") +
                             f"\n{proc.stdout}{proc.stderr}")
        tip = git(worktree, "rev-parse", "HEAD")
    deps = closures[number]
    on = args.on if not deps else f"{args.on} + " + ", ".join(deps)
    return tip, on


def existing_branches(checkout, names):
    return [n for n in names if has_ref(checkout, f"refs/heads/{n}")]


def cmd_branches(args):
    checkout = Path(args.checkout).resolve()
    if not (checkout / ".git").exists():
        raise PatchError(f"{checkout} is not a git checkout of upstream DeepSpeed")
    series = read_series(args.patches)
    if not series:
        raise PatchError(f"{Path(args.patches) / SERIES} lists no patches")
    uncommitted = uncommitted_series(args.patches)
    if uncommitted:
        raise PatchError(f"{args.patches} has uncommitted changes; the branches take patches and tests as "
                         f"committed: commit them first\n{uncommitted}")
    tests = read_tests_manifest(args.patches, series)
    args.titles = {n: entry.get("title") for n, entry in tests.items()}
    args.closures = closures = dependency_closures(series)
    stray = stray_diffs(args.patches, series)
    if stray:
        raise PatchError("\n".join(f"{diff}: {why}" for diff, why in stray))
    names = [branch_name(p, args.prefix) for p in series]
    taken = existing_branches(checkout, names)
    if taken and not args.force:
        raise PatchError(f"{checkout} already has {', '.join(taken)}; --force rewrites them")
    require_identity(checkout)
    base = git(checkout, "rev-parse", "--verify", f"{args.base}^{{commit}}")
    pristine = ensure_series_objects(checkout, args.fork, args.patches)
    wrong = dependency_problems(checkout, series, pristine)
    if wrong:  # git am -3 could merge a patch without a dependency it needs: refused (make check names these too)
        raise PatchError("a `Depends on` line does not match what its patch needs:\n" + "\n".join(wrong))
    args.base_ref, args.on = base, args.base
    worktree = Path(tempfile.mkdtemp(prefix="ds-fork-branches-")) / "tree"
    git(checkout, "worktree", "add", "--quiet", "--detach", str(worktree), base)
    try:
        files_of, listed, plan = {}, {}, []
        for patch in series:  # every manifest and diff mistake before any branch is written
            number = patch_number(patch)
            placed = placed_by(number, closures, files_of)
            files_of[number] = branch_test_files(tests[number], number, placed, args.source, listed)
            listed.update((f, number) for f in tests[number]["tests"])
            plan.append(patch)
        check_upstream_updates(checkout, base, args.patches, series, closures)
        args.test_files = {rel for files in files_of.values() for rel in files}
        built, branches = {}, {}
        for patch in plan:
            number = patch_number(patch)
            tip, on = branch_base(worktree, patch, closures, built, args)
            name, diffs = build_branch(worktree, patch, tip, on, files_of[number], args)
            built[number] = git(worktree, "rev-parse", "HEAD")
            below, branches[number] = stacked_on(number, closures), name
            where = branches[below] if below else " + ".join([args.base] + closures[number])
            print(f"{name}: {Path(patch).name} on {where}" +
                  (f" + {len(files_of[number])} test files" if files_of[number] else "") +
                  "".join(f" + {d.relative_to(Path(args.patches).parent)}" for d in diffs))
    finally:
        git(checkout, "worktree", "remove", "--force", str(worktree), check=False)
        shutil.rmtree(worktree.parent, ignore_errors=True)
    for a, b, rel in diverging_files([patch_number(p) for p in series], closures, files_of):
        both = [n for n in closures if {a, b} <= set(closures[n])]
        print(f"note: {branches[a]} and {branches[b]} (neither depends on the other) both add {rel}, in different "
              f"versions: whichever pull request is merged second must be rebased onto the other's" +
              (f"; below {', '.join(both)}, which need{'s' if len(both) == 1 else ''} both, {b}'s commit replaces "
               f"{a}'s version" if both else ""),
              flush=True)
    print(f"{len(series)} branches on {args.base} ({base[:12]}) in {checkout}, each with exactly the patches its "
          f"`Depends on` needs below it")


def placed_by(number, closures, files_of):
    """{path: text} of the test files in a patch's base: those the branches of the patches it depends on carry,
    in series order (a later one's version of a file replaces an earlier one's, as its commit does)."""
    placed = {}
    for dep in closures[number]:
        placed.update(files_of[dep])
    return placed


def diverging_files(numbers, closures, files_of):
    """(earlier, later, path) for the test files that two patches, neither depending on the other, both carry in
    different versions (patches/tests.toml `at`, or a helper changed in between): their pull requests conflict
    there, whichever is merged second."""
    return [(a, b, rel) for i, a in enumerate(numbers) for b in numbers[i + 1:] if a not in closures[b]
            for rel in sorted(set(files_of[a]) & set(files_of[b])) if files_of[a][rel] != files_of[b][rel]]
