# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 through Hugging Face accelerate: `Accelerator.save_state` at one data-parallel size, `load_state` at
another. The state right after the load (fp32 masters, both Adam moments, the step counts, every weight) must equal
the state saved, bit for bit. A test runs two launches (upstream's world_size lists): the first saves, the second
loads."""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.test_hf_trainer_resume import optimizer_steps
from unit.checkpoint.zero_resume_helpers import assert_same, masters, moments, weights
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP

accelerate = pytest.importorskip("accelerate")

MICRO_BATCH, HIDDEN, STEPS = 2, 16, 3


def accelerator():
    """An Accelerator with a ZeRO-3 DeepSpeed plugin at DeepSpeed's defaults."""
    config = {
        "zero_optimization": {
            "stage": 3
        },
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        # CPU only, not DeepSpeed's doing: without an accelerator accelerate's state counts one process under
        # DeepSpeed and would derive train_batch_size for one rank, which DeepSpeed's batch-size check refuses
        "train_batch_size": MICRO_BATCH * dist.get_world_size(),
        "steps_per_print": 10**6,
    }
    plugin = accelerate.utils.DeepSpeedPlugin(hf_ds_config=config)
    return accelerate.Accelerator(deepspeed_plugin=plugin)


def prepared(seed):
    acc = accelerator()
    torch.manual_seed(seed)
    model = TinyMLP(hidden=HIDDEN)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    engine, optimizer = acc.prepare(model, optimizer)
    assert engine.zero_optimization_stage() == 3 and engine.dp_world_size == dist.get_world_size()
    return acc, engine, optimizer


def train(acc, engine, optimizer, steps):
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(MICRO_BATCH, HIDDEN, generator=gen), torch.randn(MICRO_BATCH, HIDDEN, generator=gen)
        acc.backward(engine(x, y))
        optimizer.step()
        optimizer.zero_grad()


def state(engine):
    return dict(masters=masters(engine),
                moments=moments(engine),
                steps=optimizer_steps(engine),
                weights=weights(engine))


class TestAccelerateResumeAtAnotherSize(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 1])
    def test_2_to_1(self, tmp_path):
        self.resumes(str(tmp_path), saved_world=2)

    @pytest.mark.world_size([1, 2])
    def test_1_to_2(self, tmp_path):
        self.resumes(str(tmp_path), saved_world=1)

    @staticmethod
    def resumes(save_dir, saved_world):
        checkpoint, reference = os.path.join(save_dir, "state"), os.path.join(save_dir, "saved_state.pt")
        if dist.get_world_size() == saved_world:
            acc, engine, optimizer = prepared(seed=0)
            train(acc, engine, optimizer, STEPS)
            saved = state(engine)
            acc.save_state(checkpoint)
            if dist.get_rank() == 0:
                torch.save(saved, reference)
            dist.barrier()
            return
        saved = torch.load(reference, weights_only=False)
        acc, engine, optimizer = prepared(seed=1)
        acc.load_state(checkpoint)
        loaded = state(engine)
        for key in ("masters", "moments", "weights"):
            assert_same(loaded[key], saved[key], key)
        assert loaded["steps"] == saved["steps"] and saved["steps"]
