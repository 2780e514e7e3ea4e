# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""safe_get_full_fp32_param / safe_get_full_optimizer_state under ZeRO-1/2 (and the BF16_Optimizer path) for a
model trained with two optimizer param groups: every parameter of every group reads back its fp32 master and
Adam moments, bit for bit the slice of the optimizer's own flat fp32 partitions gathered from every rank.

The second group holds the three biases of TinyMLP (48 elements, 24 per rank): layers.0.bias lies wholly in rank
0's partition, layers.1.bias is split across both ranks and layers.2.bias lies wholly in rank 1's, so a rank
that fails to read its fragment while the other waits in the all-reduce shows up as a hang (the harness kills it
after the first rank's error)."""

import pytest
import torch
import torch.distributed as dist

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch, zero3_config

# The BF16_Optimizer wrapper: bf16 weights, fp32 gradient accumulation, ZeRO stage 1.
BF16_FP32_ACCUM = "bf16_fp32_grad_accum"
LOW_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, BF16_FP32_ACCUM: torch.bfloat16, "fp16": torch.float16}
GROUPS = ({"lr": 1e-2, "weight_decay": 0.0}, {"lr": 3e-3, "weight_decay": 0.1})
STEPS = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


def config_for(stage, precision, offload, optimizer):
    # fp32 is DeepSpeed's default precision; fp16 and the fp32-accumulation variant are built on a bf16/fp32 base.
    config = zero3_config("fp32" if precision in ("fp32", "fp16") else "bf16")
    config["zero_optimization"] = {"stage": stage}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == BF16_FP32_ACCUM:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if offload == "cpu":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if optimizer == "ds_adam":
        # DeepSpeed's own Adam: DeepSpeedCPUAdam with optimizer offload (its CPU op is JIT-built once).
        config["optimizer"]["params"].pop("torch_adam")
    return config


def build(stage, precision, offload, optimizer="torch_adam"):
    if precision == "fp16":
        # The CPU accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels; the tiny model's
        # fp16 Linear/tanh/MSE and gloo's fp16 all-reduce still run (slowly) on CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(0)
    model = TinyMLP()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    param_groups = [dict(GROUPS[0], params=weights), dict(GROUPS[1], params=biases)]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=param_groups,
                                           config=config_for(stage, precision, offload, optimizer))
    return engine, [weights, biases]


def flat_partitions(optimizer):
    """The optimizer's fp32 partition (one per param group) and the lists of 16-bit params it is laid out from."""
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # DeepSpeedZeroOptimizer (ZeRO-1/2)
        return optimizer.single_partition_of_fp32_groups, optimizer.bit16_groups
    return optimizer.fp32_groups_flat_partition, optimizer.bf16_groups  # BF16_Optimizer


def gathered(partition):
    """The whole flat group: every rank's equally sized partition, in rank order."""
    parts = [torch.empty_like(partition) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, partition.detach().contiguous())
    return torch.cat(parts)


def expected_slices(flat, params):
    """{param: its slice of the flat group}, params laid out back to back in group order (padding at the end)."""
    slices, offset = {}, 0
    for p in params:
        slices[p] = flat.narrow(0, offset, p.numel()).view_as(p)
        offset += p.numel()
    return slices


class TestZero12HpLinkParamGroups(DistributedTest):
    world_size = 2
    exec_timeout = 240

    @pytest.mark.parametrize("stage, precision, offload, optimizer", [
        (1, "fp32", "none", "torch_adam"),
        (2, "fp32", "none", "torch_adam"),
        (1, "bf16", "none", "torch_adam"),
        (2, "bf16", "none", "torch_adam"),
        (1, "fp16", "none", "torch_adam"),
        (2, "fp16", "none", "torch_adam"),
        (1, "fp32", "cpu", "ds_adam"),
        (2, "bf16", "cpu", "ds_adam"),
        (2, "fp16", "cpu", "ds_adam"),
        (1, "bf16", "cpu", "torch_adam"),
        (2, "bf16", "cpu", "torch_adam"),
        (1, BF16_FP32_ACCUM, "none", "torch_adam"),
    ])
    def test_every_group_reads_back(self, stage, precision, offload, optimizer):
        engine, groups = build(stage, precision, offload, optimizer)
        base = engine.optimizer.optimizer
        expected = "DeepSpeedCPUAdam" if optimizer == "ds_adam" else "AdamW"
        assert type(base).__name__ == expected
        optimizer = engine.optimizer
        expected_class = "BF16_Optimizer" if precision == BF16_FP32_ACCUM else "DeepSpeedZeroOptimizer"
        assert type(optimizer).__name__ == expected_class
        assert [(g["lr"], g["weight_decay"]) for g in base.param_groups] == [(g["lr"], g["weight_decay"])
                                                                             for g in GROUPS]
        partitions, layouts = flat_partitions(optimizer)
        for group, layout in zip(groups, layouts):
            assert [id(p) for p in layout] == [id(p) for p in group], "params not laid out in group order"

        x, y = fixed_batch(dtype=LOW_DTYPE[precision], device=engine.device)
        for _ in range(STEPS):
            engine.backward(engine(x, y))
            engine.step()
        assert not getattr(optimizer, "overflow", False), "the last step was skipped: nothing to read back"

        problems = []
        for group_index, (group, partition) in enumerate(zip(groups, partitions)):
            state = base.state[partition]
            assert set(MOMENTS) <= set(state), f"group {group_index}: no Adam state {sorted(state)}"
            masters = expected_slices(gathered(partition), group)
            moments = {key: expected_slices(gathered(state[key]), group) for key in MOMENTS}
            for p in group:
                name = f"group {group_index} param of shape {tuple(p.shape)}"
                master = safe_get_full_fp32_param(p)
                if not torch.equal(master.cpu(), masters[p].cpu()):
                    problems.append(f"{name}: fp32 master differs from the optimizer's partition")
                if not torch.equal(master.to(p.dtype).cpu(), p.detach().cpu()):
                    problems.append(f"{name}: fp32 master does not round to the module's weight")
                for key in MOMENTS:
                    value = safe_get_full_optimizer_state(p, key)
                    if not torch.equal(value.cpu(), moments[key][p].cpu()):
                        problems.append(f"{name}: {key} differs from the optimizer's state")
                    if not value.abs().sum() > 0:
                        problems.append(f"{name}: {key} is all zeros after {STEPS} steps")
        assert not problems, problems

    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "fp32"), (1, BF16_FP32_ACCUM)])
    def test_readable_right_after_a_load(self, tmpdir, stage, precision):
        """A full resume from a rigid checkpoint re-creates the hp mappings: read right after the load, before any
        step, every parameter's moments are the saved ones, in an engine that had stepped since the save and in a
        fresh one."""
        engine, groups = build(stage, precision, "none")
        x, y = fixed_batch(dtype=LOW_DTYPE[precision], device=engine.device)
        for _ in range(STEPS):
            engine.backward(engine(x, y))
            engine.step()
        saved = read_moments(groups)
        engine.save_checkpoint(str(tmpdir), tag="ckpt")
        engine.backward(engine(x, y))
        engine.step()  # the moments move on: the load must bring the saved ones back
        engine.load_checkpoint(str(tmpdir), tag="ckpt")
        assert_same_moments(read_moments(groups), saved, "the engine that saved")
        fresh, fresh_groups = build(stage, precision, "none")
        fresh.load_checkpoint(str(tmpdir), tag="ckpt")
        assert_same_moments(read_moments(fresh_groups), saved, "a fresh engine")


def read_moments(groups):
    """{(group index, param index): {key: full moment}} through safe_get_full_optimizer_state."""
    return {
        (g, i): {
            key: safe_get_full_optimizer_state(p, key).cpu().clone()
            for key in MOMENTS
        }
        for g, group in enumerate(groups)
        for i, p in enumerate(group)
    }


def assert_same_moments(read, saved, engine):
    problems = [
        f"{engine}: group {g} param {i} {key}" for (g, i), moments in saved.items() for key in MOMENTS
        if not torch.equal(read[(g, i)][key], moments[key])
    ]
    assert not problems, problems
