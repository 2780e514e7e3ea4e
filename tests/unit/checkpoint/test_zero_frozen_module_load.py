# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Loads that take the module weights from the checkpoint's module (ZeRO-2) or from the shards (ZeRO-3, which
consolidates them when load_optimizer_states=False), with frozen parameters: frozen only since the save, or frozen
when saved and loaded at another data-parallel size."""

import pytest
import torch

import deepspeed.comm as dist

from unit.checkpoint.zero_resume_helpers import TAG, assert_same, make_config, make_engine, train, weights
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS


def save_and_load(save_dir, config, saved_frozen, loaded_frozen, **load_kwargs):
    engine = make_engine(config, frozen=saved_frozen)
    train(engine)
    saved_weights = weights(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    resumed = make_engine(config, seed=1, frozen=loaded_frozen)
    resumed.load_checkpoint(save_dir, tag=TAG, **load_kwargs)
    assert_same(weights(resumed), saved_weights, "weights")
    train(resumed, steps=1)


class TestZero3FrozenModuleLoad(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("settings", list(SETTINGS))
    @pytest.mark.parametrize("module_only", [False, True])
    def test_frozen_since_the_save(self, tmpdir, settings, module_only):
        """Saved with every layer trainable, loaded with layers.0 frozen: its weight comes from the module."""
        save_and_load(str(tmpdir),
                      make_config(3, "bf16", settings=settings), (), ("layers.0.", ),
                      load_optimizer_states=False,
                      load_module_only=module_only)

    @pytest.mark.parametrize("module_only", [False, True])
    def test_frozen_at_save_and_load(self, tmpdir, module_only):
        save_and_load(str(tmpdir),
                      make_config(3, "bf16"), ("layers.0.", ), ("layers.0.", ),
                      load_optimizer_states=False,
                      load_module_only=module_only)

    @pytest.mark.world_size([2, 1])
    @pytest.mark.parametrize("module_only", [False, True])
    def test_frozen_at_another_dp_size(self, tmpdir, module_only):
        """Saved by 2 ranks with layers.0 frozen (its saved pieces are halves), loaded by 1."""
        save_dir, config = str(tmpdir), make_config(3, "bf16")
        if dist.get_world_size() == 2:
            engine = make_engine(config, frozen=("layers.0.", ))
            train(engine)
            saved_weights = weights(engine)
            engine.save_checkpoint(save_dir, tag=TAG)
            if dist.get_rank() == 0:
                torch.save(saved_weights, f"{save_dir}/saved_weights.pt")
            dist.barrier()
            return
        resumed = make_engine(config, seed=1, frozen=("layers.0.", ))
        resumed.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_module_only=module_only)
        assert_same(weights(resumed), torch.load(f"{save_dir}/saved_weights.pt"), "weights")


class TestZero2FrozenModuleLoad(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("module_only", [False, True])
    def test_frozen_since_the_save(self, tmpdir, module_only):
        """Saved with every layer trainable, loaded with layers.0 frozen: its weight comes from the module."""
        save_and_load(str(tmpdir),
                      make_config(2, "bf16"), (), ("layers.0.", ),
                      load_optimizer_states=False,
                      load_module_only=module_only)
