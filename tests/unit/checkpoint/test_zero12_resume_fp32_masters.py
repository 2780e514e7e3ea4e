# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""load_checkpoint(load_fp32_weights=...) under ZeRO-1/2 (bf16, fp16), the BF16_Optimizer path (bf16 weights
with fp32 gradient accumulation, ZeRO-1) and ZeRO-3 fp16: which fp32 masters, moments and steps a resume ends
with, and the resumes that cannot restore the masters failing early, alike on every rank, leaving the engine as
it was. The ZeRO-3 bf16 version is test_zero_resume_fp32_masters.py."""

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import DS_VERSION, OPTIMIZER_STATE_DICT, UNIVERSAL_CHECKPOINT_INFO
from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, WAYS_OUT, assert_fresh, assert_same,
                                                 check_refused_then_rebuilt, freeze, make_config, masters,
                                                 move_aside_on_rank, moments, remove_shards, rounding, shard_path,
                                                 steps, to_universal, truncate_on_rank)
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch
from unit.checkpoint.checkpoint_edits import without_manifest

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


def build(config, seed=0, hidden=16, frozen=(), nlayers=3, groups=None, lr_scheduler=None):
    """A TinyMLP engine; parameters whose names start with a prefix in `frozen` do not train. groups: [(prefixes,
    hyperparameters), ...], one param group each, in that order, of the trainable parameters named by prefix."""
    if config.get("fp16", {}).get("enabled"):
        # The CPU accelerator reports fp16 unsupported when oneDNN lacks fp16 kernels; the tiny model's
        # fp16 Linear/tanh/MSE and gloo's fp16 all-reduce still run (slowly) on CPU.
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    model = freeze(TinyMLP(hidden=hidden, nlayers=nlayers), frozen)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if groups is None:
        model_parameters = [p for _, p in trainable]
    else:
        model_parameters = [
            dict(params=[p for name, p in trainable if name.startswith(prefixes)], **hyperparameters)
            for prefixes, hyperparameters in groups
        ]
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model_parameters,
                                           lr_scheduler=lr_scheduler,
                                           config=config)
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


class TestZero12ResumeTable(DistributedTest):
    world_size = 2
    exec_timeout = 300

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


class TestZero12ResumeWithoutShards(DistributedTest):
    world_size = 2
    exec_timeout = 200

    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16"), (1, BF16_FP32_ACCUM)])
    def test_missing_shards(self, tmpdir, stage, precision):
        """Rank 0's shard missing, then rank 1's: restoring the masters (with or without optimizer states) is
        rejected alike on every rank with the engine unchanged, and a fresh-optimizer resume rebuilds them from the
        16-bit module on every rank (the rank that has its shard too). With every shard gone, load_fp32_weights=False
        never opens a shard."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(stage, precision), save_dir)
        engine = build(config_for(stage, precision), seed=1)
        match = "optim_states.pt shard.*" + WAYS_OUT
        for missing_rank in (0, 1):
            put_back = move_aside_on_rank(shard_path(save_dir, missing_rank), missing_rank)
            check_refused_then_rebuilt(engine, lambda: build(config_for(stage, precision), seed=1), save_dir, match,
                                       rounded_to(saved_masters, precision), missing_rank)
            put_back()
        remove_shards(save_dir)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False, load_fp32_weights=False)
        assert_masters(engine, rounded_to(saved_masters, precision))
        assert_fresh(engine)

    def test_truncated_shard_on_one_rank(self, tmpdir):
        """Rank 1's shard cut in half: restoring the masters is refused on every rank before anything changes
        (instead of rank 0 waiting for rank 1), and a fresh-optimizer resume rebuilds them on every rank, as 0.19.8
        did without reading the shards."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16"), save_dir)
        truncate_on_rank(shard_path(save_dir, 1), 1)
        check_refused_then_rebuilt(build(config_for(1, "bf16"), seed=1), lambda: build(config_for(1, "bf16"), seed=1),
                                   save_dir, "cannot be read.*truncated or corrupt.*" + WAYS_OUT,
                                   rounding(saved_masters), 1)


# What a load restores besides weights and masters: the loss scaler (fp16) and clip_grad (saved by ZeRO-1/2 and
# BF16_Optimizer) are optimizer state, so only a full resume (load_optimizer_states=True) takes them from the
# checkpoint.
SAVED_SCALE_POWER, RUN_SCALE_POWER = 8, 10
SAVED_CLIP, RUN_CLIP = 1.0, 0.5
LOAD_MODES = {
    "full": dict(),
    "fresh optimizer": dict(load_optimizer_states=False),
    "module only": dict(load_module_only=True),
}


def optimizer_side_state(engine):
    optimizer = engine.optimizer
    scaler = getattr(optimizer, "loss_scaler", None)
    return dict(loss_scale=getattr(scaler, "cur_scale", None), clip_grad=getattr(optimizer, "clip_grad", None))


class TestOptimizerSideState(DistributedTest):
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", [(2, "fp16"), (3, "fp16"), (1, "bf16"), (1, BF16_FP32_ACCUM)])
    def test_only_a_full_resume_restores_it(self, tmpdir, stage, precision):
        """Saved with loss scale 2**8 and gradient_clipping 1.0, loaded into a run configured with 2**10 and 0.5:
        a full resume takes the saved values, a fresh-optimizer or module-only load keeps the run's."""
        save_dir = str(tmpdir)

        def config(scale_power, clip):
            conf = config_for(stage, precision)
            conf["gradient_clipping"] = clip
            if precision == "fp16":
                conf["fp16"]["initial_scale_power"] = scale_power
            return conf

        saved = build(config(SAVED_SCALE_POWER, SAVED_CLIP))
        x, y = fixed_batch(dtype=next(saved.module.parameters()).dtype, device=saved.device)
        saved.backward(saved(x, y))
        saved.step()
        saved_state = optimizer_side_state(saved)
        saved.save_checkpoint(save_dir, tag=TAG, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
        problems = []
        for mode, kwargs in LOAD_MODES.items():
            engine = build(config(RUN_SCALE_POWER, RUN_CLIP), seed=1)
            run_state = optimizer_side_state(engine)
            assert run_state != saved_state, "the test needs the run's values to differ from the saved ones"
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            expected = dict(run_state)
            if mode == "full":  # ZeRO-3 saves no clip_grad: its gradient_clipping always comes from the config
                expected.update(loss_scale=saved_state["loss_scale"])
                if stage < 3:
                    expected.update(clip_grad=saved_state["clip_grad"])
            if optimizer_side_state(engine) != expected:
                problems.append(f"{mode}: {optimizer_side_state(engine)}, expected {expected}")
        assert not problems, problems


class TestZero12ResumeAlignmentChange(DistributedTest):
    world_size = 2
    exec_timeout = 150

    def test_parameter_alignment_change(self, tmpdir):
        """Saved with zero_optimization.parameter_alignment=true (odd-sized parameters, so padded), loaded
        without: restoring the masters is rejected before anything changes, naming the ways out; a
        fresh-optimizer resume rebuilds them."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16", parameter_alignment=True), save_dir, hidden=15)
        check_refused_then_rebuilt(build(config_for(1, "bf16"), seed=1,
                                         hidden=15), lambda: build(config_for(1, "bf16"), seed=1, hidden=15), save_dir,
                                   "parameter-alignment layout.*" + WAYS_OUT, rounding(saved_masters))


class TestZero1LayoutBefore0317(DistributedTest):
    world_size = 2
    exec_timeout = 150

    def test_shard_saved_before_0_3_17(self, tmpdir):
        """ZeRO-1 shards whose ds_version is 0.3.16 (DeepSpeed changed the ZeRO-1 partition layout in 0.3.17): a full
        resume and load_fp32_weights=True are refused on every rank before anything changes, and a fresh-optimizer
        resume rebuilds the masters from the 16-bit weights instead of copying partitions of another layout."""
        save_dir = str(tmpdir)
        saved_masters, _ = train_and_save(config_for(1, "bf16"), save_dir)
        mark_saved_by(save_dir, "0.3.16")
        check_refused_then_rebuilt(build(config_for(1, "bf16"), seed=1), lambda: build(config_for(1, "bf16"), seed=1),
                                   save_dir, "older than 0.3.17.*" + WAYS_OUT, rounding(saved_masters))


def mark_saved_by(save_dir, version):
    """Rewrite every rank's shard as if DeepSpeed `version` had saved it (rank 0 writes, every rank waits)."""
    dist.barrier()
    if dist.get_rank() == 0:
        for rank in range(dist.get_world_size()):
            path = shard_path(save_dir, rank)
            state = torch.load(path, map_location="cpu", weights_only=False)
            state[OPTIMIZER_STATE_DICT][DS_VERSION] = version
            torch.save(state, path)
            without_manifest(path)
    dist.barrier()
