# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The content checks of every engine end alike on every rank: a pipeline engine (ZeRO-0, its default) and a MoE
engine refuse a damaged or missing file of one rank on every rank, before anything is loaded, instead of one rank
raising while the others go on into a collective; ranks that would read files of two saves (node-local storage
after a save that one node did not publish) refuse on every rank; a checkpoint edited on purpose loads once its
files are recorded again (python -m deepspeed.checkpoint.content_manifest record)."""

import glob
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.runtime.zero.utils import ZeRORuntimeException
from unit.checkpoint.checkpoint_edits import flip_byte
from unit.checkpoint.zero_resume_helpers import (TAG, assert_same, make_config, make_engine, masters, moments, on_rank,
                                                 steps, train)
from unit.common import DistributedTest

HIDDEN = 8


def pipeline_engine(seed=0):
    """Four linear layers in two pipeline stages (one per rank), ZeRO-0, fp32, Adam."""
    from deepspeed.pipe import PipelineModule
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4)]
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss())
    config = {
        "train_batch_size": 2,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


class MoEModel(torch.nn.Module):

    def __init__(self):
        super().__init__()
        from deepspeed.moe.layer import MoE
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=2, ep_size=2, k=1)


def moe_engine(stage, seed=0):
    """A dense layer and a MoE layer of two experts, one per rank (expert-parallel size 2), fp32, Adam."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    torch.manual_seed(seed)
    model = MoEModel()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    config = {
        "train_batch_size": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def weights(engine):
    return {name: param.detach().clone() for name, param in engine.module.named_parameters()}


def refused_on_every_rank(make, save_dir, match, tag=TAG):
    """A fresh engine's load of the tag raises a ZeRORuntimeException matching `match` on this rank, and leaves its
    weights as they were."""
    engine = make(seed=1)
    before = weights(engine)
    with pytest.raises(ZeRORuntimeException, match=match):
        engine.load_checkpoint(save_dir, tag=tag)
    assert_same(weights(engine), before)


class TestEveryEngineRefusesOnEveryRank(DistributedTest):
    world_size = 2
    exec_timeout = 300

    def test_pipeline_layer_file_damaged_on_one_stage(self, tmpdir):
        save_dir = str(tmpdir)
        saved = pipeline_engine()
        saved.save_checkpoint(save_dir, tag=TAG)
        expected = weights(saved)
        last_layer = os.path.join(save_dir, TAG, "layer_03-model_states.pt")  # stage 1's, read by rank 1 only
        shutil.copyfile(last_layer, f"{tmpdir}/good{dist.get_rank()}")
        on_rank(1, lambda: flip_byte(last_layer, os.path.getsize(last_layer) // 2))
        refused_on_every_rank(pipeline_engine, save_dir, "not the file its save wrote|rank 1 refused it")
        on_rank(1, lambda: shutil.copyfile(f"{tmpdir}/good1", last_layer))
        loaded = pipeline_engine(seed=1)
        loaded.load_checkpoint(save_dir, tag=TAG)
        assert_same(weights(loaded), expected)

    @pytest.mark.parametrize("stage", [ZeroStageEnum.gradients, ZeroStageEnum.disabled])
    def test_moe_expert_file_damaged_or_missing_on_one_rank(self, tmpdir, stage):
        save_dir = str(tmpdir)
        saved = moe_engine(stage)
        saved.save_checkpoint(save_dir, tag=TAG)
        expected = weights(saved)
        expert = os.path.join(save_dir, TAG, "layer_0_expert_1_mp_rank_00_model_states.pt")  # rank 1's expert
        shutil.copyfile(expert, f"{tmpdir}/good")
        on_rank(1, lambda: flip_byte(expert, os.path.getsize(expert) // 2))
        refused_on_every_rank(lambda seed: moe_engine(stage, seed), save_dir,
                              "not the file its save wrote|rank 1 refused it")
        on_rank(1, lambda: os.remove(expert))
        refused_on_every_rank(lambda seed: moe_engine(stage, seed), save_dir,
                              "lacks the expert files|rank 1 refused it")
        on_rank(1, lambda: shutil.copyfile(f"{tmpdir}/good", expert))
        loaded = moe_engine(stage, seed=1)
        loaded.load_checkpoint(save_dir, tag=TAG)
        assert_same(weights(loaded), expected)


class TestNodesWithDifferentSaves(DistributedTest):
    """Two nodes (one rank each) with node-local storage: a save_dir each."""
    world_size = 2
    local_size = 1
    exec_timeout = 300

    def test_ranks_reading_two_saves_refuse_on_every_rank(self, tmpdir):
        config = {**make_config(3, "fp32"), "checkpoint": {"use_node_local_storage": True}}
        save_dir = os.path.join(str(tmpdir), f"node{dist.get_rank()}")
        engine = make_engine(config)
        train(engine, 1)
        engine.save_checkpoint(save_dir, tag="a")
        first = os.path.join(save_dir, "a")
        shutil.copytree(first, f"{first}.first")
        train(engine, 1)
        engine.save_checkpoint(save_dir, tag="a")
        saved = dict(masters=masters(engine), moments=moments(engine), steps=steps(engine))
        if dist.get_rank() == 1:  # node 1 kept the first save: it did not publish the second
            os.rename(first, f"{first}.second")
            os.rename(f"{first}.first", first)
        dist.barrier()
        refused = make_engine(config, seed=1)
        with pytest.raises(ZeRORuntimeException, match="different saves"):
            refused.load_checkpoint(save_dir, tag="a")
        warned = make_engine({**config, "checkpoint": {**config["checkpoint"], "content_validation": "Warn"}}, seed=1)
        warned.load_checkpoint(save_dir, tag="a")  # "Warn" loads, with a warning
        if dist.get_rank() == 1:  # node 1's copy of the second save, without its manifest: nothing to compare
            shutil.rmtree(first)
            os.rename(f"{first}.second", first)
            shutil.rmtree(os.path.join(first, ".manifest"))
        dist.barrier()
        loaded = make_engine(config, seed=1)
        loaded.load_checkpoint(save_dir, tag="a")
        assert_same(dict(masters=masters(loaded), moments=moments(loaded), steps=steps(loaded)), saved)


class TestEditedCheckpoint(DistributedTest):
    world_size = 1
    exec_timeout = 300

    def test_recorded_again_it_loads(self, tmpdir):
        """A client-state key dropped from the model-states file, and an optimizer file's manifest entry removed:
        refused, naming the record command; once the files are recorded again, the load is exact."""
        save_dir = str(tmpdir)
        config = make_config(3, "bf16")
        engine = make_engine(config)
        train(engine, 2)
        engine.save_checkpoint(save_dir, tag=TAG, client_state={"kept": 1, "dropped": 2})
        saved = dict(masters=masters(engine), moments=moments(engine), steps=steps(engine))
        folder = os.path.join(save_dir, TAG)
        model_states = glob.glob(os.path.join(folder, "*model_states.pt"))[0]
        optim_states = glob.glob(os.path.join(folder, "*optim_states.pt"))[0]
        state = torch.load(model_states, weights_only=False)
        del state["dropped"]
        torch.save(state, model_states)
        for entry in glob.glob(os.path.join(folder, ".manifest", "checksums.*optim_states.pt.json")):
            os.remove(entry)
        record = [sys.executable, "-m", "deepspeed.checkpoint.content_manifest", "record", folder]
        with pytest.raises(ZeRORuntimeException, match=re.escape(f"content_manifest record {folder} {model_states}")):
            make_engine(config, seed=1).load_checkpoint(save_dir, tag=TAG)
        subprocess.run(record + [model_states, optim_states], check=True, capture_output=True, timeout=120)
        subprocess.run(record[:3] + ["verify", folder], check=True, capture_output=True, timeout=120)
        loaded = make_engine(config, seed=1)
        _, client_state = loaded.load_checkpoint(save_dir, tag=TAG)
        assert client_state["kept"] == 1 and "dropped" not in client_state
        assert_same(dict(masters=masters(loaded), moments=moments(loaded), steps=steps(loaded)), saved)
