# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""ZeRO-3: a rigid checkpoint saved at one data-parallel size resumes directly at another.

Each rank reads its new partitions as slices of the saved shards. A checkpoint saved by `saved_world` ranks is
loaded by `world_size` ranks in every resume mode; the gathered fp32 masters, both Adam moments, the step
counts and every 16-bit weight must equal the saved ones bit for bit (or, where the mode rebuilds them, the
saved weights' rounding), and one more step lands where the run that never stopped did.

The data is one global batch of 12 samples, split over the ranks (12 divides by 2, 3 and 4): the same global
batch at every size, so one step from bit-exact state differs from the uninterrupted run's only by the order in
which the gradients of the ranks are summed (tolerances at NEXT_STEP_RTOL).
"""

import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.checkpoint.zero_resume_helpers import (TAG, assert_fresh, assert_same, expect_rejected, masters, moments,
                                                 rounding, steps, truncate_on_rank, weights, move_aside_on_rank)
from unit.common import DistributedTest
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

# Relative tolerance of the loss after one step from the resumed state (global_loss) against the uninterrupted
# run's: the weights it starts from are bit-exact, the gradient is averaged over another number of ranks (another
# summation order), and 16-bit weights round the update. Measured at 4 -> 3: 1.5e-7 (fp32), 1.2e-6 (autocast),
# 1.8e-5 (bf16, bf16_master); a fresh optimizer's step differs by 4e-3.
NEXT_STEP_RTOL = {"fp32": 1e-6, "autocast": 1e-5, "bf16": 2e-4, "bf16_master": 2e-4}


def reshard_config(precision, world_size, settings="defaults", **zero_overrides):
    config = zero3_config(precision, settings=settings, **zero_overrides)
    config["train_micro_batch_size_per_gpu"] = GLOBAL_BATCH // world_size
    return config


def build(precision, world_size, seed, frozen=FROZEN, **overrides):
    torch.manual_seed(seed)
    model = TinyMLP(hidden=HIDDEN)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=trainable,
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
    model = TinyMLP(hidden=HIDDEN)
    model.load_state_dict({name: weight.float() for name, weight in weights(engine).items()})
    with torch.no_grad():
        return model(*global_batch()).item()


def saved_state(engine):
    return dict(masters=masters(engine), moments=moments(engine), steps=steps(engine), weights=weights(engine))


def saves_reference(save_dir, precision, saved_world, settings="defaults"):
    """In the world of `saved_world` ranks (the first of the test's two): train, save TAG, then train on as if never
    stopped, keeping the saved state and those losses in reference.pt; returns True. In the other world: False."""
    if dist.get_world_size() != saved_world:
        return False
    engine = build(precision, saved_world, seed=0, settings=settings)
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
    rebuilt = rounding(ref["masters"]) if precision == "bf16" else ref["masters"]
    assert_same(masters(engine), ref["masters"] if expected_masters == "saved" else rebuilt, f"masters {label}")
    if optimizer_state == "saved":
        assert_same(moments(engine), ref["moments"], f"moments {label}")
        assert steps(engine) and set(steps(engine)) == set(ref["steps"]), (steps(engine), ref["steps"])
    else:
        assert_fresh(engine)


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


# [saved by, resumed by]: the test runs in each world in turn (upstream's world_size lists)
LAYOUTS = {"dp4->dp2": [4, 2], "dp2->dp4": [2, 4], "dp4->dp3": [4, 3]}
PRECISIONS = ["fp32", "autocast", "bf16", "bf16_master"]


def layouts(*names):
    """parametrize("world_size, layout", ...) for these layouts"""
    return pytest.mark.parametrize("world_size, layout", [(LAYOUTS[name], name) for name in names],
                                   ids=[name.replace("->", "to") for name in names])


class TestZero3Reshard(DistributedTest):
    world_size = 2

    @layouts(*LAYOUTS)
    @pytest.mark.parametrize("precision", PRECISIONS)
    def test_every_mode_is_exact(self, tmp_path, world_size, layout, precision):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, precision, saved_world=world_size[0]):
            return
        ref = reference(save_dir)
        for mode, (kwargs, expected_masters, optimizer_state) in MODES.items():
            engine = build(precision, dist.get_world_size(), seed=1)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            check_resumed(engine, ref, expected_masters, optimizer_state, precision)
            if mode in ("full", "fresh_optimizer"):
                check_next_step(engine, ref, precision, optimizer_state)


# (saved with, loaded with) beyond DeepSpeed's defaults: no persistent parameter, other sub-groups at the load,
# the serial load (zero_optimization.pipeline_loading_checkpoint)
OTHER_SETTINGS = {
    "persistence_threshold=0": (dict(settings="persistence_threshold=0"), dict(settings="persistence_threshold=0")),
    "sub_group_size=100": (dict(), dict(sub_group_size=100)),
    "serial_load": (dict(), dict(pipeline_loading_checkpoint=True)),
}


class TestZero3ReshardSettings(DistributedTest):
    world_size = 2

    @layouts("dp4->dp3")
    @pytest.mark.parametrize("settings", list(OTHER_SETTINGS))
    def test_every_mode_is_exact(self, tmp_path, world_size, layout, settings):
        save_overrides, load_overrides = OTHER_SETTINGS[settings]
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], **save_overrides):
            return
        ref = reference(save_dir)
        for mode, (kwargs, expected_masters, optimizer_state) in MODES.items():
            engine = build(precision, dist.get_world_size(), seed=1, **load_overrides)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            check_resumed(engine, ref, expected_masters, optimizer_state, precision)
            if mode == "full":
                check_next_step(engine, ref, precision, optimizer_state)


UNFROZEN = "layers.2.weight, layers.2.bias are trainable now but were not when it was saved"


class TestZero3ReshardTrainableSetChange(DistributedTest):
    world_size = 2

    @layouts("dp4->dp2")
    def test_unfreeze_then_resume(self, tmp_path, world_size, layout):
        """Layers frozen when saved train after the resume at another size: their saved weights are there, their
        masters and moments are not. Loads that restore masters refuse, with the engine unchanged; the default
        fresh-optimizer resume rebuilds every master from the loaded weights, as at the same size."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0]):
            return
        ref = reference(save_dir)
        engine = build(precision, dist.get_world_size(), seed=1, frozen=())
        for kwargs in (dict(), dict(load_optimizer_states=False, load_fp32_weights=True)):
            expect_rejected(engine, save_dir, UNFROZEN + ".*load_fp32_weights=False", **kwargs)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(weights(engine), ref["weights"], "weights")
        assert_same(masters(engine), {name: weight.float() for name, weight in ref["weights"].items()}, "masters")
        assert_fresh(engine)
        train_step(engine, precision)


def rewrite_model_states(save_dir, change):
    """Apply change(state) to every saved model-states file (rank 0 writes, every rank waits)."""
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(os.path.join(save_dir, TAG)):
            if name.endswith("_model_states.pt"):
                path = os.path.join(save_dir, TAG, name)
                state = torch.load(path, weights_only=False)
                change(state)
                torch.save(state, path)
    dist.barrier()


def without_param_shapes(state):
    state.pop("param_shapes")


def saved_with_tensor_parallelism(state):
    state["checkpoint_parallel_dimensions"] = dict(pp_degree=1, tp_degree=2)


class TestZero3ReshardRefused(DistributedTest):
    """What the slices cannot serve is refused on every rank before anything changes, naming the way out."""
    world_size = 2

    @layouts("dp4->dp2")
    def test_truncated_shard_read_by_one_rank(self, tmp_path, world_size, layout):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        # at 2 ranks, rank 1 alone reads saved rank 3's pieces
        truncate_on_rank(os.path.join(save_dir, TAG, "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt"), rank=0)
        engine = build("bf16", dist.get_world_size(), seed=1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine, save_dir, "rank_3.*cannot be read.*Restore the file", refusing_rank=1, **kwargs)

    def test_missing_model_states_file_at_the_saved_size(self, tmp_path):
        """Only ranks beyond the saved ones read saved rank 0's model-states file: a saved rank's own file missing
        is refused on every rank (its frozen parameters' pieces are there)."""
        save_dir = str(tmp_path)
        saves_reference(save_dir, "bf16", saved_world=dist.get_world_size())
        move_aside_on_rank(os.path.join(save_dir, TAG, "zero_pp_rank_1_mp_rank_00_model_states.pt"), rank=0)
        engine = build("bf16", dist.get_world_size(), seed=1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine,
                            save_dir,
                            "zero_pp_rank_1_mp_rank_00_model_states.pt is missing.*Restore the file",
                            refusing_rank=1,
                            **kwargs)

    @layouts("dp4->dp2")
    @pytest.mark.parametrize("change, match", [(without_param_shapes, "has no param_shapes.*saved with"),
                                               (saved_with_tensor_parallelism, "tp_degree.*universal")],
                             ids=["no_param_shapes", "tensor_parallel"])
    def test_checkpoint_the_slices_cannot_serve(self, tmp_path, world_size, layout, change, match):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        rewrite_model_states(save_dir, change)
        engine = build("bf16", dist.get_world_size(), seed=1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine, save_dir, match, **kwargs)

    @layouts("dp4->dp2")
    def test_nvme_offload(self, tmp_path, world_size, layout):
        """NVMe offload reads this rank's own shard and swap files in every mode: no slices."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible():
            pytest.skip("async_io is not available")
        engine = build("bf16",
                       dist.get_world_size(),
                       seed=1,
                       offload_optimizer=dict(device="nvme", nvme_path=os.path.join(save_dir, "nvme")))
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine, save_dir, "NVMe optimizer offload.*data-parallel size", **kwargs)
