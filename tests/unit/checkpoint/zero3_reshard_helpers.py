# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Helpers of the ZeRO-3 reshard tests: a rigid checkpoint saved in one world is loaded in another.

A test runs in two worlds in turn (upstream's world_size lists). In the first, `saves_reference` trains
SAVED_STEPS steps, saves TAG and takes one more step as the run that never stopped, keeping what it saved in
reference.pt; the second loads the checkpoint and compares what it restored with that reference, bit for bit.

The data is one global batch of 12 samples, split over the ranks (12 divides by 2, 3 and 4): the same global
batch at every size, so one step from bit-exact state differs from the uninterrupted run's only by the order in
which the gradients of the ranks are summed (tolerances at NEXT_STEP_RTOL).
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.checkpoint.zero_resume_helpers import TAG, assert_fresh, assert_same, masters, moments, rounding, weights
from unit.zero_tiny_models import TinyMLP, model_dtype, zero3_config

GLOBAL_BATCH = 12
HIDDEN = 16
SAVED_STEPS = 3
FROZEN = ("layers.2.", )  # a frozen layer: its pieces are saved in the model-states files, not the shards

# mode -> (load_checkpoint kwargs, masters: "saved" | "rounded", optimizer state: "saved" | "fresh")
MODES = {
    "full": (dict(), "saved", "saved"),
    "fresh_optimizer": (dict(load_optimizer_states=False), "saved", "fresh"),
    "rebuilt_masters": (dict(load_fp32_weights=False), "rounded", "saved"),
    "module_only": (dict(load_module_only=True), "rounded", "fresh"),
}

# Two optimizer param groups with hyperparameters of their own (build's `groups`).
SAVED_GROUPS = [(("layers.0.", ), dict(lr=0.01, weight_decay=0.0)), (("layers.1.", ), dict(lr=0.03, weight_decay=0.1))]

# Relative tolerance of the loss after one step from the resumed state (global_loss) against the uninterrupted
# run's: the weights it starts from are bit-exact, the gradient is averaged over another number of ranks (another
# summation order), and 16-bit weights round the update. Measured at 4 -> 3: 1.5e-7 (fp32), 1.2e-6 (autocast),
# 1.8e-5 (bf16, bf16_master); a fresh optimizer's step differs by 4e-3.
NEXT_STEP_RTOL = {"fp32": 1e-6, "autocast": 1e-5, "bf16": 2e-4, "bf16_master": 2e-4, "fp16": 2e-4}


def reshard_config(precision, world_size, settings="defaults", warmup_lr=False, **zero_overrides):
    config = zero3_config(precision, settings=settings, **zero_overrides)
    config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world_size
    if warmup_lr:
        config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}
    return config


class TinyMLPTiedAndScalar(TinyMLP):
    """TinyMLP whose last layer shares the first one's weight, with a one-element parameter: every rank but the
    first holds only padding of `gain`. (A zero-element parameter fails in ZeRO-3's all-gather on 0.19.8, in the
    first forward: "torch.cat(): expected a non-empty list of Tensors".)"""

    def __init__(self, hidden=HIDDEN):
        super().__init__(hidden=hidden)
        self.layers[2].weight = self.layers[0].weight
        self.gain = torch.nn.Parameter(torch.full((1, ), 0.5))

    def forward(self, x, y):
        return super().forward(x * (1 + self.gain), y)


MODELS = {"mlp": TinyMLP, "tied_and_scalar": TinyMLPTiedAndScalar}


def build(precision, world_size, seed, frozen=FROZEN, groups=None, model="mlp", lr_scheduler=None, **overrides):
    """A TinyMLP engine. groups: [(name prefixes, hyperparameters)], one optimizer param group each, in order."""
    if precision == "fp16":
        # The CPU accelerator reports fp16 unsupported where oneDNN lacks fp16 kernels; the tiny model's fp16
        # Linear/tanh/MSE and gloo's fp16 collectives still run (slowly) on the CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    model = MODELS[model](hidden=HIDDEN)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    trainable = [p for p in model.parameters() if p.requires_grad]
    if groups is not None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        trainable = [
            dict(params=[p for name, p in named if name.startswith(prefixes)], **hyperparameters)
            for prefixes, hyperparameters in groups
        ]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=trainable,
                                           lr_scheduler=lr_scheduler,
                                           config=reshard_config(precision, world_size, **overrides))
    return engine


def global_batch():
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(GLOBAL_BATCH, HIDDEN,
                       generator=gen), torch.tanh(torch.randn(GLOBAL_BATCH, HIDDEN, generator=gen))


def train_step(engine, precision):
    """One step on this rank's rows of the global batch (the same global batch every step, at every size)."""
    x, y = global_batch()
    rows = GLOBAL_BATCH // dist.get_world_size()
    start, dtype = dist.get_rank() * rows, model_dtype(precision)
    loss = engine(x[start:start + rows].to(engine.device, dtype), y[start:start + rows].to(engine.device, dtype))
    engine.backward(loss)
    engine.step()


def global_loss(engine):
    """The loss of the whole global batch under the engine's (gathered) weights, computed in fp32 the same way on
    every rank and at every size: it compares two runs' weights without the 16-bit loss's own rounding."""
    model = type(engine.module)(hidden=HIDDEN)
    # not strict: a tied weight is one parameter under one name, and two keys of the module's state dict
    model.load_state_dict({name: weight.float() for name, weight in weights(engine).items()}, strict=False)
    with torch.no_grad():
        return model(*global_batch()).item()


def saved_state(engine):
    return dict(masters=masters(engine),
                moments=moments(engine),
                steps=steps_by_name(engine),
                weights=weights(engine),
                hyperparameters=hyperparameters_by_name(engine),
                loss_scale=loss_scale(engine),
                lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None)


def optimizer_groups_by_name(engine):
    """{parameter name: (its sub-group's optimizer state, its param group)}."""
    optimizer = engine.optimizer
    found = {}
    for sub_group_id, params in enumerate(optimizer.fp16_groups):
        state = optimizer.optimizer.state.get(optimizer.fp32_partitioned_groups_flat[sub_group_id], {})
        group = optimizer.optimizer.param_groups[optimizer.sub_group_to_group_id[sub_group_id]]
        for param in params:
            found[optimizer.param_names[param]] = (state, group)
    return found


def steps_by_name(engine):
    """{parameter name: the step count of its sub-group} (None: fresh); the same on every rank."""
    return {
        name: float(state["step"]) if "step" in state else None
        for name, (state, _) in optimizer_groups_by_name(engine).items()
    }


def hyperparameters_by_name(engine):
    """{parameter name: (lr, weight_decay, betas)} of the optimizer param group that trains it."""
    return {
        name: (group["lr"], group["weight_decay"], tuple(group["betas"]))
        for name, (_, group) in optimizer_groups_by_name(engine).items()
    }


def loss_scale(engine):
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return getattr(scaler, "cur_scale", None)


def saves_reference(save_dir, precision, saved_world, settings="defaults", **build_args):
    """In the world of `saved_world` ranks (the first of the test's two): train, save TAG, then train on as if never
    stopped, keeping the saved state and those losses in reference.pt; returns True. In the other world: False."""
    if dist.get_world_size() != saved_world:
        return False
    engine = build(precision, saved_world, seed=0, settings=settings, **build_args)
    for _ in range(SAVED_STEPS):
        train_step(engine, precision)
    state = saved_state(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    train_step(engine, precision)
    state["next_loss"] = global_loss(engine)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(save_dir, "reference.pt"))
    dist.barrier()
    return True


def reference(save_dir):
    return torch.load(os.path.join(save_dir, "reference.pt"), weights_only=False)


def check_resumed(engine, ref, expected_masters, optimizer_state, precision):
    label = f"at {dist.get_world_size()} ranks"
    assert_same(weights(engine), ref["weights"], f"weights {label}")
    # a rebuild rounds the masters to the 16-bit weights (no-op where the weights are fp32 or the masters bf16)
    rebuilt = rounding(ref["masters"], model_dtype(precision)) if precision in ("bf16", "fp16") else ref["masters"]
    assert_same(masters(engine), ref["masters"] if expected_masters == "saved" else rebuilt, f"masters {label}")
    if optimizer_state == "saved":
        assert_same(moments(engine), ref["moments"], f"moments {label}")
        assert steps_by_name(engine) == ref["steps"], (steps_by_name(engine), ref["steps"])
        assert hyperparameters_by_name(engine) == ref["hyperparameters"], hyperparameters_by_name(engine)
        assert loss_scale(engine) == ref["loss_scale"]
    else:
        assert_fresh(engine)
    if ref["lr_scheduler"] is not None and optimizer_state == "saved":
        assert engine.lr_scheduler.state_dict() == ref["lr_scheduler"], engine.lr_scheduler.state_dict()


def check_next_step(engine, ref, precision, optimizer_state):
    """One more step from the resumed state matches the uninterrupted run's (global_loss after it), within the
    rounding of a gradient averaged over another number of ranks; from a fresh optimizer it does not (the check
    can tell the two apart)."""
    train_step(engine, precision)
    loss, rtol = global_loss(engine), NEXT_STEP_RTOL[precision]
    if optimizer_state == "saved":
        assert loss == pytest.approx(ref["next_loss"], rel=rtol, abs=0), (loss, ref["next_loss"])
    else:
        assert loss != pytest.approx(ref["next_loss"], rel=10 * rtol, abs=0), (loss, ref["next_loss"])


def resume_in_every_mode(save_dir, ref, precision, next_step_in=("full", ), **build_args):
    """Load the checkpoint into a new engine in each mode and check what it restored, then, in the modes named, the
    next step."""
    for mode, (kwargs, expected_masters, optimizer_state) in MODES.items():
        engine = build(precision, dist.get_world_size(), seed=1, **build_args)
        engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
        check_resumed(engine, ref, expected_masters, optimizer_state, precision)
        if mode in next_step_in:
            check_next_step(engine, ref, precision, optimizer_state)


# [saved by, resumed by]: the test runs in each world in turn (upstream's world_size lists)
LAYOUTS = {"dp4->dp2": [4, 2], "dp2->dp4": [2, 4], "dp4->dp3": [4, 3], "dp3->dp2": [3, 2]}
PRECISIONS = ["fp32", "autocast", "bf16", "bf16_master"]


def layouts(*names):
    """parametrize("world_size, layout", ...) for these layouts"""
    return pytest.mark.parametrize("world_size, layout", [(LAYOUTS[name], name) for name in names],
                                   ids=[name.replace("->", "to") for name in names])
