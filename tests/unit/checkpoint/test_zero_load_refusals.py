# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO load that some rank cannot carry out is refused on every rank before anything is loaded: the rank that
found the problem gives its reason, the others name that rank, and none is left waiting in a collective."""

import os

import pytest
import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import groups
from unit.checkpoint.universal_zero3_helpers import MLP_PARTITION_CONFIG, TinyMLPBlocks, batches, new_engine
from unit.checkpoint.universal_zero3_helpers import make_config as tp_config
from unit.checkpoint.universal_zero3_helpers import train as train_blocks
from unit.checkpoint.zero_resume_helpers import (TAG, expect_rejected, make_config, make_engine, move_aside_on_rank,
                                                 shard_path, train, train_and_save, truncate_on_rank)
from unit.common import DistributedTest

# A full resume reads this rank's shard; a ZeRO-3 fresh-optimizer resume consolidates the module from every shard.
FULL_RESUME = dict(load_optimizer_states=True)
FRESH_OPTIMIZER = dict(load_optimizer_states=False)


def gathered_params(engine):
    """The names of the ZeRO-3 parameters this rank holds whole (persistent parameters, between steps)."""
    return sorted(name for name, param in engine.module.named_parameters()
                  if param.ds_status == ZeroParamStatus.AVAILABLE)


class TestRefusedOnEveryRank(DistributedTest):
    world_size = 2
    exec_timeout = 240

    @pytest.mark.parametrize("stage,precision", [(3, "fp32"), (3, "bf16"), (2, "fp32")])
    def test_missing_shard_of_one_rank(self, tmpdir, stage, precision):
        """Rank 0's shard missing, then rank 1's: the rank that lacks it refuses, and so does the other."""
        save_dir = str(tmpdir)
        train_and_save(make_config(stage, precision), save_dir)
        engine = make_engine(make_config(stage, precision), seed=1)
        # a ZeRO-1/2 fresh-optimizer resume reads no shard
        modes = (FULL_RESUME, FRESH_OPTIMIZER) if stage == 3 else (FULL_RESUME, )
        for missing_rank in (0, 1):
            put_back = move_aside_on_rank(shard_path(save_dir, missing_rank, bf16=precision == "bf16"), missing_rank)
            for kwargs in modes:
                expect_rejected(engine,
                                save_dir,
                                f"rank_{missing_rank}_mp_rank_00_optim_states.pt",
                                refusing_rank=missing_rank,
                                **kwargs)
            put_back()

    @pytest.mark.parametrize("precision", ["fp32", "bf16"])
    def test_truncated_shard_on_one_rank(self, tmpdir, precision):
        """Rank 1's shard cut in half: every rank refuses before anything changes, none waits for rank 1. The engine
        has trained, so its persistent parameters are gathered: the load's checkpoint_event_prologue releases them
        and the refusal must gather them again (the epilogue), as a successful load does."""
        save_dir = str(tmpdir)
        train_and_save(make_config(3, precision), save_dir)
        truncate_on_rank(shard_path(save_dir, 1, bf16=precision == "bf16"), 1)
        engine = make_engine(make_config(3, precision), seed=1)
        train(engine, steps=1)
        gathered = gathered_params(engine)
        assert gathered, "the tiny model's parameters are persistent at the default threshold"
        for kwargs in (FULL_RESUME, FRESH_OPTIMIZER):
            expect_rejected(engine,
                            save_dir,
                            "rank_1_mp_rank_00_optim_states.pt cannot be read.*Restore the file",
                            refusing_rank=1,
                            **kwargs)
            assert gathered_params(engine) == gathered, kwargs
        train(engine, steps=1)


class TestRefusedAcrossATensorParallelGrid(DistributedTest):
    world_size = 4
    exec_timeout = 300

    def test_missing_shard_of_one_rank(self, tmpdir):
        """TP2 x DP2 (AutoTP): the shard of global rank 3 is missing. Rank 3 shares its data-parallel group with
        one rank and its tensor-parallel group with another: all four refuse, the three others naming rank 3."""
        save_dir = str(tmpdir)
        torch.manual_seed(0)
        engine = new_engine(TinyMLPBlocks(), tp_config(2, partition_config=MLP_PARTITION_CONFIG))
        train_blocks(engine, batches(2))
        engine.save_checkpoint(save_dir, tag=TAG)
        torch.manual_seed(1)
        resumed = new_engine(TinyMLPBlocks(), tp_config(2, partition_config=MLP_PARTITION_CONFIG))
        dp_rank = torch.distributed.get_rank(group=resumed.optimizer.dp_process_group)
        own_shard = os.path.join(
            save_dir, TAG, f"zero_pp_rank_{dp_rank}_mp_rank_{groups.get_tensor_model_parallel_rank():02d}"
            "_optim_states.pt")
        assert os.path.isfile(own_shard), own_shard
        move_aside_on_rank(own_shard, 3)
        expect_rejected(resumed, save_dir, "optim_states.pt", refusing_rank=3, **FULL_RESUME)
