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
from deepspeed.checkpoint.affine import replicated_map
from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO
from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import LAYOUTS, assert_resumed, rewritten_copy, saves
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
    return tp_reshard.new_engine(module, config)


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


def old_layout(seed):
    """The tied Llama at TP2 partitioned as 0.19.8's zero.Init partitions it under AutoTP: the parameters AutoTP
    leaves whole over every rank (data_parallel_group=world)."""
    config = make_config(2)
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported inside zero.Init, torch._dynamo fails)
    with deepspeed.zero.Init(config_dict_or_path=config, data_parallel_group=dist.get_world_group()):
        module = tp_reshard.tied_llama(seed)
    return tp_reshard.new_engine(module, config)


def _record_whole_parameters_as_empty(state):
    """What 0.19.8 recorded for the parameters AutoTP leaves whole under zero.Init: their (0,) shape."""
    maps = state[UNIVERSAL_CHECKPOINT_INFO][AFFINE_MAP][AFFINE_MAP_PARAMS]
    for pattern in [pattern for pattern in maps if "norm" in pattern]:
        maps[pattern] = replicated_map((0, ), 2).to_dict()


class TestZero3TensorParallelCheckpointOfTheOldLayout(DistributedTest):
    """A checkpoint of 0.19.8's layout (saved with the old partitioning, its maps rewritten as 0.19.8 wrote them) loaded
    by a run of the new one, at the saved TP size (where the maps differ) or at another, is refused on every rank,
    naming the way out; built that way, the run loads it exactly, by position, as 0.19.8 did."""
    world_size = 2

    @pytest.mark.world_size([2, 2, 2])
    def test_refused_then_resumed_the_way_it_names(self, tmp_path):
        """Three launches: the save, the load at TP1 (refused), the load at TP2 (refused, then the way out)."""
        save_dir, old = str(tmp_path), os.path.join(str(tmp_path), "as_0.19.8_wrote_it")
        if saves("tied_llama", save_dir, 2, "defaults", builder=old_layout):
            return
        match = "built under zero.Init.*shape \\(0,\\).*data_parallel_group=deepspeed.comm.get_world_group"
        if not os.path.isdir(old):
            rewritten_copy(save_dir, os.path.basename(old), change=_record_whole_parameters_as_empty)
            expect_rejected(build(1, 1, zero_init=True), old, match)
            return
        expect_rejected(build(2, 1, zero_init=True), old, match)
        engine = old_layout(1)
        engine.load_checkpoint(old, tag=TAG)
        assert_resumed(engine, save_dir, "full")
