# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The examples' scripts as modules, and their argument refusals, for the tests of their flags."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_example(file_name):
    """examples/<file_name> imported as a module (nothing runs: each script's work is under __main__)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(file_name).stem}", ROOT / "examples" / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(example, capsys, *argv):
    """The message of the usage error (exit 2) example.parse_args gives for argv."""
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err
