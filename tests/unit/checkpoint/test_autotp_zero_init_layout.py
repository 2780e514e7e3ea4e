# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""AutoTP + ZeRO-3 with the model from `from_pretrained`, which builds it under deepspeed.zero.Init under ZeRO-3 (a
tiny Llama saved locally, nothing downloaded). zero.Init partitions every parameter over all ranks. The parameters
AutoTP leaves whole (the norms and, with Llama's plan, the embedding) are partitioned over the data-parallel group, as
in a model built without zero.Init, and recorded with their whole shapes. Such a checkpoint converts with
ds_to_universal. tensor_parallel.keep_zero_init_partitioning keeps the old layout, whose (0,)-shaped checkpoints
resume at their sizes with it and are refused without it, before anything changes."""

import glob
import os

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, DS_AUTOTP_UC_META, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from unit.checkpoint.universal_conversion import convert_to_universal
from unit.checkpoint.universal_zero3_helpers import (assert_same_state, from_pretrained, full_state, make_config,
                                                     new_engine, pretrained, step_counts, tiny_llama, token_batches,
                                                     tp_rank_and_size, train_lm)
from unit.checkpoint.zero_resume_helpers import expect_rejected
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS

TAG = "saved"
KEEP_REFUSAL = "saved from a model built under zero.Init.*keep_zero_init_partitioning\": true"
ONLY_KEPT_REFUSAL = "keeps parameters AutoTP leaves whole partitioned over every rank.*without keep_zero_init"


def tiny_opt(seed):
    """A Hugging Face architecture without a tensor-parallel plan: AutoTP splits it by its heuristics."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(seed)
    return OPTForCausalLM(
        OPTConfig(vocab_size=64,
                  hidden_size=32,
                  ffn_dim=64,
                  num_hidden_layers=2,
                  num_attention_heads=4,
                  max_position_embeddings=32,
                  word_embed_proj_dim=32))


# cell -> (model, config changes, frozen prefixes): DeepSpeed's defaults with Llama's Hugging Face plan first; AutoTP's
# heuristics; bf16 weights (fp32 masters) with gradient clipping, as Trainer's max_grad_norm sets it; no persistent
# parameters (fetched and released as a large embedding is); parameters offloaded to the CPU with a frozen layer
LAYOUT_CELLS = {
    "hf_plan": (tiny_llama, {}, ()),
    "heuristic": (tiny_opt, {}, ()),
    "bf16_clipping": (tiny_llama, {
        "bf16": {
            "enabled": True
        },
        "gradient_clipping": 1.0
    }, ()),
    "persistence_threshold=0": (tiny_llama, {
        "zero_optimization": SETTINGS["persistence_threshold=0"]
    }, ()),
    "param_offload_frozen": (tiny_llama, {
        "zero_optimization": {
            "offload_param": {
                "device": "cpu"
            }
        }
    }, ("model.layers.0.", )),
}


def engine(tp_size, folder, keep=False, load_universal=False, model=tiny_llama, changes=None, frozen=()):
    config = configured(tp_size, changes or {}, load_universal)
    if keep:
        config["tensor_parallel"]["keep_zero_init_partitioning"] = True
    return from_pretrained(model, config, folder, seed=0, frozen=frozen)


def configured(tp_size, changes, load_universal=False):
    """make_config's config with `changes`: top-level sections replaced, zero_optimization's entries updated."""
    config = make_config(tp_size, load_universal=load_universal)
    for key, value in changes.items():
        if key == "zero_optimization":
            config[key].update(value)
        else:
            config[key] = value
    return config


def without_zero_init(tp_size, folder, model, changes, frozen):
    """The same engine, the model from_pretrained built without zero.Init."""
    from transformers import AutoModelForCausalLM
    module = AutoModelForCausalLM.from_pretrained(pretrained(model, folder, 0))
    assert not any(hasattr(param, "ds_id") for param in module.parameters())
    for name, param in module.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    return new_engine(module, configured(tp_size, changes))


def left_whole(engine):
    """{name: parameter} of the parameters AutoTP left whole: those without its metadata."""
    return {
        name: param
        for name, param in engine.module.named_parameters() if getattr(param, DS_AUTOTP_UC_META, None) is None
    }


def recorded_shape(engine, name):
    maps = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO)[AFFINE_MAP][AFFINE_MAP_PARAMS]
    return list(maps["^" + name.replace(".", "\\.") + "$"]["logical_shape"])


def whole(shards, whole_shape):
    """A parameter's whole state from the TP ranks' shards: AutoTP cuts along the one dimension whose size differs."""
    if tuple(shards[0].shape) == tuple(whole_shape):
        assert all(torch.equal(shards[0], shard) for shard in shards[1:])
        return shards[0]
    dim = next(d for d, (a, b) in enumerate(zip(whole_shape, shards[0].shape)) if a != b)
    return torch.cat(shards, dim=dim)


class TestAutoTPZeroInitLayout(DistributedTest):
    """At TP2 x DP1: the parameters AutoTP left whole are partitioned over the data-parallel group (one rank),
    recorded with their whole shapes, and train exactly as in the same model built without zero.Init; with
    keep_zero_init_partitioning they stay partitioned over both ranks, recorded (0,)."""
    world_size = 2

    @pytest.mark.parametrize("cell", LAYOUT_CELLS)
    def test_partitioned_over_data_parallel(self, tmp_path, cell):
        model, changes, frozen = LAYOUT_CELLS[cell]
        built = engine(2, str(tmp_path), model=model, changes=changes, frozen=frozen)
        assert_layout(built, data_parallel_ranks=[[0], [1]][dist.get_rank()], keep=False)
        plain = without_zero_init(2, str(tmp_path), model, changes, frozen)
        assert losses_and_norms(built, 3) == losses_and_norms(plain, 3)
        if cell == "hf_plan":
            assert_layout(engine(2, str(tmp_path), keep=True), data_parallel_ranks=None, keep=True)

    @pytest.mark.world_size(4)
    def test_two_data_parallel_ranks(self, tmp_path):
        """TP2 x DP2: each whole parameter partitioned over this rank's data-parallel pair (TP ranks are
        neighbours: {0, 2} and {1, 3})."""
        built = engine(2, str(tmp_path))
        assert_layout(built, data_parallel_ranks=[dist.get_rank() % 2, dist.get_rank() % 2 + 2], keep=False)
        plain = without_zero_init(2, str(tmp_path), tiny_llama, {}, ())
        assert losses_and_norms(built, 2) == losses_and_norms(plain, 2)


def losses_and_norms(engine, nsteps):
    """The loss and the global gradient norm of each of nsteps training steps."""
    out = []
    for ids in token_batches(nsteps):
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out.append((loss.item(), float(engine.get_global_grad_norm())))
    return out


def assert_layout(built, data_parallel_ranks, keep):
    """The parameters AutoTP left whole are partitioned over data_parallel_ranks and recorded with their whole shapes
    (with keep_zero_init_partitioning: over every rank, recorded (0,))."""
    params = left_whole(built)
    assert any("norm" in name for name in params), sorted(params)
    want = list(range(dist.get_world_size())) if keep else data_parallel_ranks
    for name, param in params.items():
        group = param.ds_process_group
        assert [dist.get_global_rank(group, rank) for rank in range(dist.get_world_size(group=group))] == want, name
        assert recorded_shape(built, name) == ([0] if keep else list(param.ds_shape)), (keep, name)


class TestAutoTPZeroInitCheckpointConverts(DistributedTest):
    """Saved at TP2 x DP1, converted with ds_to_universal, loaded at TP1 x DP2 (zero.Init on both sides): every
    parameter's fp32 master and both Adam moments equal the TP ranks' saved shards put together, bit for bit, and
    the step counts."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_tp2_to_universal_tp1(self, tmp_path):
        save_dir = str(tmp_path)
        if not os.path.isdir(os.path.join(save_dir, TAG)):
            saving = engine(2, save_dir)
            train_lm(saving, token_batches(3))
            saving.save_checkpoint(save_dir, tag=TAG)
            tp_rank, _ = tp_rank_and_size(saving)
            torch.save((full_state(saving), step_counts(saving)), os.path.join(save_dir, f"tp{tp_rank}.pt"))
            return
        universal_tag = convert_to_universal(save_dir, TAG)
        loading = engine(1, save_dir, load_universal=True)
        loading.load_checkpoint(save_dir, tag=universal_tag)
        saved = [torch.load(path) for path in sorted(glob.glob(os.path.join(save_dir, "tp*.pt")))]
        restored = full_state(loading)
        assert len(saved) == 2 and set(restored) == set(saved[0][0])
        for name, entry in restored.items():
            for key, tensor in entry.items():
                want = whole([state[name][key] for state, _ in saved], tensor.shape)
                assert torch.equal(tensor, want), f"{name} {key}"
        assert set(step_counts(loading)) == set(saved[0][1])


class TestAutoTPZeroInitKeptLayout(DistributedTest):
    """At TP2 x DP1, the sizes it was saved with: a checkpoint of the kept layout (as 0.19.x saved it) resumes
    exactly with keep_zero_init_partitioning and is refused on every rank without it, the engine unchanged (the
    parameters' ZeRO status included); a checkpoint of the new layout is refused by a run that keeps the old one,
    which loads it once converted to a universal checkpoint."""
    world_size = 2

    def test_resumes_with_the_setting_and_is_refused_without(self, tmp_path):
        save_dir = str(tmp_path)
        for keep in (True, False):
            folder = os.path.join(save_dir, f"keep_{keep}")
            saving = engine(2, save_dir, keep=keep)
            train_lm(saving, token_batches(2))
            saving.save_checkpoint(folder, tag=TAG)
            saved = full_state(saving)
            other = engine(2, save_dir, keep=not keep)
            train_lm(other, token_batches(1))  # moments and steps of its own, which the refusal must leave alone
            refusal = KEEP_REFUSAL if keep else ONLY_KEPT_REFUSAL
            statuses = [param.ds_status for param in other.module.parameters()]
            with pytest.raises(ZeRORuntimeException, match=refusal):
                other.load_checkpoint(folder, tag=TAG)
            assert [param.ds_status for param in other.module.parameters()] == statuses
            expect_rejected(other, folder, refusal, tag=TAG)
            resumed = engine(2, save_dir, keep=keep)
            resumed.load_checkpoint(folder, tag=TAG)
            assert_same_state(saved, full_state(resumed))
        kept = engine(2, save_dir, keep=True, load_universal=True)
        kept.load_checkpoint(folder, tag=convert_to_universal(folder, TAG))
        assert_same_state(saved, full_state(kept))
