# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 and BF16_Optimizer: a rigid checkpoint saved at one data-parallel size resumes directly at another.

Each rank reads, by parameter name, the pieces of its new flat partitions from the saved ranks' memory-mapped
shards (their param_slice_mappings locate every piece). A checkpoint saved by `saved_world` ranks is loaded by
`world_size` ranks in every resume mode; the gathered fp32 masters, both Adam moments, the steps, each parameter's
hyperparameters, the loss scale and every 16-bit weight must equal the saved ones bit for bit (or, where the mode
rebuilds the masters, the saved weights' rounding), and one more step lands where the run that never stopped did.
The global batch, the layouts and the next-step tolerances are those of the ZeRO-3 reshard tests."""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.checkpoint.zero3_reshard_helpers import (GLOBAL_BATCH, HIDDEN, MODES, NEXT_STEP_RTOL, SAVED_STEPS,
                                                   global_batch, global_loss, layouts, reference)
from unit.checkpoint.zero_resume_helpers import (TAG, WAYS_OUT, assert_fresh, assert_same, check_refused_then_rebuilt,
                                                 expect_rejected, make_config, masters, moments, move_aside_on_rank,
                                                 rounding, shard_path, weights)
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP

BF16_FP32_ACCUM = "bf16_fp32_grad_accum"  # bf16 with fp32 gradient accumulation: BF16_Optimizer under ZeRO-1
# (stage, precision): DeepSpeedZeroOptimizer in bf16 at stages 1 and 2 first, then fp32, fp16 and BF16_Optimizer
CELLS = [(1, "bf16"), (2, "bf16")]
MORE_CELLS = [(2, "fp32"), (2, "fp16"), (1, BF16_FP32_ACCUM)]
# Two param groups with hyperparameters of their own (build's `groups`), both other than the config's (lr 1e-2, no
# weight decay); loaded with other values again, so a full resume that restores the saved ones is visible.
SAVED_GROUPS = [(("layers.0.", ), dict(lr=0.02, weight_decay=0.0)), (("layers.1.", ), dict(lr=0.03, weight_decay=0.1))]
LOADED_GROUPS = [(("layers.0.", ), dict(lr=0.05, weight_decay=0.2)), (("layers.1.", ), dict(lr=0.07,
                                                                                            weight_decay=0.3))]


def reshard_config(stage, precision, world_size, **zero_overrides):
    config = make_config(stage, "fp32" if precision in ("fp32", "fp16") else "bf16", **zero_overrides)
    if precision == "fp16":
        # the scale doubles after every step without overflow: the saved scale is not the configured one
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}
    elif precision == BF16_FP32_ACCUM:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world_size
    return config


def build(stage, precision, seed, frozen=(), groups=None, **zero_overrides):
    """A TinyMLP engine at this world size. groups: [(name prefixes, hyperparameters)], one param group each."""
    if precision == "fp16":
        # The CPU accelerator reports fp16 unsupported where oneDNN lacks fp16 kernels; the tiny model's fp16
        # Linear/tanh/MSE and gloo's fp16 collectives still run (slowly) on the CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    model = TinyMLP(hidden=HIDDEN)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(tuple(frozen)))
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    trainable = [param for _, param in named] if groups is None else [
        dict(params=[param for name, param in named if name.startswith(prefixes)], **hyperparameters)
        for prefixes, hyperparameters in groups
    ]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=trainable,
                                           config=reshard_config(stage, precision, dist.get_world_size(),
                                                                 **zero_overrides))
    return engine


def train_step(engine):
    """One step on this rank's rows of the global batch (the same global batch every step, at every size)."""
    x, y = global_batch()
    rows = GLOBAL_BATCH // dist.get_world_size()
    start, dtype = dist.get_rank() * rows, next(engine.module.parameters()).dtype
    rows_x, rows_y = x[start:start + rows], y[start:start + rows]
    engine.backward(engine(rows_x.to(engine.device, dtype), rows_y.to(engine.device, dtype)))
    engine.step()


def param_groups_by_name(engine):
    """{parameter name: (the base optimizer's state of its param group's flat partition, that param group)}."""
    optimizer = engine.optimizer
    lp_groups = optimizer.bf16_groups if hasattr(optimizer, "bf16_groups") else optimizer.bit16_groups
    names = {param: name for name, param in engine.module.named_parameters()}
    return {
        names[param]: (optimizer.optimizer.state.get(group["params"][0], {}), group)
        for lp_group, group in zip(lp_groups, optimizer.optimizer.param_groups)
        for param in lp_group
    }


def steps_by_name(engine):
    """{parameter name: its param group's step count} (None: fresh); the same on every rank."""
    return {
        name: float(state["step"]) if "step" in state else None
        for name, (state, _) in param_groups_by_name(engine).items()
    }


def hyperparameters_by_name(engine):
    return {
        name: (group["lr"], group["weight_decay"], tuple(group["betas"]))
        for name, (_, group) in param_groups_by_name(engine).items()
    }


def optimizer_side_state(engine):
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return dict(loss_scale=getattr(scaler, "cur_scale", None), clip_grad=engine.optimizer.clip_grad)


def saves_reference(save_dir, stage, precision, saved_world, **build_args):
    """In the world of `saved_world` ranks (the first of the test's two): train, save TAG, then train on as if never
    stopped, keeping the saved state and that loss in reference.pt; returns True. In the other world: False."""
    if dist.get_world_size() != saved_world:
        return False
    engine = build(stage, precision, seed=0, **build_args)
    for _ in range(SAVED_STEPS):
        train_step(engine)
    state = dict(masters=masters(engine),
                 moments=moments(engine),
                 steps=steps_by_name(engine),
                 weights=weights(engine),
                 hyperparameters=hyperparameters_by_name(engine),
                 optimizer_side=optimizer_side_state(engine))
    engine.save_checkpoint(save_dir, tag=TAG)
    train_step(engine)
    state["next_loss"] = global_loss(engine)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(save_dir, "reference.pt"))
    dist.barrier()
    return True


def check_resumed(engine, ref, expected_masters, optimizer_state, precision):
    label = f"at {dist.get_world_size()} ranks"
    assert_same(weights(engine), ref["weights"], f"weights {label}")
    # a rebuild rounds the masters to the 16-bit weights (a no-op where the weights are fp32)
    weight_dtype = next(engine.module.parameters()).dtype
    rebuilt = ref["masters"] if precision == "fp32" else rounding(ref["masters"], weight_dtype)
    assert_same(masters(engine), ref["masters"] if expected_masters == "saved" else rebuilt, f"masters {label}")
    if optimizer_state == "saved":
        assert_same(moments(engine), ref["moments"], f"moments {label}")
        assert steps_by_name(engine) == ref["steps"], (steps_by_name(engine), ref["steps"])
        assert hyperparameters_by_name(engine) == ref["hyperparameters"], hyperparameters_by_name(engine)
        assert optimizer_side_state(engine) == ref["optimizer_side"], optimizer_side_state(engine)
    else:
        assert_fresh(engine)


def check_next_step(engine, ref, precision, optimizer_state):
    """One more step from the resumed state matches the uninterrupted run's (global_loss after it), within the
    rounding of a gradient averaged over another number of ranks; from a fresh optimizer it does not."""
    train_step(engine)
    loss, rtol = global_loss(engine), NEXT_STEP_RTOL["bf16" if precision == BF16_FP32_ACCUM else precision]
    if optimizer_state == "saved":
        assert loss == pytest.approx(ref["next_loss"], rel=rtol, abs=0), (loss, ref["next_loss"])
    else:
        assert loss != pytest.approx(ref["next_loss"], rel=10 * rtol, abs=0), (loss, ref["next_loss"])


# The ZeRO-3 reshard tests' modes, and a fresh optimizer with the masters rebuilt from the 16-bit weights.
RESUME_MODES = dict(MODES,
                    rebuilt_fresh=(dict(load_optimizer_states=False, load_fp32_weights=False), "rounded", "fresh"))


def resume_in_every_mode(save_dir, stage, precision, **build_args):
    """Load the checkpoint into a new engine (built with build_args) in each mode and check what it restored."""
    ref = reference(save_dir)
    for mode, (kwargs, expected_masters, optimizer_state) in RESUME_MODES.items():
        engine = build(stage, precision, seed=1, **build_args)
        engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
        check_resumed(engine, ref, expected_masters, optimizer_state, precision)
        if mode in ("full", "fresh_optimizer"):
            check_next_step(engine, ref, precision, optimizer_state)


class TestZero12Reshard(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @layouts("dp4->dp2", "dp2->dp4", "dp4->dp3")
    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_every_mode_is_exact(self, tmp_path, world_size, layout, stage, precision):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, stage, precision, saved_world=world_size[0]):
            return
        resume_in_every_mode(save_dir, stage, precision)

    @layouts("dp2->dp4")  # ranks beyond the saved size have no shard of their own (loss scale, clip_grad)
    @pytest.mark.parametrize("stage, precision", MORE_CELLS)
    def test_other_precisions(self, tmp_path, world_size, layout, stage, precision):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, stage, precision, saved_world=world_size[0]):
            return
        resume_in_every_mode(save_dir, stage, precision)

    @layouts("dp4->dp3")
    @pytest.mark.parametrize("stage, precision", CELLS)
    def test_cpu_optimizer_offload(self, tmp_path, world_size, layout, stage, precision):
        """offload_optimizer.device=cpu (DeepSpeedCPUAdam, masters and moments in host memory) at both sizes."""
        save_dir, offload = str(tmp_path), dict(offload_optimizer=dict(device="cpu"))
        if saves_reference(save_dir, stage, precision, saved_world=world_size[0], **offload):
            return
        resume_in_every_mode(save_dir, stage, precision, **offload)

    @layouts("dp4->dp3")
    @pytest.mark.parametrize("stage, precision", [(2, "bf16")])
    def test_param_groups_and_a_frozen_layer(self, tmp_path, world_size, layout, stage, precision):
        """Two param groups of their own hyperparameters and a frozen layer (saved whole in the model states), loaded
        with other hyperparameters configured: a full resume restores each parameter's saved ones."""
        save_dir, frozen = str(tmp_path), ("layers.2.", )
        if saves_reference(save_dir, stage, precision, saved_world=world_size[0], groups=SAVED_GROUPS, frozen=frozen):
            return
        resume_in_every_mode(save_dir, stage, precision, groups=LOADED_GROUPS, frozen=frozen)


class TestZero12ReshardRefused(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @layouts("dp2->dp4")
    def test_missing_shard_of_a_saved_rank(self, tmp_path, world_size, layout):
        """Saved rank 1's shard missing: every rank refuses the loads that must restore the saved masters, naming it,
        with the engine unchanged; the default fresh-optimizer resume rebuilds them from the 16-bit weights on every
        rank, those beyond the saved size included."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, 2, "bf16", saved_world=world_size[0]):
            return
        put_back = move_aside_on_rank(shard_path(save_dir, 1), 0)
        check_refused_then_rebuilt(build(2, "bf16", seed=1), lambda: build(2, "bf16", seed=1), save_dir,
                                   "shard of saved rank 1.*" + WAYS_OUT, rounding(reference(save_dir)["masters"]))
        put_back()

    @layouts("dp4->dp2")
    def test_round_robin_gradients(self, tmp_path, world_size, layout):
        """round_robin_gradients orders a flat partition by the data-parallel size, which param_slice_mappings do
        not follow: refused on every rank, naming it, engine unchanged."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, 2, "bf16", saved_world=world_size[0], round_robin_gradients=True):
            return
        engine = build(2, "bf16", seed=1, round_robin_gradients=True)
        expect_rejected(engine, save_dir, "round_robin_gradients reorders the flat partitions.*" + WAYS_OUT)
