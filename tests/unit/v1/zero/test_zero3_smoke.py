# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Smoke test of the harness and the installed fork: ZeRO-3 trains on 2 ranks."""

import math

import pytest
import torch

import deepspeed
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch, model_dtype, zero3_config


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
class TestZero3Trains(DistributedTest):
    world_size = 2

    def test_three_steps_finite_falling_loss(self, precision):
        torch.manual_seed(0)
        model = TinyMLP()
        engine, _, _, _ = deepspeed.initialize(model=model,
                                               model_parameters=model.parameters(),
                                               config=zero3_config(precision))
        x, y = fixed_batch(dtype=model_dtype(precision), device=engine.device)
        losses = []
        for _ in range(3):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        assert all(math.isfinite(v) for v in losses), losses
        assert losses[-1] < losses[0], losses
