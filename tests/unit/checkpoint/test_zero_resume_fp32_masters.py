# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""load_checkpoint(load_fp32_weights=...): which fp32 masters, moments and steps a resume ends with, and
the resumes that cannot restore the masters failing early, alike on every rank, leaving the engine as it
was."""

import pytest
import torch

from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, assert_fresh, assert_same,
                                                 expect_rejected, make_config, make_engine, masters,
                                                 move_aside_on_rank, moments, remove_shards, rounding,
                                                 saves_checkpoint, shard_path, steps, to_universal, train,
                                                 train_and_save)
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS


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


class TestZero3ResumeTable(DistributedTest):
    world_size = 2
    exec_timeout = 240

    @pytest.mark.parametrize("settings", list(SETTINGS))
    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    def test_resume_table(self, tmpdir, checkpoint, settings):
        save_dir = str(tmpdir)
        universal = checkpoint == "universal"
        saved_masters, saved_moments = train_and_save(make_config(3, "bf16", settings=settings),
                                                      save_dir,
                                                      steps=SAVED_STEPS)
        tag = to_universal(save_dir) if universal else TAG
        check_resume_table(make_config(3, "bf16", universal=universal, settings=settings), save_dir, tag,
                           saved_masters, saved_moments)


class TestZero3ResumeRejected(DistributedTest):
    """A missing or truncated shard of one rank in the usual layout: test_zero_load_refusals.py."""
    world_size = 2
    exec_timeout = 200

    @pytest.mark.world_size([4, 2])
    def test_dp_size_change_with_a_missing_shard(self, tmpdir):
        """Saved by 4 ranks, loaded by 2, saved rank 3's shard gone: rank 1 reads pieces of it in every mode, so
        every mode is refused on every rank before anything changes."""
        dp4_checkpoint = str(tmpdir)
        if saves_checkpoint(dp4_checkpoint, saved_by=4):
            return
        engine = make_engine(make_config(3, "bf16"), seed=1)
        put_back = move_aside_on_rank(shard_path(dp4_checkpoint, 3), 0)
        for kwargs in (dict(load_optimizer_states=False), dict(load_optimizer_states=False,
                                                               load_fp32_weights=False), dict(load_module_only=True)):
            expect_rejected(engine, dp4_checkpoint, "rank_3_mp_rank_00_optim_states.pt is missing.*Restore the file",
                            **kwargs)
        put_back()


class TestZero3ResumeOlderTag(DistributedTest):
    world_size = 2
    exec_timeout = 200

    def test_rebuilding_loads_the_named_tag(self, tmpdir):
        """Modes that consolidate the module from every shard (module-only, masters rebuilt) read the tag asked for,
        not the one `latest` names."""
        save_dir = str(tmpdir)
        engine = make_engine(make_config(3, "bf16"))
        train(engine)
        saved_masters = masters(engine)
        engine.save_checkpoint(save_dir, tag=TAG)
        train(engine, steps=2)
        engine.save_checkpoint(save_dir, tag="later")  # `latest` now names "later"
        for kwargs in (dict(load_module_only=True), dict(load_optimizer_states=False, load_fp32_weights=False)):
            resumed = make_engine(make_config(3, "bf16"), seed=1)
            resumed.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_same(masters(resumed), rounding(saved_masters), str(kwargs))


class TestZero3UniversalModuleOnly(DistributedTest):
    world_size = 2
    exec_timeout = 150

    def test_module_only_reads_no_rigid_shards(self, tmpdir):
        """A universal module-only load reads the universal folder only: the rigid shards named in `latest`
        are deleted after the conversion, and the masters still come out as the bf16 rounding of the saved."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(make_config(3, "bf16"), save_dir)
        tag = to_universal(save_dir)
        remove_shards(save_dir)
        engine = make_engine(make_config(3, "bf16", universal=True), seed=1)
        engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=False, load_module_only=True)
        assert_same(masters(engine), rounding(saved_masters))
        assert_fresh(engine)
