#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""JIT-build, once, the DeepSpeed ops the tests, benchmarks and demo load, for the tree `import deepspeed`
finds (fork/, or pristine/ on PYTHONPATH), into that tree's cache under .venv/torch_extensions/.

A build inside a test would count against the test's timeout: async_io alone takes about 6 minutes on 2
cores, and a build killed by the timeout leaves a `lock` file that makes every later load wait forever.
So `make setup` builds them first; when they are built this takes a few seconds.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from unit.env import set_default_environment  # noqa: E402

# FusedAdam (offload_states tests), the CPU shm allreduce (every multi-rank run on the CPU accelerator),
# async_io and pin_memory (NVMe offload).
OPS = ("FusedAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder")
STALE_LOCK_S = 30 * 60  # no build here takes this long; an older lock was left by a killed build


def remove_stale_locks(cache):
    for lock in Path(cache).glob("*/lock"):
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            print(f"build_ops: removing the stale {lock} (left by a killed build)")
            lock.unlink()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=OPS, default=OPS, help="build only these builders' ops")
    args = parser.parse_args()
    set_default_environment()
    cache = os.environ["TORCH_EXTENSIONS_DIR"]
    remove_stale_locks(cache)
    from deepspeed.accelerator import get_accelerator
    for name in args.only:
        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            print(f"build_ops: {name}: not provided by the {get_accelerator().device_name()} accelerator")
            continue
        if not builder.is_compatible(verbose=False):
            print(f"build_ops: {builder.NAME}: not buildable here (for async_io: apt-get install libaio-dev)")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"build_ops: {builder.NAME} ready ({time.perf_counter() - start:.0f} s, {cache})", flush=True)


if __name__ == "__main__":
    main()
