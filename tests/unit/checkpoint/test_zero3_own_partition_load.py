# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a load that does not restore the saved masters (load_module_only=True, or load_optimizer_states=False
with load_fp32_weights=False) reads only this rank's own files at the data-parallel size it was saved with (its
shard memory-mapped), where consolidating the model with zero_to_fp32 made every rank read every rank's files. A
load with a custom_load_fn, which is handed the whole module's state dict, is still consolidated.
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


def record_files_opened(monkeypatch):
    """The set of (tag/file name, memory-mapped) of the checkpoint files torch.load opens from now on, in this
    process: every *_optim_states.pt (the shards) and *_model_states.pt."""
    opened, load = set(), torch.load

    def recording_load(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and str(f).endswith(("_optim_states.pt", "_model_states.pt")):
            path = str(f)
            opened.add(
                (f"{os.path.basename(os.path.dirname(path))}/{os.path.basename(path)}", bool(kwargs.get("mmap"))))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    return opened


def own_files(tag=TAG):
    """This rank's own shard and model-states file, as saved at this data-parallel size."""
    rank = dist.get_rank()
    return {
        f"{tag}/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
        f"{tag}/zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
    }


def train_and_save(config, save_dir):
    """Train 3 steps, save TAG, train 2 more and save "later" (named in `latest`); returns TAG's 16-bit weights and
    masters."""
    engine = make_engine(config, frozen=FROZEN)
    train(engine)
    saved = weights(engine), masters(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    train(engine, steps=2)
    engine.save_checkpoint(save_dir, tag="later")
    return saved


class TestZero3LoadWithoutMastersReadsOwnPartition(DistributedTest):
    """Saved and loaded by 2 ranks, bf16 with fp32 masters, a frozen layer."""
    world_size = 2

    @pytest.mark.parametrize("settings", ["defaults", "persistence_threshold=0"])
    @pytest.mark.parametrize("mode", list(MODES))
    def test_reads_only_its_own_files(self, tmp_path, monkeypatch, mode, settings):
        save_dir, config = str(tmp_path), make_config(settings=settings)
        saved_weights, saved_masters = train_and_save(config, save_dir)

        engine = make_engine(config, seed=1, frozen=FROZEN)
        opened = record_files_opened(monkeypatch)
        engine.load_checkpoint(save_dir, tag=TAG, **MODES[mode])
        monkeypatch.undo()

        assert {name for name, _ in opened} == own_files(), f"rank {dist.get_rank()} opened {sorted(opened)}"
        # the shard memory-mapped: only the pages of this rank's partitions are read, not its moments
        assert all(mapped for name, mapped in opened if name.endswith("_optim_states.pt")), sorted(opened)
        assert_same(weights(engine), saved_weights)
        assert_same(masters(engine), rounding(saved_masters))
        assert_fresh(engine)

    def test_custom_load_fn_still_consolidates(self, tmp_path, monkeypatch):
        """A custom_load_fn is handed the whole module's state dict: that load is still consolidated from every
        rank's files, of the tag asked for."""
        save_dir, config = str(tmp_path), make_config()
        saved_weights, _ = train_and_save(config, save_dir)

        engine = make_engine(config, seed=1, frozen=FROZEN)
        opened = record_files_opened(monkeypatch)
        engine.load_checkpoint(save_dir,
                               tag=TAG,
                               load_module_only=True,
                               custom_load_fn=lambda src, dst: dst.load_state_dict(src))
        monkeypatch.undo()

        assert {name
                for name, _ in opened if name.endswith("_optim_states.pt")} == {
                    f"{TAG}/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
                    for rank in range(dist.get_world_size())
                }, f"rank {dist.get_rank()} opened {sorted(opened)}"
        assert_same(weights(engine), saved_weights)
