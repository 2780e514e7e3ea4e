# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""zero_optimization.load_from_fp32_weights=false under ZeRO-3: a full resume restores the optimizer's moments and
step and rebuilds the fp32 masters from the loaded 16-bit weights, as ZeRO-1/2 does."""

import pytest
import torch

from unit.checkpoint.zero_resume_helpers import (SAVED_STEPS, TAG, assert_same, make_config, make_engine, masters,
                                                 moments, rounding, steps, to_universal, train_and_save)
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS


class TestZero3LoadFromFp32WeightsFalse(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("settings", list(SETTINGS))
    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    def test_full_resume_rebuilds_the_masters(self, tmpdir, checkpoint, settings):
        save_dir = str(tmpdir)
        saved_masters, saved_moments = train_and_save(make_config(3, "bf16", settings=settings), save_dir)
        universal = checkpoint == "universal"
        tag = to_universal(save_dir) if universal else TAG
        config = make_config(3, "bf16", universal=universal, settings=settings, load_from_fp32_weights=False)
        engine = make_engine(config, seed=1)
        assert any(not torch.equal(m, rounding(saved_masters)[n]) for n, m in saved_masters.items()), \
            "the saved masters are bf16 values already: restoring and rebuilding would look alike"
        engine.load_checkpoint(save_dir, tag=tag)
        assert_same(masters(engine), rounding(saved_masters), "masters")
        assert_same(moments(engine), saved_moments, "moments")
        assert set(steps(engine)) == {float(SAVED_STEPS)}, steps(engine)

    def test_default_restores_the_saved_masters(self, tmpdir):
        """The default (true) keeps restoring the saved masters exactly."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(make_config(3, "bf16"), save_dir)
        engine = make_engine(make_config(3, "bf16"), seed=1)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters, "masters")
