# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""AutoTP + ZeRO-3 with the model built under deepspeed.zero.Init, as `from_pretrained` builds it under ZeRO-3: a
checkpoint saved at TP2 x DP1 converts with ds_to_universal, and a universal load at TP1 x DP2 (zero.Init again)
restores every parameter's fp32 master and both Adam moments bit for bit, and the step counts.

Two launches of 2 ranks: the first trains and saves, keeping each TP rank's shards; the second converts and loads."""

import glob
import os

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from unit.checkpoint.universal_conversion import convert_to_universal
from unit.checkpoint.universal_zero3_helpers import (full_state, make_config, new_engine, step_counts, tiny_llama,
                                                     token_batches, tp_rank_and_size, train_lm)
from unit.common import DistributedTest

TAG = "saved"


def built_under_zero_init(tp_size, load_universal=False):
    config = make_config(tp_size, load_universal=load_universal)
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported inside zero.Init, torch._dynamo fails)
    with deepspeed.zero.Init(config_dict_or_path=config):
        module = tiny_llama(seed=0)
    return new_engine(module, config)


def whole(shards, whole_shape):
    """A parameter's whole state from the TP ranks' shards: AutoTP cuts along the one dimension whose size differs."""
    if tuple(shards[0].shape) == tuple(whole_shape):
        assert all(torch.equal(shards[0], shard) for shard in shards[1:])
        return shards[0]
    dim = next(d for d, (a, b) in enumerate(zip(whole_shape, shards[0].shape)) if a != b)
    return torch.cat(shards, dim=dim)


class TestAutoTPZeroInitCheckpointConverts(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_tp2_to_universal_tp1(self, tmp_path):
        save_dir = str(tmp_path)
        if not os.path.isdir(os.path.join(save_dir, TAG)):
            engine = built_under_zero_init(tp_size=2)
            train_lm(engine, token_batches(3))
            engine.save_checkpoint(save_dir, tag=TAG)
            tp_rank, _ = tp_rank_and_size(engine)
            torch.save((full_state(engine), step_counts(engine)), os.path.join(save_dir, f"tp{tp_rank}.pt"))
            return
        universal_tag = convert_to_universal(save_dir, TAG)
        engine = built_under_zero_init(tp_size=1, load_universal=True)
        engine.load_checkpoint(save_dir, tag=universal_tag)
        saved = [torch.load(path) for path in sorted(glob.glob(os.path.join(save_dir, "tp*.pt")))]
        restored = full_state(engine)
        assert len(saved) == 2 and set(restored) == set(saved[0][0])
        for name, entry in restored.items():
            for key, tensor in entry.items():
                want = whole([state[name][key] for state, _ in saved], tensor.shape)
                assert torch.equal(tensor, want), f"{name} {key}"
        assert set(step_counts(engine)) == set(saved[0][1])
        assert dist.get_world_size() == 2 and tp_rank_and_size(engine) == (0, 1)
