# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 serial checkpoint loading (zero_optimization.pipeline_loading_checkpoint): local ranks load
one at a time per node, for rigid and universal checkpoints, and every early exit fails every rank
promptly instead of leaving the next local rank waiting for the token until the process-group
timeout."""

import pytest
import torch

from unit.checkpoint.zero_resume_helpers import (TAG, make_config, make_engine, masters, simulate_nodes, to_universal,
                                                 train_and_save)
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS


def serial_config(universal=False, settings="defaults"):
    return make_config(3, "bf16", universal=universal, settings=settings, pipeline_loading_checkpoint=True)


def assert_masters_equal(engine, saved):
    loaded = masters(engine)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name


def rigid_and_universal_roundtrip(tmpdir, settings="defaults"):
    """Save from a plain engine, then load it with serial loading on, rigid and universal."""
    save_dir = str(tmpdir)
    saved_masters, _ = train_and_save(make_config(3, "bf16", settings=settings), save_dir)
    universal_tag = to_universal(save_dir)
    for universal, tag in ((False, TAG), (True, universal_tag)):
        engine = make_engine(serial_config(universal, settings), seed=1)
        engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=True)
        assert_masters_equal(engine, saved_masters)


class TestSerialLoadOneNode(DistributedTest):
    world_size = 2
    exec_timeout = 150

    @pytest.mark.parametrize("settings", list(SETTINGS))
    def test_rigid_and_universal(self, tmpdir, settings):
        rigid_and_universal_roundtrip(tmpdir, settings)

    @pytest.mark.parametrize("failing_rank", [0, 1])
    def test_failure_inside_the_chain_fails_every_rank(self, tmpdir, failing_rank):
        """A rank whose shard load fails inside the token chain (here: reading it raises OSError) raises its own
        error; the other rank, whether it loads before or would load after it, raises that another rank failed,
        with no wait for a token that never comes."""
        save_dir = str(tmpdir)
        train_and_save(make_config(3, "bf16"), save_dir)
        engine = make_engine(serial_config(), seed=1)
        if torch.distributed.get_rank() == failing_rank:

            def unreadable_shard(*args, **kwargs):
                raise OSError("simulated read error")

            engine.optimizer._rigid_load_state_dict = unreadable_shard
            expected = pytest.raises(OSError, match="simulated read error")
        else:
            expected = pytest.raises(RuntimeError, match="another rank failed")
        with expected:
            engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=True)


class TestSerialLoadTwoNodes(DistributedTest):
    """4 ranks as 2 nodes x 2 local ranks: each node runs its own token chain."""
    world_size = 4
    exec_timeout = 200

    def test_rigid_and_universal(self, tmpdir):
        simulate_nodes(ranks_per_node=2)
        rigid_and_universal_roundtrip(tmpdir)
