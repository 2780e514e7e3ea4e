# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a rigid checkpoint resumes after its trainable parameters were laid out otherwise: another trainable set,
sub_group_size or param grouping, at the saved data-parallel size or another.

Every parameter that was trainable when saved gets its saved master (and, in a full resume, its moments and step)
by name, exactly; one frozen when saved starts from its saved weight with zero moments; each param group takes the
hyperparameters of the group its parameters were saved in. What cannot follow the parameters is refused on every
rank before anything changes. The checkpoint and the reference come from zero3_reshard_helpers.
"""

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.zero3_reshard_helpers import (MODES, SAVED_GROUPS, build, check_next_step, check_resumed,
                                                   hyperparameters_by_name, reference, resume_in_every_mode,
                                                   saves_reference, steps_by_name, train_step)
from unit.checkpoint.zero_resume_helpers import TAG, assert_same, expect_rejected, masters, moments, weights
from unit.common import DistributedTest


def constant_lambda_lr(optimizer):
    """A torch scheduler (as Hugging Face's Trainer passes): per-group state (base_lrs) restored by position."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


# The layout changes below at the saved size (one world saves, then loads) and at another ([saved by, resumed by])
SAME_OR_OTHER_SIZE = pytest.mark.parametrize("world_size, layout", [(2, "dp2"), ([4, 2], "dp4->dp2")],
                                             ids=["same_size", "dp4todp2"])


def only_saves(save_dir, precision, world_size, **build_args):
    """saves_reference for SAME_OR_OTHER_SIZE: True in a world that only saves."""
    if isinstance(world_size, int):
        saves_reference(save_dir, precision, saved_world=world_size, **build_args)
        return False
    return saves_reference(save_dir, precision, saved_world=world_size[0], **build_args)


# The layer frozen when saved in a param group of its own: its optimizer state (and step) starts afresh.
NEW_LAYER_APART = [(("layers.0.", "layers.1."), {}), (("layers.2.", ), {})]


def assert_exact_where_saved(engine, ref, optimizer_state):
    """Every parameter trainable both when saved and now has its saved master (and moments); one that was frozen
    when saved starts from its saved weight with zero moments; every weight is the saved one."""
    assert_same(weights(engine), ref["weights"], "weights")
    loaded_masters, loaded_moments = masters(engine), moments(engine)
    for name, master in loaded_masters.items():
        saved = name in ref["masters"]
        assert_same(master, ref["masters"][name] if saved else ref["weights"][name].float(), f"master {name}")
        for key, value in loaded_moments[name].items():
            if optimizer_state == "fresh":
                assert value is None or not value.any(), f"{name}.{key} not fresh"
            else:
                expected = ref["moments"][name][key] if saved else torch.zeros_like(value)
                assert_same(value, expected, f"{name}.{key}")
    if optimizer_state == "saved":
        loaded_steps = steps_by_name(engine)
        expected_steps = {name: ref["steps"].get(name, 0.0) for name in loaded_masters}
        assert {name: loaded_steps[name] for name in loaded_masters} == expected_steps, loaded_steps


class TestZero3LayoutChange(DistributedTest):
    """Another trainable set or sub-grouping, at the saved data-parallel size or another: every parameter that was
    trainable when saved gets its saved master and optimizer states by name, exactly; only a parameter with nothing
    saved starts fresh, from its saved weight."""
    world_size = 2

    @SAME_OR_OTHER_SIZE
    @pytest.mark.parametrize("frozen_at_load", [(), ("layers.0.", "layers.2.")], ids=["unfreeze", "freeze_another"])
    def test_trainable_set_change(self, tmp_path, world_size, layout, frozen_at_load):
        save_dir, precision = str(tmp_path), "bf16"
        if only_saves(save_dir, precision, world_size):  # layers.2 frozen
            return
        ref = reference(save_dir)
        for mode in ("full", "fresh_optimizer"):
            kwargs, _, optimizer_state = MODES[mode]
            engine = build(precision, dist.get_world_size(), seed=1, frozen=frozen_at_load)
            if mode == "full" and not frozen_at_load:
                # layers.2 would share the sub-group's saved step with zero moments: refused, the way out named
                expect_rejected(
                    engine, save_dir, "layers.2.weight, layers.2.bias were not trainable when it was "
                    "saved.*param group of their own.*load_optimizer_states=False")
                engine = build(precision, dist.get_world_size(), seed=1, frozen=(), groups=NEW_LAYER_APART)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_exact_where_saved(engine, ref, optimizer_state)
            train_step(engine, precision)

    def test_sub_group_size_change_at_the_saved_size(self, tmp_path):
        save_dir, precision = str(tmp_path), "bf16"
        saves_reference(save_dir, precision, saved_world=dist.get_world_size())
        ref = reference(save_dir)
        assert len(build(precision, dist.get_world_size(), seed=1, sub_group_size=100).optimizer.fp16_groups) > 1
        resume_in_every_mode(save_dir, ref, precision, sub_group_size=100)


# Saved with SAVED_GROUPS; loaded with the same two swapped in order, each position keeping its
# hyperparameters: restored by position, layers.0 would train with lr 0.03 / weight_decay 0.1.
SWAPPED_GROUPS = [(("layers.1.", ), dict(lr=0.01, weight_decay=0.0)), (("layers.0.", ), dict(lr=0.03,
                                                                                             weight_decay=0.1))]
MERGED_GROUPS = [(("layers.0.", "layers.1."), dict(lr=0.02, weight_decay=0.0))]


class TestZero3ParamGroupHyperparameters(DistributedTest):
    """A restored param group takes the hyperparameters of the group its parameters were saved in, at every size;
    where they come from saved groups that differ, a full resume is refused on every rank."""
    world_size = 2

    @SAME_OR_OTHER_SIZE
    def test_follow_their_parameters(self, tmp_path, world_size, layout):
        save_dir, precision = str(tmp_path), "bf16"
        if only_saves(save_dir, precision, world_size, groups=SAVED_GROUPS, lr_scheduler=constant_lambda_lr):
            return
        ref = reference(save_dir)
        saved = {
            name: (group["lr"], group["weight_decay"], (0.9, 0.999))
            for name in ref["masters"]
            for prefixes, group in SAVED_GROUPS if name.startswith(prefixes)
        }
        engine = build(precision,
                       dist.get_world_size(),
                       seed=1,
                       groups=SWAPPED_GROUPS,
                       lr_scheduler=constant_lambda_lr)
        # the scheduler's base_lrs would give each group the other's lr from its next step on
        expect_rejected(engine, save_dir, "lr scheduler state.*base_lrs.*load_lr_scheduler_states=False")
        engine.load_checkpoint(save_dir, tag=TAG, load_lr_scheduler_states=False)
        restored = hyperparameters_by_name(engine)
        assert restored == saved, (restored, saved)
        check_resumed(engine, dict(ref, lr_scheduler=None), "saved", "saved", precision)  # its scheduler is fresh
        check_next_step(engine, ref, precision, "saved")

    @SAME_OR_OTHER_SIZE
    def test_from_groups_that_differ_refused(self, tmp_path, world_size, layout):
        save_dir, precision = str(tmp_path), "bf16"
        if only_saves(save_dir, precision, world_size, groups=SAVED_GROUPS):
            return
        ref = reference(save_dir)
        engine = build(precision, dist.get_world_size(), seed=1, groups=MERGED_GROUPS)
        expect_rejected(
            engine, save_dir, "param group 0 holds parameters saved in param groups whose "
            "hyperparameters differ.*load_optimizer_states=False")
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert set(hyperparameters_by_name(engine).values()) == {(0.02, 0.0, (0.9, 0.999))}
        assert_same(masters(engine), ref["masters"], "masters")
