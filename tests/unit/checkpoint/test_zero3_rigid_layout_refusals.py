# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a rigid checkpoint that its shards cannot serve at this run's layout is refused on every rank, alike and
before anything changes, naming the way out: saved at another tensor-parallel size (a universal checkpoint changes
it), or saved with NVMe optimizer offload and loaded without it (its swapped sub-groups are not in the shards).
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected
from unit.common import DistributedTest
from unit.zero_tiny_models import zero3_config

# every resume mode: a full resume, a fresh optimizer, rebuilt masters, the module only
LOAD_MODES = [
    dict(),
    dict(load_optimizer_states=False),
    dict(load_fp32_weights=False),
    dict(load_module_only=True),
]


class TestZero3TensorParallelChangeRefused(DistributedTest):
    """Saved at TP2 x DP1 and loaded at TP1 x DP2, or the reverse: every rank refuses with the same message, naming
    ds_to_universal."""
    world_size = 2

    # one launch saves, the next loads: a process that built a TP2 engine cannot build a TP1 one
    @pytest.mark.world_size([2, 2])
    @pytest.mark.parametrize("saved_tp, loaded_tp", [(2, 1), (1, 2)], ids=["tp2dp1_to_tp1dp2", "tp1dp2_to_tp2dp1"])
    def test_refused_alike_on_every_rank(self, tmp_path, saved_tp, loaded_tp):
        from unit.checkpoint.universal_zero3_helpers import (MLP_PARTITION_CONFIG, TinyMLPBlocks, batches, make_config,
                                                             new_engine, train)

        def tp_engine(tp_size, seed):
            torch.manual_seed(seed)
            return new_engine(TinyMLPBlocks(), make_config(tp_size, partition_config=MLP_PARTITION_CONFIG))

        save_dir = str(tmp_path)
        if not os.path.isdir(os.path.join(save_dir, TAG)):
            saved = tp_engine(saved_tp, seed=0)
            train(saved, batches(2))
            saved.save_checkpoint(save_dir, tag=TAG)
            return
        engine = tp_engine(loaded_tp, seed=1)
        for kwargs in LOAD_MODES:
            message = expect_rejected(engine, save_dir, "model-parallel layout.*ds_to_universal", **kwargs)
            messages = [None] * dist.get_world_size()
            dist.all_gather_object(messages, message)
            assert len(set(messages)) == 1, messages


class TestZero3SavedWithNVMeRefused(DistributedTest):
    world_size = 2

    def test_loaded_without_nvme(self, tmp_path):
        """Saved with NVMe optimizer offload, loaded without it at the saved size: the swapped sub-groups' masters and
        moments are not in the shards, so every mode is refused before anything changes, naming NVMe offload as the
        way out (no crash half-way through the load)."""
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible():
            pytest.skip("NVMe offload needs the async_io op")
        from unit.checkpoint.test_zero3_nvme_resume import SUB_GROUP_SIZE, make_nvme_engine, save_checkpoint
        save_checkpoint(str(tmp_path))
        engine = make_nvme_engine(zero3_config("bf16", sub_group_size=SUB_GROUP_SIZE), seed=1)
        for kwargs in LOAD_MODES:
            expect_rejected(engine, os.path.join(str(tmp_path), "ckpt"),
                            "without NVMe optimizer offload.*Load it with offload_optimizer.device='nvme'", **kwargs)
