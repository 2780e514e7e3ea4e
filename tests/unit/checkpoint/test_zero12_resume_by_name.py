# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-1/2 (bf16, fp16) and BF16_Optimizer fresh-optimizer resumes at the saved data-parallel size after the
trainable set or the param groups changed: the fp32 masters of every parameter that was trainable when saved are
restored by name from every saved rank's memory-mapped shard; where the shards cannot serve that, the masters are
rebuilt from the 16-bit weights on every rank (or, with load_fp32_weights=True, the load is refused on every rank,
leaving the engine as it was). Full resumes by name: test_zero12_full_resume_by_name.py. The resume table and the
other layout changes: test_zero12_resume_fp32_masters.py."""

import logging

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from deepspeed.utils import logger
from unit.checkpoint.test_zero12_resume_fp32_masters import BF16_FP32_ACCUM, build, config_for
from unit.checkpoint.zero_resume_helpers import (REBUILD_MASTERS, SAVED_STEPS, TAG, WAYS_OUT, assert_fresh,
                                                 assert_same, expect_rejected, masters, move_aside_on_rank, moments,
                                                 shard_path, steps, weights)
from unit.common import DistributedTest
from unit.zero_tiny_models import fixed_batch


def constant_lambda_lr(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


# Another trainable set or grouping at the saved data-parallel size: every parameter that was trainable when saved
# resumes with its saved master read by name; the others start from their 16-bit weights. HIDDEN 5: 30 elements a
# layer (25 + 5), so a flat group of 1 or 3 layers is padded at 2 ranks and the partition boundaries cut parameters
# in two.
HIDDEN = 5
LAYOUT_CELLS = [(1, "bf16"), (2, "bf16"), (1, BF16_FP32_ACCUM), (2, "fp16")]
# Saved with two param groups; the load configures other values, so a group that kept them is visible.
SAVED_GROUPS = [(("layers.0.", ), dict(lr=0.01, weight_decay=0.0, betas=(0.9, 0.999))),
                (("layers.1.", "layers.2.", "layers.3."), dict(lr=0.03, weight_decay=0.1, betas=(0.8, 0.99)))]
LOADED_HYPERPARAMETERS = [
    dict(lr=0.05, weight_decay=0.2, betas=(0.7, 0.9)),
    dict(lr=0.07, weight_decay=0.3, betas=(0.6, 0.95))
]
FRESH_OPTIMIZER = dict(load_optimizer_states=False)


def train_steps(engine, count):
    x, y = fixed_batch(hidden=HIDDEN, dtype=next(engine.module.parameters()).dtype, device=engine.device)
    for _ in range(count):
        engine.backward(engine(x, y))
        engine.step()


def hyperparameters(engine):
    """{name: lr, weight_decay and betas of the param group the optimizer updates it with}."""
    optimizer = engine.optimizer
    lp_groups = optimizer.bf16_groups if hasattr(optimizer, "bf16_groups") else optimizer.bit16_groups
    names = {param: name for name, param in engine.module.named_parameters()}
    return {
        names[param]: {
            key: tuple(group[key]) if key == "betas" else group[key]
            for key in ("lr", "weight_decay", "betas")
        }
        for lp_group, group in zip(lp_groups, optimizer.optimizer.param_groups)
        for param in lp_group
    }


def save_trained(config, save_dir, **build_kwargs):
    """Train SAVED_STEPS steps, save TAG; returns what was saved: masters, moments, steps, 16-bit weights and
    each parameter's hyperparameters."""
    engine = build(config, hidden=HIDDEN, **build_kwargs)
    train_steps(engine, SAVED_STEPS)
    saved = dict(masters=masters(engine),
                 moments=moments(engine),
                 steps=steps(engine),
                 weights=weights(engine),
                 hyperparameters=hyperparameters(engine))
    engine.save_checkpoint(save_dir, tag=TAG)
    return saved


class WarningsOnThisRank:
    """The WARNING records DeepSpeed's logger emits on this rank inside the with block."""

    def __enter__(self):
        self.records = []
        self._handler = logging.Handler(level=logging.WARNING)
        self._handler.emit = self.records.append
        logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        logger.removeHandler(self._handler)

    def naming(self, text):
        return [record.getMessage() for record in self.records if text in record.getMessage()]


def load_warning(engine, save_dir, **load_kwargs):
    """Load; returns the warnings logged on this rank that name layers.0.weight."""
    with WarningsOnThisRank() as warned:
        engine.load_checkpoint(save_dir, tag=TAG, **load_kwargs)
    return warned.naming("layers.0.weight")


def assert_named_once(warnings, new):
    """The parameters in `new` (nothing saved) are named in one warning, on rank 0 only."""
    if dist.get_rank() == 0:
        assert len(warnings) == 1 and all(name in warnings[0] for name in new), warnings
        assert "had none saved" in warnings[0], warnings[0]
    else:
        assert not warnings, warnings


def assert_masters_round_to_weights(engine):
    """Each master rounds to its module weight: a check independent of the hp mappings the restore writes through
    (masters() reads through them too)."""
    module_weights = weights(engine)
    for name, master in masters(engine).items():
        assert torch.equal(master.to(module_weights[name].dtype), module_weights[name]), name


def expected_masters(saved, engine, new=()):
    """The saved masters of the parameters this engine trains, and the 16-bit weights, upcast, of those in `new`."""
    trainable = [name for name, param in engine.module.named_parameters() if param.requires_grad]
    return {name: saved["weights"][name].float() if name in new else saved["masters"][name] for name in trainable}


def expected_moments(saved, engine, new=()):
    """The saved moments of the parameters this engine trains, zero for those in `new`."""
    trainable = [name for name, param in engine.module.named_parameters() if param.requires_grad]
    return {
        name: {
            key: torch.zeros_like(saved["weights"][name], dtype=torch.float32)
            for key in ("exp_avg", "exp_avg_sq")
        } if name in new else saved["moments"][name]
        for name in trainable
    }


def assert_rebuilt(engine, saved, reason, warnings):
    """Every master is its saved 16-bit weight, upcast (rebuilt, as with load_fp32_weights=False), on every rank; the
    rebuild warning, logged on rank 0, gives the reason."""
    assert_same(masters(engine), {name: weight.float() for name, weight in saved["weights"].items()}, "masters")
    assert_fresh(engine)
    if dist.get_rank() == 0:
        assert any("Rebuilding the fp32 master weights" in text and reason in text for text in warnings), warnings


def rebuild_warnings(engine, save_dir):
    """Load with a fresh optimizer; returns the rebuild warnings logged on this rank."""
    with WarningsOnThisRank() as warned:
        engine.load_checkpoint(save_dir, tag=TAG, **FRESH_OPTIMIZER)
    return warned.naming("Rebuilding")


class ReadWholeCheckpointEngine(CheckpointEngine):
    """A checkpoint engine other than torch's (as FastPersist, Nebula or DataStates are): it reads files whole, and
    records which."""

    def __init__(self):
        super().__init__(config_params=None)
        self.loaded = []

    def create(self, info):
        pass

    def save(self, state_dict, path):
        torch.save(state_dict, path)

    def load(self, path, map_location=None):
        self.loaded.append(path)
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info):
        return True


class TestZero12TrainableSetChange(DistributedTest):
    """Saved with layers.0 frozen (3 layers: 90 elements, padded), resumed with everything trainable (4 layers: the
    partitions hold other pieces of other parameters), or saved with everything trainable and resumed with
    layers.1 frozen. 0011's fresh-optimizer resume rebuilt every master from its 16-bit weight here."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_unfreeze_fresh_optimizer(self, tmpdir, stage, precision):
        """The masters of the parameters trainable when saved are the saved ones bit for bit, the unfrozen layer's
        are its saved 16-bit weights upcast, named in one warning; training continues."""
        save_dir, config, new = str(tmpdir), config_for(stage, precision), ["layers.0.weight", "layers.0.bias"]
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        warnings = load_warning(engine, save_dir, **FRESH_OPTIMIZER)
        assert_same(masters(engine), expected_masters(saved, engine, new), "masters")
        assert_masters_round_to_weights(engine)
        assert_fresh(engine)
        assert_named_once(warnings, new)
        assert_same(weights(engine), saved["weights"], "weights")
        train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_freeze_at_load(self, tmpdir, stage, precision):
        """Saved with everything trainable, layers.1 frozen at load: the other layers' masters are the saved ones;
        every weight as saved."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir)
        engine = build(config, seed=1, hidden=HIDDEN, frozen=("layers.1.", ))
        engine.load_checkpoint(save_dir, tag=TAG, **FRESH_OPTIMIZER)
        assert_same(masters(engine), expected_masters(saved, engine), "masters")
        assert_fresh(engine)
        assert_same(weights(engine), saved["weights"], "weights")
        train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", [(2, "bf16")])
    def test_round_robin_gradients(self, tmpdir, stage, precision):
        """round_robin_gradients lays the flat partitions out in another order than the hp mappings and the saved
        param_slice_mappings describe (so safe_get_full_fp32_param cannot check it either): no restore by name. The
        masters are rebuilt from the 16-bit weights, with the reason in the warning: each rank's fp32 partition is
        its 16-bit partition, upcast."""
        save_dir, config = str(tmpdir), config_for(stage, precision, round_robin_gradients=True)
        save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        warnings = rebuild_warnings(engine, save_dir)
        if dist.get_rank() == 0:
            assert any("round_robin_gradients reorders the flat partitions" in text for text in warnings), warnings
        assert_fresh(engine)
        optimizer, rank = engine.optimizer, dist.get_rank()
        for fp32_partition, bit16_partitions in zip(optimizer.single_partition_of_fp32_groups,
                                                    optimizer.parallel_partitioned_bit16_groups):
            assert torch.equal(fp32_partition, bit16_partitions[rank].float())

    @pytest.mark.parametrize("stage, precision", [(1, "bf16")])
    def test_missing_shard_of_another_rank(self, tmpdir, stage, precision):
        """Restoring by name reads every saved rank's shard: with saved rank 1's missing, a load that requires the
        saved masters (load_fp32_weights=True) is refused on every rank before anything changes, and the default
        fresh-optimizer resume rebuilds them on every rank."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        put_back = move_aside_on_rank(shard_path(save_dir, 1), 1)
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        expect_rejected(engine,
                        save_dir,
                        "shard of saved rank 1.*" + WAYS_OUT,
                        load_fp32_weights=True,
                        **FRESH_OPTIMIZER)
        for kwargs in REBUILD_MASTERS:
            rebuilt = build(config, seed=1, hidden=HIDDEN, nlayers=4)
            rebuilt.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_same(masters(rebuilt), {
                name: weight.float()
                for name, weight in saved["weights"].items()
            }, f"masters after {kwargs}")
            assert_fresh(rebuilt)
        put_back()

    @pytest.mark.parametrize("stage, precision", [(1, "bf16")])
    def test_shard_unreadable_on_one_rank(self, tmpdir, stage, precision):
        """Only rank 0 cannot read saved rank 1's shard (node-local copies): rank 1 could restore by name, but every
        rank must load alike. load_fp32_weights=True is refused on both ranks, rank 1 naming rank 0, engine
        unchanged; the default fresh-optimizer resume rebuilds the masters on both."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        unreadable = shard_path(save_dir, 1)

        def build_unreadable_on_rank_0():
            engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
            if dist.get_rank() == 0:
                map_shard = engine._map_zero_shard

                def fail_on_unreadable(shard):
                    if shard == unreadable:
                        raise OSError(f"{shard}: Input/output error")
                    return map_shard(shard)

                engine._map_zero_shard = fail_on_unreadable
            return engine

        expect_rejected(build_unreadable_on_rank_0(),
                        save_dir,
                        "Input/output error.*" + WAYS_OUT,
                        refusing_rank=0,
                        load_fp32_weights=True,
                        **FRESH_OPTIMIZER)
        engine = build_unreadable_on_rank_0()
        assert_rebuilt(engine, saved, "Input/output error", rebuild_warnings(engine, save_dir))

    @pytest.mark.parametrize("stage, precision", [(1, "bf16"), (2, "bf16")])
    def test_checkpoint_engine_that_cannot_memory_map(self, tmpdir, stage, precision):
        """Restoring by name reads every saved rank's shard. A checkpoint engine that reads files whole would hold
        every rank's partitions in memory on every rank: no restore by name, the masters are rebuilt, with the
        reason in the warning, and no rank reads another rank's shard."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, frozen=("layers.0.", ))
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4)
        engine.checkpoint_engine = ReadWholeCheckpointEngine()
        assert_rebuilt(engine, saved, "can memory-map (this run uses ReadWholeCheckpointEngine)",
                       rebuild_warnings(engine, save_dir))
        other_rank = 1 - dist.get_rank()
        assert shard_path(save_dir, other_rank) not in engine.checkpoint_engine.loaded, engine.checkpoint_engine.loaded


class TestZero12ParamGroupsByName(DistributedTest):
    """Saved with two param groups of different hyperparameters (1 and 3 layers, both padded), resumed with a fresh
    optimizer and the groups changed: the saved masters, and this run's hyperparameters."""
    world_size = 2
    exec_timeout = 300

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_reordered_groups(self, tmpdir, stage, precision):
        """The groups reordered at load, with other configured values: the saved masters, the configured
        hyperparameters."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS)
        reordered = [(SAVED_GROUPS[1][0], LOADED_HYPERPARAMETERS[0]), (SAVED_GROUPS[0][0], LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=reordered)
        configured = hyperparameters(engine)
        engine.load_checkpoint(save_dir, tag=TAG, **FRESH_OPTIMIZER)
        assert hyperparameters(engine) == configured != saved["hyperparameters"], hyperparameters(engine)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_fresh(engine)
        train_steps(engine, 1)

    @pytest.mark.parametrize("stage, precision", LAYOUT_CELLS)
    def test_parameter_moved_to_another_group(self, tmpdir, stage, precision):
        """layers.1 moved into layers.0's group, whose saved hyperparameters differ: the saved masters."""
        save_dir, config = str(tmpdir), config_for(stage, precision)
        saved = save_trained(config, save_dir, nlayers=4, groups=SAVED_GROUPS)
        moved = [(("layers.0.", "layers.1."), LOADED_HYPERPARAMETERS[0]),
                 (("layers.2.", "layers.3."), LOADED_HYPERPARAMETERS[1])]
        engine = build(config, seed=1, hidden=HIDDEN, nlayers=4, groups=moved)
        engine.load_checkpoint(save_dir, tag=TAG, **FRESH_OPTIMIZER)
        assert_same(masters(engine), saved["masters"], "masters")
        assert_fresh(engine)
