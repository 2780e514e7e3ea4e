# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 master weights share the weight partition when they would be identical (same dtype and
device): fp32 models, fp32 under torch autocast, and bf16 models with bf16 master weights. bf16
models with fp32 masters, and optimizer offload, keep a separate master copy.

Regression tests (fail on pristine 0.19.8, where the device comparison never matched):
identity, parity, offload round trips and GatheredParameters persistence for the aliased
precisions. The non-aliased cases pin upstream behaviour and pass on both.
"""

import contextlib

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from unit.common import DistributedTest
from unit.zero_tiny_models import SETTINGS, TinyMLP, fixed_batch, model_dtype, zero3_config

ALIASED = ["fp32", "autocast", "bf16_master"]
NOT_ALIASED = ["bf16"]


def make_engine(precision, config=None):
    config = config or zero3_config(precision)
    torch.manual_seed(0)
    model = TinyMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_step(engine, precision):
    x, y = fixed_batch(dtype=model_dtype(precision), device=engine.device)
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.detach().clone()


def storage_ptr(tensor):
    return tensor.untyped_storage().data_ptr()


def assert_aliased(optimizer):
    """Every master partition is the weight partition, and both live in lp_param_buffer with the ds_tensors."""
    masters, weights = optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat
    assert len(masters) == len(weights) > 0
    for i, (master, weight) in enumerate(zip(masters, weights)):
        assert master is weight, f"sub-group {i}: master partition is a separate copy"
    buffer_storage = storage_ptr(optimizer.lp_param_buffer)
    assert all(storage_ptr(m) == buffer_storage for m in masters), "master not backed by lp_param_buffer"
    assert_ds_tensors_in_lp_buffer(optimizer)


def assert_ds_tensors_in_lp_buffer(optimizer):
    buffer_storage = storage_ptr(optimizer.lp_param_buffer)
    for p in optimizer.module.parameters():
        assert storage_ptr(p.ds_tensor) == buffer_storage, "ds_tensor no longer backed by lp_param_buffer"


def assert_not_aliased(optimizer):
    weight_storages = {storage_ptr(t) for t in optimizer.fp16_partitioned_groups_flat}
    for master, weight in zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat):
        assert master is not weight
        assert storage_ptr(master) not in weight_storages


def snapshot(engine):
    """Clones of everything an offload round trip must preserve: weights, masters, Adam moments, steps."""
    optimizer = engine.optimizer
    state = {
        "weights": [p.ds_tensor.detach().clone() for p in engine.module.parameters()],
        "masters": [m.detach().clone() for m in optimizer.fp32_partitioned_groups_flat],
        "exp_avg": [],
        "exp_avg_sq": [],
        "step": [],
    }
    for master in optimizer.fp32_partitioned_groups_flat:
        adam_state = optimizer.optimizer.state[master]
        state["exp_avg"].append(adam_state["exp_avg"].detach().clone())
        state["exp_avg_sq"].append(adam_state["exp_avg_sq"].detach().clone())
        step = adam_state.get("step", optimizer.optimizer.param_groups[0].get("step"))
        state["step"].append(int(step) if step is not None else None)
    return state


def assert_snapshots_equal(actual, expected, where):
    for key in expected:
        assert len(actual[key]) == len(expected[key])
        for i, (a, e) in enumerate(zip(actual[key], expected[key])):
            if isinstance(e, torch.Tensor):
                assert a.dtype == e.dtype and torch.equal(a, e), f"{where}: {key}[{i}] differs"
            else:
                assert a == e, f"{where}: {key}[{i}] is {a}, expected {e}"


class TestMasterPartitionIdentity(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("precision", ALIASED)
    def test_aliased(self, precision):
        engine = make_engine(precision)
        assert_aliased(engine.optimizer)
        losses = [train_step(engine, precision).item() for _ in range(3)]
        assert losses[-1] < losses[0]
        assert_aliased(engine.optimizer)

    @pytest.mark.parametrize("precision", NOT_ALIASED)
    def test_separate_master_for_16bit_weights(self, precision):
        engine = make_engine(precision)
        assert_not_aliased(engine.optimizer)
        train_step(engine, precision)
        assert_not_aliased(engine.optimizer)

    @pytest.mark.parametrize("precision", ["fp32", "bf16"])
    def test_separate_master_with_optimizer_offload(self, precision):
        engine = make_engine(precision, zero3_config(precision, offload_optimizer={"device": "cpu"}))
        assert_not_aliased(engine.optimizer)
        train_step(engine, precision)
        assert_not_aliased(engine.optimizer)


def keep_separate_master_copies(monkeypatch):
    """Make every ZeRO-3 engine built afterwards keep a separate master copy (upstream 0.19.8's layout)."""
    original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions

    def create_separate_copies(self):
        original(self)
        for i in sorted(self.aliased_sub_groups):
            alias = self.fp32_partitioned_groups_flat[i]
            copy = alias.detach().clone()
            copy.ds_id, copy.requires_grad = alias.ds_id, True
            self.fp32_partitioned_groups_flat[i] = copy
        self.aliased_sub_groups.clear()

    monkeypatch.setattr(DeepSpeedZeroOptimizer_Stage3, "_create_fp32_partitions", create_separate_copies)


class TestAliasNumericalParity(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("precision", ALIASED)
    def test_aliased_matches_separate_copy(self, precision):
        aliased = make_engine(precision)
        assert_aliased(aliased.optimizer)
        with pytest.MonkeyPatch.context() as monkeypatch:
            keep_separate_master_copies(monkeypatch)
            separate = make_engine(precision)
        assert_not_aliased(separate.optimizer)

        for step in range(4):
            loss_aliased, loss_separate = train_step(aliased, precision), train_step(separate, precision)
            assert torch.equal(loss_aliased, loss_separate), f"step {step}: {loss_aliased} != {loss_separate}"
        assert_snapshots_equal(snapshot(aliased), snapshot(separate), "after 4 steps")


ALL_STATES = list(OffloadStateTypeEnum)
HP, LP = OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.lp_params
OPTIM, GRADS = OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.lp_grads

# Each sequence is a list of (include, pin_memory) round trips, each followed by a training step.
ROUND_TRIPS = {
    # the sequence that left lp_param_buffer stale once the partitions aliased
    "hp-then-lp": [([HP], True), ([LP], True)],
    "lp-then-hp": [([LP], True), ([HP], True)],
    "everything": [(None, True), (None, False)],
    "mixed": [([OPTIM, GRADS], False), ([HP, OPTIM], True), ([LP, GRADS], False), ([GRADS, HP, LP, OPTIM], True)],
}


@contextlib.contextmanager
def real_copies():
    """Make Tensor.to() copy, as a move between accelerator and host memory does. On the CPU accelerator
    .to('cpu') returns the tensor itself, so a reload that reads a stale buffer (the pinned copy of an earlier
    offload, say) would still find the current values there."""
    original = torch.Tensor.to

    def copying_to(tensor, *args, **kwargs):
        kwargs.setdefault("copy", True)
        return original(tensor, *args, **kwargs)

    torch.Tensor.to = copying_to
    try:
        yield
    finally:
        torch.Tensor.to = original


def offload_with_fused_adam(precision, settings="defaults"):
    # offload_states needs DeepSpeed's FusedAdam (the CPU op is JIT-built once).
    config = zero3_config(precision, settings=settings)
    config["optimizer"]["params"].pop("torch_adam")
    return config


class TestOffloadReloadRoundTrips(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("settings", list(SETTINGS))
    @pytest.mark.parametrize("sequence", list(ROUND_TRIPS))
    @pytest.mark.parametrize("precision", ALIASED + NOT_ALIASED)
    def test_round_trips_are_exact(self, precision, sequence, settings):
        config = offload_with_fused_adam(precision, settings)
        engine, reference = make_engine(precision, config), make_engine(precision, config)  # reference: no offload
        check_layout = assert_aliased if precision in ALIASED else assert_not_aliased

        train_step(engine, precision), train_step(reference, precision)
        for round_trip, (include, pin_memory) in enumerate(ROUND_TRIPS[sequence]):
            where = f"round trip {round_trip} ({include}, pin_memory={pin_memory})"
            before = snapshot(engine)
            with real_copies():
                engine.optimizer.offload_states(include=include, pin_memory=pin_memory)
            assert_offloaded_weights_moved_together(engine.optimizer, precision, include, pin_memory)
            with real_copies():
                engine.optimizer.reload_states()
            assert engine.optimizer.offloaded_states == set()
            assert_snapshots_equal(snapshot(engine), before, where)
            check_layout(engine.optimizer)
            assert_ds_tensors_in_lp_buffer(engine.optimizer)

            loss, reference_loss = train_step(engine, precision), train_step(reference, precision)
            assert torch.equal(loss, reference_loss), f"{where}: loss {loss} != {reference_loss}"
            assert_snapshots_equal(snapshot(engine), snapshot(reference), f"step after {where}")
            check_layout(engine.optimizer)


def assert_offloaded_weights_moved_together(optimizer, precision, include, pin_memory):
    """While offloaded, aliased hp/lp params moved as one: both recorded, both in one new storage."""
    moved_lp = include is None or LP in include or (precision in ALIASED and HP in include)
    if precision in ALIASED and moved_lp:
        assert {HP, LP} <= optimizer.offloaded_states
        offloaded_storage = storage_ptr(optimizer.lp_param_buffer)
        for master in optimizer.fp32_partitioned_groups_flat:
            assert storage_ptr(master) == offloaded_storage, "aliased master left behind by the offload"
        for p in optimizer.module.parameters():
            assert storage_ptr(p.ds_tensor) == offloaded_storage
        if pin_memory:  # the weights and masters now live in the pinned copy, and only there
            assert offloaded_storage == storage_ptr(optimizer.lp_param_contiguous_pin_buffer)


class TestGatheredParametersEdits(DistributedTest):
    """Edits made under GatheredParameters(modifier_rank=0) reach the partitions. Where the master aliases the
    partition they are the master and persist through step(); with fp32 masters for 16-bit weights the next
    step() overwrites them from the master unless refresh_fp32_params() is called (as in upstream)."""
    world_size = 2

    @pytest.mark.parametrize("precision, refresh",
                             [(p, False) for p in ALIASED + NOT_ALIASED] + [(p, True) for p in NOT_ALIASED])
    def test_edit_survives_step(self, precision, refresh):
        engine = make_engine(precision, zero3_config(precision, lr=0.0))  # lr 0: a step changes no weight
        weight = engine.module.layers[0].weight
        with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
            original = weight.detach().clone()
            if torch.distributed.get_rank() == 0:
                weight.data.fill_(0.5)
        if refresh:
            engine.optimizer.refresh_fp32_params()
        train_step(engine, precision)
        with deepspeed.zero.GatheredParameters([weight]):
            after_step = weight.detach().clone()

        edit_persists = refresh or precision in ALIASED
        expected = torch.full_like(original, 0.5) if edit_persists else original
        assert torch.equal(after_step, expected), (f"{precision}, refresh={refresh}: edit "
                                                   f"{'lost' if edit_persists else 'unexpectedly kept'}")
