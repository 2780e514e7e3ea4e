# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 and BF16_Optimizer loads honour load_optimizer_states=False and zero_optimization.load_from_fp32_weights=
false: a universal checkpoint loaded with a fresh optimizer keeps this run's moments (none), step, hyperparameters,
loss scaler and clip_grad; with load_from_fp32_weights=false the masters are rebuilt from the 16-bit weights, for
universal checkpoints and for BF16_Optimizer's rigid ones."""

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from unit.checkpoint.zero_resume_helpers import (SAVED_STEPS, TAG, assert_fresh, assert_same, make_config, masters,
                                                 moments, rounding, steps, to_universal)
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch

BF16_FP32_ACCUM = "bf16_fp32_grad_accum"  # BF16_Optimizer: bf16 weights, fp32 gradient accumulation, ZeRO-1
CELLS = [(1, "bf16"), (2, "bf16"), (2, "fp16"), (1, BF16_FP32_ACCUM)]
LOW_DTYPE = {"bf16": torch.bfloat16, BF16_FP32_ACCUM: torch.bfloat16, "fp16": torch.float16}
# What the saving run and the loading run configure: a load that keeps this run's optimizer keeps the second.
SAVED_RUN = dict(lr=0.01, betas=(0.9, 0.999), clip=1.0, scale_power=8)
THIS_RUN = dict(lr=0.05, betas=(0.7, 0.9), clip=0.5, scale_power=10)
NEW_LAYER = "layers.3."


def config_for(stage, precision, run, universal=False, **zero_overrides):
    config = make_config(stage, "fp32" if precision == "fp16" else "bf16", universal, **zero_overrides)
    config["optimizer"]["params"].update(lr=run["lr"], betas=list(run["betas"]))
    config["gradient_clipping"] = run["clip"]
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": run["scale_power"]}
        # The CPU accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels; the tiny model's fp16 ops
        # and gloo's fp16 all-reduce still run on CPU.
        get_accelerator().is_fp16_supported = lambda: True
    elif precision == BF16_FP32_ACCUM:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def build(config, seed, biases_apart=False, new_layer=False):
    """With biases_apart, two param groups (the biases without weight decay, as fine-tuning sets them up); with
    new_layer, a fourth layer the saved model does not have, in a param group of its own (a new head)."""
    torch.manual_seed(seed)
    model = TinyMLP(nlayers=4 if new_layer else 3)
    named = list(model.named_parameters())
    params = model.parameters()
    if biases_apart:
        params = [{
            "params": [p for n, p in named if not n.endswith("bias")]
        }, {
            "params": [p for n, p in named if n.endswith("bias")],
            "weight_decay": 0.0
        }]
    elif new_layer:
        params = [{
            "params": [p for n, p in named if not n.startswith(NEW_LAYER)]
        }, {
            "params": [p for n, p in named if n.startswith(NEW_LAYER)]
        }]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    return engine


def optimizer_settings(engine):
    """The hyperparameters of every param group, the loss scale and clip_grad."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return dict(groups=[(group["lr"], tuple(group["betas"])) for group in engine.optimizer.param_groups],
                loss_scale=getattr(scaler, "cur_scale", None),
                clip_grad=getattr(engine.optimizer, "clip_grad", None))


def train_and_save(config, save_dir):
    """SAVED_STEPS steps, then save; returns the masters, moments and optimizer settings saved."""
    engine = build(config, seed=0)
    x, y = fixed_batch(dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(SAVED_STEPS):
        engine.backward(engine(x, y))
        engine.step()
    saved = dict(masters=masters(engine), moments=moments(engine), settings=optimizer_settings(engine))
    # ds_to_universal needs this entry (empty: no tensor-parallel patterns) in ZeRO-1/2 checkpoints.
    engine.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    return saved


class TestUniversalZero12LoadFlags(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_fresh_optimizer(self, tmpdir, stage, precision):
        """load_optimizer_states=False: the saved masters, and this run's optimizer (no moments, no step, its lr
        and betas, loss scale and clip_grad), with the masters from the checkpoint or, with
        load_from_fp32_weights=false, their 16-bit rounding."""
        save_dir = str(tmpdir)
        saved = train_and_save(config_for(stage, precision, SAVED_RUN), save_dir)
        tag = to_universal(save_dir)
        for from_fp32 in (True, False):
            config = config_for(stage, precision, THIS_RUN, universal=True, load_from_fp32_weights=from_fp32)
            engine = build(config, seed=1)
            configured = optimizer_settings(engine)
            assert configured != saved["settings"], "the test needs this run's settings to differ from the saved ones"
            engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=False)
            expected = saved["masters"] if from_fp32 else rounding(saved["masters"], LOW_DTYPE[precision])
            assert_same(masters(engine), expected, f"masters, load_from_fp32_weights={from_fp32}")
            assert_fresh(engine)
            assert optimizer_settings(engine) == configured, (optimizer_settings(engine), configured)

    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_fresh_optimizer_more_param_groups(self, tmpdir, stage, precision):
        """A fresh optimizer that puts the parameters into more groups than the saving run did: every parameter
        gets its saved master, those of the group the saving run did not have too (they kept this run's initial
        weights)."""
        save_dir = str(tmpdir)
        saved = train_and_save(config_for(stage, precision, SAVED_RUN), save_dir)
        tag = to_universal(save_dir)
        engine = build(config_for(stage, precision, THIS_RUN, universal=True), seed=1, biases_apart=True)
        assert len(engine.optimizer.param_groups) == 2
        engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=False)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_fresh(engine)

    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_fresh_optimizer_new_layer(self, tmpdir, stage, precision):
        """Fine-tuning with a layer the saved model does not have (a new head in a param group of its own, the
        module loaded with load_module_strict=False): the saved parameters get their saved masters and the new
        layer keeps its initial one; nothing saved is asked for it."""
        save_dir = str(tmpdir)
        saved = train_and_save(config_for(stage, precision, SAVED_RUN), save_dir)
        tag = to_universal(save_dir)
        engine = build(config_for(stage, precision, THIS_RUN, universal=True), seed=1, new_layer=True)
        initial = masters(engine)
        engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=False, load_module_strict=False)
        new = {name: master for name, master in initial.items() if name.startswith(NEW_LAYER)}
        assert new and not set(new) & set(saved["masters"])
        assert_same(masters(engine), dict(saved["masters"], **new), "masters")
        assert_fresh(engine)

    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_full_resume_load_from_fp32_weights_false(self, tmpdir, stage, precision):
        """A full resume with load_from_fp32_weights=false: the saved moments and step, and every master its saved
        16-bit weight, upcast."""
        save_dir = str(tmpdir)
        saved = train_and_save(config_for(stage, precision, SAVED_RUN), save_dir)
        tag = to_universal(save_dir)
        engine = build(config_for(stage, precision, THIS_RUN, universal=True, load_from_fp32_weights=False), seed=1)
        engine.load_checkpoint(save_dir, tag=tag)
        assert_same(masters(engine), rounding(saved["masters"], LOW_DTYPE[precision]), "masters")
        assert_same(moments(engine), saved["moments"], "moments")
        assert set(steps(engine)) == {float(SAVED_STEPS)}, steps(engine)


class TestBF16OptimizerLoadFromFp32WeightsFalse(DistributedTest):
    world_size = 2
    exec_timeout = 300

    def test_rigid_full_resume(self, tmpdir):
        """BF16_Optimizer, rigid checkpoint, full resume with load_from_fp32_weights=false: every master is its
        loaded bf16 weight, upcast (it kept the new engine's initial values), with the saved moments and step."""
        save_dir = str(tmpdir)
        saved = train_and_save(config_for(1, BF16_FP32_ACCUM, SAVED_RUN), save_dir)
        engine = build(config_for(1, BF16_FP32_ACCUM, SAVED_RUN, load_from_fp32_weights=False), seed=1)
        assert type(engine.optimizer).__name__ == "BF16_Optimizer"
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), rounding(saved["masters"]), "masters")
        assert_same(moments(engine), saved["moments"], "moments")
        assert set(steps(engine)) == {float(SAVED_STEPS)}, steps(engine)
