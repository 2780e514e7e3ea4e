# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP: a rigid checkpoint saved at one tensor-parallel x data-parallel layout resumes at another,
directly (no ds_to_universal), in every load mode: fp32 masters bit for bit, both Adam moments and the step counts
where the optimizer is restored, fresh where it is not. What the parameters' TP maps cannot describe is refused on
every rank alike, before anything changes, naming ds_to_universal.

A test runs two launches of 2 ranks (a process that built a TP2 engine cannot build a TP1 one): the first saves,
keeping each rank's TP shard of every state (gathered over DP) and the loss of one more step; the second loads.
"""

import glob
import os
import shutil

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.checkpoint.universal_zero3_helpers import (MLP_PARTITION_CONFIG, TinyMLPBlocks, batches, expected_shard,
                                                     make_config, new_engine, step_counts, token_batches, train,
                                                     train_lm, tp_rank_and_size)
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected, steps
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS
from unit.checkpoint.checkpoint_edits import without_manifest

SAVED_STEPS = 2
# the next step's loss after a full resume against the uninterrupted run's: the same weights, gradients summed in
# another order over other TP and DP groups
NEXT_STEP_RTOL = {"fp32": 1e-5, "bf16": 2e-3, "bf16_master": 2e-3}
LAYOUTS = {"tp2dp1_to_tp1dp2": (2, 1), "tp1dp2_to_tp2dp1": (1, 2)}  # saved TP size, loaded TP size
# (model, precision, settings, offload, layout): DeepSpeed's defaults first, in both directions; then the
# non-default settings, precisions and optimizer offload
DEFAULT_CELLS = [("mlp", "fp32"), ("mlp", "bf16"), ("tied_llama", "fp32")]
CELLS = [(model, precision, "defaults", "none", layout) for model, precision in DEFAULT_CELLS for layout in LAYOUTS]
CELLS += [("mlp", "fp32", "persistence_threshold=0", "none", layout) for layout in LAYOUTS]
CELLS += [("mlp", "bf16", "defaults", "cpu", "tp2dp1_to_tp1dp2"),
          ("mlp", "bf16_master", "defaults", "none", "tp1dp2_to_tp2dp1")]


def tied_llama(seed):
    """A tiny Hugging Face Llama whose LM head is its embedding: AutoTP splits the vocabulary of both."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=64,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=32,
                    tie_word_embeddings=True))


def build(model, tp_size, settings, seed, precision="fp32", offload="none", frozen=(), **zero_overrides):
    """An AutoTP engine at TP tp_size: the tiny MLP (rows, columns, replicated biases) or the tied Llama, its
    optimizer offloaded to the CPU or not; the parameters whose names start with a `frozen` prefix do not train.
    precision: fp32 | bf16 (fp32 masters) | bf16_master (bf16 masters and optimizer states)."""
    config = make_config(tp_size, partition_config=MLP_PARTITION_CONFIG if model == "mlp" else None)
    config["zero_optimization"].update(SETTINGS[settings], **zero_overrides)
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}  # fp32 masters, bf16 weights: the masters rebuilt from them round
    elif precision == "bf16_master":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    torch.manual_seed(seed)
    module = TinyMLPBlocks() if model == "mlp" else tied_llama(seed)
    for name, param in module.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    engine = new_engine(module, config)
    assert engine.zero_cpu_offload() == (offload == "cpu")
    masters = engine.optimizer.fp32_partitioned_groups_flat[0]
    assert masters.dtype == (torch.bfloat16 if precision == "bf16_master" else torch.float32), masters.dtype
    if model == "tied_llama":
        assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    return engine


def run_steps(model, engine, nsteps, first=0):
    """Losses of steps first..first+nsteps-1: the same data on every rank, so every layout takes the same steps."""
    if model == "tied_llama":
        return train_lm(engine, token_batches(first + nsteps)[first:])
    dtype = next(engine.module.parameters()).dtype
    return train(engine, [(x.to(dtype), y.to(dtype)) for x, y in batches(first + nsteps)[first:]])


def shard_states(engine):
    """{name: {fp32, exp_avg, exp_avg_sq}} of this rank's TP shard of every parameter, gathered over DP: a trainable
    one's fp32 master and moments (None before the optimizer has any), a frozen one's weight (it has no master) and
    no moments."""
    states = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            states[name] = {"fp32": safe_get_full_fp32_param(param).clone()}
            for key in ("exp_avg", "exp_avg_sq"):
                try:
                    states[name][key] = safe_get_full_optimizer_state(param, key).clone()
                except KeyError:
                    states[name][key] = None
            continue
        with deepspeed.zero.GatheredParameters([param]):
            states[name] = {"fp32": param.detach().float().clone(), "exp_avg": None, "exp_avg_sq": None}
    return states


def whole_shapes(engine):
    """Each parameter's whole shape: its TP map's (a TP1 parameter is whole)."""
    tp_maps = (getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None) or {}).get(AFFINE_MAP, {})
    return {
        name: tuple(tp_maps[AFFINE_MAP_PARAMS][_pattern(name)]["logical_shape"]) if tp_maps else tuple(param.ds_shape)
        for name, param in engine.module.named_parameters()
    }


def saves(model, save_dir, tp_size, settings, builder=None, **build_args):
    """The first launch: train, save TAG, keep this rank's TP shards of every state and the next step's loss. The
    engine is build's, or builder(seed)'s."""
    if os.path.isdir(os.path.join(save_dir, TAG)):
        return False
    engine = builder(0) if builder else build(model, tp_size, settings, seed=0, **build_args)
    run_steps(model, engine, SAVED_STEPS)
    engine.save_checkpoint(save_dir, tag=TAG)
    shards, steps = shard_states(engine), step_counts(engine)
    next_loss = run_steps(model, engine, 1, first=SAVED_STEPS)[0]
    torch.save((tp_rank_and_size(engine), whole_shapes(engine), shards, steps, next_loss),
               os.path.join(save_dir, f"reference.rank{dist.get_rank()}.pt"))
    return True


def saved_reference(save_dir):
    """(the whole of every state {name: {state: tensor}}, the saved step counts, the next step's loss), from the
    saving ranks' TP shards: AutoTP cut each parameter into even contiguous blocks along the one dimension where a
    shard's size differs from the whole's (none: replicated), which torch.cat puts back."""
    references = [torch.load(path) for path in sorted(glob.glob(os.path.join(save_dir, "reference.rank*.pt")))]
    shards_by_tp_rank = {tp_rank: shards for (tp_rank, _), _, shards, _, _ in references}
    _, shapes, _, steps, next_loss = references[0]
    tp_shards = [shards_by_tp_rank[tp_rank] for tp_rank in sorted(shards_by_tp_rank)]
    return {
        name: {
            key: _join([shards[name][key] for shards in tp_shards], shapes[name])
            for key in entry
        }
        for name, entry in tp_shards[0].items()
    }, steps, next_loss


def _join(shards, whole_shape):
    if shards[0] is None:
        return None
    if tuple(shards[0].shape) == whole_shape:
        assert all(torch.equal(shards[0], shard) for shard in shards), "a replicated state differs between TP ranks"
        return shards[0]
    return torch.cat(shards, dim=_split_dim(whole_shape, shards[0].shape))


def _split_dim(whole_shape, shard_shape):
    return next(dim for dim, (whole, shard) in enumerate(zip(whole_shape, shard_shape)) if whole != shard)


def assert_resumed(engine, save_dir, mode):
    """fp32 masters bit for bit in every mode (the saved ones, or where they are rebuilt from the 16-bit weights,
    those rounded to the weights' dtype: exact for fp32 weights); both moments and the step counts bit for bit where
    the optimizer is restored, fresh (none, or zeros) where it is not."""
    whole, saved_steps, _ = saved_reference(save_dir)
    tp_rank, tp_size = tp_rank_and_size(engine)
    _, masters, optimizer = MODES[mode]
    weight_dtype = next(engine.module.parameters()).dtype
    restored = shard_states(engine)
    assert set(restored) == set(whole)
    for name, entry in restored.items():
        want = expected_shard(whole[name]["fp32"], entry["fp32"].shape, tp_rank, tp_size)
        if masters == "rounded":
            want = want.to(weight_dtype).float()
        # float(): bf16 masters compare exactly with their saved (or rounded) values
        assert torch.equal(entry["fp32"].float(), want.float()), f"{name} fp32 after {mode} (tp rank {tp_rank})"
        for key in ("exp_avg", "exp_avg_sq"):
            if whole[name][key] is None:  # frozen
                assert entry[key] is None, f"{name} {key} after {mode}"
            elif optimizer == "saved":
                want = expected_shard(whole[name][key], entry[key].shape, tp_rank, tp_size)
                assert torch.equal(entry[key], want), f"{name} {key} after {mode} (tp rank {tp_rank})"
            else:
                assert entry[key] is None or not entry[key].any(), f"{name} {key} not fresh after {mode}"
    if optimizer == "saved":
        assert step_counts(engine) and set(step_counts(engine)) == set(saved_steps), (step_counts(engine), saved_steps)
    else:
        assert set(steps(engine)) <= {0.0}, steps(engine)


class TestZero3ResumeAtAnotherTensorParallelSize(DistributedTest):
    """Saved at TP2 x DP1 and resumed at TP1 x DP2, or the reverse, in every load mode; after a full resume the next
    step's loss is the uninterrupted run's (another summation order: NEXT_STEP_RTOL)."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    @pytest.mark.parametrize("model, precision, settings, offload, layout", CELLS)
    def test_every_mode_is_exact(self, tmp_path, model, precision, settings, offload, layout):
        saved_tp, loaded_tp = LAYOUTS[layout]
        save_dir = str(tmp_path)
        if saves(model, save_dir, saved_tp, settings, precision=precision, offload=offload):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build(model, loaded_tp, settings, seed=1, precision=precision, offload=offload)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)
            if mode == "full":
                _, _, next_loss = saved_reference(save_dir)
                loss = run_steps(model, engine, 1, first=SAVED_STEPS)[0]
                assert loss == pytest.approx(next_loss, rel=NEXT_STEP_RTOL[precision])


def rewritten_copy(save_dir, name, change=None, edit_file=None, only=""):
    """A copy of TAG in save_dir/name (rank 0 writes, every rank waits): change(state) applied to the state of every
    model-states file whose name contains `only`, or edit_file(folder) run on the copied folder."""
    copy_dir = os.path.join(save_dir, name)
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(save_dir, TAG), os.path.join(copy_dir, TAG))
        folder = os.path.join(copy_dir, TAG)
        for file_name in sorted(os.listdir(folder)):
            if change is not None and file_name.endswith("_model_states.pt") and only in file_name:
                state = torch.load(os.path.join(folder, file_name), weights_only=False)
                change(state)
                torch.save(state, os.path.join(folder, file_name))
        if edit_file is not None:
            edit_file(folder)
        without_manifest(folder)
    dist.barrier()
    return copy_dir


def _maps(state):
    return state[UNIVERSAL_CHECKPOINT_INFO][AFFINE_MAP][AFFINE_MAP_PARAMS]


def _pattern(name):
    return "^" + name.replace(".", "\\.") + "$"


def _strip_maps(state):
    state[UNIVERSAL_CHECKPOINT_INFO].pop(AFFINE_MAP)


def _record_another_size(state):
    state["mp_world_size"] = 4


def _mark_unsupported(state):
    state[UNIVERSAL_CHECKPOINT_INFO]["autotp_unsupported_parameter_patterns"] = {
        _pattern("blocks.0.up_proj.weight"): "a fused layout"
    }


def _swap_up_and_down_maps(state):
    maps, up, down = _maps(state), _pattern("blocks.0.up_proj.weight"), _pattern("blocks.0.down_proj.weight")
    maps[up], maps[down] = maps[down], maps[up]


def _uneven_bias_map(state):
    from deepspeed.checkpoint.affine import contiguous_split_map
    _maps(state)[_pattern("blocks.0.up_proj.bias")] = contiguous_split_map((32, ), [20, 12], 0).to_dict()


def _scaled_bias(state):
    for rank in _maps(state)[_pattern("blocks.1.down_proj.bias")]["ranks"].values():
        rank["pieces"][0]["scale"] = 0.5


def _add_a_buffer(state):
    state["module"]["extra_buffer"] = torch.ones(3)


def _truncate_optim_states_of_tp_rank_1(folder):
    path = os.path.join(folder, "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


# case -> (how the checkpoint is changed, what every rank's refusal says)
REFUSALS = {
    "no_maps": (dict(change=_strip_maps), "no tensor-parallel map.*ds_to_universal"),
    "recorded_size_differs":
    (dict(change=_record_another_size), "saved at 2, and it records model-parallel size 4.*ds_to_universal"),
    "unsupported_layout":
    (dict(change=_mark_unsupported), "cannot describe.*blocks.0.up_proj.weight: a fused layout.*ds_to_universal"),
    "map_of_another_parameter":
    (dict(change=_swap_up_and_down_maps), "lacks blocks.0.up_proj.weight.*ds_to_universal"),
    "map_disagrees_with_the_shards": (dict(change=_uneven_bias_map), "blocks.0.up_proj.bias gives rank 0 a shard "
                                      "of shape \\[20\\], where it holds \\[16\\].*ds_to_universal"),
    "scaled_piece": (dict(change=_scaled_bias), "Cannot plan.*ds_to_universal"),
    # one TP rank's file only: files of different saves, or a TP-dependent buffer
    "counters_differ": (dict(change=lambda state: state.update(global_steps=7),
                             only="mp_rank_01"), "record different global_steps \\(7 and 2\\).*ds_to_universal"),
    "maps_differ": (dict(change=_scaled_bias,
                         only="mp_rank_01"), "record different universal_checkpoint_info.*ds_to_universal"),
    "buffer_differs": (dict(change=_add_a_buffer,
                            only="mp_rank_01"), "do not both hold module entry extra_buffer.*ds_to_universal"),
    "truncated_shard": (dict(edit_file=_truncate_optim_states_of_tp_rank_1),
                        "zero_pp_rank_0_mp_rank_01_optim_states.pt.*(truncated|corrupt)"),
}


class TestZero3TensorParallelChangeRefusals(DistributedTest):
    """Saved at TP2 x DP1, loaded at TP1 x DP2 from a copy whose TP maps or files cannot serve the load: every rank
    refuses alike, in every load mode, before anything changes. A custom_load_fn is refused up front."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_refused_alike_on_every_rank(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("mlp", save_dir, 2, "defaults"):
            return
        engine = build("mlp", 1, "defaults", seed=1)
        run_steps("mlp", engine, 1)  # moments and steps of its own, which a refused load must leave as they are
        for case, (rewrite, match) in REFUSALS.items():
            copy_dir = rewritten_copy(save_dir, case, **rewrite)
            for kwargs, _, _ in MODES.values():
                message = expect_rejected(engine, copy_dir, match, **kwargs)
                messages = [None] * dist.get_world_size()
                dist.all_gather_object(messages, message)
                assert len(set(messages)) == 1, (case, messages)
        expect_rejected(engine, save_dir, "without a custom_load_fn.*ds_to_universal", custom_load_fn=lambda *_: None)


class TestZero3ResumeAtAnotherTensorParallelSizeFourRanks(DistributedTest):
    """Saved at TP2 x DP2, resumed at TP4 x DP1 and TP1 x DP4 (every saved file read by some rank, each TP shard
    from several saved ones), with a frozen layer (its fragments are read from the model-states files) and small
    sub-groups, in every mode."""
    world_size = 4

    @pytest.mark.world_size([4, 4])
    @pytest.mark.parametrize("layout", ["tp2dp2_to_tp4dp1", "tp2dp2_to_tp1dp4"])
    def test_frozen_layer_and_sub_groups(self, tmp_path, layout):
        loaded_tp = {"tp2dp2_to_tp4dp1": 4, "tp2dp2_to_tp1dp4": 1}[layout]
        layer = dict(frozen=("blocks.0.", ), sub_group_size=100)
        save_dir = str(tmp_path)
        if saves("mlp", save_dir, 2, "defaults", **layer):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = build("mlp", loaded_tp, "defaults", seed=1, **layer)
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)


def _truncate_dp_rank_1_model_states(folder):
    path = os.path.join(folder, "zero_pp_rank_1_mp_rank_00_model_states.pt")
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)


class TestZero3TensorParallelChangeOneRankRefuses(DistributedTest):
    """Saved at TP1 x DP2 with block 0's column-split layer frozen, loaded at TP2 x DP1: each TP rank reads that
    layer's half from one saved DP rank's model-states file. That file of DP rank 1 truncated: only TP rank 1 reads
    it and refuses, and TP rank 0, which loaded nothing either, says that rank 1 refused; the intact checkpoint
    loads exactly."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_refused_on_every_rank(self, tmp_path):
        layer = dict(frozen=("blocks.0.up_proj.", ))
        save_dir = str(tmp_path)
        if saves("mlp", save_dir, 1, "defaults", **layer):
            return
        engine = build("mlp", 2, "defaults", seed=1, **layer)
        run_steps("mlp", engine, 1)  # moments and steps of its own, which a refused load must leave as they are
        copy_dir = rewritten_copy(save_dir, "truncated", edit_file=_truncate_dp_rank_1_model_states)
        for kwargs, _, _ in MODES.values():
            expect_rejected(engine,
                            copy_dir,
                            "zero_pp_rank_1_mp_rank_00_model_states.pt.*(truncated|corrupt)",
                            refusing_rank=1,
                            **kwargs)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_resumed(engine, save_dir, "full")
