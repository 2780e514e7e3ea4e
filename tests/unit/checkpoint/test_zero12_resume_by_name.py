# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""ZeRO-1/2 (bf16, fp16) and BF16_Optimizer resumes at the saved data-parallel size after the trainable set or the
param groups changed: the fp32 masters (and, on a full resume, the moments, steps and hyperparameters) of every
parameter that was trainable when saved are restored by name from the saved shards; the resumes that cannot be
served that way fail early, alike on every rank, leaving the engine as it was. The resume table and the other
layout changes are in test_zero12_resume_fp32_masters.py."""

import logging

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.utils import logger
from unit.checkpoint.test_zero12_resume_fp32_masters import BF16_FP32_ACCUM, build, config_for
from unit.checkpoint.zero_resume_helpers import (SAVED_STEPS, TAG, WAYS_OUT, assert_fresh, assert_same,
                                                 check_refused_then_rebuilt, expect_rejected, masters,
                                                 move_aside_on_rank, moments, shard_path, steps, weights)
from unit.common import DistributedTest
from unit.zero_tiny_models import fixed_batch


def constant_lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


# Another trainable set or grouping at the saved data-parallel size: every parameter that was trainable when saved
# resumes with its saved master (and, on a full resume, moments and step) read by name; the others start from their
# 16-bit weights with zero moments. HIDDEN 5: 30 elements a layer (25 + 5), so a flat group of 1 or 3 layers is padded
# at 2 ranks and the partition boundaries cut parameters in two.
HIDDEN = 5
LAYOUT_CELLS = [(1, "bf16"), (2, "bf16"), (1, BF16_FP32_ACCUM), (2, "fp16")]
# Saved with two param groups; the load configures other values, so a group that kept them is visible.
SAVED_GROUPS = [(("layers.0.", ), dict(lr=0.01, weight_decay=0.0, betas=(0.9, 0.999))),
                (("layers.1.", "layers.2.", "layers.3."), dict(lr=0.03, weight_decay=0.1, betas=(0.8, 0.99)))]
LOADED_HYPERPARAMETERS = [
    dict(lr=0.05, weight_decay=0.2, betas=(0.7, 0.9)),
    dict(lr=0.07, weight_decay=0.3, betas=(0.6, 0.95))
]
HYPERPARAMETER_REFUSAL = r"param group.*saved in param group.*hyperparameters differ.*load_optimizer_states=False"


def train_steps(engine, count):
    x, y = fixed_batch(hidden=HIDDEN, dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(count):
        engine.backward(engine(x, y))
        engine.step()


def linked_moments(engine):
    """moments(), after linking every param group's moments to its parameters: ZeRO-1/2 links them once, after
    group 0's first update, so that safe_get_full_optimizer_state fails for the other groups' parameters."""
    engine.optimizer._hp_optimizer_states_linked = False
    engine.optimizer._lazy_init_hp_params_optimizer_state()
    return moments(engine)


def hyperparameters(engine):
    """{name: lr, weight_decay and betas of the param group the optimizer updates it with}."""
    optimizer = engine.optimizer
    lp_groups = optimizer.bf16_groups if hasattr(optimizer, "bf16_groups") else optimizer.bit16_groups
    names = {param: name for name, param in engine.module.named_parameters()}
    return {
        names[param]: {
            key: tuple(group[key]) if key == "betas" else group[key]
            for key in ("lr", "weight_decay", "betas")
        }
        for lp_group, group in zip(lp_groups, optimizer.optimizer.param_groups)
        for param in lp_group
    }


def save_trained(config, save_dir, **build_kwargs):
    """Train SAVED_STEPS steps, save TAG; returns what was saved: masters, moments, steps, 16-bit weights and
    each parameter's hyperparameters."""
    engine = build(config, hidden=HIDDEN, **build_kwargs)
    train_steps(engine, SAVED_STEPS)
    saved = dict(masters=masters(engine),
                 moments=linked_moments(engine),
                 steps=steps(engine),
                 weights=weights(engine),
                 hyperparameters=hyperparameters(engine))
    engine.save_checkpoint(save_dir, tag=TAG)
    return saved


class WarningsOnThisRank:
    """The WARNING records DeepSpeed's logger emits on this rank inside the with block."""

    def __enter__(self):
        self.records = []
        self._handler = logging.Handler(level=logging.WARNING)
        self._handler.emit = self.records.append
        logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        logger.removeHandler(self._handler)

    def naming(self, text):
        return [record.getMessage() for record in self.records if text in record.getMessage()]


def load_warning(engine, save_dir, **load_kwargs):
    """Load; returns the warnings logged on this rank that name layers.0.weight."""
    with WarningsOnThisRank() as warned:
        engine.load_checkpoint(save_dir, tag=TAG, **load_kwargs)
    return warned.naming("layers.0.weight")


def assert_named_once(warnings, new):
    """The parameters in `new` (nothing saved) are named in one warning, on rank 0 only."""
    if dist.get_rank() == 0:
        assert len(warnings) == 1 and all(name in warnings[0] for name in new), warnings
        assert "had none saved" in warnings[0], warnings[0]
    else:
        assert not warnings, warnings


def assert_masters_round_to_weights(engine):
    """Each master rounds to its module weight: a check independent of the hp mappings the restore writes through
    (masters() reads through them too)."""
    module_weights = weights(engine)
    for name, master in masters(engine).items():
        assert torch.equal(master.to(module_weights[name].dtype), module_weights[name]), name


def expected_masters(saved, engine, new=()):
    """The saved masters of the parameters this engine trains, and the 16-bit weights, upcast, of those in `new`."""
    trainable = [name for name, param in engine.module.named_parameters() if param.requires_grad]
    return {name: saved["weights"][name].float() if name in new else saved["masters"][name] for name in trainable}


def expected_moments(saved, engine, new=()):
    """The saved moments of the parameters this engine trains, zero for those in `new`."""
    trainable = [name for name, param in engine.module.named_parameters() if param.requires_grad]
    return {
        name: {
            key: torch.zeros_like(saved["weights"][name], dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq")
        } if name in new else saved["moments"][name]
        for name in trainable
    }


class TestZero12TrainableSetChange(DistributedTest):
    """Saved with layers.0 frozen (3 layers: 90 elements, padded), resumed with everything trainable (4 layers: the
    partitions hold other pieces of other parameters), or saved with everything trainable and resumed with
    layers.1 frozen. These replace the tests that pinned the rebuild of every master (and the refusal of a full
    resume), as 0.19.8 rebuilt them."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_unfreeze_fresh_optimizer(self, tmpdir, stage, precision):
        """(a) Fresh optimizer: the masters of the parameters trainable when saved are the saved ones bit for bit,
        the unfrozen layer's are its saved 16-bit weights upcast, named in one warning; training continues."""
        save_dir, config, new = str(tmpdir), config_for(stage, precision), ["layers.0.weight", "layers.0.bias"]
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        warnings = load_warning(engine, save_dir, load_optimizer_states=False)
        assert_same(masters(engine), expected_masters(saved, engine, new), "masters")
        assert_masters_round_to_weights(engine)
        assert_fresh(engine)
        assert_named_once(warnings, new)
        assert_same(weights(engine), saved["weights"], "weights")
        train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_unfreeze_full_resume(self, tmpdir, stage, precision):
        """(b) Full resume. The unfrozen layer in the restored group would share its saved step with zero moments
        (updates several times a fresh start's): refused on every rank, engine unchanged, naming the ways out. In a
        param group of its own: masters, moments and step exact for the parameters trainable when saved; the
        unfrozen layer starts from its 16-bit weights with zero moments at step 0, named in one warning; training
        continues. With load_fp32_weights=False, the same moments and every master rebuilt from its 16-bit
        weight."""
        save_dir, config, new = str(tmpdir), config_for(stage, precision), ["layers.0.weight", "layers.0.bias"]
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        apart = [(("layers.1.", "layers.2.", "layers.3."), {}), (("layers.0.", ), {})]
        expect_rejected(build(config, seed=1, hidden=HIDDEN, nlayers=4), save_dir,
                        "layers.0.weight, layers.0.bias were not trainable.*param group of their own")
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=apart)
        warnings = load_warning(engine, save_dir)
        assert_same(masters(engine), expected_masters(saved, engine, new), "masters")
        assert_same(linked_moments(engine), expected_moments(saved, engine, new), "moments")
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
        """(c) Saved with everything trainable, layers.1 frozen at load: with a fresh optimizer and on a full
        resume, the other layers' masters (and moments and step) are the saved ones; every weight as saved."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir)
        for load_kwargs in (dict(load_optimizer_states=False), dict()):
            engine = build(config, seed=1, hidden=HIDDEN, frozen=("layers.1.", ))
            engine.load_checkpoint(save_dir, tag=TAG, **load_kwargs)
            assert_same(masters(engine), expected_masters(saved, engine), f"masters after {load_kwargs}")
            if load_kwargs:
                assert_fresh(engine)
            else:
                assert_same(moments(engine), expected_moments(saved, engine), "moments")
                assert steps(engine) == [float(SAVED_STEPS)], steps(engine)
            assert_same(weights(engine), saved["weights"], "weights")
            train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", [(2, "bf16")])
    def test_round_robin_gradients(self, tmpdir, stage, precision):
        """round_robin_gradients lays the flat partitions out in another order than the hp mappings and the saved
        param_slice_mappings describe (so safe_get_full_fp32_param cannot check it either): no restore by name. A
        full resume is refused on every rank with the engine unchanged, and a fresh-optimizer resume rebuilds every
        master from its 16-bit weight, as before: each rank's fp32 partition is its 16-bit partition, upcast."""
        save_dir, config = str(tmpdir), config_for(stage, precision, round_robin_gradients=True)
        save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        # (matched from "reorders": pytest's tmpdir, in the message's path, is named after this test)
        expect_rejected(engine, save_dir, "round_robin_gradients reorders the flat partitions.*" + WAYS_OUT)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        optimizer, rank = engine.optimizer, dist.get_rank()
        for fp32_partition, bit16_partitions in zip(optimizer.single_partition_of_fp32_groups,
                                                    optimizer.parallel_partitioned_bit16_groups):
            assert torch.equal(fp32_partition, bit16_partitions[rank].float())

    @pytest.mark.parametrize("stage, precision", [(1, "bf16")])
    def test_missing_shard_of_another_rank(self, tmpdir, stage, precision):
        """Restoring by name reads every saved rank's shard: with saved rank 1's missing, every rank refuses a full
        resume before anything changes and rebuilds the masters on a fresh-optimizer resume."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        put_back = move_aside_on_rank(shard_path(save_dir, 1), 1)

        def resumed():
            return build(config, seed=1, hidden=HIDDEN, nlayers=4)

        check_refused_then_rebuilt(resumed(), resumed, save_dir, "shard of saved rank 1.*" + WAYS_OUT, {
            name: weight.float()
            for name, weight in saved["weights"].items()
        })
        put_back()


class TestZero12ParamGroupsByName(DistributedTest):
    """Saved with two param groups of different hyperparameters (1 and 3 layers, both padded). A current group
    takes the hyperparameters of the saved group its parameters were in, by name, not by position."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_reordered_groups(self, tmpdir, stage, precision):
        """(d) The groups reordered at load, with other configured values: a full resume gives each parameter the
        lr, weight_decay and betas of its saved group, and its saved master, moments and step, and it trains as at
        the saved layout; a fresh-optimizer resume keeps the configured values, with the saved masters."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS, lr_scheduler=constant_lambda_lr)
        reordered = [(SAVED_GROUPS[1][0], LOADED_HYPERPARAMETERS[0]), (SAVED_GROUPS[0][0], LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert hyperparameters(engine) == saved["hyperparameters"], hyperparameters(engine)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_same(linked_moments(engine), saved["moments"], "moments")
        assert steps(engine) == saved["steps"] == [float(SAVED_STEPS)] * 2, steps(engine)
        # One more step at either layout: the same masters.
        as_saved = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=SAVED_GROUPS)
        as_saved.load_checkpoint(save_dir, tag=TAG)
        train_steps(engine, 1)
        train_steps(as_saved, 1)
        assert_same(masters(engine), masters(as_saved), "masters one step after the resume")

        # A torch lr scheduler restores its per-group state (base_lrs) by position: refused unless left out.
        scheduled = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered, lr_scheduler=constant_lambda_lr)
        for load_kwargs in (dict(), dict(load_optimizer_states=False)):
            expect_rejected(scheduled, save_dir, "lr scheduler state.*load_lr_scheduler_states=False", **load_kwargs)

        fresh = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered)
        configured = hyperparameters(fresh)
        fresh.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert hyperparameters(fresh) == configured != saved["hyperparameters"], hyperparameters(fresh)
        assert_same(masters(fresh), saved["masters"], "masters, fresh optimizer")
        assert_fresh(fresh)

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_parameter_moved_to_another_group(self, tmpdir, stage, precision):
        """(e) layers.1 moved into layers.0's group, whose saved hyperparameters differ: no saved group's apply to
        it, so a full resume is refused on every rank, naming the way out, with the engine unchanged; that way out,
        a fresh-optimizer resume, keeps the saved masters."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS)
        moved = [(("layers.0.", "layers.1."), LOADED_HYPERPARAMETERS[0]),
                 (("layers.2.", "layers.3."), LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=moved)
        train_steps(engine, 1)  # moments and steps of its own, which the refused loads must leave alone
        linked_moments(engine)
        for load_kwargs in (dict(), dict(load_optimizer_states=True, load_fp32_weights=True)):
            expect_rejected(engine, save_dir, HYPERPARAMETER_REFUSAL, **load_kwargs)
        fresh = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=moved)
        fresh.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(masters(fresh), saved["masters"], "masters, fresh optimizer")
        assert_fresh(fresh)
