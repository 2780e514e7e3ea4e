# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The optimizer files a ZeRO-3 load at another data-parallel or tensor-parallel size reads: each saved (dp, tp)
rank's file is found by name in one listing of the checkpoint folder, bf16_ or not, new or old pattern. Looking each
candidate up with a stat per saved rank, over a list of every saved name built per rank, cost a loading rank seconds
at thousands of saved ranks. No process group: the engine's naming methods on a stand-in."""

import os
from unittest import mock

from deepspeed.runtime.engine import DeepSpeedEngine

TAG = "global_step3"


class _Namer:
    """The engine's naming methods, with the one setting they read."""
    _saved_zero_shards = DeepSpeedEngine._saved_zero_shards
    _saved_zero_shard = DeepSpeedEngine._saved_zero_shard
    _get_rank_zero_ckpt_name = DeepSpeedEngine._get_rank_zero_ckpt_name
    _get_zero_ckpt_prefix = DeepSpeedEngine._get_zero_ckpt_prefix
    _old_and_new_shard_names = staticmethod(DeepSpeedEngine._old_and_new_shard_names)

    def __init__(self, bf16):
        self.bf16 = bf16

    def bfloat16_enabled(self):
        return self.bf16


def saved_folder(tmp_path, names):
    folder = tmp_path / TAG
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
    return str(tmp_path)


def test_each_saved_rank_found_in_one_listing(tmp_path):
    ranks = [(dp, tp) for dp in range(3) for tp in range(2)]
    present = {
        (0, 0): "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        (0, 1): "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
        (1, 0): "zero_pp_rank_1_mp_rank_00_optim_states.pt",  # saved without bf16
        (1, 1): "bf16_zero_pp_rank_1_mp_rank_01optim_states.pt",  # the old pattern
        (2, 0): "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
    }  # (2, 1) is missing: its first candidate is named, for the read to report
    load_dir = saved_folder(tmp_path, list(present.values()) + ["zero_pp_rank_2_mp_rank_00_model_states.pt"])
    listdir = mock.Mock(wraps=os.listdir)
    with mock.patch("os.listdir", listdir), mock.patch("os.path.isfile") as isfile, \
            mock.patch("os.path.exists") as exists:
        found = _Namer(bf16=True)._saved_zero_shards(load_dir, TAG, ranks)
    assert listdir.call_count == 1 and not isfile.called and not exists.called
    expected = [os.path.join(load_dir, TAG, present.get(rank, "")) for rank in ranks[:-1]]
    expected.append(os.path.join(load_dir, TAG, "bf16_zero_pp_rank_2_mp_rank_01_optim_states.pt"))
    assert found == expected


def test_a_missing_folder_names_the_first_candidates(tmp_path):
    found = _Namer(bf16=False)._saved_zero_shards(str(tmp_path), TAG, [(0, 0), (1, 0)])
    assert found == [
        os.path.join(str(tmp_path), TAG, f"zero_pp_rank_{dp}_mp_rank_00_optim_states.pt") for dp in (0, 1)
    ]
