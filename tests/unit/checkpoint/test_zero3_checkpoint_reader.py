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
    assert [reader.was_trainable(name) for name in ("a", "b", "c", "frozen", "missing")] == [True] * 3 + [False] * 2
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


def _even(numel, parts):
    return [numel // parts + (index < numel % parts) for index in range(parts)]


def _tp_maps(tp_size):
    """A row-split, a column-split, a replicated and a fused (QKV-like, each sub-parameter split on columns)
    trainable parameter, and a frozen row-split one; uneven splits where the sizes do not divide."""
    from deepspeed.checkpoint.affine import contiguous_split_map, replicated_map, sub_param_map
    return {
        "rows": contiguous_split_map((7, 5), _even(7, tp_size), 0),
        "cols": contiguous_split_map((4, 6), _even(6, tp_size), 1),
        "norm": replicated_map((5, ), tp_size),
        "fused": sub_param_map((3, 9), [3, 3, 3], [_even(3, tp_size)] * 3, 1),
        "frozen": contiguous_split_map((7, 3), _even(7, tp_size), 0),
    }


def _sub_groups(tp):
    """Each TP rank's sub-groups: their boundaries differ between TP ranks, as sub_group_size cuts shards of other
    sizes otherwise."""
    return [("rows", "cols"), ("norm", "fused")] if tp % 2 == 0 else [("rows", ), ("cols", "norm", "fused")]


def _tp_grid_files(full, maps, saved_tp, saved_dp):
    """The optim and model-states files of every saved (dp, tp) rank, in the order dp * saved_tp + tp, NaN-padded,
    with each TP rank's param_shapes and frozen shapes."""
    param_shapes = [[{
        name: maps[name].shard_shapes[tp]
        for name in names
    } for names in _sub_groups(tp)] for tp in range(saved_tp)]
    frozen_shapes = [{"frozen": maps["frozen"].shard_shapes[tp]} for tp in range(saved_tp)]

    def partition(name, dp, tp):
        return zero3_buffers(maps[name].extract(full[name], tp).reshape(-1), saved_dp, float("nan"))[dp]

    files = {}
    for dp in range(saved_dp):
        for tp in range(saved_tp):
            label = dp * saved_tp + tp
            flats = [torch.cat([partition(name, dp, tp) for name in names]) for names in _sub_groups(tp)]
            files[f"optim{label}"] = {
                OPTIMIZER_STATE_DICT: {
                    FP32_FLAT_GROUPS: flats,
                    OPTIMIZER_STATE_DICT: {
                        "state": {
                            group: {
                                "exp_avg": flat * 2
                            }
                            for group, flat in enumerate(flats)
                        }
                    }
                }
            }
            files[f"model{label}"] = {FROZEN_PARAM_FRAGMENTS: {"frozen": partition("frozen", dp, tp)}}
    return files, param_shapes, frozen_shapes


@pytest.mark.parametrize("saved_tp, saved_dp, tp_size, dp_size", [(2, 1, 1, 2), (1, 2, 2, 1), (2, 2, 1, 4),
                                                                  (2, 3, 3, 2), (3, 1, 2, 3), (2, 2, 2, 3)])
def test_reader_partitions_at_another_tensor_parallel_size(saved_tp, saved_dp, tp_size, dp_size):
    """Saved at TP a x DP b, read at TP c x DP d: every rank's partition of every state, frozen too, equals its TP
    shard (cut by the running map from the whole parameter) cut into ZeRO-3 partitions; the saved NaN padding is
    never read, and a rank opens only the saved files its partitions come from."""
    torch.manual_seed(0)
    saved_maps, running_maps = _tp_maps(saved_tp), _tp_maps(tp_size)
    full = {name: torch.randn(tp_map.logical_shape) for name, tp_map in saved_maps.items()}
    files, param_shapes, frozen_shapes = _tp_grid_files(full, saved_maps, saved_tp, saved_dp)
    labels = range(saved_tp * saved_dp)
    for tp_rank in range(tp_size):
        opened = []
        change = zero3_checkpoint_reader.TensorParallelChange(saved_maps, running_maps, tp_rank, tp_size)
        reader = zero3_checkpoint_reader.Zero3CheckpointReader([f"optim{label}" for label in labels],
                                                               [f"model{label}"
                                                                for label in labels], param_shapes, frozen_shapes,
                                                               lambda path: opened.append(path) or files[path], change)
        assert reader.saved_dp == saved_dp and reader.saved_tp == saved_tp
        assert all(reader.was_trainable(name) for name in ("rows", "cols", "norm", "fused"))
        assert not reader.was_trainable("frozen")
        for name, tp_map in running_maps.items():
            shard = tp_map.extract(full[name], tp_rank).reshape(-1)
            assert reader.shape(name) == torch.Size(tp_map.shard_shapes[tp_rank])
            keys = [("frozen", 1)] if name == "frozen" else [("fp32", 1), ("exp_avg", 2)]
            for dp_rank in range(dp_size):
                for key, scale in keys:
                    expected = zero3_buffers(shard * scale, dp_size, 0.0)[dp_rank]
                    found = reader.partition(name, key, dp_rank, dp_size, torch.float32)
                    assert torch.equal(found, expected), (name, key, tp_rank, dp_rank)
                reader.close()
                opened.clear()
                reader.check([(name, keys[0][0], dp_rank, dp_size)])
                kind = "model" if name == "frozen" else "optim"
                assert opened == [f"{kind}{label}" for label in reader.saved_ranks(name, dp_rank, dp_size)]


def test_reader_at_another_tensor_parallel_size_refuses_maps_of_another_parameter():
    """A parameter whose saved and running maps describe different whole shapes has no shape here (the engine
    refuses the load as a missing parameter); files that are not a (dp, tp) grid, and TP ranks whose param_shapes or
    frozen_param_shapes name different parameters, are refused outright."""
    saved_maps, running_maps = _tp_maps(2), _tp_maps(1)
    running_maps["rows"] = running_maps["cols"]
    files, param_shapes, frozen_shapes = _tp_grid_files(
        {
            name: torch.randn(tp_map.logical_shape)
            for name, tp_map in saved_maps.items()
        }, saved_maps, 2, 1)
    change = zero3_checkpoint_reader.TensorParallelChange(saved_maps, running_maps, 0, 1)
    reader = zero3_checkpoint_reader.Zero3CheckpointReader(["optim0", "optim1"], ["model0", "model1"], param_shapes,
                                                           frozen_shapes, files.__getitem__, change)
    assert reader.shape("rows") is None and reader.shape("cols") == torch.Size([4, 6])

    def reader_of(optim_files=("optim0", "optim1"), frozen=frozen_shapes):
        return zero3_checkpoint_reader.Zero3CheckpointReader(list(optim_files), ["model0", "model1"], param_shapes,
                                                             frozen, files.__getitem__, change)

    with pytest.raises(ValueError, match="3 optimizer-state and 2 model-states files.*not a \\(dp, tp\\) grid"):
        reader_of(optim_files=("optim0", "optim1", "optim2"))
    with pytest.raises(ValueError, match="frozen_param_shapes name different parameters"):
        reader_of(frozen=[frozen_shapes[0], {}])
    del param_shapes[1][1]["norm"]
    with pytest.raises(ValueError, match="tensor-parallel ranks' param_shapes name different trainable parameters"):
        reader_of()
