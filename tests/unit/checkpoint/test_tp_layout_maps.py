# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""tensor_parallel_maps (no process group): each parameter's TP map, from the affine_map entry AutoTP publishes in
universal_checkpoint_info, checked against the shard shapes a checkpoint or a model holds; every map it cannot
trust refused with a TensorParallelMapError that names the parameter."""

import pytest

from deepspeed.checkpoint.affine import (AFFINE_MAP_FORMAT_VERSION, contiguous_split_map, replicated_map,
                                         sub_param_map)
from deepspeed.checkpoint.constants import (AFFINE_MAP, AFFINE_MAP_PARAMS, AFFINE_MAP_VERSION,
                                            AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS)
from deepspeed.checkpoint.tp_layout_maps import TensorParallelMapError, tensor_parallel_maps

# name -> the map AutoTP publishes at TP2: rows (a column-parallel layer), columns (a row-parallel one), replicated
# (a norm), a fused QKV weight split per sub-parameter
MAPS = {
    "layers.0.up.weight": contiguous_split_map((8, 4), [4, 4], 0),
    "layers.0.down.weight": contiguous_split_map((4, 8), [4, 4], 1),
    "layers.0.norm.weight": replicated_map((4, ), 2),
    "layers.0.qkv.weight": sub_param_map((12, 4), [4, 4, 4], [[2, 2], [2, 2], [2, 2]], 0),
}


def pattern(name):
    return "^" + name.replace(".", "\\.") + "$"


def published(maps=MAPS, version=AFFINE_MAP_FORMAT_VERSION, **info):
    params = {pattern(name): tp_map.to_dict() for name, tp_map in maps.items()}
    return {AFFINE_MAP: {AFFINE_MAP_VERSION: version, AFFINE_MAP_PARAMS: params}, **info}


def shards(*names, ranks=(0, 1)):
    return {name: {rank: MAPS[name].shard_shapes[rank] for rank in ranks} for name in names}


def test_every_rank_of_a_checkpoint_and_one_rank_of_a_model():
    found = tensor_parallel_maps(published(), 2, shards(*MAPS))
    assert {
        name: tp_map.to_dict()
        for name, tp_map in found.items()
    } == {
        name: tp_map.to_dict()
        for name, tp_map in MAPS.items()
    }
    own = tensor_parallel_maps(published(), 2, shards("layers.0.down.weight", ranks=(1, )))
    assert own["layers.0.down.weight"].shard_shapes == {0: (4, 4), 1: (4, 4)}


def test_without_tensor_parallelism_each_map_is_the_identity():
    found = tensor_parallel_maps(None, 1, {"w": {0: (3, 5)}})
    assert found["w"].logical_shape == (3, 5) and found["w"].shard_shapes == {0: (3, 5)}
    assert len(found["w"].pieces_by_rank[0]) == 1
    with pytest.raises(TensorParallelMapError, match="w has shards of tensor-parallel ranks \\[0, 1\\] at size 1"):
        tensor_parallel_maps(None, 1, {"w": {0: (3, 5), 1: (3, 5)}})


def _malformed():
    entry = MAPS["layers.0.up.weight"].to_dict()
    entry["ranks"][1]["shard_shape"] = [5, 4]  # 20 elements, where its one piece holds 16
    return {AFFINE_MAP: {AFFINE_MAP_VERSION: 1, AFFINE_MAP_PARAMS: {pattern("layers.0.up.weight"): entry}}}


@pytest.mark.parametrize("info, tp_size, held, match", [
    (None, 2, shards("layers.0.up.weight"), "there is no tensor-parallel map \\(affine_map"),
    ({}, 2, shards("layers.0.up.weight"), "AutoTP publishes them since DeepSpeed 0.19.8"),
    (published(version=2), 2, shards("layers.0.up.weight"), "format version 2.*reads versions 1 to 1"),
    (published(version=None), 2, shards("layers.0.up.weight"), "format version None"),
    (published(), 2, {
        "layers.0.gate.weight": {
            0: (4, 4)
        }
    }, "layers.0.gate.weight has no tensor-parallel map: "
     "no pattern matches it"),
    (published(**{AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: {
        pattern("layers.0.qkv.weight"): "uneven heads"
    }}), 2, shards("layers.0.qkv.weight"), "cannot describe the tensor-parallel layout of layers.0.qkv.weight: "
     "uneven heads"),
    (published(), 4, shards("layers.0.up.weight"), "of layers.0.up.weight describes ranks \\[0, 1\\], not the 4"),
    (published(), 2, {
        "layers.0.up.weight": {
            0: (4, 4),
            1: (2, 8)
        }
    }, "of layers.0.up.weight gives rank 1 a "
     "shard of shape \\[4, 4\\], where it holds \\[2, 8\\]"),
    (_malformed(), 2, {
        "layers.0.up.weight": {
            0: (4, 4)
        }
    }, "map of layers.0.up.weight is malformed: Rank 1 "
     "holds a shard of 20 elements"),
],
                         ids=[
                             "no_info", "no_maps", "newer_format", "no_version", "unmatched", "unsupported",
                             "other_tp_size", "other_shard_shape", "malformed"
                         ])
def test_refused_naming_the_parameter(info, tp_size, held, match):
    with pytest.raises(TensorParallelMapError, match=match):
        tensor_parallel_maps(info, tp_size, held)


def test_a_pattern_other_than_the_name_matches_once():
    """AutoTP writes each name as its own pattern, found by the name; any other pattern is found by matching, as
    ds_to_universal matches them, and two that match one name are refused, whichever they are."""
    entry = MAPS["layers.0.up.weight"].to_dict()
    info = published(maps={})
    info[AFFINE_MAP][AFFINE_MAP_PARAMS]["^layers\\.\\d+\\.up\\.weight$"] = entry
    found = tensor_parallel_maps(info, 2, shards("layers.0.up.weight"))
    assert found["layers.0.up.weight"].to_dict() == entry
    info[AFFINE_MAP][AFFINE_MAP_PARAMS]["^layers\\.0\\.up\\..*$"] = entry
    with pytest.raises(TensorParallelMapError, match="layers.0.up.weight has no tensor-parallel map: 2 patterns"):
        tensor_parallel_maps(info, 2, shards("layers.0.up.weight"))
    info = published()
    info[AFFINE_MAP][AFFINE_MAP_PARAMS]["^layers\\.0\\..*$"] = entry
    with pytest.raises(TensorParallelMapError, match="layers.0.up.weight has no tensor-parallel map: 2 patterns"):
        tensor_parallel_maps(info, 2, shards("layers.0.up.weight"))


@pytest.mark.parametrize("change, match", [
    (lambda info: info[AFFINE_MAP].update(version=True), "format version True"),
    (lambda info: info[AFFINE_MAP].update(version=0), "format version 0"),
    (lambda info: info[AFFINE_MAP].update(params=[]), "not a dict with a dict of maps"),
    (lambda info: info.update(affine_map="maps"), "not a dict with a dict of maps"),
    (lambda info: info[AFFINE_MAP][AFFINE_MAP_PARAMS].update({"^layers\\.(": {}}), "not a regular expression"),
    (lambda info: info.update(autotp_unsupported_parameter_patterns={"^(": "x"}), "not a regular expression"),
    (lambda info: info[AFFINE_MAP][AFFINE_MAP_PARAMS].update({pattern("layers.0.up.weight"): []}), "malformed"),
    (lambda info: info.update(autotp_unsupported_parameter_patterns=["^x$"]), "is not a dict of reasons"),
],
                         ids=[
                             "version_true", "version_0", "params_list", "map_str", "bad_regex", "bad_unsupported",
                             "entry_list", "unsupported_list"
                         ])
def test_malformed_info_is_refused_as_a_map_error(change, match):
    info = published()
    change(info)
    with pytest.raises(TensorParallelMapError, match=match):
        tensor_parallel_maps(info, 2, shards("layers.0.up.weight"))


def test_info_that_is_not_a_dict_is_refused():
    with pytest.raises(TensorParallelMapError, match="universal_checkpoint_info is a list, not a dict"):
        tensor_parallel_maps(["maps"], 2, shards("layers.0.up.weight"))
