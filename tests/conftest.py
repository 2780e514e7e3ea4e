# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Test setup shared by every test: the import path and accelerator default, and the hook that
runs DistributedTest methods in their ranks (tests/unit/common.py)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from unit.cells import CellRecorder  # noqa: E402
from unit.env import deepspeed_tree, set_default_environment  # noqa: E402

set_default_environment()


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(n): run this DistributedTest method in n ranks")
    config.addinivalue_line("markers", "exec_timeout(seconds): fail (and kill every rank) after this long")
    config.addinivalue_line("markers", "cell(**axes): the compatibility-matrix cell a test validates (unit/cells.py)")
    config.pluginmanager.register(CellRecorder(deepspeed_tree()), "cells")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    if getattr(item.cls, "is_dist_test", False):
        item.cls()(item._request)
        item.runtest = lambda: None  # the ranks ran the body; don't run it again here


def pytest_report_header(config):
    import deepspeed
    return f"deepspeed {deepspeed.__version__} from {Path(deepspeed.__file__).parent}"
