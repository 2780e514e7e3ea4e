# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The README is the landing page, docs/ the reference: the README's list of patches is the one
`tools/patches.py readme` generates from patches/series (a stale list fails here), it follows a renumbered series,
and every relative link of the README and docs/ leads to a file, and heading, that exists."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "patches.py"
README = ROOT / "README.md"
MARKDOWN = [README, ROOT / "patches" / "upstream-tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANDING_PAGE_BYTES = 12 * 1024

PATCH = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: dev <dev@localhost>
Date: Sat, 1 Jan 2000 00:00:00 +0000
Subject: {subject}

{body}
---
 x.py | 1 +
 1 file changed, 1 insertion(+)

diff --git a/x.py b/x.py
"""


def run_tool(*args):
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def load_tool():
    spec = importlib.util.spec_from_file_location("tools_patches", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_patch_list_is_current():
    result = run_tool("readme", "--check")
    assert result.returncode == 0, result.stderr + "\nrun `make readme` (tools/patches.py readme) and commit README.md"


def test_the_readme_is_a_landing_page():
    size = README.stat().st_size
    assert size < LANDING_PAGE_BYTES, f"README.md has {size} bytes: move reference material to docs/"


def write_series(patches, entries, titles=None):
    """entries: [(file name, subject, body)]; titles: {number: tests.toml title}."""
    patches.mkdir(exist_ok=True)
    for old in patches.glob("*.patch"):
        old.unlink()
    for name, subject, body in entries:
        (patches / name).write_text(PATCH.format(subject=subject, body=body))
    (patches / "series").write_text("".join(f"{name}\n" for name, _, _ in entries))
    tables = [f'[{number}]\ntests = []\ntitle = "{title}"\n' for number, title in (titles or {}).items()]
    (patches / "tests.toml").write_text("".join(tables))


def readme_list(readme, patches):
    result = run_tool("--patches", str(patches), "readme", "--readme", str(readme))
    assert result.returncode == 0, result.stderr
    text = readme.read_text()
    assert text.startswith("# Title\n\nBefore.\n") and text.endswith("\nAfter.\n")
    return [line for line in text.splitlines() if line.startswith("- [")]


def test_the_list_follows_a_renumbered_series(tmp_path):
    tool = load_tool()
    patches, readme = tmp_path / "patches", tmp_path / "README.md"
    readme.write_text(f"# Title\n\nBefore.\n\n{tool.README_BEGIN}\n- stale\n{tool.README_END}\n\nAfter.\n")
    first = ("0001-zero-3-first.patch", "ZeRO-3: first", "Depends on: none.\n\nSummary")
    second = ("0002-zero-3-second.patch", "ZeRO-3: second",
              "Depends on: 0001 (its\nhelper 0009), and\n0003.\n\nSummary")
    write_series(patches, [first, second], titles={"0002": "ZeRO-3: the second, whole scope"})
    stale = run_tool("--patches", str(patches), "readme", "--readme", str(readme), "--check")
    assert stale.returncode == 1 and "tools/patches.py readme" in stale.stderr
    assert readme_list(readme, patches) == [
        "- [0001](patches/0001-zero-3-first.patch): ZeRO-3: first (depends on: none)",
        "- [0002](patches/0002-zero-3-second.patch): ZeRO-3: the second, whole scope (depends on: 0001, 0003)",
    ]
    assert run_tool("--patches", str(patches), "readme", "--readme", str(readme), "--check").returncode == 0

    write_series(patches, [("0001-zero-3-second.patch", "ZeRO-3: second", "Summary without dependencies")])
    assert run_tool("--patches", str(patches), "readme", "--readme", str(readme), "--check").returncode == 1
    renumbered = "- [0001](patches/0001-zero-3-second.patch): ZeRO-3: second (depends on: not stated)"
    assert readme_list(readme, patches) == [renumbered]


@pytest.mark.parametrize("message, expected", [
    ("S\n\nDepends on: none.\n\nSummary", "none"),
    ("S\n\nDepends on: none (applies to 0.19.8 alone; stacked after 0001).", "none"),
    ("S\n\nDepends on: 0003 (load_fp32_weights) and 0005 (load_universal_state in\nthe loader).", "0003, 0005"),
    ("S\n\nDepends on: 0003 (a), 0002 (b), 0001\n(c) and 0007 (d).\n\nNot 0010.", "0001, 0002, 0003, 0007"),
    ("S\n\nSummary 0002", "not stated"),
])
def test_depends_on_names_the_patch_numbers(message, expected):
    assert load_tool().depends_on(message) == expected


def test_a_readme_without_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Title\n")
    result = run_tool("readme", "--readme", str(readme))
    assert result.returncode == 1 and "patches:begin" in result.stderr
    assert readme.read_text() == "# Title\n"


def without_fences(text):
    return re.sub(r"(?ms)^```.*?^```", "", text)


def without_code(text):
    return re.sub(r"`[^`\n]*`", "", without_fences(text))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path):
    return {slug(line.lstrip("#")) for line in without_fences(path.read_text()).splitlines() if line.startswith("#")}


def broken_links(path):
    """The relative links of a markdown file whose target file, or heading, does not exist."""
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(path.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# A heading: `with` code\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-heading-with-code) [gone](missing.md) [bad](other.md#nowhere) "
                    "[web](https://example.com/x) `[code](missing.md)`\n\n## Here\n[self](#here) [no](#there)\n")
    assert broken_links(page) == ["missing.md", "other.md#nowhere", "#there"]
