# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""What the tooling tests share: a scratch copy of patches/ cut to the first patches of the series, which proves
what the tooling does to a series as well as all of it does, in a fraction of the time (each patch's files are
style-checked and its `Depends on` applied by every `check`)."""

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT_SERIES = 3


def short_series(dest, count=SHORT_SERIES):
    """patches/ copied to dest with only the first `count` patches of its series, and their diffs of upstream's
    tests and docs (another patch's diff would be a stray one to `check`); returns dest."""
    names = [n for n in (ROOT / "patches" / "series").read_text().split() if not n.startswith("#")][:count]
    kept = {name[:4] for name in names}

    def left_out(folder, entries):
        return [e for e in entries if re.fullmatch(r"\d{4}\.diff|\d{4}-.*\.patch", e) and e[:4] not in kept]

    shutil.copytree(ROOT / "patches", dest, ignore=left_out)
    (Path(dest) / "series").write_text("".join(f"{name}\n" for name in names))
    return Path(dest)


@pytest.fixture(scope="session")
def series_copy():
    """short_series(dest, count=SHORT_SERIES), for a test or fixture to call."""
    return short_series
