# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""`readme`: the README's list of patches, one line per patch of the series, between markers."""

import os
import re
import sys
from pathlib import Path

from .common import PatchError, SERIES, TESTS_MANIFEST, load_toml, patch_number, read_series, series_message

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
