# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""CPU accelerator: the /dev/shm buffers of DeepSpeed's shm allreduce do not outlive the job.

Each rank creates a buffer (about 66 MiB) named after MASTER_ADDR and MASTER_PORT and maps every peer's.
Upstream never unlinks them, so every CPU run through the launcher left them in /dev/shm, holding RAM
until reboot. With the patch each rank unlinks its own name once every rank has mapped them all (a
barrier at the end of init); the allreduce keeps working through the mappings."""

import os
from pathlib import Path

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from unit.common import DistributedTest

# Below and above the kernel's 1 MiB threshold: the symmetric and the distributed algorithm.
SIZES = (1024, 1 << 20)


def shm_buffers_of_this_job():
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_"
    return sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))


class TestShmAllreduceBuffers(DistributedTest):
    world_size = 2

    def test_unlinked_after_init_and_allreduce_still_works(self):
        if get_accelerator().device_name() != "cpu":
            pytest.skip("the shm allreduce is the CPU accelerator's")
        if getattr(dist.comm.cdb, "shm_comm_op", None) is None:
            pytest.skip("DeepSpeed's shm op is not built here (tools/build_ops.py --only ShareMemCommBuilder)")
        dist.barrier()  # every rank is past init, so past unlinking its own buffer
        assert shm_buffers_of_this_job() == [], "the shm allreduce buffers are still linked in /dev/shm"
        rank = dist.get_rank()
        for numel in SIZES:
            tensor = torch.full((numel, ), float(rank + 1))
            dist.inference_all_reduce(tensor)
            assert torch.all(tensor == 3.0), f"allreduce of {numel} floats: {tensor[:4]}"
