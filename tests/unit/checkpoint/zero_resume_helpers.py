# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Shared steps for the checkpoint-resume tests: train a tiny model, save, convert, reload, and read
back the fp32 masters and optimizer moments of every parameter (gathered, so equal on every rank)."""

import contextlib
import glob
import logging
import os
from unittest import mock

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from deepspeed.utils import logger, safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.checkpoint.universal_conversion import convert_to_universal
from unit.zero_tiny_models import TinyMLP, fixed_batch, zero3_config
from unit.checkpoint.checkpoint_edits import without_manifest

TAG = "ckpt"
SAVED_STEPS = 3

# The load_fp32_weights table every ZeRO stage, precision and offload follows:
# (load_optimizer_states, load_fp32_weights, load_module_only) -> (masters, moments/step)
RESUME_TABLE = [
    (True, None, False, "saved", "saved"),
    (True, True, False, "saved", "saved"),
    (True, False, False, "rounded", "saved"),
    (False, None, False, "saved", "fresh"),
    (False, True, False, "saved", "fresh"),
    (False, False, False, "rounded", "fresh"),
    (False, True, True, "rounded", "fresh"),
    (True, True, True, "rounded", "fresh"),
]

# What every "cannot restore the masters" error must name.
WAYS_OUT = r"universal.*load_fp32_weights=False.*load_from_fp32_weights=false"

# Where the saved masters cannot be restored (another data-parallel size, trainable set or parameter alignment, a
# missing ZeRO-1/2 shard), these loads are refused on every rank with the engine unchanged ...
REFUSED_UNLESS_RESTORABLE = (dict(load_optimizer_states=True), dict(load_optimizer_states=False,
                                                                    load_fp32_weights=True))
# ... and these rebuild the masters from the 16-bit weights (the default with a warning, as 0.19.8 did).
REBUILD_MASTERS = (dict(load_optimizer_states=False), dict(load_optimizer_states=False, load_fp32_weights=False))


def make_config(stage=3, precision="bf16", universal=False, settings="defaults", **zero_overrides):
    config = zero3_config(precision, settings=settings, **zero_overrides)
    config["zero_optimization"]["stage"] = stage
    if stage < 3:
        config["zero_optimization"].pop("stage3_param_persistence_threshold", None)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def make_engine(config, seed=0, frozen=()):
    """A TinyMLP engine; parameters whose names start with a prefix in `frozen` do not train."""
    torch.manual_seed(seed)
    model = freeze(TinyMLP(), frozen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def freeze(model, prefixes):
    for name, param in model.named_parameters():
        if name.startswith(tuple(prefixes)):
            param.requires_grad_(False)
    return model


def train(engine, steps=3):
    x, y = fixed_batch(dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(steps):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def masters(engine):
    """{name: fp32 master} of every trainable parameter."""
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}


def moments(engine):
    """{name: {key: tensor or None}} for Adam's exp_avg / exp_avg_sq."""
    link_optimizer_states(engine)
    base = _base_optimizer(engine)
    present = {k for state in base.state.values() for k in state}
    return {
        n: {
            k: _clone(safe_get_full_optimizer_state(p, k)) if k in present else None
            for k in ("exp_avg", "exp_avg_sq")
        }
        for n, p in engine.module.named_parameters() if p.requires_grad
    }


def link_optimizer_states(engine):
    """Attach every param group's optimizer-state fragments to its parameters now: ZeRO-1/2 and BF16_Optimizer
    attach them lazily, after a step, which a test that reads the states right after a load has not taken."""
    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _base_optimizer(engine):
    return engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer


def steps(engine):
    """The base optimizer's step count of each state entry (empty when the state is fresh)."""
    base = _base_optimizer(engine)
    return sorted(float(state["step"]) for state in base.state.values() if "step" in state)


def _clone(t):
    return None if t is None else t.clone()


def train_and_save(config, save_dir, steps=3):
    """Train a fresh engine and save it; returns the saved masters and moments."""
    engine = make_engine(config)
    train(engine, steps)
    saved = masters(engine), moments(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    return saved


def to_universal(save_dir):
    """Convert save_dir/TAG to save_dir/TAG_universal on rank 0 (writes latest_universal)."""
    return convert_to_universal(save_dir, TAG)


def shard_path(save_dir, dp_rank, tag=TAG, bf16=True):
    prefix = "bf16_" if bf16 else ""
    return os.path.join(save_dir, tag, f"{prefix}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt")


def remove_shards(save_dir, tag=TAG):
    """Delete every rank's *_optim_states.pt of `tag` (rank 0 deletes, all ranks wait)."""
    dist.barrier()
    if dist.get_rank() == 0:
        for shard in glob.glob(os.path.join(save_dir, tag, "*_optim_states.pt")):
            os.remove(shard)
    dist.barrier()


def snapshot(engine):
    """Everything a rejected load must leave untouched: module (ZeRO-3: this rank's partition), masters,
    moments, steps, loss scale, clip_grad, learning-rate schedule and the engine's counters."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return dict(module={
        n: getattr(p, "ds_tensor", p).detach().clone()
        for n, p in engine.module.named_parameters()
    },
                masters=masters(engine),
                moments=moments(engine),
                steps=steps(engine),
                loss_scale=getattr(scaler, "cur_scale", None),
                clip_grad=getattr(engine.optimizer, "clip_grad", None),
                lr=[group["lr"] for group in engine.optimizer.param_groups],
                lr_scheduler=engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                counters=(engine.global_steps, engine.global_samples, engine.skipped_steps))


def check_refused_then_rebuilt(engine, build, save_dir, match, expected_masters, refusing_rank=None):
    """The saved masters cannot be restored: every load that needs them is refused (engine unchanged), and every
    load that may rebuild them does, in a fresh engine from build(), giving expected_masters and a fresh optimizer."""
    for kwargs in REFUSED_UNLESS_RESTORABLE:
        expect_rejected(engine, save_dir, match, refusing_rank=refusing_rank, **kwargs)
    for kwargs in REBUILD_MASTERS:
        rebuilt = build()
        rebuilt.load_checkpoint(save_dir, tag=TAG, **kwargs)
        assert_same(masters(rebuilt), expected_masters, f"masters after {kwargs}")
        assert_fresh(rebuilt)


def assert_same(a, b, path="engine"):
    """Bit-identical nested dicts / lists of tensors (None matches None)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), path
    else:
        assert a == b, path


def saves_checkpoint(save_dir, saved_by, stage=3, precision="bf16"):
    """For a test that runs at two world sizes in turn (`@pytest.mark.world_size([saved_by, n])`, upstream's
    DistributedTest idiom): in the world of `saved_by` ranks, train, save TAG and the saved masters
    (saved_masters.pt) in save_dir and return True (the test returns); in the other world return False, and
    the test loads what the first world saved."""
    if dist.get_world_size() != saved_by:
        return False
    saved_masters, _ = train_and_save(make_config(stage, precision), save_dir)
    if dist.get_rank() == 0:
        torch.save(saved_masters, os.path.join(save_dir, "saved_masters.pt"))
    dist.barrier()
    return True


def simulate_nodes(ranks_per_node):
    """Make this rank one of `ranks_per_node` local ranks of its node (LOCAL_RANK = rank % ranks_per_node), before
    any engine reads the layout: several nodes on one machine, which only the CPU accelerator can run (elsewhere
    each local rank binds its own device, so ranks of different simulated nodes would share one)."""
    from deepspeed.accelerator import get_accelerator
    if get_accelerator().device_name() != "cpu":
        pytest.skip("simulated nodes share devices: CPU accelerator only")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.environ.update(LOCAL_RANK=str(rank % ranks_per_node),
                      LOCAL_SIZE=str(ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node),
                      CROSS_RANK=str(rank // ranks_per_node),
                      CROSS_SIZE=str(world_size // ranks_per_node))


def rounding(tensors, dtype=torch.bfloat16):
    """The masters a rebuild from the 16-bit weights gives: the saved ones rounded to `dtype` and back."""
    return {n: t.to(dtype).float() for n, t in tensors.items()}


def assert_fresh(engine):
    assert steps(engine) in ([], [0.0] * len(steps(engine))), steps(engine)
    for name, state in moments(engine).items():
        for key, value in state.items():
            assert value is None or torch.equal(value, torch.zeros_like(value)), f"{name}.{key}"


def expect_rejected(engine, save_dir, match, refusing_rank=None, tag=TAG, **load_kwargs):
    """The load raises ZeRORuntimeException matching `match` and leaves the engine bit-identical. With
    refusing_rank, only that rank found the problem: every other rank must say that it refused."""
    before = snapshot(engine)
    with pytest.raises(ZeRORuntimeException, match=match) as refused:
        engine.load_checkpoint(save_dir, tag=tag, **load_kwargs)
    if refusing_rank is not None and dist.get_rank() != refusing_rank:
        assert f"rank {refusing_rank} refused it" in str(refused.value), str(refused.value)
    assert_same(snapshot(engine), before)
    return str(refused.value)


def weights(engine):
    """{name: full 16-bit weight} of every parameter, trainable or frozen (gathered under ZeRO-3)."""
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {name: param.detach().clone() for name, param in params.items()}


def move_aside_on_rank(path, rank):
    """Move `path` to path + '.aside' if this is `rank` (every rank waits); returns a function that puts it back."""
    dist.barrier()
    if dist.get_rank() == rank:
        os.rename(path, path + ".aside")
    dist.barrier()

    def restore():
        dist.barrier()
        if dist.get_rank() == rank:
            os.rename(path + ".aside", path)
        dist.barrier()

    return restore


def truncate_on_rank(path, rank):
    """Cut `path` to half its size on `rank` (a file half-written or half-copied); every rank waits."""
    dist.barrier()
    if dist.get_rank() == rank:
        os.truncate(path, os.path.getsize(path) // 2)
        without_manifest(path)
    dist.barrier()


TRAINABLE_SET_CHANGED = {
    "unfreeze": "trainable now but were not when it was saved.*" + WAYS_OUT,
    "freeze": "were trainable when it was saved but are not now.*" + WAYS_OUT,
}


def check_trainable_set_change(save_dir, config, build, direction):
    """Save with layers.0 frozen and resume with everything trainable (direction "unfreeze", the usual reason for a
    fresh optimizer), or the reverse ("freeze"). Restoring the saved optimizer states or, explicitly, the saved
    masters is refused on every rank with the engine unchanged; a fresh-optimizer resume loads as 0.19.8 did: every
    weight as saved and the masters rebuilt from those weights. build(config, seed, frozen)."""
    saved_frozen, resumed_frozen = (("layers.0.", ), ()) if direction == "unfreeze" else ((), ("layers.0.", ))
    engine = build(config, seed=0, frozen=saved_frozen)
    train(engine)
    saved_weights = weights(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    resumed = build(config, seed=1, frozen=resumed_frozen)
    trainable = {name for name, param in resumed.module.named_parameters() if param.requires_grad}
    expected_masters = {name: weight.float() for name, weight in saved_weights.items() if name in trainable}
    check_refused_then_rebuilt(resumed, lambda: build(config, seed=1, frozen=resumed_frozen), save_dir,
                               TRAINABLE_SET_CHANGED[direction], expected_masters)
    resumed.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
    assert_same(weights(resumed), saved_weights, "weights")
    train(resumed, steps=1)


@contextlib.contextmanager
def logged():
    """The lines DeepSpeed's logger writes meanwhile, at INFO and above."""
    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(f"{record.levelname} {record.getMessage()}")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def on_rank(rank, damage):
    """Run damage() on `rank` (every rank waits)."""
    dist.barrier()
    if dist.get_rank() == rank:
        damage()
    dist.barrier()


@contextlib.contextmanager
def hashed_from_mappings():
    """{path: bytes the content checks hash from a memory mapping of the file} while active."""
    from deepspeed.checkpoint import content_manifest
    hashed, mapped = {}, content_manifest._mapped

    class CountedView:

        def __init__(self, view, path):
            self.view, self.path = view, path

        def __len__(self):
            return len(self.view)

        def __getitem__(self, span):
            part = self.view[span]
            hashed[self.path] = hashed.get(self.path, 0) + len(part)
            return part

    @contextlib.contextmanager
    def counted(path):
        with mapped(path) as view:
            yield CountedView(view, path)

    with mock.patch.object(content_manifest, "_mapped", counted):
        yield hashed
