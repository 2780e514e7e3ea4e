# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3: a rigid checkpoint loads at the tensor-parallel size it was saved with, whatever
checkpoint_parallel_dimensions records. (At another tensor-parallel size it loads through the parameters' TP maps:
test_zero3_tensor_parallel_reshard.py.)
"""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.zero_resume_helpers import (TAG, assert_same, make_config, make_engine, masters, moments,
                                                 train_and_save)
from unit.common import DistributedTest
from unit.checkpoint.checkpoint_edits import without_manifest


class TestZero3SavedTensorParallelSize(DistributedTest):
    """Saved and loaded at TP2 x DP1: the load succeeds, each rank reading its own TP rank's files."""
    world_size = 2

    # one launch saves, the next loads (as the tests of a TP change do)
    @pytest.mark.world_size([2, 2])
    def test_loads(self, tmp_path):
        from unit.checkpoint.universal_zero3_helpers import (MLP_PARTITION_CONFIG, TinyMLPBlocks, batches, make_config,
                                                             new_engine, train)

        def tp_engine(tp_size, seed):
            torch.manual_seed(seed)
            return new_engine(TinyMLPBlocks(), make_config(tp_size, partition_config=MLP_PARTITION_CONFIG))

        save_dir = str(tmp_path)
        saved_state = os.path.join(save_dir,
                                   f"saved_state.rank{dist.get_rank()}.pt")  # this rank's, for the next launch
        if not os.path.isdir(os.path.join(save_dir, TAG)):
            saved = tp_engine(2, seed=0)
            train(saved, batches(2))
            saved.save_checkpoint(save_dir, tag=TAG)
            torch.save((masters(saved), moments(saved)), saved_state)
            return
        engine = tp_engine(2, seed=1)
        engine.load_checkpoint(save_dir, tag=TAG)
        saved_masters, saved_moments = torch.load(saved_state)
        assert_same(masters(engine), saved_masters)
        assert_same(moments(engine), saved_moments)


def rewrite_model_states(save_dir, change):
    """Apply change(state) to every saved model-states file (rank 0 writes, every rank waits)."""
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(os.path.join(save_dir, TAG)):
            if name.endswith("_model_states.pt"):
                path = os.path.join(save_dir, TAG, name)
                state = torch.load(path, weights_only=False)
                change(state)
                torch.save(state, path)
                without_manifest(path)
    dist.barrier()


class TestZero3SavedModelParallelSize(DistributedTest):
    """The model-parallel size is the count of model-states files, not checkpoint_parallel_dimensions: a
    sequence-parallel mpu (Ulysses) records its sequence-parallel size there as tp_degree while the engine's
    model-parallel size, which names the files and cuts the partitions, stays 1."""
    world_size = 2

    def test_recorded_sequence_parallel_degree_loads(self, tmp_path):
        save_dir = str(tmp_path)
        saved_masters, saved_moments = train_and_save(make_config(), save_dir)
        rewrite_model_states(save_dir,
                             lambda state: state.update(checkpoint_parallel_dimensions=dict(pp_degree=1, tp_degree=4)))
        engine = make_engine(make_config(), seed=1)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters)
        assert_same(moments(engine), saved_moments)
