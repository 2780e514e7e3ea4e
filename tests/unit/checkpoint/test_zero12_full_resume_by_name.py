# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 (bf16, fp16) and BF16_Optimizer full resumes at the saved data-parallel size after the trainable set or
the param groups changed: the fp32 masters, moments, steps and hyperparameters of every parameter that was trainable
when saved are restored by name; a full resume that cannot be served that way is refused on every rank, leaving the
engine as it was. Fresh-optimizer resumes: test_zero12_resume_by_name.py."""

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT
from unit.checkpoint.test_zero12_resume_by_name import (HIDDEN, LAYOUT_CELLS, LOADED_HYPERPARAMETERS, SAVED_GROUPS,
                                                        assert_named_once, build, config_for, constant_lambda_lr,
                                                        expected_masters, expected_moments, hyperparameters,
                                                        load_warning, save_trained, train_steps)
from unit.checkpoint.zero_resume_helpers import (SAVED_STEPS, TAG, WAYS_OUT, assert_same, expect_rejected, masters,
                                                 move_aside_on_rank, moments, shard_path, steps, weights)
from unit.common import DistributedTest
from unit.checkpoint.checkpoint_edits import without_manifest

HYPERPARAMETER_REFUSAL = r"param group.*saved in param group.*hyperparameters differ.*load_optimizer_states=False"


class TestZero12FullResumeTrainableSetChange(DistributedTest):
    """Saved with layers.0 frozen (3 layers, padded), resumed with everything trainable, or saved with everything
    trainable and resumed with layers.1 frozen. Before this change every such full resume was refused."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_unfreeze_full_resume(self, tmpdir, stage, precision):
        """The unfrozen layer in the restored group would share its saved step with zero moments (updates several
        times a fresh start's): refused on every rank, engine unchanged, naming the ways out. In a param group of
        its own: masters, moments and step exact for the parameters trainable when saved; the unfrozen layer starts
        from its 16-bit weights with zero moments at step 0, named in one warning; training continues. With
        load_fp32_weights=False, the same moments and every master rebuilt from its 16-bit weight."""
        save_dir, config, new = str(tmpdir), config_for(stage, precision), ["layers.0.weight", "layers.0.bias"]
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        apart = [(("layers.1.", "layers.2.", "layers.3."), {}), (("layers.0.", ), {})]
        expect_rejected(build(config, seed=1, hidden=HIDDEN, nlayers=4), save_dir,
                        "layers.0.weight, layers.0.bias were not trainable.*param group of their own")
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=apart)
        warnings = load_warning(engine, save_dir)
        assert_same(masters(engine), expected_masters(saved, engine, new), "masters")
        assert_same(moments(engine), expected_moments(saved, engine, new), "moments")
        assert steps(engine) == [0.0, float(SAVED_STEPS)] and saved["steps"] == [float(SAVED_STEPS)], steps(engine)
        assert_named_once(warnings, new)
        assert_same(weights(engine), saved["weights"], "weights")
        train_steps(engine, 1)
        # With load_fp32_weights=False the states are restored the same way and every master is its 16-bit weight.
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=apart)
        engine.load_checkpoint(save_dir, tag=TAG, load_fp32_weights=False)
        assert_same(masters(engine), {name: weight.float() for name, weight in saved["weights"].items()}, "masters")
        assert_same(moments(engine), expected_moments(saved, engine, new), "moments")

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_freeze_at_load(self, tmpdir, stage, precision):
        """Saved with everything trainable, layers.1 frozen at load: the other layers' masters, moments and step are
        the saved ones; every weight as saved."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir)
        engine = build(config, seed=1, hidden=HIDDEN, frozen=("layers.1.", ))
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), expected_masters(saved, engine), "masters")
        assert_same(moments(engine), expected_moments(saved, engine), "moments")
        assert steps(engine) == [float(SAVED_STEPS)], steps(engine)
        assert_same(weights(engine), saved["weights"], "weights")
        train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", [(2, "bf16")])
    def test_round_robin_gradients(self, tmpdir, stage, precision):
        """round_robin_gradients reorders the flat partitions, which the saved param_slice_mappings do not follow: a
        full resume is refused on every rank, naming it, with the engine unchanged."""
        save_dir, config = str(tmpdir), config_for(stage, precision, round_robin_gradients=True)
        save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        # ("reorders" keeps the match off pytest's tmpdir, which is named after the test and is in the message)
        expect_rejected(engine, save_dir, "round_robin_gradients reorders the flat partitions.*" + WAYS_OUT)

    @pytest.mark.parametrize("stage, precision", [(1, "bf16")])
    def test_missing_shard_of_another_rank(self, tmpdir, stage, precision):
        """With saved rank 1's shard missing, a full resume is refused on every rank before anything changes,
        naming the shard."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        put_back = move_aside_on_rank(shard_path(save_dir, 1), 1)
        apart = [(("layers.1.", "layers.2.", "layers.3."), {}), (("layers.0.", ), {})]
        expect_rejected(build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=apart), save_dir,
                        "shard of saved rank 1.*" + WAYS_OUT)
        put_back()

    @pytest.mark.parametrize("stage, precision", [(2, "bf16")])
    def test_optimizer_state_not_element_wise(self, tmpdir, stage, precision):
        """A saved optimizer state that is not one element per fp32 element (a blockwise or quantized optimizer's)
        has no element offsets to restore by: a full resume is refused on every rank, engine unchanged; a fresh
        resume, which reads only the masters, restores them."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir)
        dist.barrier()
        path = shard_path(save_dir, dist.get_rank())  # each rank rewrites its own shard
        shard = torch.load(path, weights_only=False)
        state = shard[OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]["state"][0]
        state["exp_avg"] = torch.cat([state["exp_avg"], state["exp_avg"]])
        torch.save(shard, path)
        without_manifest(path)
        dist.barrier()
        expect_rejected(build(config, seed=1, hidden=HIDDEN, frozen=("layers.1.", )), save_dir,
                        "exp_avg with .*only optimizer states of one element per fp32 element.*" + WAYS_OUT)
        engine = build(config, seed=1, hidden=HIDDEN, frozen=("layers.1.", ))
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(masters(engine), expected_masters(saved, engine), "masters")


class TestZero12FullResumeParamGroupsByName(DistributedTest):
    """Saved with two param groups of different hyperparameters (1 and 3 layers, both padded). A current group
    takes the hyperparameters of the saved group its parameters were in, by name, not by position."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_reordered_groups(self, tmpdir, stage, precision):
        """The groups reordered at load, with other configured values: each parameter gets the lr, weight_decay and
        betas of its saved group, and its saved master, moments and step, and it trains as at the saved layout. A
        torch lr scheduler's per-group state (base_lrs), restored by position, would give each group the other's
        lr: refused on every rank unless left out."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS, lr_scheduler=constant_lambda_lr)
        reordered = [(SAVED_GROUPS[1][0], LOADED_HYPERPARAMETERS[0]), (SAVED_GROUPS[0][0], LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert hyperparameters(engine) == saved["hyperparameters"], hyperparameters(engine)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_same(moments(engine), saved["moments"], "moments")
        assert steps(engine) == saved["steps"] == [float(SAVED_STEPS)] * 2, steps(engine)
        # One more step at either layout: the same masters.
        as_saved = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=SAVED_GROUPS)
        as_saved.load_checkpoint(save_dir, tag=TAG)
        train_steps(engine, 1)
        train_steps(as_saved, 1)
        assert_same(masters(engine), masters(as_saved), "masters one step after the resume")

        scheduled = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered, lr_scheduler=constant_lambda_lr)
        expect_rejected(scheduled, save_dir, "lr scheduler state.*base_lrs.*load_lr_scheduler_states=False")
        scheduled.load_checkpoint(save_dir, tag=TAG, load_lr_scheduler_states=False)
        assert hyperparameters(scheduled) == saved["hyperparameters"], hyperparameters(scheduled)
        # A fresh optimizer keeps this run's hyperparameters, so the rule is not applied: the load goes through.
        # The scheduler still loads by position, as 0.19.8 loads it everywhere (Left for later in the message).
        scheduled_fresh = build(config,
                                seed=1,
                                hidden=HIDDEN,
                                nlayers=4,
                                groups=reordered,
                                lr_scheduler=constant_lambda_lr)
        scheduled_fresh.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(masters(scheduled_fresh), saved["masters"], "masters")

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_parameter_moved_to_another_group(self, tmpdir, stage, precision):
        """layers.1 moved into layers.0's group, whose saved hyperparameters differ: no saved group's apply to it,
        so a full resume is refused on every rank, naming the way out, with the engine unchanged."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS)
        moved = [(("layers.0.", "layers.1."), LOADED_HYPERPARAMETERS[0]),
                 (("layers.2.", "layers.3."), LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=moved)
        train_steps(engine, 1)  # moments and steps of its own, which the refused loads must leave alone
        for load_kwargs in (dict(), dict(load_optimizer_states=True, load_fp32_weights=True)):
            expect_rejected(engine, save_dir, HYPERPARAMETER_REFUSAL, **load_kwargs)
