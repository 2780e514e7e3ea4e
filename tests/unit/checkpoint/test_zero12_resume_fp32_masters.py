# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""load_checkpoint(load_fp32_weights=...) under ZeRO-1/2 (bf16, fp16), the BF16_Optimizer path (bf16 weights
with fp32 gradient accumulation, ZeRO-1) and ZeRO-3 fp16: which fp32 masters, moments and steps a resume ends
with, and the resumes that cannot restore the masters failing early, alike on every rank, leaving the engine as
it was. The ZeRO-3 bf16 version is test_zero_resume_fp32_masters.py."""

import glob
import os

import pytest
import torch

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, WAYS_OUT, assert_fresh, assert_same,
                                                 expect_rejected, make_config, masters, moments, rounding,
                                                 save_in_world, steps, to_universal)
from unit.common import DistributedTest
from unit.simple_model import TinyMLP, fixed_batch

# The BF16_Optimizer wrapper: bf16 weights, fp32 gradient accumulation, ZeRO stage 1 (engine
# _do_optimizer_sanity_check; stage 0 with these types is rejected unless pipeline-parallel).
BF16_FP32_ACCUM = "bf16_fp32_grad_accum"
LOW_DTYPE = {"bf16": torch.bfloat16, BF16_FP32_ACCUM: torch.bfloat16, "fp16": torch.float16}
OPTIMIZER_CLASS = {1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}


def config_for(stage, precision, universal=False, **zero_overrides):
    config = make_config(stage, "fp32" if precision == "fp16" else "bf16", universal, **zero_overrides)
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == BF16_FP32_ACCUM:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def build(config, seed=0, hidden=16):
    if config.get("fp16", {}).get("enabled"):
        # The CPU accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels; the tiny model's
        # fp16 Linear/tanh/MSE and gloo's fp16 all-reduce still run (slowly) on CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    model = TinyMLP(hidden=hidden)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_and_save(config, save_dir, hidden=16):
    engine = build(config, hidden=hidden)
    x, y = fixed_batch(hidden=hidden, dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(SAVED_STEPS):
        engine.backward(engine(x, y))
        engine.step()
    saved = masters(engine), moments(engine)
    # ds_to_universal needs this entry (empty: no tensor-parallel patterns) in ZeRO-1/2 checkpoints.
    engine.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    return saved


def rounded_to(tensors, precision):
    return rounding(tensors, LOW_DTYPE[precision])


def assert_masters(engine, expected, case=""):
    loaded = masters(engine)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), f"{case}: master {name}"


def remove_shards(save_dir):
    """Delete every rank's *_optim_states.pt of TAG (rank 1 deletes, all ranks wait)."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 1:
        for shard in glob.glob(os.path.join(save_dir, TAG, "*_optim_states.pt")):
            os.remove(shard)
    torch.distributed.barrier()


@pytest.mark.cell(feature="resume", offload="none", layout="none")
class TestZero12ResumeTable(DistributedTest):
    world_size = 2

    @pytest.mark.exec_timeout(300)
    @pytest.mark.parametrize("checkpoint", ["rigid", "universal"])
    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16"), (2, "fp16"), (1, BF16_FP32_ACCUM),
                                                  (3, "fp16")])
    def test_resume_table(self, tmpdir, stage, precision, checkpoint):
        """Every (load_optimizer_states, load_fp32_weights, load_module_only) row of RESUME_TABLE, loaded by a
        fresh engine from one saved checkpoint: masters saved bit for bit or their exact 16-bit rounding."""
        save_dir = str(tmpdir)
        universal = checkpoint == "universal"
        saved_masters, saved_moments = train_and_save(config_for(stage, precision), save_dir)
        tag = to_universal(save_dir) if universal else TAG
        for load_optimizer_states, load_fp32_weights, load_module_only, want_masters, want_state in RESUME_TABLE:
            case = f"load_optimizer_states={load_optimizer_states} load_fp32_weights={load_fp32_weights} " \
                   f"load_module_only={load_module_only}"
            engine = build(config_for(stage, precision, universal), seed=1)
            expected_class = "BF16_Optimizer" if precision == BF16_FP32_ACCUM else OPTIMIZER_CLASS[stage]
            assert type(engine.optimizer).__name__ == expected_class
            engine.load_checkpoint(save_dir,
                                   tag=tag,
                                   load_optimizer_states=load_optimizer_states,
                                   load_fp32_weights=load_fp32_weights,
                                   load_module_only=load_module_only)
            assert_masters(engine, saved_masters if want_masters == "saved" else rounded_to(saved_masters, precision),
                           case)
            if want_state == "saved":
                assert_same(moments(engine), saved_moments, case)
                assert set(steps(engine)) == {float(SAVED_STEPS)}, f"{case}: {steps(engine)}"
            else:
                assert_fresh(engine)


@pytest.mark.cell(feature="resume", offload="none", checkpoint="rigid", layout="none")
class TestZero12ResumeWithoutShards(DistributedTest):
    world_size = 2
    pg_timeout_s = 60

    @pytest.mark.exec_timeout(150)
    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16"), (1, BF16_FP32_ACCUM)])
    def test_missing_shards(self, tmpdir, stage, precision):
        """All *_optim_states.pt removed: restoring the masters (with or without optimizer states) is rejected
        alike on every rank with the engine unchanged; load_fp32_weights=False never opens a shard and rebuilds
        the masters from the 16-bit module."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(stage, precision), save_dir)
        remove_shards(save_dir)
        engine = build(config_for(stage, precision), seed=1)
        match = "optim_states.pt shard.*" + WAYS_OUT
        expect_rejected(engine, save_dir, match, load_optimizer_states=False)
        expect_rejected(engine, save_dir, match, load_optimizer_states=True)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        assert_masters(engine, rounded_to(saved_masters, precision))
        assert_fresh(engine)


@pytest.fixture
def dp4_checkpoint(tmp_path, stage):
    save_in_world(tmp_path, world_size=4, stage=stage)
    return str(tmp_path)


@pytest.mark.cell(feature="resume", precision="bf16", offload="none", checkpoint="rigid", layout="dp4->dp2")
class TestZero12ResumeDPChange(DistributedTest):
    world_size = 2
    pg_timeout_s = 60

    @pytest.mark.exec_timeout(200)
    @pytest.mark.parametrize("stage", [1, 2])
    def test_dp_size_change(self, dp4_checkpoint, stage):
        """Saved by 4 ranks, loaded by 2: neither masters nor optimizer states can be restored rigidly; the
        fallback named in the error rebuilds the masters from the bf16 module."""
        engine = build(config_for(stage, "bf16"), seed=1)
        match = "DP world size of 4.*" + WAYS_OUT
        expect_rejected(engine, dp4_checkpoint, match, load_optimizer_states=False)
        expect_rejected(engine, dp4_checkpoint, match, load_optimizer_states=True)
        engine.load_checkpoint(dp4_checkpoint, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        saved_masters = torch.load(os.path.join(dp4_checkpoint, "saved_masters.pt"))
        assert_masters(engine, rounding(saved_masters))
        assert_fresh(engine)


@pytest.mark.cell(feature="resume",
                  stage=1,
                  precision="bf16",
                  offload="none",
                  checkpoint="rigid",
                  layout="parameter_alignment")
class TestZero12ResumeAlignmentChange(DistributedTest):
    world_size = 2
    pg_timeout_s = 60

    @pytest.mark.exec_timeout(150)
    def test_parameter_alignment_change(self, tmpdir):
        """Saved with zero_optimization.parameter_alignment=true (odd-sized parameters, so padded), loaded
        without: rejected before anything changes, naming the ways out; load_fp32_weights=False then loads."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16", parameter_alignment=True), save_dir, hidden=15)
        engine = build(config_for(1, "bf16"), seed=1, hidden=15)
        match = "parameter-alignment layout.*" + WAYS_OUT
        expect_rejected(engine, save_dir, match, load_optimizer_states=False)
        expect_rejected(engine, save_dir, match, load_optimizer_states=True)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        assert_masters(engine, rounding(saved_masters))


@pytest.mark.cell(feature="resume", stage=3, precision="bf16", offload="none", checkpoint="universal", layout="none")
class TestZero3UniversalModuleOnly(DistributedTest):
    world_size = 2

    @pytest.mark.exec_timeout(150)
    def test_module_only_reads_no_rigid_shards(self, tmpdir):
        """A universal module-only load reads the universal folder only: the rigid shards named in `latest`
        are deleted after the conversion, and the masters still come out as the bf16 rounding of the saved."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(3, "bf16"), save_dir)
        tag = to_universal(save_dir)
        remove_shards(save_dir)
        engine = build(config_for(3, "bf16", universal=True), seed=1)
        engine.load_checkpoint(save_dir, tag=tag, load_optimizer_states=False, load_module_only=True)
        assert_masters(engine, rounding(saved_masters))
        assert_fresh(engine)
