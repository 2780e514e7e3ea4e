# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 with the optimizer offloaded to NVMe: every load_checkpoint mode ends in the same fp32 masters,
moments and steps as the same run without offload (test_zero_resume_fp32_masters.py), for the sub-groups
swapped to NVMe and for those kept in memory because they are below the aio minimum size."""

import contextlib
import os

import pytest
import torch

import deepspeed
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.runtime.zero.partition_parameters import Init
from unit.checkpoint.universal_conversion import convert_to_universal, converter_args
from unit.checkpoint.zero_resume_helpers import (RESUME_TABLE, SAVED_STEPS, TAG, assert_same, expect_rejected,
                                                 make_config, masters, move_aside_on_rank, moments, rounding, snapshot,
                                                 steps)
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS

# The big layer's weight is a sub-group of its own whose per-rank fp32 partition (768 * 768 / 2 elements,
# 1.2 MB) reaches the aio minimum (1 MiB) and is swapped; the rest (bias and the small layer) form a second
# sub-group that stays in memory.
BIG, SMALL = 768, 16
SUB_GROUP_SIZE = 100_000

# load_fp32_weights left out (None): it is ignored with load_module_only, and 0.19.8 does not take it.
MODULE_ONLY_ROWS = [(False, None, True, "rounded", "fresh"), (True, None, True, "rounded", "fresh")]


def aio_missing():
    try:
        return not AsyncIOBuilder().is_compatible()
    except Exception:  # noqa: BLE001 -- any failure to probe the op means it cannot be used
        return True


pytestmark = pytest.mark.skipif(aio_missing(),
                                reason="NVMe offload needs the async_io op (libaio-dev), "
                                "which AsyncIOBuilder().is_compatible() reports unavailable here")


class TwoSizeMLP(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.big = torch.nn.Linear(BIG, BIG)
        self.small = torch.nn.Linear(BIG, SMALL)
        self.loss_fn = torch.nn.MSELoss()

    def forward(self, x, y):
        return self.loss_fn(self.small(torch.tanh(self.big(x))), y)


def nvme_config(nvme_path, universal=False, **zero_overrides):
    return make_config(3,
                       "bf16",
                       universal=universal,
                       sub_group_size=SUB_GROUP_SIZE,
                       offload_optimizer={
                           "device": "nvme",
                           "nvme_path": str(nvme_path)
                       },
                       **zero_overrides)


def make_nvme_engine(config, seed=0, first_param_id=0):
    # Swap files are named after the parameters' ds_id, counted process-wide: start from 0 as a resumed process
    # does, so that each engine of this process finds the files that the saving engine wrote.
    Init.param_id = first_param_id
    torch.manual_seed(seed)
    model = TwoSizeMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train(engine, steps=SAVED_STEPS):
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(4, BIG, generator=gen).to(device=engine.device, dtype=torch.bfloat16)
    y = torch.tanh(torch.randn(4, SMALL, generator=gen)).to(device=engine.device, dtype=torch.bfloat16)
    for _ in range(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def swapped_sub_groups(engine):
    """Per sub-group: whether its fp32 partition and optimizer state live on NVMe."""
    optimizer = engine.optimizer
    return [optimizer._swappable_optimizer_subgroup(i) for i in range(len(optimizer.fp16_groups))]


def assert_both_kinds(engine):
    kinds = swapped_sub_groups(engine)
    assert True in kinds and False in kinds, f"want swapped and in-memory sub-groups, got {kinds}"


def fresh_state_problems(engine):
    problems = []
    if steps(engine) not in ([], [0.0] * len(steps(engine))):
        problems.append(f"steps {steps(engine)}")
    for name, state in moments(engine).items():
        for key, value in state.items():
            if value is not None and not torch.equal(value, torch.zeros_like(value)):
                problems.append(f"{name}.{key} not fresh")
    return problems


def resume_problems(engine, row, saved_masters, saved_moments):
    """What differs from the table's promise after a load (empty: nothing)."""
    _, _, _, want_masters, want_state = row
    expected = saved_masters if want_masters == "saved" else rounding(saved_masters)
    loaded = masters(engine)
    problems = [f"master {n}" for n in expected if not torch.equal(loaded[n], expected[n])]
    if want_state == "saved":
        try:
            assert_same(moments(engine), saved_moments)
        except AssertionError as e:
            problems.append(f"moments {e}")
        if set(steps(engine)) != {float(SAVED_STEPS)}:
            problems.append(f"steps {steps(engine)}")
    else:
        problems += fresh_state_problems(engine)
    return problems


def check_rows(rows, tmpdir, tag, universal, **zero_overrides):
    """Load the checkpoint saved under tmpdir/ckpt with each row's arguments into a fresh engine (own
    nvme_path), and compare with the masters and moments saved beside it."""
    save_dir = os.path.join(tmpdir, "ckpt")
    saved_masters, saved_moments = torch.load(os.path.join(save_dir, "saved.pt"))
    failures = {}
    for i, row in enumerate(rows):
        load_optimizer_states, load_fp32_weights, load_module_only = row[:3]
        engine = make_nvme_engine(nvme_config(os.path.join(tmpdir, f"nvme_load{i}"), universal, **zero_overrides),
                                  seed=1)
        assert_both_kinds(engine)
        try:
            kwargs = {} if load_fp32_weights is None else dict(load_fp32_weights=load_fp32_weights)
            engine.load_checkpoint(save_dir,
                                   tag=tag,
                                   load_optimizer_states=load_optimizer_states,
                                   load_module_only=load_module_only,
                                   **kwargs)
            problems = resume_problems(engine, row, saved_masters, saved_moments)
        except Exception as e:  # noqa: BLE001 -- reported with the row it belongs to
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            failures[f"load_optimizer_states={load_optimizer_states} load_fp32_weights={load_fp32_weights} "
                     f"load_module_only={load_module_only}"] = problems
    assert not failures, failures


def save_checkpoint(tmpdir, settings="defaults"):
    """Train with NVMe offload and save to tmpdir/ckpt, with the masters and moments read before saving."""
    engine = make_nvme_engine(nvme_config(os.path.join(tmpdir, "nvme_save"), settings=settings))
    assert_both_kinds(engine)
    train(engine)
    saved = masters(engine), moments(engine)
    save_dir = os.path.join(tmpdir, "ckpt")
    engine.save_checkpoint(save_dir, tag=TAG)
    if torch.distributed.get_rank() == 0:
        torch.save(saved, os.path.join(save_dir, "saved.pt"))
    torch.distributed.barrier()
    return engine


class TestZero3NVMeResume(DistributedTest):
    world_size = 2
    exec_timeout = 300

    def test_module_only(self, tmpdir):
        """load_module_only=True rebuilds the fp32 masters of swapped and in-memory sub-groups from the loaded
        16-bit weights (the swapped ones through the swapper), with fresh moments and steps."""
        save_checkpoint(str(tmpdir))
        check_rows(MODULE_ONLY_ROWS, str(tmpdir), TAG, universal=False)

    @pytest.mark.parametrize("settings", list(SETTINGS))
    def test_resume_table(self, tmpdir, settings):
        save_checkpoint(str(tmpdir), settings)
        check_rows(RESUME_TABLE, str(tmpdir), TAG, universal=False, settings=settings)

    def test_universal_refused_before_anything_changes(self, tmpdir):
        """Universal checkpoints do not support NVMe optimizer offload yet: converting an NVMe checkpoint and
        loading a universal one into an NVMe run both fail with an error that says so, the load with the engine
        left bit-identical."""
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal
        from deepspeed.runtime.zero.utils import ZeRORuntimeException
        save_checkpoint(str(tmpdir))
        nvme_checkpoint = os.path.join(str(tmpdir), "ckpt", TAG)
        with pytest.raises(ValueError, match="offload_optimizer.device='nvme'.*offloaded_tensors"):
            ds_to_universal(converter_args(nvme_checkpoint, nvme_checkpoint + "_u"))
        assert not os.path.exists(nvme_checkpoint + "_u")

        plain = make_nvme_engine(make_config(3, "bf16", sub_group_size=SUB_GROUP_SIZE))
        train(plain)
        plain_dir = os.path.join(str(tmpdir), "plain")
        plain.save_checkpoint(plain_dir, tag=TAG)
        universal_tag = convert_to_universal(plain_dir, TAG)
        engine = make_nvme_engine(nvme_config(os.path.join(str(tmpdir), "nvme_load"), universal=True), seed=1)
        before = snapshot(engine)
        with pytest.raises(ZeRORuntimeException, match="universal checkpoints do not support NVMe.*'cpu' or 'none'"):
            engine.load_checkpoint(plain_dir, tag=universal_tag)
        assert_same(snapshot(engine), before)

    def test_serial_load(self, tmpdir):
        """zero_optimization.pipeline_loading_checkpoint at the default persistence threshold: the shard load
        runs one rank at a time, so it must reach no collective (the persistent parameters are gathered once
        every rank has loaded)."""
        save_checkpoint(str(tmpdir))
        rows = [row for row in RESUME_TABLE if row[1] is None] + MODULE_ONLY_ROWS[:1]
        check_rows(rows, str(tmpdir), TAG, universal=False, pipeline_loading_checkpoint=True)

    def test_unusable_offload_folder_refused_before_anything_changes(self, tmpdir):
        """Every mode reads this rank's offloaded_tensors/: swap files named for other parameter ids (another
        ZeRO-3 model was built first in the process), or rank 1's folder missing, are refused on every rank
        with the engine and its swap folder unchanged."""
        save_checkpoint(str(tmpdir))
        save_dir = os.path.join(str(tmpdir), "ckpt")
        modes = (dict(), dict(load_optimizer_states=False), dict(load_module_only=True))
        shifted = make_nvme_engine(nvme_config(os.path.join(str(tmpdir), "nvme_shifted")), seed=1, first_param_id=100)
        for kwargs in modes:
            with swap_folder_unchanged(shifted):
                expect_rejected(shifted, save_dir, "no swap file .*same ZeRO-3 models", **kwargs)
        engine = make_nvme_engine(nvme_config(os.path.join(str(tmpdir), "nvme_load")), seed=1)
        put_back = move_aside_on_rank(os.path.join(save_dir, TAG, "offloaded_tensors", "rank01"), 1)
        for kwargs in modes:
            with swap_folder_unchanged(engine):
                expect_rejected(engine, save_dir, "lacks .*offloaded_tensors", refusing_rank=1, **kwargs)
        put_back()

    def test_loaded_without_nvme_refused_before_anything_changes(self, tmpdir):
        """Loaded without NVMe offload (the saved config otherwise), at the saved size: the swapped sub-group's
        master and moments are in offloaded_tensors/, not in the shards, so every mode is refused on every rank,
        naming NVMe offload as the way out."""
        save_checkpoint(str(tmpdir))
        save_dir = os.path.join(str(tmpdir), "ckpt")
        engine = make_nvme_engine(make_config(3, "bf16", sub_group_size=SUB_GROUP_SIZE), seed=1)
        modes = (dict(), dict(load_optimizer_states=False), dict(load_fp32_weights=False), dict(load_module_only=True))
        for kwargs in modes:
            expect_rejected(engine, save_dir, "without NVMe optimizer offload.*offload_optimizer.device='nvme'",
                            **kwargs)


@contextlib.contextmanager
def swap_folder_unchanged(engine):
    folder = engine.optimizer.optimizer_swapper.swap_folder

    def listing():
        return {name: os.stat(os.path.join(folder, name)).st_mtime_ns for name in sorted(os.listdir(folder))}

    before = listing()
    yield
    assert listing() == before, f"{folder} changed"
