# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP: a rigid checkpoint resumed at the tensor-parallel size it was saved at, by a run that splits a
parameter otherwise (another partition_config): each up projection as two packed sub-parameters (a fused
gate/up layout, shape (2, -1)) against one plain column split. The TP shards have the same shape either way but hold
other rows, so a load by position restores the wrong rows without an error; it must load through the parameters'
TP maps, exactly, in every load mode.

A test runs two launches of 2 ranks (test_zero3_tensor_parallel_reshard.py's helpers): the first saves, the second
loads.
"""

import copy
from unittest import mock

import pytest
import torch

import deepspeed
from deepspeed.checkpoint.affine import AffinePiece, ParamAffineMap, contiguous_split_map, sub_param_map
from deepspeed.checkpoint.constants import AFFINE_MAP, AFFINE_MAP_PARAMS, AFFINE_MAP_VERSION, UNIVERSAL_CHECKPOINT_INFO
from deepspeed.runtime.engine import DeepSpeedEngine
from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import (rewritten_copy, run_steps, saved_reference,
                                                                shard_states, step_counts)
from unit.checkpoint.universal_zero3_helpers import (MLP_PARTITION_CONFIG, expected_shard, make_config, new_engine,
                                                     TinyMLPBlocks, tp_rank_and_size)
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected, steps
from unit.common import DistributedTest

TP_SIZE = 2
PACKED = "packed"  # the up projections as [gate; up], each split on its own
PACKED_UP_CONFIG = copy.deepcopy(MLP_PARTITION_CONFIG)
PACKED_UP_CONFIG["layer_specs"][0].update(shape=[2, -1], partition_dim=0)
LAYOUTS = {"plain_to_packed": ("plain", PACKED), "packed_to_plain": (PACKED, "plain")}  # saved, loaded


def build(layout, seed, frozen=(), stage=3):
    """The tiny MLP at TP2 under the plain or the packed partition_config, at a ZeRO stage; the parameters whose
    names start with a `frozen` prefix do not train."""
    config = make_config(TP_SIZE,
                         partition_config=PACKED_UP_CONFIG if layout == PACKED else MLP_PARTITION_CONFIG,
                         stage=stage)
    torch.manual_seed(seed)
    module = TinyMLPBlocks()
    for name, param in module.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    return new_engine(module, config)


def saves(layout, save_dir, **build_args):
    """The first launch (tp_reshard.saves, under this layout's engine)."""
    return tp_reshard.saves("mlp",
                            save_dir,
                            TP_SIZE,
                            "defaults",
                            builder=lambda seed: build(layout, seed, **build_args))


def _is_packed(name):
    return ".up_proj." in name  # the weight and its bias, which AutoTP splits as the weight


def packed_shard(whole, tp_rank, tp_size):
    """AutoTP's shard of a weight packed from two equal sub-parameters along dim 0: each one's own TP block, in
    order."""
    return torch.cat([part.chunk(tp_size, dim=0)[tp_rank] for part in whole.chunk(2, dim=0)])


def saved_whole(save_dir, saved_layout):
    """Every saved state whole: saved_reference joins TP shards end to end, which puts packed shards back as
    [gate_0; up_0; gate_1; up_1]; reordered here as [gate_0; gate_1; up_0; up_1]."""
    whole, saved_steps, _ = saved_reference(save_dir)
    if saved_layout == PACKED:
        for name, entry in whole.items():
            if _is_packed(name):
                for key, joined in entry.items():
                    if joined is not None:  # None: a frozen parameter's moments
                        entry[key] = joined.unflatten(0, (TP_SIZE, 2, -1)).transpose(0, 1).flatten(0, 2)
    return whole, saved_steps


def expected(name, whole, shard_shape, tp_rank, layout):
    if layout == PACKED and _is_packed(name):
        return packed_shard(whole, tp_rank, TP_SIZE)
    return expected_shard(whole, shard_shape, tp_rank, TP_SIZE)


def assert_resumed(engine, save_dir, mode, saved_layout, layout):
    """fp32 masters bit for bit (rounded where rebuilt: exact for fp32 weights), both moments and steps where the
    optimizer is restored, fresh where not: each TP shard as this run's layout cuts the saved whole."""
    whole, saved_steps = saved_whole(save_dir, saved_layout)
    tp_rank, _ = tp_rank_and_size(engine)
    _, _, optimizer = MODES[mode]
    for name, entry in shard_states(engine).items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            if whole[name][key] is None:  # a frozen parameter's moments
                assert entry[key] is None, f"{name} {key} after {mode}"
            elif key != "fp32" and optimizer != "saved":
                assert entry[key] is None or not entry[key].any(), f"{name} {key} not fresh after {mode}"
            else:
                want = expected(name, whole[name][key], entry[key].shape, tp_rank, layout)
                assert torch.equal(entry[key], want), f"{name} {key} after {mode} (tp rank {tp_rank})"
    if optimizer == "saved":
        assert set(step_counts(engine)) == set(saved_steps), (step_counts(engine), saved_steps)
    else:
        assert set(steps(engine)) <= {0.0}, steps(engine)
    assert_weights_are_masters(engine, mode)


def assert_weights_are_masters(engine, mode):
    """The fp32 weights the model computes with equal its masters: the partitions were refreshed from what loaded."""
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue  # a frozen one's weight is what shard_states compared
        with deepspeed.zero.GatheredParameters([param]):
            weight = param.detach().clone()
        assert torch.equal(weight, deepspeed.utils.safe_get_full_fp32_param(param)), f"{name} weight after {mode}"


def resume_every_mode(save_dir, saved_layout, loaded_layout, **build_args):
    """The second launch: every mode from a fresh engine, exact; then a custom_load_fn refused on every rank, on an
    engine trained one step of its own (which the refused load must leave as it is). Returns that engine."""
    for mode, (kwargs, _, _) in MODES.items():
        engine = build(loaded_layout, seed=1, **build_args)
        engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
        assert_resumed(engine, save_dir, mode, saved_layout, loaded_layout)
    run_steps("mlp", engine, 1)
    expect_rejected(engine,
                    save_dir, "splits blocks.0.up_proj.weight otherwise.*cannot change tensor-parallel layout with a "
                    "custom_load_fn.*ds_to_universal",
                    custom_load_fn=lambda *_: None)
    return engine


class TestZero3ResumeAtAnotherTensorParallelLayout(DistributedTest):
    """Saved at TP2 under one partition_config, resumed at TP2 under the other, in every load mode (no next-step loss
    is compared: packing the up projection, which this model does not fuse, changes what its TP ranks compute): at DP
    1 (2 ranks) and at DP 2 (4 ranks: each rank reads its own shard's file, and the re-split layer of block 0 is
    frozen: its fragments come from the model-states files). A load under the saved partition_config keeps the load by
    position (the maps route is never taken). Files of two saves whose maps differ (some ranks would read through
    the maps, others by position) are refused on every rank."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_plain_to_packed(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("plain", save_dir):
            return
        resume_every_mode(save_dir, "plain", PACKED)
        engine = build("plain", seed=1)
        with mock.patch.object(DeepSpeedEngine, "_zero3_tensor_parallel_slices", side_effect=AssertionError):
            engine.load_checkpoint(save_dir, tag=TAG)
        assert_resumed(engine, save_dir, "full", "plain", "plain")

    @pytest.mark.world_size([4, 4])
    def test_packed_to_plain_at_two_data_parallel_ranks(self, tmp_path):
        frozen = dict(frozen=("blocks.0.up_proj.", ))
        save_dir = str(tmp_path)
        if saves(PACKED, save_dir, **frozen):
            return
        engine = resume_every_mode(save_dir, PACKED, "plain", **frozen)
        plain_info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO)
        mixed = rewritten_copy(save_dir,
                               "mixed",
                               change=lambda state: state.update({UNIVERSAL_CHECKPOINT_INFO: plain_info}),
                               only="zero_pp_rank_1_")
        expect_rejected(engine, mixed, "record different tensor-parallel maps.*files of one save")


class TestZero2AnotherTensorParallelLayoutRefused(DistributedTest):
    """ZeRO-2 has no route through the maps: saved at TP2 under the plain partition_config, loaded under the packed
    one, every mode is refused on every rank before anything changes (it loaded the wrong rows by position)."""
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_refused_in_every_mode(self, tmp_path):
        save_dir = str(tmp_path)
        if saves("plain", save_dir, stage=2):
            return
        engine = build(PACKED, seed=1, stage=2)
        run_steps("mlp", engine, 1)
        for kwargs, _, _ in MODES.values():
            expect_rejected(
                engine, save_dir, "splits blocks.0.up_proj.weight otherwise.*cannot change tensor-parallel "
                "layout with ZeRO stage 1 or 2.*layout it was saved with", **kwargs)


class TestFirstTensorParallelMapChange:
    """first_tensor_parallel_map_change on maps built with affine.py: a parameter split otherwise is found; the same
    placement of every element written with other pieces, or a map one side lacks or cannot read, is not a change."""

    COLUMNS = contiguous_split_map((32, 16), [16, 16], 0).to_dict()
    PACKED = sub_param_map((32, 16), [16, 16], [[8, 8], [8, 8]], 0).to_dict()

    @staticmethod
    def info(maps, version=1):
        return {AFFINE_MAP: {AFFINE_MAP_VERSION: version, AFFINE_MAP_PARAMS: maps}}

    def change(self, saved, running, names=("up.weight", )):
        # imported here, so that the distributed tests above show what a load without it does
        from deepspeed.checkpoint.tp_layout_maps import first_tensor_parallel_map_change
        return first_tensor_parallel_map_change(saved, running, TP_SIZE, list(names))

    def test_another_split_is_a_change(self):
        saved = self.info({"^up\\.weight$": self.COLUMNS, "^other$": self.COLUMNS})
        running = self.info({"^up\\.weight$": self.PACKED, "^other$": self.COLUMNS})
        assert self.change(saved, running, names=["other", "up.weight"]) == "up.weight"

    def test_the_same_split_written_otherwise_is_not(self):
        string_ranks = copy.deepcopy(self.COLUMNS)
        string_ranks["ranks"] = {str(rank): entry for rank, entry in string_ranks["ranks"].items()}
        saved = self.info({"^up\\.weight$": string_ranks, "^unused$": self.PACKED})
        running = self.info({"up\\.(weight|bias)$": self.COLUMNS})
        assert self.change(saved, running) is None

    def test_nothing_to_compare_is_not(self):
        columns = self.info({"^up\\.weight$": self.COLUMNS})
        assert self.change(None, columns) is None
        assert self.change(columns, self.info({})) is None
        assert self.change(self.info({"^up\\.weight$": {"ranks": 3}}), columns) is None
        assert self.change(self.info({"^up\\.weight$": self.PACKED}, version=99), columns) is None

    @staticmethod
    def rewritten(tp_map, rank, pieces):
        """tp_map with ``rank``'s pieces replaced (the shard shapes kept), as a saved entry."""
        pieces_by_rank = {**tp_map.pieces_by_rank, rank: pieces}
        return ParamAffineMap(tp_map.logical_shape, tp_map.shard_shapes, pieces_by_rank).to_dict()

    def test_a_block_written_as_two_pieces_is_not(self):
        # rank 1's rows 16..31 as rows 16..23 and 24..31; then as its left and right column halves
        columns = contiguous_split_map((32, 16), [16, 16], 0)
        halves = [AffinePiece((8, 16), 256 + rows * 16, (16, 1), rows * 16, (16, 1), [1]) for rows in (8, 0)]
        sides = [AffinePiece((16, 8), 256 + col, (16, 1), col, (16, 1), [1]) for col in (0, 8)]
        for pieces in (halves, sides):
            saved = self.info({"^up\\.weight$": self.COLUMNS})
            assert self.change(saved, self.info({"^up\\.weight$": self.rewritten(columns, 1, pieces)})) is None

    def test_empty_pieces_are_not(self):
        packed = sub_param_map((32, 16), [16, 16], [[8, 8], [8, 8]], 0)
        empty = AffinePiece((0, 16), 0, (16, 1), 0, (16, 1), [0])
        running = self.rewritten(packed, 0, packed.pieces_by_rank[0] + [empty])
        assert self.change(self.info({"^up\\.weight$": self.PACKED}), self.info({"^up\\.weight$": running})) is None

    def test_other_elements_or_scales_are(self):
        columns = contiguous_split_map((32, 16), [16, 16], 0)
        swapped = [AffinePiece((8, 16), 256 + rows * 16, (16, 1), (8 - rows) * 16, (16, 1), [1]) for rows in (0, 8)]
        scaled = [AffinePiece((16, 16), 256, (16, 1), 0, (16, 1), [1], scale=0.5)]
        saved = self.info({"^up\\.weight$": self.COLUMNS})
        for pieces in (swapped, scaled):
            running = self.info({"^up\\.weight$": self.rewritten(columns, 1, pieces)})
            assert self.change(saved, running) == "up.weight"

    def test_maps_past_the_run_budget_compare_as_written(self):
        columns = contiguous_split_map((32, 16), [16, 16], 0)
        halves = [AffinePiece((8, 16), 256 + rows * 16, (16, 1), rows * 16, (16, 1), [1]) for rows in (0, 8)]
        saved = self.info({"^up\\.weight$": self.COLUMNS})
        running = self.info({"^up\\.weight$": self.rewritten(columns, 1, halves)})
        with mock.patch("deepspeed.checkpoint.tp_layout_maps.MAX_PLACEMENT_RUNS", 1):
            assert self.change(saved, running) == "up.weight"

    def test_a_column_split_written_row_by_row_is_not(self):
        # rank 1 holds columns 8..15 of every row: one strided piece, or one piece per row (the folded and the
        # non-unit-stride paths of the comparison)
        rows = contiguous_split_map((32, 16), [8, 8], 1)
        per_row = [AffinePiece((1, 8), row * 16 + 8, (16, 1), row * 8, (8, 1), [1]) for row in range(32)]
        saved = self.info({"^up\\.weight$": rows.to_dict()})
        assert self.change(saved, self.info({"^up\\.weight$": self.rewritten(rows, 1, per_row)})) is None
        shifted = per_row[1:] + [AffinePiece((1, 8), 0, (16, 1), 0, (8, 1), [1])]  # row 0 holds rank 0's columns
        assert self.change(saved, self.info({"^up\\.weight$": self.rewritten(rows, 1, shifted)})) == "up.weight"

    def test_pieces_writing_one_element_twice_compare_as_written(self):
        # rank 1's left and right column halves both written to the shard's left half (strided pieces, which the map's
        # own validation does not check for overlap)
        columns = contiguous_split_map((32, 16), [16, 16], 0)
        overlapping = [AffinePiece((16, 8), 256 + col, (16, 1), 0, (16, 1), [1]) for col in (0, 8)]
        saved = self.info({"^up\\.weight$": self.COLUMNS})
        assert self.change(saved, self.info({"^up\\.weight$": self.rewritten(columns, 1, overlapping)})) == "up.weight"
