# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""`export`: fork/'s commits after `upstream` written back to patches/ and patches/series."""

from pathlib import Path

from .common import IMPORTED_TAG, PatchError, SERIES, UPSTREAM_TAG, git, has_ref
from .fork import CURRENT, assess, older_series_message


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
                   "--keep-subject", "--stat", "--full-index", commit) + "\n"
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
