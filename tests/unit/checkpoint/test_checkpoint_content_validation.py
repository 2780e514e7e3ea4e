# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Every load checks the bytes it reads against the manifest its save wrote (checkpoint.content_validation): a
flipped bit in any kind of tensor, a truncated, missing or swapped file, a damaged manifest or one of another save
is refused on every rank with the engine bit-identical, at the saved size and at another; an undamaged checkpoint
loads exactly. The damage is found by the tensor's own bytes in the file, not by the manifest's records."""

import contextlib
import glob
import inspect
import json
import os
import shutil
import zipfile
from unittest import mock

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint import content_manifest
from unit.checkpoint.zero_resume_helpers import (TAG, assert_same, expect_rejected, hashed_from_mappings, logged,
                                                 make_config, make_engine, masters, moments, on_rank, saves_checkpoint,
                                                 shard_path, steps, to_universal, train)
from unit.checkpoint.checkpoint_edits import flip_byte
from unit.common import DistributedTest
from unit.zero_tiny_models import TinyMLP, fixed_batch

OTHER = "other_save"
WIDE = 512
MANIFEST = ".manifest"


def flip_bit_of(path, tensor):
    """Flip the top mantissa bit of the first element of `tensor`, found in the file by its bytes."""
    with open(path, "rb") as fd:
        data = bytearray(fd.read())
    wanted = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    offset = data.find(wanted)
    assert offset >= 0 and data.find(wanted, offset + 1) < 0, "the tensor's bytes are not unique in the file"
    data[offset + tensor.element_size() - 2] ^= 0x40
    with open(path, "wb") as fd:
        fd.write(data)


def flip_bit_of_record(path, tensor):
    """Flip a bit of `tensor`, a tensor small enough to share its bytes with others in the file (a step), found as
    the one storage record that holds exactly its bytes."""
    wanted = tensor.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename and archive.read(info) == wanted]
        assert len(records) == 1, [info.filename for info in records]
        record = records[0]
    with open(path, "rb") as fd:
        data = bytearray(fd.read())
    offset = data.find(wanted, record.header_offset + 30 + len(record.filename))
    data[offset + tensor.element_size() - 2] ^= 0x40
    with open(path, "wb") as fd:
        fd.write(data)


def saved_tensor(path, *keys):
    state = torch.load(path, map_location="cpu", weights_only=False)
    for key in keys:
        state = state[key]
    return state


def backed_up(paths):
    """Copies of `paths` (rank 0 makes them); returns a function that puts them back."""
    dist.barrier()
    if dist.get_rank() == 0:
        for path in paths:
            shutil.copyfile(path, path + ".good")
    dist.barrier()

    def restore():
        dist.barrier()
        if dist.get_rank() == 0:
            for path in paths:
                os.replace(path + ".good", path)
        dist.barrier()

    return restore


def manifest_entry(save_dir, tag, name):
    return os.path.join(save_dir, tag, MANIFEST, "checksums." + name + ".json")


def damages(save_dir, bf16=True):
    """(name, file damaged, rank that damages and finds it, damage(), refusal it must raise)."""
    optim = [shard_path(save_dir, rank, bf16=bf16) for rank in (0, 1)]
    model = [os.path.join(save_dir, TAG, f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt") for rank in (0, 1)]
    other_optim = shard_path(save_dir, 1, tag=OTHER, bf16=bf16)
    name = os.path.basename

    def flip(path, *keys):
        return lambda: flip_bit_of(path, saved_tensor(path, *keys))

    return [
        ("fp32 master", optim[1], 1, flip(optim[1], "optimizer_state_dict", "fp32_flat_groups",
                                          0), "fp32_flat_groups"),
        ("exp_avg", optim[1], 1, flip(optim[1], "optimizer_state_dict", "optimizer_state_dict", "state", 0,
                                      "exp_avg"), "exp_avg"),
        ("exp_avg_sq", optim[0], 0,
         flip(optim[0], "optimizer_state_dict", "optimizer_state_dict", "state", 0, "exp_avg_sq"), "exp_avg_sq"),
        ("truncated", optim[0], 0, lambda: os.truncate(optim[0],
                                                       os.path.getsize(optim[0]) - 4096), "truncated or overwritten"),
        ("missing", optim[1], 1, lambda: os.remove(optim[1]), "missing"),
        ("file of another save", optim[1], 1, lambda: shutil.copyfile(other_optim, optim[1]), "is not the file"),
        ("corrupt manifest entry", manifest_entry(save_dir, TAG, name(optim[0])), 0,
         lambda: open(manifest_entry(save_dir, TAG, name(optim[0])), "w").write("{"), "cannot be read"),
        ("manifest entry of another save", manifest_entry(save_dir, TAG, name(optim[1])), 1, lambda: shutil.copyfile(
            manifest_entry(save_dir, OTHER, name(optim[1])), manifest_entry(save_dir, TAG, name(optim[1]))),
         "a file of another save"),
        ("file and entry of another save", optim[1], 1, lambda:
         (shutil.copyfile(other_optim, optim[1]),
          shutil.copyfile(manifest_entry(save_dir, OTHER, name(optim[1])), manifest_entry(
              save_dir, TAG, name(optim[1])))), "a file of another save"),
        ("model states", model[0], 0, lambda: flip_text_byte(model[0], b"global_steps"), "is not the file"),
    ]


def nvme_unavailable():
    from unit.checkpoint.test_zero3_nvme_resume import aio_missing
    return aio_missing()


def flip_text_byte(path, text):
    """Change one byte inside the file's pickle (its client state, scalars, hyperparameters): of `text` there."""
    with open(path, "rb") as fd:
        data = bytearray(fd.read())
    offset = data.find(text)
    assert offset > 0
    data[offset] ^= 0x20
    with open(path, "wb") as fd:
        fd.write(data)


def save_two(config, save_dir):
    """Train and save TAG, then one more step and OTHER: returns TAG's masters, moments and steps."""
    engine = make_engine(config)
    train(engine)
    saved = masters(engine), moments(engine), steps(engine)
    engine.save_checkpoint(save_dir, tag=TAG)
    train(engine, steps=1)
    engine.save_checkpoint(save_dir, tag=OTHER)
    return saved


@contextlib.contextmanager
def whole_reads(engine):
    """{path: ["check" or "load", ...]}: the files engine's checkpoint engine reads whole while active, each with the
    stage that read it (the check stage of a ZeRO load, or after)."""
    reads, load = {}, engine.checkpoint_engine.load

    def recorded(path, *args, **kwargs):
        stage = "check" if any(frame.function == "_verify_zero_shards_read" for frame in inspect.stack()) else "load"
        reads.setdefault(os.fspath(path), []).append(stage)
        return load(path, *args, **kwargs)

    with mock.patch.object(engine.checkpoint_engine, "load", recorded):
        yield reads


def check_every_damage_refused(engine, save_dir, bf16=True, **load_kwargs):
    for what, path, rank, damage, match in damages(save_dir, bf16=bf16):
        paths = [path] if "entry" not in what or "file" not in what else [
            path, manifest_entry(save_dir, TAG, os.path.basename(path))
        ]
        restore = backed_up(paths)
        on_rank(rank, damage)
        message = expect_rejected(engine, save_dir, match, refusing_rank=rank, **load_kwargs)
        # a missing file is refused by the checks before (0.19.8 raised on that rank alone)
        assert what == "missing" or "content_validation" in message, (what, message)
        restore()


class TestContentValidation(DistributedTest):
    world_size = 2
    exec_timeout = 420

    @pytest.mark.parametrize("precision", ["bf16", "fp32"])
    def test_each_damage_is_refused_on_every_rank_and_the_undamaged_load_is_exact(self, tmpdir, precision):
        save_dir = str(tmpdir)
        config = make_config(3, precision)
        saved_masters, saved_moments, saved_steps = save_two(config, save_dir)
        engine = make_engine(config, seed=1)
        check_every_damage_refused(engine, save_dir, bf16=precision == "bf16", load_optimizer_states=True)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters, "masters")
        assert_same(moments(engine), saved_moments, "moments")
        assert steps(engine) == saved_steps

    def test_the_save_and_a_full_resume_hash_the_shard_as_they_write_and_read_it(self, tmpdir):
        """The manifest takes the checksums of each storage from the write that writes it, and a full ZeRO-3 resume
        checks this rank's shard in the read that loads it: the check stage loads the shard, the load uses it. Only
        the pickle and zip records are hashed from a mapping of the file; before, all of it: the save read it back,
        and the check read it before torch.load read it again. Serial loading (one rank at a time, to bound a node's
        memory) and a fresh-optimizer resume (the masters, memory-mapped) keep nothing."""
        save_dir = str(tmpdir)
        engine = wide_engine(make_config(3, "bf16"), seed=0)
        x, y = fixed_batch(hidden=WIDE, dtype=torch.bfloat16, device=engine.device)
        engine.backward(engine(x, y))
        engine.step()
        saved = masters(engine), moments(engine), steps(engine)
        with hashed_from_mappings() as hashed:
            engine.save_checkpoint(save_dir, tag=TAG)
        shard = shard_path(save_dir, dist.get_rank())
        assert os.path.isfile(manifest_entry(save_dir, TAG, os.path.basename(shard)))
        assert sum(size for path, size in hashed.items() if path.endswith(os.path.basename(shard))) < 2**16, hashed
        records = content_manifest._storage_records(content_manifest._zip_records(shard))
        assert sum(size for _, size in records.values()) > 4 * 2**20, records  # masters and moments: 4.5 MiB a rank
        for settings, load_optimizer_states, reads in (({}, True, ["check"]), ({}, False, []),
                                                       (dict(pipeline_loading_checkpoint=True), True, ["load"])):
            engine = wide_engine(make_config(3, "bf16", **settings), seed=1)
            with hashed_from_mappings() as hashed, whole_reads(engine) as whole:
                engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=load_optimizer_states)
            assert whole.get(shard, []) == reads, (settings, load_optimizer_states, whole)
            assert engine._checked_zero3_shard is None
            if reads == ["check"]:
                assert hashed.get(shard, 0) < 2**16, hashed
            assert_same(masters(engine), saved[0], "masters")
            if load_optimizer_states:
                assert_same(moments(engine), saved[1], "moments")
                assert steps(engine) == saved[2]

    def test_fresh_optimizer_reads_and_checks_the_masters(self, tmpdir):
        """A fresh-optimizer resume reads only the masters of its shard: a flipped master is refused, a flipped
        moment (never read) is not."""
        save_dir = str(tmpdir)
        config = make_config(3, "bf16")
        saved_masters, _, _ = save_two(config, save_dir)
        engine = make_engine(config, seed=1)
        optim = shard_path(save_dir, 1)
        restore = backed_up([optim])
        on_rank(1, lambda: flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", "fp32_flat_groups", 0)))
        for kwargs in (dict(load_optimizer_states=False), dict(load_module_only=True)):
            expect_rejected(engine, save_dir, "fp32_flat_groups", refusing_rank=1, **kwargs)
        restore()
        on_rank(
            1, lambda: flip_bit_of(
                optim, saved_tensor(optim, "optimizer_state_dict", "optimizer_state_dict", "state", 0, "exp_avg")))
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(masters(engine), saved_masters, "masters")

    @pytest.mark.parametrize("stage,precision", [(2, "bf16"), (1, "bf16_fp32_grad_accum")])
    def test_zero12_refuses_a_flipped_master_or_weight(self, tmpdir, stage, precision):
        """ZeRO-2, and BF16_Optimizer under ZeRO-1: a flipped master in rank 1's shard, and a flipped bf16 weight in
        the model-states file, are refused on every rank; the undamaged load is exact."""
        from unit.checkpoint.test_zero12_resume_fp32_masters import config_for
        save_dir = str(tmpdir)
        config = config_for(stage, precision)
        saved_masters, saved_moments, _ = save_two(config, save_dir)
        engine = make_engine(config, seed=1)
        optim = shard_path(save_dir, 1)
        model_states = os.path.join(save_dir, TAG, "mp_rank_00_model_states.pt")
        restore = backed_up([optim, model_states])
        on_rank(
            1, lambda: flip_bit_of(optim,
                                   saved_tensor(optim, "optimizer_state_dict", "single_partition_of_fp32_groups", 0)))
        expect_rejected(engine, save_dir, "single_partition_of_fp32_groups", refusing_rank=1)
        restore()
        restore = backed_up([model_states])
        on_rank(0, lambda: flip_bit_of(model_states, saved_tensor(model_states, "module", "layers.0.weight")))
        for kwargs in (dict(), dict(load_optimizer_states=False), dict(load_module_only=True)):
            expect_rejected(engine, save_dir, r"\['module'\]\['layers.0.weight'\]", **kwargs)
        restore()
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters, "masters")
        assert_same(moments(engine), saved_moments, "moments")

    def test_warn_loads_and_names_the_file_and_a_checkpoint_without_manifest_loads(self, tmpdir):
        save_dir = str(tmpdir)
        config = make_config(3, "bf16")
        saved_masters, _, _ = save_two(config, save_dir)
        optim = shard_path(save_dir, 1)
        on_rank(
            1, lambda: flip_bit_of(
                optim, saved_tensor(optim, "optimizer_state_dict", "optimizer_state_dict", "state", 0, "exp_avg")))
        with logged() as lines:
            warned = make_engine({**config, "checkpoint": {"content_validation": "Warn"}}, seed=1)
            warned.load_checkpoint(save_dir, tag=TAG)
            assert_same(masters(warned), saved_masters, "masters")
            if dist.get_rank() == 1:
                assert any("exp_avg" in line and "loading it anyway" in line for line in lines), lines
            # 0.19.8's checkpoints, and copies without .manifest, have none: loaded as before, with one warning
            # (DeepSpeed's logger shows warnings, not info lines), on rank 0, once per checkpoint
            on_rank(0, lambda: shutil.rmtree(os.path.join(save_dir, OTHER, MANIFEST)))
            for _ in range(2):
                legacy = make_engine(config, seed=1)
                legacy.load_checkpoint(save_dir, tag=OTHER)
            unchecked = [line for line in lines if "has no content manifest" in line]
            assert [line.split()[0] for line in unchecked] == (["WARNING"] if dist.get_rank() == 0 else []), lines
        ignored = make_engine({**config, "checkpoint": {"content_validation": "Ignore"}}, seed=1)
        ignored.load_checkpoint(save_dir, tag=TAG)  # the flipped moment loads unchecked
        assert_same(masters(ignored), saved_masters, "masters")


class TestContentValidationAtAnotherSize(DistributedTest):
    world_size = [2, 1]
    exec_timeout = 420

    @pytest.mark.parametrize("stage,masters_key", [(3, "fp32_flat_groups"), (2, "single_partition_of_fp32_groups")])
    def test_a_flipped_master_read_at_another_size_is_refused(self, tmpdir, stage, masters_key):
        """Saved at 2 ranks, loaded at 1, which reads the saved shards by parts (ZeRO-3: the slices reader;
        ZeRO-1/2: by name): a flipped master is refused in a full and a fresh-optimizer resume, a flipped moment
        in the full one only; the undamaged checkpoint loads exactly."""
        save_dir = str(tmpdir)
        if saves_checkpoint(save_dir, saved_by=2, stage=stage):
            return
        saved_masters = torch.load(os.path.join(save_dir, "saved_masters.pt"), weights_only=False)
        config = make_config(stage, "bf16")
        engine = make_engine(config, seed=1)
        optim = shard_path(save_dir, 1)
        shutil.copyfile(optim, optim + ".good")
        flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", masters_key, 0))
        for load_optimizer_states in (True, False):
            expect_rejected(engine, save_dir, masters_key, load_optimizer_states=load_optimizer_states)
        shutil.copyfile(optim + ".good", optim)
        states = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
        step = saved_tensor(optim, "optimizer_state_dict", states, "state", 0, "step")
        assert step.dim() == 0, "torch Adam's step: a storage of its own, read whole with the file's structure"
        flip_bit_of_record(optim, step)
        expect_rejected(engine, save_dir, "'step'", load_optimizer_states=True)
        shutil.copyfile(optim + ".good", optim)
        flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", states, "state", 0, "exp_avg"))
        expect_rejected(engine, save_dir, "exp_avg", load_optimizer_states=True)
        engine.load_checkpoint(save_dir, tag=TAG, load_optimizer_states=False)
        assert_same(masters(engine), saved_masters, "masters")
        os.replace(optim + ".good", optim)
        engine = make_engine(config, seed=1)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters, "masters")
        with open(os.path.join(save_dir, TAG, MANIFEST, "save.json")) as fd:
            assert json.load(fd)["tag"] == TAG


class TestContentValidationAtALargerSize(DistributedTest):
    world_size = [1, 2]
    exec_timeout = 420

    @pytest.mark.parametrize("stage,masters_key,finders", [(3, "fp32_flat_groups", (0, 1)),
                                                           (2, "single_partition_of_fp32_groups", (0, ))])
    def test_each_rank_checks_the_parts_it_reads(self, tmpdir, stage, masters_key, finders):
        """Saved at 1 rank, loaded at 2 (3 MiB of masters: 3 chunks and a part). A flip in the first master is
        refused by both ranks. Under ZeRO-2 only rank 0 reads it (the first half of the flat group), and rank 1
        says that rank 0 refused it; under ZeRO-3 each rank reads half of every parameter, so both find it. The
        undamaged checkpoint loads exactly."""
        save_dir = str(tmpdir)
        config = make_config(stage, "bf16")
        if dist.get_world_size() == 1:
            engine = wide_engine(config, seed=0)
            x, y = fixed_batch(hidden=WIDE, dtype=torch.bfloat16, device=engine.device)
            engine.backward(engine(x, y))
            engine.step()
            torch.save(masters(engine), os.path.join(save_dir, "saved_masters.pt"))
            engine.save_checkpoint(save_dir, tag=TAG)
            return
        saved_masters = torch.load(os.path.join(save_dir, "saved_masters.pt"), weights_only=False)
        engine = wide_engine(config, seed=1)
        optim = shard_path(save_dir, 0)
        assert saved_tensor(optim, "optimizer_state_dict", masters_key, 0).numel() * 4 > 3 * 2**20
        restore = backed_up([optim])
        on_rank(0, lambda: flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", masters_key, 0)))
        for load_optimizer_states in (True, False):
            expect_rejected(engine,
                            save_dir,
                            masters_key,
                            refusing_rank=None if len(finders) > 1 else finders[0],
                            load_optimizer_states=load_optimizer_states)
        restore()
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_same(masters(engine), saved_masters, "masters")


def wide_engine(config, seed):
    """A TinyMLP of 3 layers of 512: fp32 masters of 3 MiB, several manifest chunks."""
    torch.manual_seed(seed)
    model = TinyMLP(hidden=WIDE)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


class TestUniversalConversion(DistributedTest):
    world_size = 2
    exec_timeout = 420

    def test_conversion_checks_its_input_and_the_universal_load_checks_its_output(self, tmpdir):
        """ds_to_universal refuses a flipped master and writes a manifest for what it writes; a flipped byte in
        a universal state file is refused at load on every rank; the undamaged one loads exactly."""
        save_dir = str(tmpdir)
        config = make_config(3, "bf16")
        saved_masters, saved_moments, _ = save_two(config, save_dir)
        optim = shard_path(save_dir, 1)
        restore = backed_up([optim])
        on_rank(0, lambda: flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", "fp32_flat_groups", 0)))
        from deepspeed.checkpoint.content_manifest import CheckpointContentError
        if dist.get_rank() == 0:
            with pytest.raises(CheckpointContentError, match="fp32_flat_groups"):
                to_universal(save_dir)  # raises before its barrier
        dist.barrier()
        restore()
        universal_tag = to_universal(save_dir)
        universal = {**config, "checkpoint": {"load_universal": True}}
        state_file = os.path.join(save_dir, universal_tag, "zero", "layers.0.weight", "exp_avg.pt")
        optimizer_state = os.path.join(save_dir, universal_tag, "zero", "optimizer_state.pt")
        restore = backed_up([optimizer_state])
        on_rank(0, lambda: flip_text_byte(optimizer_state, b"weight_decay"))
        expect_rejected(make_engine(universal, seed=1), save_dir, "optimizer_state.pt", tag=universal_tag)
        restore()
        restore = backed_up([state_file])
        on_rank(1, lambda: flip_bit_of(state_file, saved_tensor(state_file, "param")))
        # every rank reads that file whole, so each finds it, before the engine changes
        expect_rejected(make_engine(universal, seed=1), save_dir, r"exp_avg.pt.*tensor \['param'\]", tag=universal_tag)
        restore()
        engine = make_engine(universal, seed=1)
        engine.load_checkpoint(save_dir, tag=universal_tag)
        assert_same(masters(engine), saved_masters, "masters")
        assert_same(moments(engine), saved_moments, "moments")


class TestContentValidationSerialAndNVMe(DistributedTest):
    world_size = 2
    exec_timeout = 420

    def test_serial_loading_refuses_on_every_rank(self, tmpdir):
        """zero_optimization.pipeline_loading_checkpoint: a flipped master in rank 1's shard is refused by both
        ranks before either loads, none waiting for a token."""
        save_dir = str(tmpdir)
        save_two(make_config(3, "bf16"), save_dir)
        engine = make_engine(make_config(3, "bf16", pipeline_loading_checkpoint=True), seed=1)
        optim = shard_path(save_dir, 1)
        on_rank(1, lambda: flip_bit_of(optim, saved_tensor(optim, "optimizer_state_dict", "fp32_flat_groups", 0)))
        expect_rejected(engine, save_dir, "fp32_flat_groups", refusing_rank=1)

    @pytest.mark.skipif(nvme_unavailable(), reason="NVMe offload needs the async_io op (libaio-dev)")
    def test_nvme_offloaded_file_checked_before_it_is_copied_back(self, tmpdir):
        """A flipped byte in one of rank 1's offloaded_tensors files (raw swap bytes, checked in 1 MiB chunks) is
        refused on every rank in every mode, the engine and its swap folder unchanged."""
        from unit.checkpoint.test_zero3_nvme_resume import (make_nvme_engine, nvme_config, save_checkpoint,
                                                            swap_folder_unchanged)
        save_checkpoint(str(tmpdir))
        save_dir = os.path.join(str(tmpdir), "ckpt")
        offloaded = os.path.join(save_dir, TAG, "offloaded_tensors", "rank01")
        swap_file = os.path.join(offloaded, sorted(os.listdir(offloaded))[0])
        on_rank(1, lambda: flip_byte(swap_file, os.path.getsize(swap_file) // 2))
        engine = make_nvme_engine(nvme_config(os.path.join(str(tmpdir), "nvme_load")), seed=1)
        for kwargs in (dict(), dict(load_optimizer_states=False), dict(load_module_only=True)):
            with swap_folder_unchanged(engine):
                expect_rejected(engine, save_dir, "offloaded_tensors.*not the file", refusing_rank=1, **kwargs)


class TestContentValidationAtAnotherTensorParallelSize(DistributedTest):
    """Saved at TP1 x DP2 (AutoTP), loaded at TP2 x DP1 through the TP maps: a flipped master in a copy of the
    checkpoint is refused on every rank, the engine unchanged; the original loads exactly."""
    world_size = 2
    exec_timeout = 420

    @pytest.mark.world_size([2, 2])
    def test_a_flipped_master_is_refused(self, tmp_path):
        from unit.checkpoint.test_zero3_tensor_parallel_reshard import assert_resumed, build, saves
        save_dir = str(tmp_path)
        if saves("mlp", save_dir, 1, "defaults"):
            return
        engine = build("mlp", 2, "defaults", seed=1)
        copy_dir = os.path.join(save_dir, "flipped")
        shard = os.path.join(copy_dir, TAG,
                             os.path.basename(glob.glob(os.path.join(save_dir, TAG, "*rank_0_*optim_states.pt"))[0]))
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(save_dir, TAG), os.path.join(copy_dir, TAG))
            flip_bit_of(shard, saved_tensor(shard, "optimizer_state_dict", "fp32_flat_groups", 0))
        dist.barrier()
        for kwargs in (dict(), dict(load_optimizer_states=False)):
            expect_rejected(engine, copy_dir, "fp32_flat_groups", **kwargs)
        engine.load_checkpoint(save_dir, tag=TAG)
        assert_resumed(engine, save_dir, "full")
