# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Zero3CheckpointReader on saved files built in memory (no process group): what it reads of a rigid ZeRO-3
checkpoint saved at one data-parallel size, for a rank at another."""

import random

import pytest
import torch

from deepspeed.checkpoint import zero3_checkpoint_reader
from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS, FROZEN_PARAM_FRAGMENTS, OPTIMIZER_STATE_DICT
from unit.checkpoint.affine_plan_helpers import zero3_buffers


def test_reader_partitions_equal_a_direct_repartition():
    """The reader alone, on saved files built in memory (no process group): every state of every parameter, frozen
    ones too, at every new rank equals the parameter cut directly at the new size; the NaN padding of the saved
    partitions is never read, and a rank opens only the saved files its partitions come from."""
    rng = random.Random(0)
    for _ in range(60):
        saved_dp, world = rng.randint(1, 9), rng.randint(1, 9)
        param_shapes = [{
            f"g{group}.p{index}": (rng.choice([0, 1, rng.randint(2, 40)]), )
            for index in range(rng.randint(1, 4))
        } for group in range(rng.randint(1, 3))]
        full = {name: torch.randn(shape) for shapes in param_shapes for name, shape in shapes.items()}
        frozen = torch.randn(rng.randint(1, 30))
        files = {}
        for rank in range(saved_dp):
            flats = [
                torch.cat([zero3_buffers(full[name], saved_dp, float("nan"))[rank] for name in shapes])
                for shapes in param_shapes
            ]
            state = {group: {"exp_avg": flat * 2} for group, flat in enumerate(flats)}
            files[f"optim{rank}"] = {
                OPTIMIZER_STATE_DICT: {
                    FP32_FLAT_GROUPS: flats,
                    OPTIMIZER_STATE_DICT: {
                        "state": state
                    }
                }
            }
            files[f"model{rank}"] = {
                FROZEN_PARAM_FRAGMENTS: {
                    "frozen": zero3_buffers(frozen, saved_dp, float("nan"))[rank]
                }
            }
        for rank in range(world):
            opened = []
            reader = zero3_checkpoint_reader.Zero3CheckpointReader([f"optim{saved}" for saved in range(saved_dp)],
                                                                   [f"model{saved}" for saved in range(saved_dp)],
                                                                   param_shapes, {"frozen": tuple(frozen.shape)},
                                                                   lambda path: opened.append(path) or files[path])
            for name, tensor in full.items():
                for key, scale in (("fp32", 1), ("exp_avg", 2)):
                    expected = zero3_buffers(tensor * scale, world, 0.0)[rank]
                    assert torch.equal(reader.partition(name, key, rank, world, torch.float32), expected), (name, key)
            assert torch.equal(reader.partition("frozen", "frozen", rank, world, torch.float32),
                               zero3_buffers(frozen, world, 0.0)[rank])
            partition = -(-frozen.numel() // world)
            start, stop = rank * partition, min((rank + 1) * partition, frozen.numel())
            saved_partition = -(-frozen.numel() // saved_dp)
            needed = sorted({index // saved_partition for index in range(start, stop)})
            assert reader.saved_ranks("frozen", rank, world) == needed
            reader.close()
            opened.clear()
            reader.check([("frozen", "frozen", rank, world)])
            assert opened == [f"model{saved}" for saved in needed]


def test_reader_names_what_each_parameter_was_saved_with():
    """Shapes, trainable or frozen when saved, the saved param group of each, and the optimizer states saved
    partitioned, from param_shapes and saved rank 0's optimizer state."""
    param_shapes = [{"a": (3, 2), "b": (5, )}, {"c": (4, )}]
    flats = [torch.zeros(6), torch.zeros(2)]  # each sub-group's partition at 2 ranks: 3 + 3, 2 elements
    optim = {
        OPTIMIZER_STATE_DICT: {
            FP32_FLAT_GROUPS: flats,
            OPTIMIZER_STATE_DICT: {
                "state": {
                    0: {
                        "step": 7,
                        "exp_avg": flats[0],
                        "exp_avg_sq": flats[0]
                    },
                    1: {
                        "step": 7,
                        "exp_avg": flats[1],
                        "exp_avg_sq": flats[1]
                    }
                },
                "param_groups": [{
                    "lr": 0.1,
                    "params": [1]
                }, {
                    "lr": 0.2,
                    "params": [0]
                }]
            }
        }
    }
    reader = zero3_checkpoint_reader.Zero3CheckpointReader(["optim0", "optim1"], ["model0", "model1"], param_shapes,
                                                           {"frozen": (2, 2)}, lambda path: optim)
    assert reader.shape("a") == torch.Size([3, 2]) and reader.shape("frozen") == torch.Size([2, 2])
    assert reader.shape("missing") is None
    assert [reader.was_trainable(name) for name in ("a", "c", "frozen")] == [True, True, False]
    assert reader.trainable_names() == ["a", "b", "c"]
    assert [reader.saved_param_group(name) for name in ("a", "b", "c")] == [1, 1, 0]
    assert reader.partitioned_state_keys("b") == ["exp_avg", "exp_avg_sq"]
    assert reader.saved_optimizer_entry("c")["step"] == 7


def test_reader_names_a_file_short_of_its_partitions():
    """check() reads what param_shapes promises and names the file that lacks it: a flat partition shorter than its
    sub-group, or a frozen parameter's missing fragment."""
    files = {
        "optim0": {
            OPTIMIZER_STATE_DICT: {
                FP32_FLAT_GROUPS: [torch.zeros(3)]
            }
        },
        "optim1": {
            OPTIMIZER_STATE_DICT: {
                FP32_FLAT_GROUPS: [torch.zeros(2)]
            }
        },
        "model0": {
            FROZEN_PARAM_FRAGMENTS: {}
        },
    }
    reader = zero3_checkpoint_reader.Zero3CheckpointReader(["optim0", "optim1"], ["model0", "model1"], [{
        "a": (6, )
    }], {"frozen": (4, )}, files.__getitem__)
    with pytest.raises(ValueError, match="optim1 does not hold the ZeRO-3 partition.*2 elements"):
        reader.check([("a", "fp32", 0, 1)])
    with pytest.raises(ValueError, match="model0 does not hold the ZeRO-3 partition.*frozen_param_fragments"):
        reader.check([("frozen", "frozen", 0, 1)])
