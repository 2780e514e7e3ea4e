# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""One launch of a benchmark's rank function in 2 fresh processes on a DeepSpeed tree (CPU accelerator, gloo), for
the benchmarks that compare trees in one run. The rank processes print one line "RESULT <json>" (rank 0)."""

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(script, tree, script_args, workdir, timeout=None):
    """Run `script --rank --save-dir <a new folder in workdir> *script_args` as ranks 0 and 1 on ROOT/tree; return
    rank 0's RESULT, the folder removed. timeout: seconds after which both ranks are killed and this raises (a rank
    can wait forever, e.g. on a JIT build's lock that a killed build left behind)."""
    from unit.env import extensions_dir  # the caller put tests/ on sys.path
    save_dir = tempfile.mkdtemp(dir=workdir)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ,
                   PYTHONPATH=str(ROOT / tree),
                   DS_ACCELERATOR="cpu",
                   RANK=str(rank),
                   LOCAL_RANK=str(rank),
                   WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)
        env.pop("LOCAL_SIZE", None)
        env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir(ROOT / tree))
        cmd = [sys.executable, str(script), "--rank", "--save-dir", save_dir] + [str(arg) for arg in script_args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        outputs = [proc.communicate()[0] for proc in procs]
        subprocess.run(["rm", "-rf", save_dir], check=True)
        raise RuntimeError(f"{tree} timed out after {timeout} s:\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}")
    subprocess.run(["rm", "-rf", save_dir], check=True)
    for line in outputs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tree} failed:\n{outputs[0][-3000:]}\n{outputs[1][-3000:]}")
