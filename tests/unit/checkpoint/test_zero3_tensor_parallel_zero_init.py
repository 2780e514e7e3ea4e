# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP with models built under deepspeed.zero.Init, as `from_pretrained` builds them under ZeRO-3: a
rigid checkpoint resumed at another tensor-parallel size, with zero.Init at the save, at the load, or both. Every
mode exact (test_zero3_tensor_parallel_reshard.py's checks)."""

import os

import pytest

import deepspeed
import deepspeed.comm as dist
from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import LAYOUTS, assert_resumed, saves
from unit.checkpoint.universal_zero3_helpers import make_config
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected
from unit.common import DistributedTest


def build(tp_size, seed, zero_init):
    """The tied tiny Llama at TP tp_size, its parameters created under zero.Init (partitioned as they are made) or
    not."""
    if not zero_init:
        return tp_reshard.build("tied_llama", tp_size, "defaults", seed=seed)
    config = make_config(tp_size)
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported inside zero.Init, torch._dynamo fails)
    with deepspeed.zero.Init(config_dict_or_path=config):
        module = tp_reshard.tied_llama(seed)
    engine = tp_reshard.new_engine(module, config)
    # a parameter AutoTP leaves whole is partitioned over the data-parallel group, as without zero.Init
    assert dist.get_world_size(group=engine.module.model.norm.weight.ds_process_group) == engine.seq_dp_world_size
    return engine


# (zero.Init at the save, at the load)
ZERO_INIT = {"both": (True, True), "save": (True, False), "load": (False, True)}


class TestZero3TensorParallelResumeUnderZeroInit(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 2])
    @pytest.mark.parametrize("layout", list(LAYOUTS))
    @pytest.mark.parametrize("zero_init", list(ZERO_INIT))
    def test_every_mode_is_exact(self, tmp_path, layout, zero_init):
        (saved_tp, loaded_tp), (init_at_save, init_at_load) = LAYOUTS[layout], ZERO_INIT[zero_init]
        save_dir = str(tmp_path)
        if saves("tied_llama",
                 save_dir,
                 saved_tp,
                 "defaults",
                 builder=lambda seed: build(saved_tp, seed, init_at_save)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build(loaded_tp, 1, init_at_load)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


class TestZero3TensorParallelResumeUnderZeroInitAt4Ranks(DistributedTest):
    """TP2 x DP2 -> TP1 x DP4 with zero.Init on both sides: each whole parameter partitioned over two ranks at the
    save, four at the load."""
    world_size = 4

    @pytest.mark.world_size([4, 4])
    def test_every_mode_is_exact(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("tied_llama", save_dir, 2, "defaults", builder=lambda seed: build(2, seed, True)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build(1, 1, True)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


def old_layout(seed):
    """The tied Llama at TP2 as 0.19.8 builds it under zero.Init: the parameters AutoTP leaves whole partitioned over
    every rank, their maps recording (0,) (tensor_parallel.keep_zero_init_partitioning)."""
    config = make_config(2)
    config["tensor_parallel"]["keep_zero_init_partitioning"] = True
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported inside zero.Init, torch._dynamo fails)
    with deepspeed.zero.Init(config_dict_or_path=config):
        module = tp_reshard.tied_llama(seed)
    engine = tp_reshard.new_engine(module, config)
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
        if saves("tied_llama", save_dir, 2, "defaults", builder=old_layout):
            return
        match = "saved by DeepSpeed 0.19.8 from a model built under zero.Init.*keep_zero_init_partitioning=true"
        if not os.path.isfile(launches):
            dist.barrier()
            if dist.get_rank() == 0:
                open(launches, "w").close()
            expect_rejected(build(1, 1, zero_init=True), save_dir, match)
            return
        expect_rejected(build(2, 1, zero_init=True), save_dir, match)
        engine = old_layout(1)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_resumed(engine, save_dir, "full")
