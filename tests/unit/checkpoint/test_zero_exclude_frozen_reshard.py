# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A checkpoint saved with exclude_frozen_parameters=True resumed at another data-parallel size, as Hugging Face's
Trainer saves and loads a PEFT/LoRA model (save_checkpoint(exclude_frozen_parameters=True), then
load_checkpoint(load_module_strict=False)): every saved trainable parameter's fp32 master, both Adam moments and the
steps come back bit for bit, and the frozen parameters the checkpoint left out keep the running model's values, as
at the saved size. A parameter trainable now that the checkpoint left out (frozen when it was saved) has no master
and no moments to restore: that full resume is refused on every rank, saying to resume with it frozen (ZeRO-3 also
names exclude_frozen_parameters).

A test runs two launches (upstream's world_size lists): the first saves, the second loads."""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint import test_zero12_reshard as zero12
from unit.checkpoint import zero3_reshard_helpers as zero3
from unit.checkpoint.zero_resume_helpers import TAG, assert_same, expect_rejected, masters, moments, weights
from unit.common import DistributedTest

FROZEN = ("layers.2.", )  # the base weights a LoRA run leaves frozen and a PEFT checkpoint leaves out
STAGES = [3, 2]
TRAINER_LOAD = dict(load_module_strict=False)  # what Trainer passes for a PEFT model


def build(stage, world_size, seed, frozen=FROZEN):
    if stage == 3:
        return zero3.build("bf16", world_size, seed=seed, frozen=frozen)
    return zero12.build(2, "bf16", seed=seed, frozen=frozen)


def train(stage, engine, steps):
    for _ in range(steps):
        zero3.train_step(engine, "bf16") if stage == 3 else zero12.train_step(engine)


def steps_of(engine):
    """The step count of every optimizer state entry, in order (one per sub-group or param group)."""
    base = engine.optimizer.optimizer
    return [float(state["step"]) for state in base.state.values() if "step" in state]


def saves_without_frozen(save_dir, stage, saved_world):
    """In the first launch: train, save with exclude_frozen_parameters=True, keep the trainable state saved."""
    if dist.get_world_size() != saved_world:
        return False
    engine = build(stage, saved_world, seed=0)
    train(stage, engine, zero3.SAVED_STEPS)
    trainable = {name for name, param in engine.module.named_parameters() if param.requires_grad}
    saved = dict(masters=masters(engine),
                 moments=moments(engine),
                 steps=steps_of(engine),
                 weights={
                     name: weight
                     for name, weight in weights(engine).items() if name in trainable
                 })
    engine.save_checkpoint(save_dir, tag=TAG, exclude_frozen_parameters=True)
    if dist.get_rank() == 0:
        torch.save(saved, os.path.join(save_dir, "saved.pt"))
    dist.barrier()
    return True


@pytest.mark.parametrize("stage", STAGES)
class TestExcludedFrozenAtAnotherSize(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 1])
    def test_2_to_1(self, tmp_path, stage):
        self.resumes(str(tmp_path), stage, saved_world=2)

    @pytest.mark.world_size([1, 2])
    def test_1_to_2(self, tmp_path, stage):
        self.resumes(str(tmp_path), stage, saved_world=1)

    @staticmethod
    def resumes(save_dir, stage, saved_world):
        if saves_without_frozen(save_dir, stage, saved_world):
            return
        saved = torch.load(os.path.join(save_dir, "saved.pt"), weights_only=False)
        engine = build(stage, dist.get_world_size(), seed=1)
        running_frozen = {name: weight for name, weight in weights(engine).items() if name.startswith(FROZEN)}
        engine.load_checkpoint(save_dir, tag=TAG, **TRAINER_LOAD)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_same(moments(engine), saved["moments"], "moments")
        assert steps_of(engine) == saved["steps"]
        loaded = weights(engine)
        assert_same({name: loaded[name] for name in saved["weights"]}, saved["weights"], "trainable weights")
        assert_same({name: loaded[name] for name in running_frozen}, running_frozen, "frozen weights kept")
        train(stage, engine, 1)  # and it trains on


@pytest.mark.parametrize("stage", STAGES)
class TestExcludedParameterTrainableNow(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([1, 2])  # loaded by 2 ranks: each must refuse
    def test_refused_on_every_rank(self, tmp_path, stage):
        save_dir = str(tmp_path)
        if saves_without_frozen(save_dir, stage, saved_world=1):
            return
        engine = build(stage, dist.get_world_size(), seed=1, frozen=())
        # ZeRO-3 names the save's setting; ZeRO-1/2 refuses the step count those parameters would share
        match = "exclude_frozen_parameters=True.*resume with them frozen" if stage == 3 else "Resume with them frozen"
        expect_rejected(engine, save_dir, f"layers.2.weight.*{match}", **TRAINER_LOAD)
