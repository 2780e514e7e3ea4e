# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""pytest plugin that tools/gpu_evidence.py loads into its pytest runs (-p gpu_evidence_plugin), set by environment:

- GPU_EVIDENCE_WORLD_SIZE=n: every collected DistributedTest class (ours or upstream's harness) runs at n ranks, so a
  one-GPU node runs the offload round trips and upstream's offload cells, written for 2 ranks, at 1.
- GPU_EVIDENCE_SHARD=i/n: keep every n-th collected test from the i-th (n pytest processes share the node).
- GPU_EVIDENCE_COLLECTED=path: write the node ids this process keeps, one a line (a test that a deadline stopped
  before it started then counts as not run).
- GPU_EVIDENCE_ONE_GPU=1 (the CPU miniature only): our harness decides its skips as on a node with one CUDA device.
"""

import os


def pytest_configure(config):
    if os.environ.get("GPU_EVIDENCE_ONE_GPU"):
        from unit import common  # tests/conftest.py put tests/ on sys.path
        common._accelerator_devices = lambda: ("cuda", 1)


def pytest_collection_modifyitems(config, items):
    world_size = os.environ.get("GPU_EVIDENCE_WORLD_SIZE")
    if world_size:
        for cls in {item.cls for item in items if getattr(item.cls, "is_dist_test", False)}:
            if isinstance(cls.world_size, int):
                cls.world_size = int(world_size)
    shard = os.environ.get("GPU_EVIDENCE_SHARD")
    if shard:
        index, count = map(int, shard.split("/"))
        kept = items[index::count]
        kept_ids = {id(item) for item in kept}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept
    collected = os.environ.get("GPU_EVIDENCE_COLLECTED")
    if collected:
        with open(collected, "w") as f:
            f.write("".join(f"{item.nodeid}\n" for item in items))
