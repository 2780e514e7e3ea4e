# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP with a model from `from_pretrained`, which builds it under deepspeed.zero.Init under ZeRO-3 (a tiny
tied Llama saved locally, nothing downloaded). The parameters AutoTP leaves whole are partitioned over the
data-parallel group and recorded with their whole shapes, as without zero.Init, so such a checkpoint resumes at another
tensor-parallel size directly, in every load mode, whether zero.Init built the model at the save, at the load or both.
A checkpoint that kept zero.Init's partitioning over every rank (DeepSpeed 0.19.8's, recorded with shape (0,)) resumes
at its sizes with tensor_parallel.keep_zero_init_partitioning; every other load of it is refused on every rank before
anything changes, naming that way out."""

import pytest

from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import LAYOUTS, assert_resumed, saves
from unit.checkpoint.universal_zero3_helpers import from_pretrained, make_config
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected
from unit.common import DistributedTest

# where zero.Init builds the model, per layout: on both sides, and on the side that has AutoTP alone
ZERO_INIT_CELLS = [("tp2dp1_to_tp1dp2", "both"), ("tp2dp1_to_tp1dp2", "save"), ("tp1dp2_to_tp2dp1", "both"),
                   ("tp1dp2_to_tp2dp1", "load")]
KEEP_REFUSAL = "saved from a model built under zero.Init.*keep_zero_init_partitioning\": true"
BY_NAME_REFUSAL = "partitioned over every rank.*recorded with shape \\(0,\\).*Resume it at the sizes it was saved with"


def builder(tp_size, folder, zero_init, keep=False):
    """seed -> an engine of the tied Llama at TP tp_size: from_pretrained under zero.Init, or built without it."""
    if not zero_init:
        return lambda seed: tp_reshard.build("tied_llama", tp_size, "defaults", seed=seed)
    config = make_config(tp_size)
    if keep:
        config["tensor_parallel"]["keep_zero_init_partitioning"] = True
    return lambda seed: from_pretrained(tp_reshard.tied_llama, config, folder, seed)


class TestZero3TensorParallelZeroInitResume(DistributedTest):
    """Saved at TP2 x DP1 and resumed at TP1 x DP2, or the reverse, zero.Init at the save, the load or both: every
    mode is exact."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    @pytest.mark.parametrize("layout, zero_init", ZERO_INIT_CELLS)
    def test_every_mode_is_exact(self, tmp_path, layout, zero_init):
        saved_tp, loaded_tp = LAYOUTS[layout]
        save_dir = str(tmp_path)
        if saves("tied_llama",
                 save_dir,
                 saved_tp,
                 "defaults",
                 builder=builder(saved_tp, save_dir, zero_init in ("both", "save"))):
            return
        load = builder(loaded_tp, save_dir, zero_init in ("both", "load"))
        for mode, (kwargs, _, _) in MODES.items():
            engine = load(1)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


class TestZero3TensorParallelKeptZeroInitLayout(DistributedTest):
    """Saved at TP2 x DP1 keeping zero.Init's partitioning, loaded at TP2 x DP1: with keep_zero_init_partitioning
    every mode that restores the saved masters by position is exact, and load_module_only=True, which reads the
    shards by name, is refused; without the setting every mode is refused, naming it."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_resumes_at_its_sizes_with_the_setting(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("tied_llama", save_dir, 2, "defaults", builder=builder(2, save_dir, zero_init=True, keep=True)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            expect_rejected(builder(2, save_dir, zero_init=True)(1), save_dir, KEEP_REFUSAL, **kwargs)
            engine = builder(2, save_dir, zero_init=True, keep=True)(1)
            if mode == "module_only":
                expect_rejected(engine, save_dir, BY_NAME_REFUSAL, **kwargs)
                continue
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)
