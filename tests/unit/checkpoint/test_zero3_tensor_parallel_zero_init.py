# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP with models from `from_pretrained`, which builds them under deepspeed.zero.Init under ZeRO-3 (a
tiny Llama saved locally, nothing downloaded): a rigid checkpoint resumed at another tensor-parallel size, with
zero.Init at the save, at the load, or both. Every mode exact (test_zero3_tensor_parallel_reshard.py's checks)."""

import os

import pytest

import deepspeed.comm as dist
from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import LAYOUTS, assert_resumed, saves
from unit.checkpoint.universal_zero3_helpers import make_config
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected
from unit.common import DistributedTest


def pretrained(folder, seed):
    """The tied tiny Llama of this seed saved where from_pretrained reads it (rank 0 writes, every rank waits)."""
    path = os.path.join(folder, f"tiny-tied-llama-{seed}")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        tp_reshard.tied_llama(seed).save_pretrained(path)
    dist.barrier()
    return path


def from_pretrained(config, folder, seed):
    """An engine of the tied Llama as Hugging Face builds it under ZeRO-3: from_pretrained, with the DeepSpeed config
    registered as Trainer registers it, builds the model under deepspeed.zero.Init."""
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    # Registered without its tensor_parallel section: transformers (5.25) refuses every weight renaming a model's
    # from_pretrained applies (Llama has some) when the registered config asks for DeepSpeed TP ("Weight
    # conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), which is not DeepSpeed's doing.
    # zero.Init reads nothing from that section; deepspeed.initialize gets the whole config.
    registered = HfDeepSpeedConfig({
        key: value
        for key, value in config.items() if key != "tensor_parallel"
    })  # noqa: F841
    module = LlamaForCausalLM.from_pretrained(pretrained(folder, seed))
    assert all(hasattr(param, "ds_id") for param in module.parameters()), "not built under zero.Init"
    return tp_reshard.new_engine(module, config)


def build(tp_size, seed, zero_init, folder):
    """The tied tiny Llama at TP tp_size, from from_pretrained under zero.Init, or built without it."""
    if not zero_init:
        return tp_reshard.build("tied_llama", tp_size, "defaults", seed=seed)
    engine = from_pretrained(make_config(tp_size), folder, seed)
    # a parameter AutoTP leaves whole is partitioned over the data-parallel group, as without zero.Init
    assert dist.get_world_size(group=engine.module.model.norm.weight.ds_process_group) == engine.seq_dp_world_size
    return engine


# (layout, zero.Init at the save, at the load): zero.Init where a TP2 side has AutoTP to split what it built
CELLS = {
    "both_tp2_to_tp1": ("tp2dp1_to_tp1dp2", True, True),
    "both_tp1_to_tp2": ("tp1dp2_to_tp2dp1", True, True),
    "save_tp2_to_tp1": ("tp2dp1_to_tp1dp2", True, False),
    "load_tp1_to_tp2": ("tp1dp2_to_tp2dp1", False, True),
}


class TestZero3TensorParallelResumeUnderZeroInit(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 2])
    @pytest.mark.parametrize("cell", list(CELLS))
    def test_every_mode_is_exact(self, tmp_path, cell):
        layout, init_at_save, init_at_load = CELLS[cell]
        (saved_tp, loaded_tp), save_dir = LAYOUTS[layout], str(tmp_path)
        if saves("tied_llama",
                 save_dir,
                 saved_tp,
                 "defaults",
                 builder=lambda seed: build(saved_tp, seed, init_at_save, save_dir)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build(loaded_tp, 1, init_at_load, save_dir)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


class TestZero3TensorParallelResumeUnderZeroInitAt4Ranks(DistributedTest):
    """TP2 x DP2 -> TP1 x DP4 with zero.Init on both sides: each whole parameter partitioned over two ranks at the
    save, four at the load."""
    world_size = 4

    @pytest.mark.world_size([4, 4])
    def test_every_mode_is_exact(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("tied_llama", save_dir, 2, "defaults", builder=lambda seed: build(2, seed, True, save_dir)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build(1, 1, True, save_dir)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


def old_layout(seed, folder):
    """The tied Llama at TP2 from from_pretrained, partitioned as 0.19.8 leaves it under zero.Init: the parameters
    AutoTP leaves whole over every rank, their maps recording (0,) (tensor_parallel.keep_zero_init_partitioning)."""
    config = make_config(2)
    config["tensor_parallel"]["keep_zero_init_partitioning"] = True
    engine = from_pretrained(config, folder, seed)
    norm = engine.module.model.norm.weight
    assert dist.get_world_size(group=norm.ds_process_group) == dist.get_world_size()
    return engine


class TestZero3TensorParallelCheckpointOfTheOldLayout(DistributedTest):
    """A checkpoint of 0.19.8's layout loaded by a run of the new one, at the saved TP size (where the maps differ) or
    at another, is refused on every rank, naming the setting that loads it; with it, the run loads it exactly, by
    position, as 0.19.8 did."""
    world_size = 2

    @pytest.mark.world_size([2, 2, 2])
    def test_refused_then_resumed_the_way_it_names(self, tmp_path, class_tmpdir):
        """Three launches: the save, the load at TP1 (refused), the load at TP2 (refused, then the way out)."""
        save_dir, launches = str(tmp_path), os.path.join(str(class_tmpdir), "launches")
        if saves("tied_llama", save_dir, 2, "defaults", builder=lambda seed: old_layout(seed, save_dir)):
            return
        match = "saved by DeepSpeed 0.19.8 from a model built under zero.Init.*keep_zero_init_partitioning=true"
        if not os.path.isfile(launches):
            dist.barrier()
            if dist.get_rank() == 0:
                open(launches, "w").close()
            expect_rejected(build(1, 1, True, save_dir), save_dir, match)
            return
        expect_rejected(build(2, 1, True, save_dir), save_dir, match)
        engine = old_layout(1, save_dir)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_resumed(engine, save_dir, "full")
