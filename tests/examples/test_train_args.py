# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""examples/train.py refuses bad flags and missing checkpoints with a message that says what to do,
before any process group or model exists."""

import pytest

from examples.example_modules import ROOT, load_example, refused

CONFIG = str(ROOT / "examples" / "configs" / "zero3_bf16.json")


@pytest.fixture(scope="module")
def train():
    return load_example("train.py")


@pytest.fixture
def rigid_checkpoint(tmp_path):
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "latest").write_text("global_step3")
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    ([], "--deepspeed_config is required"),
    (["--deepspeed_config", "nope.json"], "nope.json: no such file"),
    (["--deepspeed_config", CONFIG, "--steps", "0"], "--steps must be at least 1"),
    (["--deepspeed_config", CONFIG, "--tp", "3"], "--tp 3 must divide --heads 4"),
    (["--deepspeed_config", CONFIG, "--save-at", "2"], "--save-at needs --save-dir"),
    (["--deepspeed_config", CONFIG, "--save-dir", "x", "--save-at", "9"], "each step must be in 1..--steps"),
    (["--deepspeed_config", CONFIG, "--universal"], "need --resume DIR"),
    (["--deepspeed_config", CONFIG, "--resume-mode", "module-only"], "need --resume DIR"),
    (["--deepspeed_config", CONFIG, "--resume", "/no/such/dir"], "--resume /no/such/dir: no such directory"),
    (["--deepspeed_config", CONFIG, "--resume-mode", "fresh"], "invalid choice: 'fresh'"),
])
def test_bad_flags(train, capsys, argv, message):
    assert message in refused(train, capsys, *argv)


def test_missing_and_mismatched_checkpoints(train, capsys, rigid_checkpoint):
    base = ["--deepspeed_config", CONFIG, "--resume", str(rigid_checkpoint)]
    assert "no checkpoint tagged 'global_step9' (found: ['global_step3'])" in refused(
        train, capsys, *base, "--tag", "global_step9")
    assert "no latest_universal file; pass --tag (found: ['global_step3'])" in refused(
        train, capsys, *base, "--universal")
    (rigid_checkpoint / "global_step3" / "zero").mkdir()  # what ds_to_universal writes
    assert "is a universal checkpoint: add --universal" in refused(train, capsys, *base)


def test_good_resume_flags_resolve_the_tag(train, rigid_checkpoint):
    args = train.parse_args(
        ["--deepspeed_config", CONFIG, "--resume",
         str(rigid_checkpoint), "--resume-mode", "fresh-optimizer"])
    assert args.tag == "global_step3"
    assert train.RESUME_MODES[args.resume_mode] == dict(load_optimizer_states=False)
