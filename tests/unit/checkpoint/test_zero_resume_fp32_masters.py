# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""load_checkpoint(load_fp32_weights=...): which fp32 masters, moments and steps a resume ends with, and
the resumes that cannot restore the masters failing early, alike on every rank, leaving the engine as it
was."""

import glob
import os

import pytest
import torch

from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, WAYS_OUT, assert_fresh, assert_same,
                                                 expect_rejected, make_config, make_engine, masters, moments, rounding,
                                                 save_in_world, steps, to_universal, train_and_save)
from unit.common import DistributedTest


def check_resume_table(config, save_dir, tag, saved_masters, saved_moments):
    for load_optimizer_states, load_fp32_weights, load_module_only, want_masters, want_state in RESUME_TABLE:
        case = f"load_optimizer_states={load_optimizer_states} load_fp32_weights={load_fp32_weights} " \
               f"load_module_only={load_module_only}"
        engine = make_engine(config, seed=1)
        engine.load_checkpoint(save_dir,
                               tag=tag,
                               load_optimizer_states=load_optimizer_states,
                               load_fp32_weights=load_fp32_weights,
                               load_module_only=load_module_only)
        expected = saved_masters if want_masters == "saved" else rounding(saved_masters)
        loaded = masters(engine)
        for name in expected:
            assert torch.equal(loaded[name], expected[name]), f"{case}: master {name}"
        if want_state == "saved":
            assert_same(moments(engine), saved_moments, case)
            assert set(steps(engine)) == {float(SAVED_STEPS)}, f"{case}: {steps(engine)}"
        else:
            assert_fresh(engine)


@pytest.mark.cell(feature="resume", stage=3, precision="bf16")
class TestZero3ResumeTable(DistributedTest):
    world_size = 2

    @pytest.mark.exec_timeout(240)
    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    def test_resume_table(self, tmpdir, checkpoint):
        save_dir = str(tmpdir)
        universal = checkpoint == "universal"
        saved_masters, saved_moments = train_and_save(make_config(3, "bf16"), save_dir, steps=SAVED_STEPS)
        tag = to_universal(save_dir) if universal else TAG
        check_resume_table(make_config(3, "bf16", universal=universal), save_dir, tag, saved_masters, saved_moments)


@pytest.fixture
def dp4_checkpoint(tmp_path):
    save_in_world(tmp_path, world_size=4)
    return str(tmp_path)


@pytest.mark.cell(feature="resume", stage=3, precision="bf16", checkpoint="rigid")
class TestZero3ResumeRejected(DistributedTest):
    world_size = 2
    pg_timeout_s = 60

    @pytest.mark.cell(layout="dp4->dp2")
    @pytest.mark.exec_timeout(200)
    def test_dp_size_change(self, dp4_checkpoint):
        """Saved by 4 ranks, loaded by 2: masters and optimizer states cannot be restored rigidly; the
        fallback named in the error rebuilds the masters from the 16-bit weights."""
        engine = make_engine(make_config(3, "bf16"), seed=1)
        engine.train()
        expect_rejected(engine, dp4_checkpoint, "DP world size of 4.*" + WAYS_OUT, load_optimizer_states=False)
        expect_rejected(engine, dp4_checkpoint, "DP world size of 4.*" + WAYS_OUT, load_optimizer_states=True)
        engine.load_checkpoint(dp4_checkpoint, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        saved_masters = torch.load(os.path.join(dp4_checkpoint, "saved_masters.pt"))
        loaded = masters(engine)
        for name, tensor in rounding(saved_masters).items():
            assert torch.equal(loaded[name], tensor), name

    @pytest.mark.exec_timeout(150)
    def test_missing_shards(self, tmpdir):
        save_dir = str(tmpdir)
        train_and_save(make_config(3, "bf16"), save_dir)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 1:
            for shard in glob.glob(os.path.join(save_dir, TAG, "*_optim_states.pt")):
                os.remove(shard)
        torch.distributed.barrier()
        engine = make_engine(make_config(3, "bf16"), seed=1)
        expect_rejected(engine, save_dir, "optim_states.pt shard.*" + WAYS_OUT, load_optimizer_states=False)
        expect_rejected(engine, save_dir, "optim_states.pt shard.*" + WAYS_OUT, load_optimizer_states=True)
