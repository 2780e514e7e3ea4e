# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a load that does not restore the saved masters (load_module_only=True, load_fp32_weights=False) reads
only this rank's partition of the shards, at the data-parallel size it was saved with: the same bytes a full resume
reads, where consolidating the model with zero_to_fp32 made every rank read every rank's shard.
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.zero_resume_helpers import (TAG, assert_fresh, assert_same, make_config, make_engine, masters,
                                                 rounding, train, weights)
from unit.common import DistributedTest

FROZEN = ("layers.2.", )  # saved in the model-states files: every mode must still restore it

# mode -> load_checkpoint kwargs: the loads that need no optimizer state and rebuild the masters from the loaded
# 16-bit weights (with load_optimizer_states=True a load reads this rank's shard for the moments anyway)
MODES = {
    "fresh_optimizer_rebuilt_masters": dict(load_optimizer_states=False, load_fp32_weights=False),
    "module_only": dict(load_module_only=True),
}


def record_shards_opened(monkeypatch):
    """The set of *_optim_states.pt file names torch.load opens from now on, in this process."""
    opened, load = set(), torch.load

    def recording_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith("_optim_states.pt"):
            opened.add(os.path.basename(str(f)))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    return opened


class TestZero3LoadWithoutMastersReadsOwnPartition(DistributedTest):
    """Saved and loaded by 2 ranks, bf16 with fp32 masters, DeepSpeed's defaults, a frozen layer."""
    world_size = 2

    @pytest.mark.parametrize("mode", list(MODES))
    def test_reads_only_its_own_shard(self, tmp_path, monkeypatch, mode):
        save_dir, config = str(tmp_path), make_config()
        saved = make_engine(config, frozen=FROZEN)
        train(saved)
        saved_weights, saved_masters = weights(saved), masters(saved)
        saved.save_checkpoint(save_dir, tag=TAG)

        engine = make_engine(config, seed=1, frozen=FROZEN)
        opened = record_shards_opened(monkeypatch)
        engine.load_checkpoint(save_dir, tag=TAG, **MODES[mode])
        monkeypatch.undo()

        own = f"bf16_zero_pp_rank_{dist.get_rank()}_mp_rank_00_optim_states.pt"
        assert opened == {own}, f"rank {dist.get_rank()} opened {sorted(opened)}"
        assert_same(weights(engine), saved_weights)
        assert_same(masters(engine), rounding(saved_masters))
        assert_fresh(engine)
