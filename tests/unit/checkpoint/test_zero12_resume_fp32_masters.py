# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""load_checkpoint(load_fp32_weights=...) under ZeRO-1/2 (bf16, fp16), the BF16_Optimizer path (bf16 weights
with fp32 gradient accumulation, ZeRO-1) and ZeRO-3 fp16: which fp32 masters, moments and steps a resume ends
with, and the resumes that cannot restore the masters failing early, alike on every rank, leaving the engine as
it was. The ZeRO-3 bf16 version is test_zero_resume_fp32_masters.py."""

import logging
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from deepspeed.utils import logger
from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, WAYS_OUT, assert_fresh, assert_same,
                                                 check_refused_then_rebuilt, expect_rejected, freeze, make_config,
                                                 masters, move_aside_on_rank, moments, remove_shards, rounding,
                                                 saves_checkpoint, shard_path, steps, to_universal, truncate_on_rank,
                                                 weights)
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch

# The BF16_Optimizer wrapper: bf16 weights, fp32 gradient accumulation, ZeRO stage 1 (engine
# _do_optimizer_sanity_check; stage 0 with these types is rejected unless pipeline-parallel).
BF16_FP32_ACCUM = "bf16_fp32_grad_accum"
LOW_DTYPE = {"bf16": torch.bfloat16, BF16_FP32_ACCUM: torch.bfloat16, "fp16": torch.float16}
OPTIMIZER_CLASS = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


def config_for(stage, precision, universal=False, **zero_overrides):
    config = make_config(stage, "fp32" if precision == "fp16" else "bf16", universal, **zero_overrides)
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == BF16_FP32_ACCUM:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def build(config, seed=0, hidden=16, frozen=(), nlayers=3, groups=None, lr_scheduler=None):
    """A TinyMLP engine; parameters whose names start with a prefix in `frozen` do not train. groups: [(prefixes,
    hyperparameters), ...], one param group each, in that order, of the trainable parameters named by prefix."""
    if config.get("fp16", {}).get("enabled"):
        # The CPU accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels; the tiny model's
        # fp16 Linear/tanh/MSE and gloo's fp16 all-reduce still run (slowly) on CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    model = freeze(TinyMLP(hidden=hidden, nlayers=nlayers), frozen)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if groups is None:
        model_parameters = [p for _, p in trainable]
    else:
        model_parameters = [
            dict(params=[p for name, p in trainable if name.startswith(prefixes)], **hyperparameters)
            for prefixes, hyperparameters in groups
        ]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model_parameters,
                                           lr_scheduler=lr_scheduler,
                                           config=config)
    return engine


def constant_lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def train_and_save(config, save_dir, hidden=16):
    engine = build(config, hidden=hidden)
    x, y = fixed_batch(hidden=hidden, dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(SAVED_STEPS):
        engine.backward(engine(x, y))
        engine.step()
    saved = masters(engine), moments(engine)
    # ds_to_universal needs this entry (empty: no tensor-parallel patterns) in ZeRO-1/2 checkpoints.
    engine.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    return saved


def rounded_to(tensors, precision):
    return rounding(tensors, LOW_DTYPE[precision])


def assert_masters(engine, expected, case=""):
    loaded = masters(engine)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), f"{case}: master {name}"


class TestZero12ResumeTable(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16"), (2, "fp16"), (1, BF16_FP32_ACCUM),
                                                  (3, "fp16")])
    def test_resume_table(self, tmpdir, stage, precision, checkpoint):
        """Every (load_optimizer_states, load_fp32_weights, load_module_only) row of RESUME_TABLE, loaded by a
        fresh engine from one saved checkpoint: masters saved bit for bit or their exact 16-bit rounding."""
        save_dir = str(tmpdir)
        universal = checkpoint == "universal"
        saved_masters, saved_moments = train_and_save(config_for(stage, precision), save_dir)
        tag = to_universal(save_dir) if universal else TAG
        for load_optimizer_states, load_fp32_weights, load_module_only, want_masters, want_state in RESUME_TABLE:
            case = f"load_optimizer_states={load_optimizer_states} load_fp32_weights={load_fp32_weights} " \
                   f"load_module_only={load_module_only}"
            engine = build(config_for(stage, precision, universal), seed=1)
            expected_class = "BF16_Optimizer" if precision == BF16_FP32_ACCUM else OPTIMIZER_CLASS[stage]
            assert type(engine.optimizer).__name__ == expected_class
            engine.load_checkpoint(save_dir,
                                   tag=tag,
                                   load_optimizer_states=load_optimizer_states,
                                   load_fp32_weights=load_fp32_weights,
                                   load_module_only=load_module_only)
            assert_masters(engine, saved_masters if want_masters == "saved" else rounded_to(saved_masters, precision),
                           case)
            if want_state == "saved":
                assert_same(moments(engine), saved_moments, case)
                assert set(steps(engine)) == {float(SAVED_STEPS)}, f"{case}: {steps(engine)}"
            else:
                assert_fresh(engine)


class TestZero12ResumeWithoutShards(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16"), (1, BF16_FP32_ACCUM)])
    def test_missing_shards(self, tmpdir, stage, precision):
        """Rank 0's shard missing, then rank 1's: restoring the masters (with or without optimizer states) is
        rejected alike on every rank with the engine unchanged, and a fresh-optimizer resume rebuilds them from the
        16-bit module on every rank (the rank that has its shard too). With every shard gone, load_fp32_weights=False
        never opens a shard."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(stage, precision), save_dir)
        engine = build(config_for(stage, precision), seed=1)
        match = "optim_states.pt shard.*" + WAYS_OUT
        for missing_rank in (0, 1):
            put_back = move_aside_on_rank(shard_path(save_dir, missing_rank), missing_rank)
            check_refused_then_rebuilt(engine, lambda: build(config_for(stage, precision), seed=1), save_dir, match,
                                       rounded_to(saved_masters, precision), missing_rank)
            put_back()
        remove_shards(save_dir)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        assert_masters(engine, rounded_to(saved_masters, precision))
        assert_fresh(engine)

    def test_truncated_shard_on_one_rank(self, tmpdir):
        """Rank 1's shard cut in half: restoring the masters is refused on every rank before anything changes
        (instead of rank 0 waiting for rank 1), and a fresh-optimizer resume rebuilds them on every rank, as 0.19.8
        did without reading the shards."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16"), save_dir)
        truncate_on_rank(shard_path(save_dir, 1), 1)
        check_refused_then_rebuilt(build(config_for(1, "bf16"), seed=1), lambda: build(config_for(1, "bf16"), seed=1),
                                   save_dir, "cannot be read.*truncated or corrupt.*" + WAYS_OUT,
                                   rounding(saved_masters), 1)


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
        expect_rejected(engine, save_dir, "round_robin_gradients.*" + WAYS_OUT)
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


# What a load restores besides weights and masters: the loss scaler (fp16) and clip_grad (saved by ZeRO-1/2 and
# BF16_Optimizer) are optimizer state, so only a full resume (load_optimizer_states=True) takes them from the
# checkpoint.
SAVED_SCALE_POWER, RUN_SCALE_POWER = 8, 10
SAVED_CLIP, RUN_CLIP = 1.0, 0.5
LOAD_MODES = {
    "full": dict(),
    "fresh optimizer": dict(load_optimizer_states=False),
    "module only": dict(load_module_only=True),
}


def optimizer_side_state(engine):
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None)
    return dict(loss_scale=getattr(scaler, "cur_scale", None), clip_grad=getattr(optimizer, "clip_grad", None))


class TestOptimizerSideState(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", [(2, "fp16"), (3, "fp16"), (1, "bf16"), (1, BF16_FP32_ACCUM)])
    def test_only_a_full_resume_restores_it(self, tmpdir, stage, precision):
        """Saved with loss scale 2**8 and gradient_clipping 1.0, loaded into a run configured with 2**10 and 0.5:
        a full resume takes the saved values, a fresh-optimizer or module-only load keeps the run's."""
        save_dir = str(tmpdir)

        def config(scale_power, clip):
            conf = config_for(stage, precision)
            conf["gradient_clipping"] = clip
            if precision == "fp16":
                conf["fp16"]["initial_scale_power"] = scale_power
            return conf

        saved = build(config(SAVED_SCALE_POWER, SAVED_CLIP))
        x, y = fixed_batch(dtype=next(saved.module.parameters()).dtype, device=saved.device)
        saved.backward(saved(x, y))
        saved.step()
        saved_state = optimizer_side_state(saved)
        saved.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        problems = []
        for mode, kwargs in LOAD_MODES.items():
            engine = build(config(RUN_SCALE_POWER, RUN_CLIP), seed=1)
            run_state = optimizer_side_state(engine)
            assert run_state != saved_state, "the test needs the run's values to differ from the saved ones"
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            expected = dict(run_state)
            if mode == "full":  # ZeRO-3 saves no clip_grad: its gradient_clipping always comes from the config
                expected.update(loss_scale=saved_state["loss_scale"])
                if stage < 3:
                    expected.update(clip_grad=saved_state["clip_grad"])
            if optimizer_side_state(engine) != expected:
                problems.append(f"{mode}: {optimizer_side_state(engine)}, expected {expected}")
        assert not problems, problems


class TestZero12ResumeDPChange(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("stage", [1, 2])
    @pytest.mark.world_size([4, 2])
    def test_dp_size_change(self, tmpdir, stage):
        """Saved by 4 ranks, loaded by 2: neither masters nor optimizer states can be restored rigidly; a
        fresh-optimizer resume rebuilds the masters from the bf16 module."""
        dp4_checkpoint = str(tmpdir)
        if saves_checkpoint(dp4_checkpoint, saved_by=4, stage=stage):
            return
        saved_masters = torch.load(os.path.join(dp4_checkpoint, "saved_masters.pt"))
        check_refused_then_rebuilt(build(config_for(stage, "bf16"),
                                         seed=1), lambda: build(config_for(stage, "bf16"), seed=1), dp4_checkpoint,
                                   "DP world size of 4.*" + WAYS_OUT, rounding(saved_masters))


class TestZero12ResumeAlignmentChange(DistributedTest):
    world_size = 2
    exec_timeout = 150

    def test_parameter_alignment_change(self, tmpdir):
        """Saved with zero_optimization.parameter_alignment=true (odd-sized parameters, so padded), loaded
        without: restoring the masters is rejected before anything changes, naming the ways out; a
        fresh-optimizer resume rebuilds them."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16", parameter_alignment=True), save_dir, hidden=15)
        check_refused_then_rebuilt(build(config_for(1, "bf16"), seed=1,
                                         hidden=15), lambda: build(config_for(1, "bf16"), seed=1, hidden=15), save_dir,
                                   "parameter-alignment layout.*" + WAYS_OUT, rounding(saved_masters))
