# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The content manifest on one process: its chunks never cross a tensor's storage, a rank that maps a file checks
only the chunks under the tensors it reads, a refusal names the tensor, and both checksums (xxh3_64 and the
stdlib's crc32 fallback) write and check manifests."""

import json
import os

import pytest
import torch

from deepspeed.checkpoint import content_manifest
from deepspeed.checkpoint.content_manifest import (CHUNK_BYTES, CheckpointContentError, ContentVerifier,
                                                   ManifestWriter, verify_folder)
from deepspeed.runtime.constants import ValidationMode
from unit.checkpoint.checkpoint_edits import flip_byte
from unit.checkpoint.zero_resume_helpers import hashed_from_mappings

CHECKSUMS = sorted(content_manifest.CHECKSUMS)


def saved(root, name, state, checksum):
    path = os.path.join(root, name)
    torch.save(state, path)
    writer = ManifestWriter(root, "save-1", "tag", 7, checksum=checksum)
    writer.add(path)
    writer.write_save_record()
    return path


def offset_of(path, tensor):
    with open(path, "rb") as fd:
        return fd.read().find(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def entry(root, name):
    with open(os.path.join(root, ".manifest", "checksums." + name + ".json")) as fd:
        return json.load(fd)


def state():
    torch.manual_seed(0)
    return {"weights": {"big": torch.randn(CHUNK_BYTES // 4 + 1000), "small": torch.randn(10)}, "step": 3}


def test_the_fallback_is_the_stdlib_and_the_fast_one_is_tested_where_installed():
    assert "crc32" in CHECKSUMS
    assert content_manifest.DEFAULT_CHECKSUM == ("xxh3_64" if content_manifest.xxhash is not None else "crc32")


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_chunks_cover_the_file_and_never_cross_a_storage(tmpdir, checksum):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), checksum)
    chunks = entry(root, "a.pt")["chunks"]
    assert chunks[0][0] == 0 and sum(length for _, length, _, _ in chunks) == os.path.getsize(path)
    assert all(a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert max(length for _, length, _, _ in chunks) <= CHUNK_BYTES
    big = offset_of(path, state()["weights"]["big"])
    keys = {key for offset, length, _, key in chunks if offset < big + 4 * (CHUNK_BYTES // 4 + 1000) and offset >= big}
    assert len(keys) == 1 and None not in keys, "the big tensor's chunks hold its storage and nothing else"
    ContentVerifier(root, ValidationMode.FAIL).verify_file(path)


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_a_flipped_byte_is_refused_naming_the_tensor(tmpdir, checksum):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), checksum)
    flip_byte(path, offset_of(path, state()["weights"]["small"]) + 5)
    with pytest.raises(CheckpointContentError, match=r"\['weights'\]\['small'\].*content_validation"):
        ContentVerifier(root, ValidationMode.FAIL).verify_file(path)
    assert verify_folder(root, ValidationMode.WARN) == 1  # warns, goes on


def test_a_mapped_file_checks_only_the_chunks_of_the_tensors_read(tmpdir):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), content_manifest.DEFAULT_CHECKSUM)
    flip_byte(path, offset_of(path, state()["weights"]["big"]) + CHUNK_BYTES + 8)  # in the big tensor's 2nd chunk
    verifier = ContentVerifier(root, ValidationMode.FAIL)
    mapped = torch.load(path, mmap=True, weights_only=False)
    verifier.verify_mapped(path, mapped)  # the pickle and zip records: intact
    verifier.verify_tensor(path, mapped["weights"]["small"])
    verifier.verify_tensor(path, mapped["weights"]["big"][:1000])  # its first chunk only
    with pytest.raises(CheckpointContentError, match=r"\['weights'\]\['big'\]"):
        verifier.verify_tensor(path, mapped["weights"]["big"][CHUNK_BYTES // 4:])


def test_reads_of_any_span_return_the_file_and_hash_only_the_chunks_they_cover_whole(tmpdir):
    path = os.path.join(str(tmpdir), "bytes")
    data = os.urandom(3 * CHUNK_BYTES + CHUNK_BYTES // 2)
    with open(path, "wb") as fd:
        fd.write(data)
    chunks = [list(chunk) for chunk in content_manifest._split(0, len(data), None)]
    digest = content_manifest.CHECKSUMS[content_manifest.DEFAULT_CHECKSUM]
    with open(path, "rb", buffering=0) as raw:
        reader = content_manifest._CheckingReader(raw, chunks, digest)
        got = bytearray()
        for offset, size in [(10, 5), (0, 2 * CHUNK_BYTES + 100), (CHUNK_BYTES + 7, 10),
                             (3 * CHUNK_BYTES, CHUNK_BYTES)]:
            reader.seek(offset)
            buffer = bytearray(size)
            count = reader.readinto(buffer)
            assert buffer[:count] == data[offset:offset + size]
            got += buffer[:count]
    assert count == CHUNK_BYTES // 2, "a read past the end returns what the file holds"
    assert reader.digests == {index: digest(data[chunks[index][0]:sum(chunks[index][:2])]) for index in (0, 1, 3)}


@pytest.mark.parametrize("checksum", CHECKSUMS)
def test_a_load_checks_in_its_own_read_and_a_save_hashes_as_it_writes(tmpdir, checksum):
    root = str(tmpdir)
    path = os.path.join(root, "a.pt")
    writer = ManifestWriter(root, "save-1", "tag", 7, checksum=checksum)
    content_manifest.start_recording(writer)
    with open(path, "wb") as fd:
        content_manifest.hashing_writes(path, lambda file: torch.save(state(), file))(fd)
    big = offset_of(path, state()["weights"]["big"])
    assert {(big, CHUNK_BYTES), (big + CHUNK_BYTES, 4000)} <= set(writer.written[path]), "hashed as written"
    content_manifest.record_write(path)
    content_manifest.stop_recording()
    writer.write_save_record()
    with open(path, "rb") as fd:
        assert entry(
            root, "a.pt")["chunks"] == [[offset, length, content_manifest.CHECKSUMS[checksum](fd.read(length)), key]
                                        for offset, length, _, key in entry(root, "a.pt")["chunks"]]
    with content_manifest.verifying_reads(ContentVerifier(root,
                                                          ValidationMode.FAIL)), hashed_from_mappings() as hashed:
        loaded = content_manifest.load_verified(path, lambda file: torch.load(file, weights_only=False))
    assert torch.equal(loaded["weights"]["big"], state()["weights"]["big"]) and loaded["step"] == 3
    assert hashed[path] < 4096, "only the bytes around the storages are hashed from a mapping"
    flip_byte(path, offset_of(path, state()["weights"]["big"]) + CHUNK_BYTES + 8)
    with content_manifest.verifying_reads(ContentVerifier(root,
                                                          ValidationMode.FAIL)), hashed_from_mappings() as hashed:
        with pytest.raises(CheckpointContentError, match=r"\['weights'\]\['big'\]"):
            content_manifest.load_verified(path, lambda file: torch.load(file, weights_only=False))
    assert hashed[path] < 4096, "the flipped byte is found in the bytes the load read"


def test_a_damaged_pickle_is_refused_before_it_is_unpickled(tmpdir):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), content_manifest.DEFAULT_CHECKSUM)
    with open(path, "rb") as fd:
        flip_byte(path, fd.read().find(b"weights"))
    loads = []
    with content_manifest.verifying_reads(ContentVerifier(root, ValidationMode.FAIL)):
        with pytest.raises(CheckpointContentError, match="data.pkl"):
            content_manifest.load_verified(path, loads.append)
    assert loads == []


def test_identity_size_and_missing_entries(tmpdir):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), content_manifest.DEFAULT_CHECKSUM)
    os.makedirs(os.path.join(root, "other"))
    other = saved(os.path.join(root, "other"), "a.pt", state(), content_manifest.DEFAULT_CHECKSUM)
    with open(os.path.join(root, "other", ".manifest", "save.json"), "w") as fd:
        json.dump({"format": 1, "save_id": "save-2", "tag": "other", "step": 8}, fd)
    ContentVerifier(root, ValidationMode.FAIL).verify_file(path)
    with pytest.raises(CheckpointContentError, match="a file of another save"):
        ContentVerifier(os.path.join(root, "other"), ValidationMode.FAIL).verify_file(other)
    with open(path, "ab") as fd:
        fd.write(b"x")
    with pytest.raises(CheckpointContentError, match="truncated or overwritten"):
        ContentVerifier(root, ValidationMode.FAIL).verify_file(path)
    os.remove(os.path.join(root, ".manifest", "checksums.a.pt.json"))
    with pytest.raises(CheckpointContentError, match="has no manifest entry"):
        ContentVerifier(root, ValidationMode.FAIL).verify_file(path)
    assert ContentVerifier(root, ValidationMode.IGNORE).verify_file(path) is None


def test_files_outside_the_checkpoint_and_checkpoints_without_manifest_are_not_checked(tmpdir):
    root = str(tmpdir)
    outside = os.path.join(root, "outside.pt")
    torch.save(state(), outside)
    os.makedirs(os.path.join(root, "ckpt"))
    verifier = ContentVerifier(os.path.join(root, "ckpt"), ValidationMode.FAIL)
    assert not verifier.active
    verifier.verify_file(outside)


def test_an_entry_whose_checksum_this_python_lacks_is_loaded_unchecked_but_sized(tmpdir, monkeypatch):
    """An xxh3_64 manifest read where xxhash is missing: the bytes cannot be checked (a warning), the size still is."""
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), "crc32")
    monkeypatch.delitem(content_manifest.CHECKSUMS, "crc32")
    flip_byte(path, offset_of(path, state()["weights"]["small"]))
    ContentVerifier(root, ValidationMode.FAIL).verify_file(path)  # unchecked, with a warning
    with open(path, "ab") as fd:
        fd.write(b"x")
    with pytest.raises(CheckpointContentError, match="truncated or overwritten"):
        ContentVerifier(root, ValidationMode.FAIL).verify_file(path)


@pytest.mark.parametrize("damage", [dict(checksum=[]), dict(size=True), dict(chunks=[[0, 1, 2, None]])])
def test_a_malformed_entry_is_refused_not_crashed_on(tmpdir, damage):
    root = str(tmpdir)
    path = saved(root, "a.pt", state(), content_manifest.DEFAULT_CHECKSUM)
    with open(os.path.join(root, ".manifest", "checksums.a.pt.json")) as fd:
        malformed = {**json.load(fd), **damage}
    with open(os.path.join(root, ".manifest", "checksums.a.pt.json"), "w") as fd:
        json.dump(malformed, fd)
    with pytest.raises(CheckpointContentError, match="manifest entry"):
        ContentVerifier(root, ValidationMode.FAIL).verify_file(path)
    ContentVerifier(root, ValidationMode.WARN).verify_file(path)  # warns, goes on
