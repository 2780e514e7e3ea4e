# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""examples/hf_trainer.py refuses a missing config or checkpoint folder with a message that says what to pass, before
any process group or model exists (its training and resume run in tests/unit/checkpoint/test_hf_trainer_resume.py's
way, under the deepspeed launcher)."""

import pytest

from examples.example_modules import ROOT, load_example, refused

CONFIG = str(ROOT / "examples" / "configs" / "hf_trainer_zero3.json")


@pytest.fixture(scope="module")
def example():
    return load_example("hf_trainer.py")


def test_a_missing_config_is_named(example, capsys, tmp_path):
    assert "--deepspeed nope.json: no such file" in refused(example, capsys, "--deepspeed", "nope.json",
                                                            "--output-dir", str(tmp_path))


def test_a_missing_checkpoint_says_what_to_pass(example, capsys, tmp_path):
    err = refused(example, capsys, "--deepspeed", CONFIG, "--output-dir", str(tmp_path), "--resume",
                  str(tmp_path / "checkpoint-3"))
    assert "no such checkpoint folder" in err and "checkpoint-N" in err


def test_the_launcher_flags_parse(example, tmp_path):
    args = example.parse_args(["--deepspeed", CONFIG, "--output-dir", str(tmp_path), "--local_rank=0", "--lora"])
    assert args.lora and args.local_rank == 0 and args.resume is None
