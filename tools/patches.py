#!/usr/bin/env python3
"""Patch-series tooling for the DeepSpeed fork.

The fork is pristine upstream DeepSpeed (the sdist pinned in upstream.toml) plus the patches listed,
in order, in patches/series. Upstream files are never committed: they are materialized here.

  fetch     download the pinned sdist into .cache/ and verify its sha256
  import    unpack upstream into fork/ (a git repo whose base commit is tagged `upstream`) and
            apply every patch of the series as its own commit
  export    write the commits after `upstream` back to patches/ (format-patch) and patches/series
  check     the series applies cleanly to pristine upstream, each patch also with only the patches its
            `Depends on` line needs, and fork/ holds nothing unexported
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
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_TAG = "upstream"
SERIES = "series"
BEHIND = "behind the series:"  # check's line for a fork/ that only lacks the series' newest patches
IMPORTED_TAG = "imported"  # the tip import (or export) left: commits not under it are fork/'s own work
IMPORT_REFS = ("refs/heads/main", f"refs/tags/{UPSTREAM_TAG}", f"refs/tags/{IMPORTED_TAG}")
CURRENT, BEHIND_SERIES, OLDER_SERIES = "current", "behind", "older"
# Fixed identity and dates make the upstream commit, and so every patch's parent, reproducible.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "upstream",
    "GIT_AUTHOR_EMAIL": "upstream@localhost",
    "GIT_COMMITTER_NAME": "fork-tools",
    "GIT_COMMITTER_EMAIL": "fork-tools@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}


class PatchError(Exception):
    pass


def pin():
    return load_toml(ROOT / "upstream.toml")["deepspeed"]


def load_toml(path):
    """tomllib (Python 3.11+) or tomli where installed; else the subset of TOML upstream.toml uses, so the
    tooling runs on Python 3.9 without extra packages."""
    text = Path(path).read_text()
    try:
        import tomllib  # novermin: guarded, Python 3.9 and 3.10 take the fallbacks below
    except ModuleNotFoundError:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return parse_simple_toml(text, path)
    return tomllib.loads(text)


TOML_TABLE = re.compile(r'\[\s*([A-Za-z0-9_-]+)\s*\]\s*(#.*)?')
TOML_STRING = re.compile(r'([A-Za-z0-9_-]+)\s*=\s*"([^"\\]*)"\s*(#.*)?')
TOML_ARRAY = re.compile(r'([A-Za-z0-9_-]+)\s*=\s*\[((?:\s*"[^"\\]*"\s*,?)*)\s*\]\s*(#.*)?', re.S)
TOML_PAIR = r'"[^"\\]*"\s*=\s*"[^"\\]*"'
TOML_INLINE_TABLE = re.compile(r'([A-Za-z0-9_-]+)\s*=\s*\{\s*((?:' + TOML_PAIR + r'\s*,\s*)*' + TOML_PAIR +
                               r')?\s*\}\s*(#.*)?')


def parse_simple_toml(text, path="upstream.toml"):
    """Tables of `key = "string"`, `key = ["string", ...]` (one or several lines), `key = {"name" = "string", ...}`
    (one line) and comments; anything else is refused rather than misread."""
    data = {}
    table = data
    lines = iter(enumerate(text.splitlines(), 1))
    for number, line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        while line.count("[") > line.count("]") and "=" in line:  # an array continued on the next lines
            line += " " + next(lines, (number, "]"))[1].split("#")[0].strip()
        header, item, array = TOML_TABLE.fullmatch(line), TOML_STRING.fullmatch(line), TOML_ARRAY.fullmatch(line)
        inline = TOML_INLINE_TABLE.fullmatch(line)
        if header:
            table = data.setdefault(header.group(1), {})
        elif item:
            table[item.group(1)] = item.group(2)
        elif array:
            table[array.group(1)] = re.findall(r'"([^"\\]*)"', array.group(2))
        elif inline:
            pairs = re.findall(r'"([^"\\]*)"\s*=\s*"([^"\\]*)"', inline.group(2) or "")
            if len(dict(pairs)) != len(pairs):
                raise PatchError(f"{path}:{number}: a key appears twice in the inline table")
            table[inline.group(1)] = dict(pairs)
        else:
            raise PatchError(f"{path}:{number}: beyond the TOML this tool reads without tomllib; "
                             f"use Python 3.11+ or `pip install tomli`")
    return data


def git(repo, *args, env=None, check=True, capture=True):
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run(["git", "-C", str(repo), *args],
                          env=full_env,
                          text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.PIPE if capture else None)
    if check and proc.returncode != 0:
        raise PatchError(f"git {' '.join(args)} failed in {repo}:\n{proc.stderr or ''}{proc.stdout or ''}")
    return proc.stdout.rstrip("\n") if capture else ""


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


def read_series(patches_dir):
    series = Path(patches_dir) / SERIES
    if not series.exists():
        return []
    names = [line.strip() for line in series.read_text().splitlines()]
    names = [n for n in names if n and not n.startswith("#")]
    missing = [n for n in names if not (Path(patches_dir) / n).exists()]
    if missing:
        raise PatchError(f"{series} lists missing patches: {', '.join(missing)}")
    return [Path(patches_dir) / n for n in names]


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


def apply_series(tree, patches_dir, three_way=False):
    for patch in read_series(patches_dir):
        args = ["am", "--quiet", "--keep-cr", "--committer-date-is-author-date"]
        if three_way:
            args.append("--3way")
        proc = subprocess.run(["git", "-C", str(tree), *args, str(patch.resolve())],
                              text=True,
                              capture_output=True,
                              env=dict(os.environ, **GIT_ENV))
        if proc.returncode != 0:
            raise PatchError(f"{patch.name} does not apply:\n{proc.stdout}{proc.stderr}\n"
                             f"Resolve in {tree} and `git am --continue`, or retry with --3way.")


def cmd_import(args):
    fork = Path(args.fork)
    if fork.exists() and not args.force and refuse_unexported(fork, args.patches) == CURRENT:
        print(f"{fork}: in sync with {len(read_series(args.patches))} patches; nothing to re-import")
        return
    backup = replace_fork(fork, args.patches, three_way=args.three_way)
    print(f"{fork}: upstream + {len(read_series(args.patches))} patches" +
          (f"; the previous tree is kept as {backup}" if backup else ""))


def replace_fork(fork, patches_dir, three_way=False):
    """Import into a scratch tree beside fork/ and swap it in only once it is complete; the old tree is moved
    to fork.bak-<time>, never deleted, so a failed fetch or patch cannot cost the user fork/. Returns the backup."""
    fork = Path(fork)
    fetch()  # download and verify the sdist before anything moves
    fresh = fork.parent / f".{fork.name}.importing-{os.getpid()}"  # beside fork/: the renames stay atomic
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        unpack(fresh)
        init_upstream_repo(fresh)
        apply_series(fresh, patches_dir, three_way=three_way)
    except PatchError as err:
        raise failed_import(fork, fresh, err) from None
    git(fresh, "tag", IMPORTED_TAG)
    backup = None
    if fork.exists() or fork.is_symlink():
        backup = backup_path(fork)
        fork.rename(backup)
    fresh.rename(fork)
    return backup


def failed_import(fork, fresh, err):
    """The error of an import that failed in fresh: with no fork/ yet it becomes fork/ (resolve it there, as
    before); else fork/ stays as it was and the half-applied tree is left in fresh."""
    if not fresh.exists():
        return err
    if not fork.exists():
        fresh.rename(fork)
        return PatchError(str(err).replace(str(fresh), str(fork)))
    return PatchError(f"{err}\n{fork} is unchanged; the half-applied import is left in {fresh} (finish it there, "
                      f"or delete it).")


def backup_path(fork):
    stamp = time.strftime("%Y%m%d-%H%M%S")
    backup, n = fork.parent / f"{fork.name}.bak-{stamp}", 1
    while backup.exists() or backup.is_symlink():
        backup, n = fork.parent / f"{fork.name}.bak-{stamp}-{n}", n + 1
    return backup


def refuse_unexported(fork, patches_dir):
    """Raise unless re-importing fork/ loses nothing: it holds no work of its own (it may be in sync, behind
    the series, or imported from an older revision of it); else return how it stands to the series."""
    own, relation, missing = assess(fork, patches_dir)
    if own and relation == CURRENT:
        raise PatchError(f"{fork} holds unexported work; export it (make export) or set it aside "
                         f"(make sync FORCE=1 moves it to {fork.name}.bak-<time>):\n" + "\n".join(own))
    if own:
        raise PatchError(older_series_message(fork, relation, missing, own))
    return relation


def older_series_message(fork, relation, missing, own):
    """The refusal when fork/ predates patches/ and holds work: `make export` would overwrite the new patches."""
    what = (f"it lacks the series' last {missing} patches"
            if relation == BEHIND_SERIES else "patches/ revises patches fork/ was imported with")
    base = IMPORTED_TAG if has_ref(fork, f"refs/tags/{IMPORTED_TAG}") else UPSTREAM_TAG
    if base == UPSTREAM_TAG:  # imported before the tag: an older series and amended commits look alike
        what += ", or its commits were amended: this fork/ predates the `imported` tag that tells them apart"
    return (f"{fork} was imported from an older patch series than patches/ holds ({what}; patches/ changed, e.g. "
            f"by a pull), and it holds work of its own:\n" + "\n".join(own) + "\n"
            f"Do not `make export` now: it would overwrite the new patches with fork/'s older copies. Either "
            f"save your own work first (commit it, then `git -C {fork} format-patch -o <dir> {base}..HEAD`), "
            f"re-import with `make sync FORCE=1` and `git am` your patches onto the new fork/; or discard it: "
            f"`make sync FORCE=1` re-imports the series, which drops fork/'s own commits and edits (the old tree "
            f"is kept as {fork.name}.bak-<time>).")


def materialize(fork, patches_dir):
    """fork/ as the series describes it, for the build backend: imported when missing; kept when it holds the
    series (with a warning listing its unexported work, if any); re-imported when it predates the series and
    holds nothing of its own; refused (PatchError) when it predates the series and holds work."""
    fork = Path(fork)
    if not fork.exists():
        replace_fork(fork, patches_dir)
        return True
    if not (fork / ".git").is_dir():
        raise PatchError(f"{fork} exists but is not the git tree tools/patches.py imports; move it away")
    own, relation, missing = assess(fork, patches_dir)
    if relation == CURRENT:
        if own:
            print(f"warning: building {fork} as it is; it holds work patches/ does not (make export):\n" +
                  "\n".join(own),
                  file=sys.stderr)
        return False
    if own:
        raise PatchError(older_series_message(fork, relation, missing, own))
    backup = replace_fork(fork, patches_dir)
    print(f"{fork}: re-imported from patches/ (the previous tree is kept as {backup})", file=sys.stderr)
    return True


def refuse_stale_export(fork, patches_dir):
    """Exporting a fork/ imported from an older series would overwrite the newer patches/ (e.g. after a pull).
    Only a fork/ with the `imported` tag can tell; an older one may just have amended commits."""
    if not has_ref(fork, f"refs/tags/{IMPORTED_TAG}"):
        return
    own, relation, missing = assess(fork, patches_dir)
    if relation != CURRENT and own:
        raise PatchError(
            older_series_message(fork, relation, missing, own) +
            "\n(`tools/patches.py export --force` overwrites patches/ all the same.)")
    if relation != CURRENT:
        raise PatchError(f"{fork} was imported from an older series than {patches_dir} holds and has nothing "
                         f"to export; exporting it would overwrite the newer patches. Re-import it: make sync.")


def subject_filename(index, subject):
    slug = "".join(c if c.isalnum() else "-" for c in subject.lower())
    slug = "-".join(part for part in slug.split("-") if part)[:60].rstrip("-")
    return f"{index:04d}-{slug}.patch"


def cmd_export(args):
    fork, patches_dir = Path(args.fork), Path(args.patches)
    if git(fork, "status", "--porcelain", "--untracked-files=no"):
        raise PatchError(f"{fork} has uncommitted edits: commit them (git commit --fixup for an existing patch) first")
    if not args.force:
        refuse_stale_export(fork, patches_dir)
    commits = git(fork, "rev-list", "--reverse", "--no-merges", f"{UPSTREAM_TAG}..HEAD").split()
    patches_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for index, commit in enumerate(commits, 1):
        subject = git(fork, "log", "-1", "--format=%s", commit)
        text = git(fork, "format-patch", "--stdout", "-1", "--zero-commit", "--no-signature", "--no-numbered",
                   "--keep-subject", "--no-stat", "--full-index", commit) + "\n"
        name = subject_filename(index, subject)
        target = patches_dir / name
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
        written.append(name)
    for stale in set(p.name for p in patches_dir.glob("*.patch")) - set(written):
        (patches_dir / stale).unlink()
    series_text = "".join(f"{name}\n" for name in written)
    series = patches_dir / SERIES
    if not series.exists() or series.read_text() != series_text:
        series.write_text(series_text)
    # patches/ now holds exactly these commits: nothing under HEAD is fork/'s own work any more.
    git(fork, "tag", "--force", IMPORTED_TAG, "HEAD")
    print(f"exported {len(written)} patches to {patches_dir}")


def unexported(fork, patches_dir):
    """Describe each piece of work in fork/ that patches/ does not hold, and how fork/ stands to the series;
    empty when in sync."""
    problems, relation, missing = assess(fork, patches_dir)
    if relation == BEHIND_SERIES:
        problems.append(f"{BEHIND} it lacks the last {missing} patches of the series "
                        f"(patches/ changed, e.g. by a pull): re-import it (make sync)")
    elif relation == OLDER_SERIES:
        problems.append("fork/ was imported from an older revision of patches/ (e.g. before a pull): re-import "
                        "it (make sync; do not `make export`, which would overwrite the new patches)")
    return problems


def assess(fork, patches_dir):
    """(own, relation, missing): the work in fork/ a re-import would lose; whether the commits the import made
    are the series (CURRENT), a prefix of it (BEHIND_SERIES, `missing` patches short) or another revision
    (OLDER_SERIES)."""
    series = series_states(fork, patches_dir)
    own = local_changes(fork)
    head = commits_after(fork, "HEAD")
    imported = has_ref(fork, f"refs/tags/{IMPORTED_TAG}")
    if imported:
        base = commit_states(fork, commits_after(fork, IMPORTED_TAG))
        own_commits = git(fork, "rev-list", "--reverse", "HEAD", "--branches", "--not", IMPORTED_TAG).split()
        if not is_ancestor(fork, IMPORTED_TAG, "HEAD"):
            own.append("HEAD no longer holds every commit the import made (reset, amended or rebased)")
    else:  # imported before the `imported` tag: the commits that match the series are the import's
        states = commit_states(fork, head)
        matched = next((i for i, (a, b) in enumerate(zip(states, series)) if a != b), min(len(states), len(series)))
        base, own_commits = states[:matched], head[matched:]
    own += [f"unexported commit: {git(fork, 'log', '-1', '--format=%h %s', c)}" for c in own_commits]
    if base == series:
        return own, CURRENT, 0
    if base == series[:len(base)] and not (own_commits and not imported):  # (a legacy fork can't tell which)
        return own, BEHIND_SERIES, len(series) - len(base)
    return own, OLDER_SERIES, 0


def local_changes(fork):
    """What `git log` does not show: uncommitted and untracked files, stashes, refs the import did not make."""
    found = []
    for line in git(fork, "status", "--porcelain", "--untracked-files=normal").splitlines():
        found.append(f"{'untracked' if line[:2] == '??' else 'uncommitted'}: {line[3:]} ({line[:2].strip()})")
    found += [f"stash: {line}" for line in git(fork, "stash", "list").splitlines()]
    for ref in git(fork, "for-each-ref", "--format=%(refname)").split():
        if ref not in IMPORT_REFS and not ref.startswith(("refs/remotes/", "refs/stash")):
            found.append(f"ref the import did not make: {ref}")
    return found


def commits_after(fork, tip):
    return git(fork, "rev-list", "--reverse", "--no-merges", f"{UPSTREAM_TAG}..{tip}").split()


def commit_states(fork, commits):
    return [(git(fork, "rev-parse", f"{c}^{{tree}}"), git(fork, "log", "-1", "--format=%B", c)) for c in commits]


def series_states(fork, patches_dir):
    """(tree, message) after each patch of the series, applied to fork/'s upstream commit in a scratch index.
    Trees compare byte for byte, so a whitespace-only amendment differs (git < 2.40's patch-id ignores
    whitespace and has no --verbatim)."""
    states = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(fork, "read-tree", UPSTREAM_TAG, env=env)
        for patch in read_series(patches_dir):
            git(fork, "apply", "--cached", str(Path(patch).resolve()), env=env)
            states.append((git(fork, "write-tree", env=env), series_message(patch)))
    return states


def is_ancestor(fork, older, newer):
    return subprocess.run(["git", "-C", str(fork), "merge-base", "--is-ancestor", older, newer]).returncode == 0


def has_ref(fork, ref):
    return subprocess.run(["git", "-C", str(fork), "show-ref", "--verify", "--quiet", ref]).returncode == 0


def series_message(patch):
    """The commit message a patch file carries, as git am would record it."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(["git", "mailinfo", "-k", f"{tmp}/msg", f"{tmp}/diff"],
                              stdin=open(patch),
                              text=True,
                              capture_output=True,
                              check=True)
        subject = next(line[len("Subject: "):] for line in proc.stdout.splitlines() if line.startswith("Subject: "))
        body = Path(f"{tmp}/msg").read_text().strip()
    return f"{subject}\n\n{body}".strip() if body else subject


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
        problems += dependency_problems(scratch, read_series(args.patches))
        changed = set().union(*(changed_paths(Path(args.patches, p).read_text()) for p in read_series(args.patches)))
        problems += style_problems(scratch, changed, edit_in="fork/")
    tests = subprocess.run(["git", "-C", str(ROOT), "ls-files", "tests"], capture_output=True, text=True).stdout
    problems += style_problems(ROOT, tests.split())
    problems += [f"{diff}: {why}" for diff, why in stray_diffs(args.patches, read_series(args.patches))]
    fork = Path(args.fork)
    if fork.exists():
        problems += unexported(fork, args.patches)
    if problems:
        print("patch check FAILED:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"patch check ok: {len(read_series(args.patches))} patches apply to pristine {pin()['version']}, each "
          f"also on it with only the patches its `Depends on` needs" + ("; fork/ is in sync" if fork.exists() else ""))
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


def cmd_pristine(args):
    dest = Path(args.dest)
    if dest.exists():
        if (dest / "version.txt").read_text().strip() == pin()["version"]:
            print(f"{dest}: pristine {pin()['version']} already present")
            return
        shutil.rmtree(dest)
    unpack(dest)
    print(f"{dest}: pristine {pin()['version']}")


# ---- branches: one branch per patch, on the patches it depends on, in an upstream checkout, ready to push as PRs ----

TESTS_MANIFEST = "tests.toml"
MANIFEST_KEYS = ("tests", "updates", "at", "title")
UPSTREAM_TESTS = "upstream-tests"
UPSTREAM_DOCS = "upstream-docs"
# patches/<folder>/NNNN.diff: a patch's update of upstream's own files, applied on its branch after the patch.
UPSTREAM_DIFFS = ((UPSTREAM_TESTS, "upstream's tests"), (UPSTREAM_DOCS, "upstream's docs"))
BRANCH_PREFIX = "ds-fork/"
# Upstream's own harness: the exported tests import these and run under upstream's copies, never ours.
UPSTREAM_HARNESS = ("tests/unit/common.py", "tests/unit/util.py", "tests/unit/__init__.py")
UNIT_IMPORT = re.compile(r"^\s*(?:from\s+(unit(?:\.\w+)*)\s+import\s+(\([^)]*\)|[^\n#]*)|import\s+(unit(?:\.\w+)+))",
                         re.M)
# PR text: lines that only make sense in this repository (the cells tool and the run that filled its tables).
# PR text: paragraphs that prove a test fails on an earlier version of the same patch, a history upstream never saw.
EARLIER_VERSION = re.compile(r"(?m)^On the previous version of this patch\b.*(?:\n  .*)*\n?")
FORK_ONLY_LINES = (re.compile(r"^Generated: tools/cells\.py\b.*$"),
                   re.compile(r"^From the test run finished .* against `fork/`\.$"),
                   re.compile(r".*\btools/cells\.py\b.*"))


def patch_number(patch):
    return Path(patch).name[:4]


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


def stacked_on(number, closures):
    """The dependency whose branch this patch's branch sits on when its dependencies form one chain (the last of
    them, whose own closure is the rest); None when it has none, or needs patches that are not one chain."""
    needed = closures[number]
    if needed and set(closures[needed[-1]]) | {needed[-1]} == set(needed):
        return needed[-1]
    return None


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


def branch_name(patch, prefix):
    return prefix + Path(patch).name[:-len(".patch")]


def listing(items):
    items = list(items)
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def depends_legend(message, number, series, prefix, titles, closures):
    """For upstream readers: what this branch builds on (upstream alone, the branch of the patch it is stacked on,
    or the commits of the patches it depends on), and the patches it depends on or the text names by number, with
    their titles (a tests.toml title where there is one) and branches."""
    numbers = [patch_number(p) for p in series]
    subjects = {
        patch_number(p): (titles.get(patch_number(p)) or series_message(p).splitlines()[0], branch_name(p, prefix))
        for p in series
    }
    needed, on, branch = closures[number], stacked_on(number, closures), subjects[number][1]
    named = sorted((set(re.findall(r"\b(\d{4})\b", message)) & set(numbers) | set(needed)) - {number})
    lines = [f"- {n}: {subjects[n][0]} (branch `{subjects[n][1]}`)" for n in named]
    if not needed:
        text = (f"This pull request depends on no other: its branch `{branch}` is this one commit on upstream, to "
                f"review and merge on its own.")
    else:
        if on:
            below = [n for n in needed if n != on]
            text = (
                f"This pull request is one of a stack: its branch `{branch}` builds on `{subjects[on][1]}` "
                f"(patch {on}, in its own pull request)" +
                (f", which carries the patches it depends on, {listing(needed)}, one commit each" if below else "") +
                ".")
        else:
            text = (f"This pull request depends on patches {listing(needed)}, each in its own pull request: its "
                    f"branch `{branch}` carries their commits on upstream, one per patch in that order, then its own.")
        text += (f" Until {'that one is' if len(needed) == 1 else 'they are'} merged this one also shows "
                 f"{'its commit' if len(needed) == 1 else 'their commits'}: review only its top commit, named as its "
                 f"title.")
    return text + ("\nPatches named here by number:\n" + "\n".join(lines) if lines else "")


def pr_description(message, number, series, prefix, titles, closures):
    """The patch message as the pull request's description: fork-only lines dropped, right after its `Depends on`
    paragraph a legend of what its branch builds on and the patch numbers it names, and the title from
    patches/tests.toml if it has one."""
    message = EARLIER_VERSION.sub("", message)
    lines = [line for line in message.splitlines() if not any(p.fullmatch(line) for p in FORK_ONLY_LINES)]
    if titles.get(number):
        lines[0] = titles[number]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"
    legend = depends_legend(text, number, series, prefix, titles, closures)
    paragraphs = text.split("\n\n")
    at = next((i + 1 for i, p in enumerate(paragraphs) if p.startswith("Depends on")), 1)
    paragraphs.insert(at, legend)
    return "\n\n".join(paragraphs)


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


# ---- readme: the README's list of patches, one line per patch of the series, between markers ----

README_BEGIN = "<!-- patches:begin (tools/patches.py readme) -->"
README_END = "<!-- patches:end -->"
DEPENDS_ON_LABEL = "Depends on:"


def depends_on(message):
    """The patch numbers the message's `Depends on:` paragraph names, its parenthesized remarks left out, e.g.
    "0002, 0003"; else what it says ("none"), or "not stated" without such a paragraph."""
    paragraph = next((p for p in message.split("\n\n") if p.startswith(DEPENDS_ON_LABEL)), None)
    if paragraph is None:
        return "not stated"
    value = re.sub(r"\([^)]*\)", "", " ".join(paragraph[len(DEPENDS_ON_LABEL):].split()))
    numbers = sorted(set(re.findall(r"\b\d{4}\b", value)))
    return ", ".join(numbers) if numbers else " ".join(value.split()).rstrip(". ") or "none"


def manifest_titles(patches_dir):
    """{patch number: title} from patches/tests.toml's `title` keys (none where the file is missing)."""
    path = Path(patches_dir) / TESTS_MANIFEST
    manifest = load_toml(path) if path.exists() else {}
    return {number: table["title"] for number, table in manifest.items() if table.get("title")}


def readme_patch_list(patches_dir, readme):
    """One markdown line per patch of the series: its number linked to its file (relative to the README), its
    title (patches/tests.toml) or subject, and the patches it depends on."""
    titles = manifest_titles(patches_dir)
    base = Path(os.path.relpath(Path(patches_dir).resolve(), Path(readme).resolve().parent))
    lines = []
    for patch in read_series(patches_dir):
        message = series_message(patch)
        number = patch_number(patch)
        title = titles.get(number) or message.splitlines()[0]
        lines.append(f"- [{number}]({(base / patch.name).as_posix()}): {title} (depends on: {depends_on(message)})")
    return "\n".join(lines)


def with_patch_list(text, patch_list, readme):
    """text with the block between the README markers replaced by patch_list."""
    if README_BEGIN not in text or README_END not in text.split(README_BEGIN, 1)[1]:
        raise PatchError(f"{readme}: no '{README_BEGIN}' ... '{README_END}' block for the patch list")
    head, rest = text.split(README_BEGIN, 1)
    return f"{head}{README_BEGIN}\n{patch_list}\n{README_END}{rest.split(README_END, 1)[1]}"


def cmd_readme(args):
    readme = Path(args.readme)
    text = readme.read_text()
    new = with_patch_list(text, readme_patch_list(args.patches, readme), readme)
    if new == text:
        print(f"{readme}: the patch list matches {Path(args.patches) / SERIES}")
        return 0
    if args.check:
        print(
            f"error: {readme}: the patch list does not match {Path(args.patches) / SERIES}; "
            f"rewrite it with `tools/patches.py readme` (make readme; make export does too)",
            file=sys.stderr)
        return 1
    readme.write_text(new)
    print(f"{readme}: patch list rewritten from {Path(args.patches) / SERIES}")
    return 0


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
