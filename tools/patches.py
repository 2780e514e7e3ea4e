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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM_TAG = "upstream"
SERIES = "series"
BEHIND = "behind the series:"  # the one difference from patches/ that re-importing loses nothing to
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
    if fork.exists():
        if not args.force:
            refuse_unexported(fork, args.patches)
        shutil.rmtree(fork)
    unpack(fork)
    init_upstream_repo(fork)
    apply_series(fork, args.patches, three_way=args.three_way)
    print(f"{fork}: upstream + {len(read_series(args.patches))} patches")


def refuse_unexported(fork, patches_dir):
    """Raise unless re-importing fork/ loses nothing (it is in sync, or only lacks the series' newest patches)."""
    problems = [p for p in unexported(fork, patches_dir) if not p.startswith(BEHIND)]
    if problems:
        raise PatchError(f"{fork} holds unexported work; export it (make export) or discard it "
                         f"(tools/patches.py import --force):\n" + "\n".join(problems))


def materialize(fork, patches_dir):
    """fork/ as the series describes it, for the build backend: kept when in sync, imported when missing or
    behind the series, refused (PatchError) when it holds unexported work."""
    fork = Path(fork)
    if fork.exists() and not (fork / ".git").is_dir():
        raise PatchError(f"{fork} exists but is not the git tree tools/patches.py imports; move it away")
    if fork.exists() and not unexported(fork, patches_dir):
        return False
    cmd_import(argparse.Namespace(fork=str(fork), patches=str(patches_dir), force=False, three_way=False))
    return True


def subject_filename(index, subject):
    slug = "".join(c if c.isalnum() else "-" for c in subject.lower())
    slug = "-".join(part for part in slug.split("-") if part)[:60].rstrip("-")
    return f"{index:04d}-{slug}.patch"


def cmd_export(args):
    fork, patches_dir = Path(args.fork), Path(args.patches)
    if git(fork, "status", "--porcelain", "--untracked-files=no"):
        raise PatchError(f"{fork} has uncommitted edits: commit them (git commit --fixup for an existing patch) first")
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
    print(f"exported {len(written)} patches to {patches_dir}")


def patch_id(text):
    proc = subprocess.run(["git", "patch-id", "--stable"], input=text, text=True, capture_output=True, check=True)
    return proc.stdout.split()[0] if proc.stdout else None


def unexported(fork, patches_dir):
    """Describe each edit or commit in fork/ that patches/ does not hold; empty when in sync."""
    problems = []
    dirty = git(fork, "status", "--porcelain", "--untracked-files=normal")
    for line in dirty.splitlines():
        problems.append(f"uncommitted: {line[3:]} ({line[:2].strip()})")
    exported_ids = [patch_id(p.read_text()) for p in read_series(patches_dir)]
    commits = git(fork, "rev-list", "--reverse", "--no-merges", f"{UPSTREAM_TAG}..HEAD").split()
    fork_ids = []
    for commit in commits:
        fork_ids.append(patch_id(git(fork, "show", "--format=", "--full-index", commit) + "\n"))
        if fork_ids[-1] not in exported_ids:
            problems.append(f"unexported commit: {git(fork, 'log', '-1', '--format=%h %s', commit)}")
    if problems:
        return problems
    behind = len(fork_ids) < len(exported_ids) and fork_ids == exported_ids[:len(fork_ids)]
    messages = [git(fork, "log", "-1", "--format=%B", c) for c in commits]
    if fork_ids != exported_ids and not behind:
        problems.append("patches/series and the fork's commits differ in order or count: run export")
    elif messages != [series_message(p) for p in read_series(patches_dir)[:len(commits)]]:
        problems.append("a commit message differs from its exported patch: run export")
    elif behind:
        problems.append(f"{BEHIND} it lacks the last {len(exported_ids) - len(fork_ids)} patches of the series "
                        f"(patches/ changed, e.g. by a pull): re-import it (make sync)")
    return problems


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
    p_import.add_argument("--force", action="store_true", help="discard unexported work in the fork tree")
    sub.add_parser("export")
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
