# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ds_to_universal writes one state file format: a ZeRO-3 run without tensor parallelism converts to
the {param: tensor} dicts, in each parameter's own shape, that every other path writes, and the
ZeRO-1/2 loader also reads the bare flat tensors that 0.19.8 wrote there."""

import pytest
import torch

from unit.common import DistributedTest
from unit.checkpoint.universal_zero3_helpers import (TinyMLPBlocks, assert_one_format, assert_restored_bitwise,
                                                     batches, full_state, make_config, new_engine,
                                                     rewrite_as_bare_tensors, save_and_convert, step_counts, train)


class TestUniversalOneFormat(DistributedTest):
    world_size = 2

    def test_zero3_without_tp_converts_to_param_dicts(self, tmpdir):
        """ZeRO-3 DP2 trains 4 steps, saves, converts: fp32.pt, exp_avg.pt and exp_avg_sq.pt of every
        parameter hold {param: tensor} in the parameter's shape, equal to the saved state bit for bit."""
        torch.manual_seed(0)
        engine = new_engine(TinyMLPBlocks(), make_config())
        train(engine, batches(4))
        saved = full_state(engine)
        tag = save_and_convert(engine, str(tmpdir))
        assert_one_format(str(tmpdir), tag, saved)

    def test_zero1_loads_bare_tensor_folder(self, tmpdir):
        """The ZeRO-1/2 loader accepts state files holding a bare tensor, the form 0.19.8's converter
        writes for ZeRO-3 without TP, bit for bit. (The engine cannot load a ZeRO-3 folder into
        ZeRO-1/2 at all, so the folder here comes from ZeRO-1.)"""
        data = batches(5)
        torch.manual_seed(0)
        engine = new_engine(TinyMLPBlocks(), make_config(stage=1))
        train(engine, data[:4])
        saved, saved_steps = full_state(engine), step_counts(engine)
        tag = save_and_convert(engine, str(tmpdir), inject_missing_state=True)  # a plain model records no UC info
        reference_loss = train(engine, data[4:])
        rewrite_as_bare_tensors(str(tmpdir), tag)

        torch.manual_seed(1)
        resumed = new_engine(TinyMLPBlocks(), make_config(load_universal=True, stage=1))
        resumed.load_checkpoint(str(tmpdir), tag=tag)
        assert_restored_bitwise(resumed, saved, saved_steps)
        assert train(resumed, data[4:]) == pytest.approx(reference_loss, rel=1e-6)
