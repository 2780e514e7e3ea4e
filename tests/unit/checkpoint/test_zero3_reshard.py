# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a rigid checkpoint saved at one data-parallel size resumes directly at another.

Each rank reads its new partitions as slices of the saved shards. A checkpoint saved by `saved_world` ranks is
loaded by `world_size` ranks in every resume mode; the gathered fp32 masters, both Adam moments, the step
counts and every 16-bit weight must equal the saved ones bit for bit (or, where the mode rebuilds them, the
saved weights' rounding), and one more step lands where the run that never stopped did (zero3_reshard_helpers).
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint import zero3_checkpoint_reader
from deepspeed.checkpoint.affine_transfer import PlanBudget
from unit.checkpoint.zero3_reshard_helpers import (MODES, PRECISIONS, SAVED_GROUPS, build, layouts, reference,
                                                   resume_in_every_mode, saves_reference)
from unit.checkpoint.zero_resume_helpers import (TAG, assert_same, expect_rejected, masters, move_aside_on_rank,
                                                 truncate_on_rank)
from unit.common import DistributedTest
from unit.checkpoint.checkpoint_edits import without_manifest


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

    @layouts("dp4->dp2")
    def test_every_parameter_trainable(self, tmp_path, world_size, layout):
        """The model as DeepSpeed's defaults leave it: nothing frozen, no model-states fragments."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], frozen=()):
            return
        ref = reference(save_dir)
        resume_in_every_mode(save_dir, ref, precision, next_step_in=("full", "fresh_optimizer"), frozen=())


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


# The load of test_param_groups: at DeepSpeed's default sub_group_size, and cut into one sub-group per parameter.
PARAM_GROUP_LOADS = {"2 param groups": {}, "2 param groups, sub_group_size=100 (loaded)": dict(sub_group_size=100)}


class TestZero3ReshardLayouts(DistributedTest):
    """Sub-groups and param groups at another size: the saved sub-groups are cut by the saved size, the new ones
    by the new size, so a rank's sub-group rarely matches a saved one."""
    world_size = 2

    @layouts("dp3->dp2")
    def test_saved_padded_in_sub_groups(self, tmp_path, world_size, layout):
        """Saved by 3 ranks (a 256-element weight leaves two padding elements on the last rank) in two sub-groups
        (sub_group_size=100); loaded by 2 in one sub-group."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], sub_group_size=100):
            return
        ref = reference(save_dir)
        resume_in_every_mode(save_dir, ref, precision, next_step_in=())

    @layouts("dp4->dp2")
    @pytest.mark.parametrize("settings", list(PARAM_GROUP_LOADS), ids=["default", "sub_group_size=100"])
    def test_param_groups(self, tmp_path, world_size, layout, settings):
        """Saved in two param groups as one sub-group each; loaded in the same two groups, at DeepSpeed's default
        sub_group_size or cut into one sub-group per parameter: each parameter keeps its group's lr and weight_decay
        and its step."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], groups=SAVED_GROUPS):
            return
        ref = reference(save_dir)
        assert {hyperparameters[:2]
                for hyperparameters in ref["hyperparameters"].values()} == {(0.01, 0.0), (0.03, 0.1)}
        resume_in_every_mode(save_dir, ref, precision, groups=SAVED_GROUPS, **PARAM_GROUP_LOADS[settings])


def rewrite_saved_files(save_dir, suffix, change):
    """Apply change(state) to every saved file whose name ends with suffix (rank 0 writes, every rank waits)."""
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(os.path.join(save_dir, TAG)):
            if name.endswith(suffix):
                path = os.path.join(save_dir, TAG, name)
                state = torch.load(path, weights_only=False)
                change(state)
                torch.save(state, path)
                without_manifest(path)
    dist.barrier()


def rewrite_model_states(save_dir, change):
    rewrite_saved_files(save_dir, "_model_states.pt", change)


def rewrite_optimizer_states(save_dir, change):
    """change(optimizer state dict) of every saved rank's *_optim_states.pt."""
    rewrite_saved_files(save_dir, "_optim_states.pt",
                        lambda state: change(state["optimizer_state_dict"]["optimizer_state_dict"]))


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
            # rank 0's check passed and opened its reader: the refusal closes it there too
            assert engine._zero3_slices is None

    @layouts("dp4->dp2")
    def test_full_resume_across_saved_step_counts(self, tmp_path, world_size, layout):
        """ZeRO-3 keeps one step count per sub-group: saved in two sub-groups (sub_group_size=100), the first one's
        step rewritten, loaded in one sub-group (the default sub_group_size), a full resume would give every
        parameter one of those steps; refused on every rank, and a fresh-optimizer resume loads."""
        save_dir, precision = str(tmp_path), "bf16"
        if saves_reference(save_dir, precision, saved_world=world_size[0], sub_group_size=100):
            return
        ref = reference(save_dir)
        rewrite_optimizer_states(save_dir, lambda state: state["state"][0].update(step=state["state"][0]["step"] + 1))
        engine = build(precision, dist.get_world_size(), seed=1)
        expect_rejected(engine, save_dir, "parameters saved at different step counts.*load_optimizer_states=False")
        engine.load_checkpoint(save_dir, tag=TAG, **MODES["fresh_optimizer"][0])
        assert_same(masters(engine), ref["masters"], "masters")

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
