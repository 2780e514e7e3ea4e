# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Process environment shared by the tests, the benchmarks and the example (no pytest here)."""

import hashlib
import importlib.util
import os
import sys
from pathlib import Path


def set_default_environment():
    """DS_ACCELERATOR=cpu where no GPU is found, and a JIT-op cache beside the venv, one per DeepSpeed tree
    (fork/, pristine/, worktrees): ops built from another tree's sources would otherwise be rebuilt on every
    switch. Spawned ranks inherit both. Values already set win."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch
        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir(deepspeed_tree())


def deepspeed_tree():
    """The source tree `import deepspeed` finds (fork/, pristine/ on PYTHONPATH, a worktree)."""
    return Path(importlib.util.find_spec("deepspeed").origin).resolve().parents[1]


def extensions_dir(tree):
    """The JIT-op cache of one DeepSpeed tree, inside the venv."""
    tag = f"{tree.name}-{hashlib.sha1(str(Path(tree).resolve()).encode()).hexdigest()[:8]}"
    return os.path.join(sys.prefix, "torch_extensions", tag)


def remove_shm_comm_buffers(master_addr, master_port):
    """Unlink the /dev/shm buffers that DeepSpeed's CPU shm allreduce creates per process group
    (named after MASTER_ADDR and MASTER_PORT). Pristine 0.19.8 never unlinks them (patch 0008 does once
    every rank mapped them), so without this each of its multi-rank runs leaves 66 MiB per rank of RAM
    behind in /dev/shm; a run killed before that point leaves them too."""
    for path in Path("/dev/shm").glob(f"deepspeed_*_{master_addr}_{master_port}_*"):
        path.unlink(missing_ok=True)
