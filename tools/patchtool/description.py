# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Each patch's pull request description, as `branches` writes it and `check` counts its words: the patch message,
fork-only lines dropped, with a legend of what its branch builds on."""

import re
from pathlib import Path

from .common import patch_number

BRANCH_PREFIX = "ds-fork/"
# PR text: lines that only make sense in this repository (the cells tool and the run that filled its tables).
# PR text: paragraphs that prove a test fails on an earlier version of the same patch, a history upstream never saw.
EARLIER_VERSION = re.compile(r"(?m)^On the previous version of this patch\b.*(?:\n  .*)*\n?")
FORK_ONLY_LINES = (re.compile(r"^Generated: tools/cells\.py\b.*$"),
                   re.compile(r"^From the test run finished .* against `fork/`\.$"),
                   re.compile(r".*\btools/cells\.py\b.*"))


def stacked_on(number, closures):
    """The dependency whose branch this patch's branch sits on when its dependencies form one chain (the last of
    them, whose own closure is the rest); None when it has none, or needs patches that are not one chain."""
    needed = closures[number]
    if needed and set(closures[needed[-1]]) | {needed[-1]} == set(needed):
        return needed[-1]
    return None


def branch_name(patch, prefix):
    return prefix + Path(patch).name[:-len(".patch")]


def listing(items):
    items = list(items)
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def depends_legend(message, number, series, prefix, closures):
    """For upstream readers, in few words: what this branch builds on (upstream alone, the branch of the patch it is
    stacked on, or the commits of the patches it depends on), and the branch of each patch the text names."""
    numbers = [patch_number(p) for p in series]
    branches = {patch_number(p): branch_name(p, prefix) for p in series}
    needed, on, branch = closures[number], stacked_on(number, closures), branches[number]
    # Only the patches its text names: the rest of the stack is listed by number.
    named = sorted(set(re.findall(r"\b(\d{4})\b", message)) & set(numbers) - {number})
    lines = [f"- {n}: `{branches[n]}`" for n in named]
    if not needed:
        text = f"Depends on no other pull request: its branch `{branch}` is one commit on upstream."
    elif on:
        below = [n for n in needed if n != on]
        text = (f"Stacked on `{branches[on]}` (patch {on}, its own pull request)" +
                (f", which carries {listing(needed)}, one commit each" if below else "") +
                "; until merged they show here too: review only the top commit.")
    else:
        text = (f"Carries the commits of patches {listing(needed)}, each its own pull request, then its own; until "
                "merged they show here too: review only the top commit.")
    return text + ("\nPatches named here:\n" + "\n".join(lines) if lines else "")


def pr_description(message, number, series, prefix, titles, closures):
    """The patch message as the pull request's description: fork-only lines dropped, right after its `Depends on`
    paragraph a legend of what its branch builds on and the patch numbers it names, and the title from
    patches/tests.toml if it has one."""
    message = EARLIER_VERSION.sub("", message)
    lines = [line for line in message.splitlines() if not any(p.fullmatch(line) for p in FORK_ONLY_LINES)]
    if titles.get(number):
        lines[0] = titles[number]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"
    legend = depends_legend(text, number, series, prefix, closures)
    paragraphs = text.split("\n\n")
    at = next((i + 1 for i, p in enumerate(paragraphs) if p.startswith("Depends on")), 1)
    paragraphs.insert(at, legend)
    return "\n\n".join(paragraphs)
