# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""What every command shares: PatchError, the pin in upstream.toml, TOML, git, the series and its messages."""

import os
import re
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM_TAG = "upstream"
SERIES = "series"
TESTS_MANIFEST = "tests.toml"
UPSTREAM_TESTS = "upstream-tests"
UPSTREAM_DOCS = "upstream-docs"
# patches/<folder>/NNNN.diff: a patch's update of upstream's own files, applied on its branch after the patch.
UPSTREAM_DIFFS = ((UPSTREAM_TESTS, "upstream's tests"), (UPSTREAM_DOCS, "upstream's docs"))
IMPORTED_TAG = "imported"  # the tip import (or export) left: commits not under it are fork/'s own work
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


def patch_number(patch):
    return Path(patch).name[:4]


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
