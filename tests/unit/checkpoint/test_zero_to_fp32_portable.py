# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The zero_to_fp32.py every save copies into its checkpoint folder runs under whatever DeepSpeed its user has:
under one without content manifests (0.19.8, or the script's import of the module failing) it converts as the
fork's function does, bit for bit, checking nothing. Its content check refuses a flipped fp32 master by default,
and converts it on request: content_validation="Warn" (with a warning) or "Ignore", the CLI's --content_validation.
One 2-rank ZeRO-3 save at DeepSpeed's defaults serves every test of the class; the checks run at 1 rank."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deepspeed.comm as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from unit.checkpoint.checkpoint_edits import flip_byte
from unit.checkpoint.zero_resume_helpers import logged, saves_checkpoint, shard_path
from unit.common import DistributedTest

PRISTINE = Path(__file__).resolve().parents[3] / "pristine"  # 0.19.8 (tools/patches.py pristine)
BLOCK = "DS_TEST_BLOCK_CONTENT_MANIFEST"

# sitecustomize.py of a folder put first on PYTHONPATH: reports, at exit, the DeepSpeed the script ran under; with
# BLOCK set, the script's own import of the content manifest module fails as on a DeepSpeed without it (the fork's
# deepspeed package imports the module itself, so only the script's import is refused).
SITECUSTOMIZE = """
import atexit
import builtins
import os
import sys

_import = builtins.__import__


def _import_without_content_manifest(name, globals=None, locals=None, fromlist=(), level=0):
    if (globals or {}).get("__name__") == "__main__" and (name == "deepspeed.checkpoint.content_manifest" or
                                                          (name == "deepspeed.checkpoint"
                                                           and "content_manifest" in (fromlist or ()))):
        print("blocked the import of deepspeed.checkpoint.content_manifest", file=sys.stderr)
        raise ModuleNotFoundError("No module named 'deepspeed.checkpoint.content_manifest'",
                                  name="deepspeed.checkpoint.content_manifest")
    return _import(name, globals, locals, fromlist, level)


if os.environ.get("%s"):
    builtins.__import__ = _import_without_content_manifest
atexit.register(lambda: print("ran under", getattr(sys.modules.get("deepspeed"), "__file__", None), file=sys.stderr))
""" % BLOCK


def shared_save(class_tmpdir):
    """The class's one checkpoint: in the 2-rank world the first test saves it (ZeRO-3 at DeepSpeed's defaults, fp32,
    3 steps) and every test returns None; in the 1-rank world, returns its folder."""
    save_dir = os.path.join(str(class_tmpdir), "save")
    if dist.get_world_size() == 2 and os.path.isfile(os.path.join(save_dir, "latest")):
        return None
    return None if saves_checkpoint(save_dir, saved_by=2, precision="fp32") else save_dir


def run_copy(save_dir, output_dir, *args, **env):
    """The zero_to_fp32.py the save left in save_dir, as its user runs it (`env`: variables to set); returns the
    finished process."""
    command = [sys.executable, os.path.join(save_dir, "zero_to_fp32.py"), save_dir, output_dir, *args]
    return subprocess.run(command, env=dict(os.environ, **env), capture_output=True, text=True, timeout=300)


def converted(output_dir):
    return torch.load(os.path.join(output_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True)


def assert_bit_identical(state, expected):
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def flip_master(save_dir):
    """Flip one bit in the middle of rank 1's fp32 masters (found in its optimizer shard by their bytes)."""
    optim = shard_path(save_dir, 1, bf16=False)
    state = torch.load(optim, map_location="cpu", weights_only=False)
    wanted = state["optimizer_state_dict"]["fp32_flat_groups"][0].view(torch.uint8).numpy().tobytes()
    with open(optim, "rb") as fd:
        data = fd.read()
    offset = data.find(wanted)
    assert offset >= 0 and data.find(wanted, offset + 1) < 0, "the masters' bytes are not unique in the file"
    flip_byte(optim, offset + len(wanted) // 2)
    return optim


class TestZeroToFp32Portable(DistributedTest):
    world_size = [2, 1]

    @pytest.mark.parametrize("deepspeed_tree", [
        "fork_without_content_manifest",
        pytest.param("pristine_0.19.8",
                     marks=pytest.mark.skipif(not PRISTINE.is_dir(),
                                              reason=f"no pristine 0.19.8 at {PRISTINE} (tools/patches.py pristine)"))
    ])
    def test_copy_converts_without_content_manifest(self, class_tmpdir, tmp_path, deepspeed_tree):
        """The copy in the checkpoint folder, run under a DeepSpeed without content_manifest, writes the fp32
        weights the fork's get_fp32_state_dict_from_zero_checkpoint returns, bit for bit."""
        save_dir = shared_save(class_tmpdir)
        if save_dir is None:
            return
        expected = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        site = tmp_path / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        if deepspeed_tree == "pristine_0.19.8":
            tree, env = PRISTINE, dict(PYTHONPATH=os.pathsep.join([str(site), str(PRISTINE)]))
        else:
            import deepspeed
            tree = Path(deepspeed.__file__).resolve().parents[1]
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])), BLOCK: "1"}
        output_dir = str(tmp_path / "fp32")
        run = run_copy(save_dir, output_dir, **env)
        assert run.returncode == 0, run.stdout + run.stderr
        ran_under = [line[len("ran under "):] for line in run.stderr.splitlines() if line.startswith("ran under ")]
        assert [Path(path).resolve() for path in ran_under] == [tree / "deepspeed" / "__init__.py"], run.stderr
        assert ("blocked the import" in run.stderr) == (BLOCK in env), run.stderr
        assert_bit_identical(converted(output_dir), expected)

    def test_flipped_master_refused_by_default_converted_on_request(self, class_tmpdir, tmp_path):
        """A flipped bit in rank 1's fp32 masters: the function and the CLI refuse it by default; "Ignore" converts
        it, "Warn" converts it with a warning naming the file, each to the same damaged weights."""
        save_dir = shared_save(class_tmpdir)
        if save_dir is None:
            return
        from deepspeed.checkpoint.content_manifest import CheckpointContentError
        expected = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        damaged = str(tmp_path / "damaged")
        shutil.copytree(save_dir, damaged)
        optim = os.path.basename(flip_master(damaged))

        with pytest.raises(CheckpointContentError, match=optim):
            get_fp32_state_dict_from_zero_checkpoint(damaged)
        run = run_copy(damaged, str(tmp_path / "refused"))
        assert run.returncode != 0 and "CheckpointContentError" in run.stderr, run.stdout + run.stderr
        assert not os.path.exists(tmp_path / "refused" / "pytorch_model.bin")

        ignored = get_fp32_state_dict_from_zero_checkpoint(damaged, content_validation="Ignore")
        assert sorted(ignored) == sorted(expected)
        assert [name for name in expected if not torch.equal(ignored[name], expected[name])], "nothing was damaged"
        with logged() as lines:
            warned = get_fp32_state_dict_from_zero_checkpoint(damaged, content_validation="warn")
        assert any(optim in line for line in lines), lines
        assert_bit_identical(warned, ignored)

        for mode in ("ignore", "Warn"):  # any case, as checkpoint.content_validation
            run = run_copy(damaged, str(tmp_path / mode), "--content_validation", mode)
            assert run.returncode == 0, run.stdout + run.stderr
            assert (optim in run.stdout + run.stderr) == (mode == "Warn"), run.stdout + run.stderr
            assert_bit_identical(converted(str(tmp_path / mode)), ignored)
