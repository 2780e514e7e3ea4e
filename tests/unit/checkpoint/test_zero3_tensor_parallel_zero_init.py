# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 + AutoTP with a model from `from_pretrained`, which builds it under deepspeed.zero.Init under ZeRO-3 (a tiny
Llama saved locally, nothing downloaded). AutoTP leaves some parameters whole (norms, here the embedding too); under
zero.Init they stay partitioned over every rank and AutoTP records their shape as (0,), so no map says where their
elements are. Such a checkpoint resumes at its saved sizes, by position, exactly; a load that reads it by parameter
name (another TP size; the same one by a model built otherwise, whose maps differ; load_module_only=True) is refused on
every rank before anything changes, naming that way out, where ds_to_universal fails on it ("start (0) + length (...)
exceeds dimension size")."""

import os

import pytest

import deepspeed.comm as dist
from unit.checkpoint import test_zero3_tensor_parallel_reshard as tp_reshard
from unit.checkpoint.test_zero3_tensor_parallel_reshard import assert_resumed, saves
from unit.checkpoint.universal_zero3_helpers import make_config
from unit.checkpoint.zero3_reshard_helpers import MODES
from unit.checkpoint.zero_resume_helpers import TAG, expect_rejected
from unit.common import DistributedTest

REFUSAL = "built under zero.Init with AutoTP.*shape \\(0,\\).*Resume it at the sizes it was saved with"


def pretrained(folder, seed):
    """The tied tiny Llama of this seed saved where from_pretrained reads it (rank 0 writes, every rank waits)."""
    path = os.path.join(folder, f"tiny-tied-llama-{seed}")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        tp_reshard.tied_llama(seed).save_pretrained(path)
    dist.barrier()
    return path


def from_pretrained(tp_size, folder, seed):
    """An engine of the tied Llama as Hugging Face builds it under ZeRO-3: from_pretrained, with the DeepSpeed config
    registered as Trainer registers it, builds the model under deepspeed.zero.Init."""
    from transformers import LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    config = make_config(tp_size)
    # Registered without its tensor_parallel section: transformers (5.25) refuses every weight renaming a model's
    # from_pretrained applies (Llama has some) when the registered config asks for DeepSpeed TP ("Weight
    # conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), which is not DeepSpeed's doing.
    # zero.Init reads nothing from that section; deepspeed.initialize gets the whole config.
    registered = HfDeepSpeedConfig({
        key: value
        for key, value in config.items() if key != "tensor_parallel"
    })  # noqa: F841
    module = LlamaForCausalLM.from_pretrained(pretrained(folder, seed))
    assert all(hasattr(param, "ds_id") for param in module.parameters()), "not built under zero.Init"
    return tp_reshard.new_engine(module, config)


class TestZero3TensorParallelZeroInitCheckpoint(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 2])
    def test_resumes_at_the_saved_size(self, tmp_path):
        """Every mode that restores the saved masters from this rank's own shard (by position) is exact;
        load_module_only=True, which reads this rank's partition by name, is refused."""
        save_dir = str(tmp_path)
        if saves("tied_llama", save_dir, 2, "defaults", builder=lambda seed: from_pretrained(2, save_dir, seed)):
            return
        for mode, (kwargs, _, _) in MODES.items():
            engine = from_pretrained(2, save_dir, 1)
            if mode == "module_only":
                expect_rejected(engine, save_dir, REFUSAL, **kwargs)
                continue
            engine.load_checkpoint(save_dir, tag=TAG, **kwargs)
            assert_resumed(engine, save_dir, mode)

    @pytest.mark.world_size([2, 2, 2])
    def test_through_the_maps_refused_on_every_rank(self, tmp_path, class_tmpdir):
        """Three launches: the save at TP2; the load at TP1; at TP2, the load by a model built without zero.Init (whose
        maps record the whole shapes, so the load goes through the maps)."""
        save_dir, second_launch = str(tmp_path), os.path.join(str(class_tmpdir), "second_launch_done")
        if saves("tied_llama", save_dir, 2, "defaults", builder=lambda seed: from_pretrained(2, save_dir, seed)):
            return
        if not os.path.isfile(second_launch):
            dist.barrier()
            if dist.get_rank() == 0:
                open(second_launch, "w").close()
            for kwargs, _, _ in MODES.values():
                expect_rejected(from_pretrained(1, save_dir, 1), save_dir, REFUSAL, **kwargs)
            return
        expect_rejected(tp_reshard.build("tied_llama", 2, "defaults", seed=1), save_dir, REFUSAL)
