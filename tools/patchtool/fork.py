# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""`import` and the build backend's materialize: fork/ from the series, swapped in once complete; how fork/
stands to patches/ (its own work; the series, behind it, or an older revision)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import GIT_ENV, IMPORTED_TAG, PatchError, UPSTREAM_TAG, git, has_ref, read_series, series_message
from .sdist import fetch, init_upstream_repo, unpack

BEHIND = "behind the series:"  # check's line for a fork/ that only lacks the series' newest patches
IMPORT_REFS = ("refs/heads/main", f"refs/tags/{UPSTREAM_TAG}", f"refs/tags/{IMPORTED_TAG}")
CURRENT, BEHIND_SERIES, OLDER_SERIES = "current", "behind", "older"


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
