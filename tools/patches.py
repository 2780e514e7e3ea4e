#!/usr/bin/env python3
"""Patch-series tooling for the DeepSpeed fork.

The fork is pristine upstream DeepSpeed (the sdist pinned in upstream.toml) plus the patches listed,
in order, in patches/series. Upstream files are never committed: they are materialized here.

  fetch     download the pinned sdist into .cache/ and verify its sha256
  import    unpack upstream into fork/ (a git repo whose base commit is tagged `upstream`) and
            apply every patch of the series as its own commit
  export    write the commits after `upstream` back to patches/ (format-patch) and patches/series
  check     the series applies cleanly to pristine upstream, and fork/ holds nothing unexported
  pristine  unpack upstream, unpatched, into pristine/ (for A/B runs: PYTHONPATH=pristine)

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


def parse_simple_toml(text, path="upstream.toml"):
    """Tables of `key = "string"` lines and comments; anything else is refused rather than misread."""
    data = {}
    table = data
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        header, item = TOML_TABLE.fullmatch(line), TOML_STRING.fullmatch(line)
        if header:
            table = data.setdefault(header.group(1), {})
        elif item:
            table[item.group(1)] = item.group(2)
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
    fork = Path(args.fork)
    if fork.exists():
        problems += unexported(fork, args.patches)
    if problems:
        print("patch check FAILED:\n" + "\n".join(f"  {p}" for p in problems), file=sys.stderr)
        return 1
    print(f"patch check ok: {len(read_series(args.patches))} patches apply to pristine {pin()['version']}" +
          ("; fork/ is in sync" if fork.exists() else ""))
    return 0


def cmd_pristine(args):
    dest = Path(args.dest)
    if dest.exists():
        if (dest / "version.txt").read_text().strip() == pin()["version"]:
            print(f"{dest}: pristine {pin()['version']} already present")
            return
        shutil.rmtree(dest)
    unpack(dest)
    print(f"{dest}: pristine {pin()['version']}")


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
    p_pristine = sub.add_parser("pristine")
    p_pristine.add_argument("--dest", default=str(ROOT / "pristine"))
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
        elif args.command == "pristine":
            cmd_pristine(args)
    except PatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
