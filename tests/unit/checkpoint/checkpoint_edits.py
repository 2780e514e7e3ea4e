# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""For tests that edit a saved checkpoint to stand for another kind of save (an older DeepSpeed's, another layout,
a file cut short): the edited checkpoint loads as one saved without a content manifest; and for the tests of
that manifest, a flipped bit."""

import os
import shutil

# deepspeed/checkpoint/content_manifest.py's MANIFEST_FOLDER, spelled out: a tree without it has no manifest to drop
MANIFEST_FOLDER = ".manifest"


def without_manifest(path):
    """Remove the content manifest of the checkpoint folder holding `path` (a file or folder in it): the nearest
    folder above with a .manifest. Without one, the load checks no bytes and the checks these tests are about (a
    file that cannot be read, a layout the load cannot serve) see the edit; test_checkpoint_content_validation.py
    tests what the manifest refuses. Any rank may call it; several at once is fine."""
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    while True:
        manifest = os.path.join(folder, MANIFEST_FOLDER)
        if os.path.isdir(manifest):
            shutil.rmtree(manifest, ignore_errors=True)
            return
        if os.path.dirname(folder) == folder:
            return
        folder = os.path.dirname(folder)


def flip_byte(path, offset):
    """Flip the lowest bit of the byte at `offset` of the file at `path` (a bit rotted on disk)."""
    with open(path, "r+b") as fd:
        fd.seek(offset)
        byte = fd.read(1)
        fd.seek(offset)
        fd.write(bytes([byte[0] ^ 0x01]))
