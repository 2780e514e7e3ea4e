# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
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
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint import zero3_checkpoint_reader
from deepspeed.checkpoint.affine_transfer import PlanBudget
from unit.checkpoint.zero_resume_helpers import (TAG, assert_fresh, assert_same, expect_rejected, masters, moments,
                                                 rounding, truncate_on_rank, weights, move_aside_on_rank)
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


def constant_lambda_lr(optimizer):
    """A torch scheduler (as Hugging Face's Trainer passes): per-group state (base_lrs) restored by position."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


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


class TestZero3Reshard(DistributedTest):
    world_size = 2

    @layouts("dp4->dp2", "dp2->dp4", "dp4->dp3")
    @pytest.mark.parametrize("precision", PRECISIONS)
    def test_every_mode_is_exact(self, tmp_path, world_size, layout, precision):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, precision, saved_world=world_size[0]):
            return
        ref = reference(save_dir)
        resume_in_every_mode(save_dir, ref, precision, next_step_in=("full", "fresh_optimizer"))


class TestZero3ReshardFp16(DistributedTest):
    world_size = 2

    @layouts("dp4->dp2")
    def test_every_mode_is_exact(self, tmp_path, world_size, layout):
        """fp16 with a dynamic loss scale: the full resume also restores the loss scale (compared)."""
        save_dir, precision = str(tmp_path), "fp16"
        if saves_reference(save_dir, precision, saved_world=world_size[0]):
            return
        ref = reference(save_dir)
        assert ref["loss_scale"] is not None
        resume_in_every_mode(save_dir, ref, precision)


class TestZero3ReshardQuantizedWeights(DistributedTest):
    """ZeRO++ qwZ (zero_quantized_weights) quantizes the weights it all-gathers, not the partitions a checkpoint
    holds: such a checkpoint resumes at another size like any other."""
    world_size = 2

    @layouts("dp4->dp2")
    def test_every_mode_is_exact(self, tmp_path, world_size, layout):
        if get_accelerator().device_name() != "cuda":
            pytest.skip("qwZ's quantizer is a CUDA op")
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], zero_quantized_weights=True):
            return
        ref = reference(save_dir)
        resume_in_every_mode(save_dir, ref, precision, next_step_in=(), zero_quantized_weights=True)


class TestZero3ReshardParameterKinds(DistributedTest):
    world_size = 2

    @layouts("dp2->dp4")
    def test_tied_and_one_element_parameters(self, tmp_path, world_size, layout):
        """A weight shared by two layers and a one-element parameter (padding only on every rank but the first):
        every mode exact."""
        save_dir, precision = str(tmp_path), "bf16"
        kinds = dict(model="tied_and_scalar", frozen=("layers.1.", ))
        if saves_reference(save_dir, precision, saved_world=world_size[0], **kinds):
            return
        ref = reference(save_dir)
        assert {"gain", "layers.0.weight"} <= set(ref["masters"]) and "layers.2.weight" not in ref["masters"]
        resume_in_every_mode(save_dir, ref, precision, **kinds)


# (saved with, loaded with) beyond DeepSpeed's defaults: no persistent parameter, other sub-groups at the load,
# the serial load (zero_optimization.pipeline_loading_checkpoint)
OTHER_SETTINGS = {
    "persistence_threshold=0": (dict(settings="persistence_threshold=0"), dict(settings="persistence_threshold=0")),
    "sub_group_size=100": (dict(), dict(sub_group_size=100)),
    "serial_load": (dict(), dict(pipeline_loading_checkpoint=True)),
    "offload_optimizer=cpu": (dict(offload_optimizer=dict(device="cpu")), dict(offload_optimizer=dict(device="cpu"))),
    "warmup_lr": (dict(warmup_lr=True), dict(warmup_lr=True)),
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
        resume_in_every_mode(save_dir, ref, precision, **load_overrides)


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

    @layouts("dp3->dp2")
    def test_saved_padded_in_sub_groups(self, tmp_path, world_size, layout):
        """Saved by 3 ranks (a 256-element weight leaves one padding element on the last rank) in one sub-group per
        parameter; loaded by 2 in one sub-group."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], sub_group_size=100):
            return
        ref = reference(save_dir)
        resume_in_every_mode(save_dir, ref, precision, next_step_in=())

    def test_sub_group_size_change_at_the_saved_size(self, tmp_path):
        save_dir, precision = str(tmp_path), "bf16"
        saves_reference(save_dir, precision, saved_world=dist.get_world_size())
        ref = reference(save_dir)
        assert len(build(precision, dist.get_world_size(), seed=1, sub_group_size=100).optimizer.fp16_groups) > 1
        resume_in_every_mode(save_dir, ref, precision, sub_group_size=100)


# Saved with two param groups; loaded with the same two swapped in order, each position keeping its
# hyperparameters: restored by position, layers.0 would train with lr 0.03 / weight_decay 0.1.
SAVED_GROUPS = [(("layers.0.", ), dict(lr=0.01, weight_decay=0.0)), (("layers.1.", ), dict(lr=0.03, weight_decay=0.1))]
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
    @pytest.mark.parametrize("change, match", [(without_param_shapes, "has no param_shapes.*saved with")],
                             ids=["no_param_shapes"])
    def test_checkpoint_the_slices_cannot_serve(self, tmp_path, world_size, layout, change, match):
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        rewrite_model_states(save_dir, change)
        engine = build("bf16", dist.get_world_size(), seed=1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine, save_dir, match, **kwargs)

    @layouts("dp4->dp2")
    def test_layout_the_planner_refuses(self, tmp_path, world_size, layout):
        """A plan over the planner's budget (by default more than 65536 segments, saved plus new ranks above 65537;
        here one segment) is refused in the check stage, naming the universal route, not "restore the file"."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        engine = build("bf16", dist.get_world_size(), seed=1)
        default_cache = zero3_checkpoint_reader.PlanCache
        zero3_checkpoint_reader.PlanCache = lambda: default_cache(PlanBudget(max_segments=1))
        try:
            for kwargs, _, _ in MODES.values():
                expect_rejected(engine, save_dir, "max_segments.*ds_to_universal", **kwargs)
        finally:
            zero3_checkpoint_reader.PlanCache = default_cache

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

    @layouts("dp4->dp2")
    @pytest.mark.parametrize("signal", ["config_and_codes", "codes_only"])
    def test_quantized_frozen_fragments(self, tmp_path, world_size, layout, signal):
        """Frozen fragments saved as int8 codes (zero_quantized_nontrainable_weights) hold no scales: decided from
        the checkpoint (its config, else the fragments' dtype), not from this run's config."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        rewrite_model_states(save_dir, lambda state: quantize_frozen_fragments(state, signal == "config_and_codes"))
        engine = build("bf16", dist.get_world_size(), seed=1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine, save_dir, "int8 codes.*zero_quantized_nontrainable_weights", **kwargs)


def quantize_frozen_fragments(state, with_config):
    """What zero_quantized_nontrainable_weights saves: the frozen fragments as int8 codes (their scales are not
    saved)."""
    fragments = state["frozen_param_fragments"]
    for name, fragment in fragments.items():
        fragments[name] = fragment.float().clamp(-1, 1).mul(127).to(torch.int8)
    if with_config:
        state["ds_config"]["zero_optimization"]["zero_quantized_nontrainable_weights"] = True


class TestZero3ReshardSerialLoad(DistributedTest):
    world_size = 2

    @layouts("dp4->dp2")
    def test_files_released_before_the_token_passes(self, tmp_path, world_size, layout):
        """zero_optimization.pipeline_loading_checkpoint bounds host memory by loading one rank at a time: a rank
        must drop the saved files it opened (held whole by a checkpoint engine that cannot memory-map them) before
        it hands the token on."""
        save_dir = str(tmp_path)
        if saves_reference(save_dir, "bf16", saved_world=world_size[0]):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build("bf16", dist.get_world_size(), seed=1, pipeline_loading_checkpoint=True)
            held_at_handover = []
            load_shards = engine._load_zero_checkpoint_shards  # returns right before the token is handed on

            def load_then_record(*args, **load_kwargs):
                loaded = load_shards(*args, **load_kwargs)
                held_at_handover.append(len(engine._zero3_slices._opened))
                return loaded

            engine._load_zero_checkpoint_shards = load_then_record
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert held_at_handover == [0], (mode, held_at_handover)


def test_reader_partitions_equal_a_direct_repartition():
    """The reader alone, on saved files built in memory (no process group): every state of every parameter, frozen
    ones too, at every new rank equals the parameter cut directly at the new size; the NaN padding of the saved
    partitions is never read, and a rank opens only the saved files its partitions come from."""
    import random
    from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, FROZEN_PARAM_FRAGMENTS, OPTIMIZER_STATE_DICT
    from unit.checkpoint.affine_plan_helpers import zero3_buffers
    rng = random.Random(0)
    for _ in range(60):
        saved_dp, world = rng.randint(1, 9), rng.randint(1, 9)
        param_shapes = [{
            f"g{group}.p{index}": (rng.choice([0, 1, rng.randint(2, 40)]), )
            for index in range(rng.randint(1, 4))
        } for group in range(rng.randint(1, 3))]
        full = {name: torch.randn(shape) for shapes in param_shapes for name, shape in shapes.items()}
        frozen = torch.randn(rng.randint(1, 30))
        files = {}
        for rank in range(saved_dp):
            flats = [
                torch.cat([zero3_buffers(full[name], saved_dp, float("nan"))[rank] for name in shapes])
                for shapes in param_shapes
            ]
            state = {group: {"exp_avg": flat * 2} for group, flat in enumerate(flats)}
            files[f"optim{rank}"] = {
                OPTIMIZER_STATE_DICT: {
                    FP32_FLAT_GROUPS: flats,
                    OPTIMIZER_STATE_DICT: {
                        "state": state
                    }
                }
            }
            files[f"model{rank}"] = {
                FROZEN_PARAM_FRAGMENTS: {
                    "frozen": zero3_buffers(frozen, saved_dp, float("nan"))[rank]
                }
            }
        for rank in range(world):
            opened = []
            reader = zero3_checkpoint_reader.Zero3CheckpointReader([f"optim{saved}" for saved in range(saved_dp)],
                                                                   [f"model{saved}" for saved in range(saved_dp)],
                                                                   param_shapes, {"frozen": tuple(frozen.shape)},
                                                                   lambda path: opened.append(path) or files[path])
            for name, tensor in full.items():
                for key, scale in (("fp32", 1), ("exp_avg", 2)):
                    expected = zero3_buffers(tensor * scale, world, 0.0)[rank]
                    assert torch.equal(reader.partition(name, key, rank, world, torch.float32), expected), (name, key)
            assert torch.equal(reader.partition("frozen", "frozen", rank, world, torch.float32),
                               zero3_buffers(frozen, world, 0.0)[rank])
            partition = -(-frozen.numel() // world)
            start, stop = rank * partition, min((rank + 1) * partition, frozen.numel())
            saved_partition = -(-frozen.numel() // saved_dp)
            needed = sorted({index // saved_partition for index in range(start, stop)})
            assert reader.saved_ranks("frozen", rank, world) == needed
            reader.close()
            opened.clear()
            reader.check([("frozen", "frozen", rank, world)])
            assert opened == [f"model{saved}" for saved in needed]
