# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 loads that consolidate the module from the shards read the checkpoint of the tag asked for, not the
one the `latest` file names."""

import pytest

from unit.checkpoint.zero_resume_helpers import TAG, make_config, make_engine, train, weights
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS

# The loads that read the module weights from the shards rather than from a full optimizer-state resume.
CONSOLIDATING_LOADS = (dict(load_optimizer_states=False), dict(load_optimizer_states=False, load_module_only=True))


class TestZero3LoadNamedTag(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("load", CONSOLIDATING_LOADS, ids=["fresh_optimizer", "module_only"])
    @pytest.mark.parametrize("settings", list(SETTINGS))
    def test_loads_the_named_tag(self, tmpdir, settings, load):
        """Tags "ckpt" (step 3) and "later" (step 5, named in `latest`): loading "ckpt" gives step 3's weights."""
        save_dir = str(tmpdir)
        config = make_config(3, "bf16", settings=settings)
        engine = make_engine(config)
        train(engine)
        saved_weights = weights(engine)
        engine.save_checkpoint(save_dir, tag=TAG)
        train(engine, steps=2)
        later_weights = weights(engine)
        assert any(not later_weights[name].equal(weight) for name, weight in saved_weights.items())
        engine.save_checkpoint(save_dir, tag="later")
        resumed = make_engine(config, seed=1)
        resumed.load_checkpoint(save_dir, tag=TAG, **load)
        loaded = weights(resumed)
        for name, weight in saved_weights.items():
            assert loaded[name].equal(weight), f"{load}: {name} is not the weight saved under tag {TAG}"
