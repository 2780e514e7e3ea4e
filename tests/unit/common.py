# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Multi-rank test harness, shaped like upstream's tests/unit/common.py::DistributedTest.

A test class derives from DistributedTest and sets `world_size`; each test method then runs in
`world_size` fresh processes (one per rank: spawned, or on the CPU accelerator forked from a server
that imported torch and deepspeed once, rank_context) that have joined one process group: gloo on
the CPU accelerator, nccl on CUDA. The parent waits for every rank:

- a failure on any rank fails the test with that rank's traceback (all failing ranks are shown);
- a hang (no result before the timeout) fails the test, and every rank's process group is killed;
- pytest.skip() in a rank skips the test;
- off the CPU, a test needs one device per rank on its (simulated) node, and is skipped, with the
  reason, where the node has fewer: two NCCL ranks on one device fail or hang (upstream skips alike).

The tests use only what upstream's DistributedTest offers, so the same files run under upstream's
tests/unit/common.py: `world_size` (class attribute, `@pytest.mark.world_size(n)` or a parametrize
argument), a list of world sizes (the test runs once per entry, one launch after another, sharing
its fixtures: e.g. 4 ranks save a checkpoint, then 2 load it), the `exec_timeout` class attribute and the
`class_tmpdir` fixture.

Beyond upstream, for our own tests only: `@pytest.mark.exec_timeout(seconds)`, `local_size` (default:
the world size; simulates several nodes, LOCAL_RANK = rank % local_size) and `pg_timeout_s` (default: a
third of the test's timeout, 30 to 300 s, so that ranks stuck in a collective raise with their stack
before the test is killed).
"""

import datetime
import importlib.util
import inspect
import os
import queue
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from unit.env import remove_shm_comm_buffers

TESTS_DIR = Path(__file__).resolve().parent.parent
DEFAULT_EXEC_TIMEOUT = int(os.environ.get("DS_TEST_EXEC_TIMEOUT", "600"))
# After the first failing rank reports, the others get this long to report their own error.
FAILURE_GRACE_S = 10


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marker_arg(request, name, default):
    marker = request.node.get_closest_marker(name)
    return marker.args[0] if marker else default


class DistributedTest:
    """Base class: every test method runs in `world_size` ranks."""
    is_dist_test = True
    world_size = 2
    local_size = None
    exec_timeout = DEFAULT_EXEC_TIMEOUT
    # Process-group timeout (collectives that never complete raise after this long); None: default_pg_timeout.
    pg_timeout_s = None
    backend = None

    # As upstream's: a temporary directory shared by the test methods of a class.
    @pytest.fixture(autouse=True, scope="class")
    def class_tmpdir(self, tmpdir_factory):
        return tmpdir_factory.mktemp(self.__class__.__name__)

    def __call__(self, request):
        world_sizes = _world_sizes(request, self.world_size)
        local_size = self.local_size
        for world_size in world_sizes:
            reason = device_shortfall(*_accelerator_devices(), world_size, local_size or world_size)
            if reason:
                pytest.skip(reason)
        timeout = _marker_arg(request, "exec_timeout", self.exec_timeout)
        method = getattr(self, request.function.__name__)
        wanted = inspect.signature(method).parameters
        kwargs = {k: v for k, v in request.node.funcargs.items() if k in wanted}
        for world_size in world_sizes:  # one launch per entry, in order (upstream's world_size lists)
            spec = dict(module_file=str(request.path),
                        class_name=type(self).__name__,
                        method_name=request.function.__name__,
                        kwargs=kwargs,
                        world_size=world_size,
                        local_size=local_size or world_size,
                        backend=self.backend,
                        pg_timeout_s=self.pg_timeout_s or default_pg_timeout(timeout))
            run_ranks(spec, timeout)


def _world_sizes(request, default):
    """The world sizes to launch, in order: a parametrize argument, else the marker, else the class attribute;
    each may be one size or a list of them."""
    sizes = request.node.funcargs.get("world_size", None) or _marker_arg(request, "world_size", default)
    return list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]


def default_pg_timeout(exec_timeout):
    """A third of the test's timeout, 30 to 300 s: a rank stuck in a collective raises, with its stack, before
    the harness kills it."""
    return int(min(300, max(30, exec_timeout // 3)))


def _accelerator_devices():
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    return accelerator.device_name(), accelerator.device_count()


def device_shortfall(accelerator, device_count, world_size, local_size):
    """Why this node cannot run world_size ranks, local_size per simulated node, or None when it can.

    The CPU accelerator runs any number of ranks. Elsewhere each rank binds device LOCAL_RANK, so every
    rank needs its own device: simulated nodes would put their ranks on the same devices, and more local
    ranks than devices would fail in set_device."""
    if accelerator == "cpu":
        return None
    if local_size < world_size:
        return (f"simulates {world_size // local_size} nodes on one machine, which only the CPU accelerator "
                f"can do (ranks of different nodes would share a {accelerator} device)")
    if device_count < world_size:
        return f"needs {world_size} {accelerator} devices, one per rank; this node has {device_count}"
    return None


def rank_context():
    """The multiprocessing context the ranks start from. Upstream spawns them, and so do we where an accelerator
    other than the CPU may be in use (CUDA does not survive a fork) or DS_TEST_START_METHOD=spawn. On the CPU
    accelerator the ranks are otherwise forked from a server that imported torch and deepspeed once per session: a
    rank starts without importing them again (seconds per rank, and a suite launches ranks hundreds of times), from a
    process that never used a device or a process group, with the parent's environment as it is at the launch
    (_set_rank_env). What a forked rank shares with the others: the server's str hash seed (set iteration order
    is the same on every rank, where spawned ranks and the deepspeed launcher's differ) and what was read from the
    environment at import (e.g. TORCH_DISTRIBUTED_DEBUG); DS_TEST_START_METHOD=spawn runs the suite as upstream
    does."""
    if os.environ.get("DS_ACCELERATOR") != "cpu" or os.environ.get("DS_TEST_START_METHOD") == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "deepspeed"])
    return ctx


def run_ranks(spec, timeout):
    ctx = rank_context()
    results = ctx.Queue()
    import deepspeed
    spec = dict(spec, master_port=free_port(), environ=dict(os.environ), deepspeed_file=deepspeed.__file__)
    procs = [
        ctx.Process(target=_rank_main, args=(spec, rank, results), daemon=True) for rank in range(spec["world_size"])
    ]
    for proc in procs:
        proc.start()
    try:
        reports = _collect(procs, results, timeout)
    finally:
        _kill_all(procs)
        remove_shm_comm_buffers("127.0.0.1", spec["master_port"])
    _raise_for(reports, spec["world_size"], timeout)


def _collect(procs, results, timeout):
    """Gather (status, detail) per rank until all reported, one failed (plus grace), or timeout."""
    reports = {}
    deadline = time.monotonic() + timeout
    while len(reports) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, detail = results.get(timeout=0.5)
            reports[rank] = (status, detail)
            if status == "error":
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            if rank not in reports and proc.exitcode is not None:
                # Drain a report that raced with the exit before calling the rank dead.
                time.sleep(0.5)
                while not results.empty():
                    r, status, detail = results.get()
                    reports[r] = (status, detail)
                if rank not in reports:
                    reports[rank] = ("error", f"rank {rank} exited with code {proc.exitcode} without a result")
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
    return reports


def _raise_for(reports, world_size, timeout):
    errors = {r: d for r, (s, d) in reports.items() if s == "error"}
    if errors:
        hung = sorted(set(range(world_size)) - set(reports))
        text = "\n".join(f"----- rank {r} -----\n{d}" for r, d in sorted(errors.items()))
        if hung:
            text += f"\n(ranks {hung} were still running and were killed)"
        pytest.fail(f"{len(errors)} of {world_size} ranks failed:\n{text}", pytrace=False)
    missing = sorted(set(range(world_size)) - set(reports))
    if missing:
        pytest.fail(f"timeout after {timeout}s: ranks {missing} did not finish (hang); all ranks killed",
                    pytrace=False)
    skips = [d for s, d in reports.values() if s == "skip"]
    if skips:
        pytest.skip(skips[0])


def _kill_all(procs):
    for proc in procs:
        if proc.pid:  # alive or not (a forked rank's exit is unknown if its server died): anything left of it
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
            except ProcessLookupError:
                pass
    for proc in procs:
        proc.join(timeout=10)


def _rank_main(spec, rank, results):
    os.setpgrp()
    _die_with_parent()
    try:
        _set_rank_env(spec, rank)
        _check_deepspeed_tree(spec)
        test = _load_test_class(spec)()
        _init_process_group(spec)
        getattr(test, spec["method_name"])(**spec["kwargs"])
        _shutdown_process_group()
        results.put((rank, "ok", ""))
    except pytest.skip.Exception as skip:
        results.put((rank, "skip", str(skip)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()


def _set_rank_env(spec, rank):
    os.environ.clear()  # a forked rank starts with the fork server's environment: take the parent's, as a spawned one
    os.environ.update(spec["environ"])
    local_size = spec["local_size"]
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(spec["master_port"]),
        "RANK": str(rank),
        "WORLD_SIZE": str(spec["world_size"]),
        "LOCAL_RANK": str(rank % local_size),
        "LOCAL_SIZE": str(local_size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "CROSS_RANK": str(rank // local_size),
        "CROSS_SIZE": str(spec["world_size"] // local_size),
    })
    sys.path.insert(0, str(TESTS_DIR))


def _die_with_parent():
    """A forked rank's parent is the fork server, which exits with the pytest session: take the rank down with it."""
    try:
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass  # not Linux: the harness's killpg still ends a rank at the test's end


def _check_deepspeed_tree(spec):
    """A rank runs the DeepSpeed the parent imported (the fork server imports from its own path)."""
    import deepspeed
    if deepspeed.__file__ != spec["deepspeed_file"]:
        raise RuntimeError(f"this rank imported {deepspeed.__file__}, the test session {spec['deepspeed_file']}: "
                           "set PYTHONPATH before pytest starts, or run with DS_TEST_START_METHOD=spawn")


def _load_test_class(spec):
    module_file = Path(spec["module_file"])
    name = "dist_test_" + "_".join(module_file.relative_to(TESTS_DIR).with_suffix("").parts)
    module_spec = importlib.util.spec_from_file_location(name, module_file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return getattr(module, spec["class_name"])


def _init_process_group(spec):
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    on_cpu = accelerator.device_name() == "cpu"
    backend = spec["backend"] or ("gloo" if on_cpu else accelerator.communication_backend_name())
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]))


def _shutdown_process_group():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
