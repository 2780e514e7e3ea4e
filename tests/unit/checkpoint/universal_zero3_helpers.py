# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Helpers for the ZeRO-3 universal checkpoint tests: save a ZeRO-3 run, convert it with
ds_to_universal, load it into another layout, and read back the state that was saved."""

import glob
import os

import torch

import deepspeed
import deepspeed.comm as dist
from deepspeed.checkpoint.constants import PARAM
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from unit.checkpoint.universal_conversion import convert_to_universal
from unit.zero_tiny_models import zero3_config
from unit.checkpoint.checkpoint_edits import without_manifest

HIDDEN = 16
MOMENTS = ("exp_avg", "exp_avg_sq")


class TinyMLPBlocks(torch.nn.Module):
    """Residual MLP blocks whose up/down projections AutoTP splits column/row-wise."""

    def __init__(self, hidden=HIDDEN, inner=32, nblocks=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(up_proj=torch.nn.Linear(hidden, inner), down_proj=torch.nn.Linear(inner, hidden)))
            for _ in range(nblocks))
        self.loss_fn = torch.nn.MSELoss()

    def forward(self, x, y):
        for block in self.blocks:
            x = x + block["down_proj"](torch.tanh(block["up_proj"](x)))
        return self.loss_fn(x, y)


MLP_PARTITION_CONFIG = {
    "use_default_specs":
    False,
    "layer_specs": [
        {
            "patterns": [".*up_proj\\.(weight|bias)$"],
            "partition_type": "column"
        },
        {
            "patterns": [".*down_proj\\.(weight|bias)$"],
            "partition_type": "row"
        },
    ],
}


def make_config(tp_size=1, load_universal=False, partition_config=None, stage=3):
    config = zero3_config("fp32")
    config["zero_optimization"]["stage"] = stage
    if tp_size > 1:
        config["tensor_parallel"] = {"autotp_size": tp_size}
        if partition_config is not None:
            config["tensor_parallel"]["partition_config"] = partition_config
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return config


def tiny_llama(seed):
    """A real Hugging Face architecture, tiny and randomly initialised: AutoTP matches its layers
    through the model's own tensor-parallel plan."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64,
                         hidden_size=32,
                         intermediate_size=64,
                         num_hidden_layers=2,
                         num_attention_heads=4,
                         num_key_value_heads=2,
                         max_position_embeddings=32)
    return LlamaForCausalLM(config)


def token_batches(nsteps, vocab=64, batch=2, seq=8):
    gen = torch.Generator().manual_seed(4321)
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(nsteps)]


def train_lm(engine, data):
    losses = []
    for ids in data:
        ids = ids.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def batches(nsteps, hidden=HIDDEN, batch=4):
    """The same batches on every rank, so any DP x TP layout computes the same update."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(nsteps):
        x = torch.randn(batch, hidden, generator=gen)
        y = torch.tanh(torch.randn(batch, hidden, generator=gen))
        out.append((x, y))
    return out


def train(engine, data):
    losses = []
    for x, y in data:
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def full_state(engine):
    """{name: {fp32, exp_avg, exp_avg_sq}} of every parameter, as this rank's TP shard, gathered over DP."""
    state = {}
    for name, param in engine.module.named_parameters():
        entry = {"fp32": safe_get_full_fp32_param(param).clone()}
        for key in MOMENTS:
            try:
                entry[key] = safe_get_full_optimizer_state(param, key).clone()
            except KeyError:  # no optimizer state yet (before the first step or a full load)
                entry[key] = None
        state[name] = entry
    return state


def step_counts(engine):
    steps = []
    for param_state in engine.optimizer.optimizer.state.values():
        step = param_state["step"]
        steps.append(int(step.item()) if torch.is_tensor(step) else int(step))
    return steps


def tp_rank_and_size(engine):
    if engine.autotp_size() <= 1:
        return 0, 1
    from deepspeed.utils import groups
    return groups.get_tensor_model_parallel_rank(), groups.get_tensor_model_parallel_world_size()


def expected_shard(full, local_shape, tp_rank, tp_size):
    """This rank's piece of a whole tensor: AutoTP cuts a parameter into even contiguous blocks along
    the one dimension whose size differs; a parameter with the whole shape is replicated."""
    if tuple(full.shape) == tuple(local_shape):
        return full
    dims = [d for d, (a, b) in enumerate(zip(full.shape, local_shape)) if a != b]
    assert len(dims) == 1 and full.shape[dims[0]] == local_shape[dims[0]] * tp_size, (full.shape, local_shape)
    return full.chunk(tp_size, dim=dims[0])[tp_rank]


def assert_restored_bitwise(engine, saved, saved_steps, keys=("fp32", ) + MOMENTS):
    """Every parameter's fp32 weight and both Adam moments equal this rank's share of the saved
    ones bit for bit, and every step count equals the saved one (only `keys` and no steps after a
    weights-only load). Returns how many parameters this rank holds as a TP shard."""
    tp_rank, tp_size = tp_rank_and_size(engine)
    restored = full_state(engine)
    assert set(restored) == set(saved), (sorted(restored), sorted(saved))
    sharded = 0
    for name, entry in restored.items():
        for key in keys:
            tensor = entry[key]
            want = expected_shard(saved[name][key], tensor.shape, tp_rank, tp_size)
            assert torch.equal(tensor, want), f"{name} {key} differs after restore (tp_rank {tp_rank})"
        sharded += entry["fp32"].shape != saved[name]["fp32"].shape
    if "exp_avg" in keys:
        assert set(step_counts(engine)) == set(saved_steps), (step_counts(engine), saved_steps)
    assert (sharded > 0) == (tp_size > 1), f"{sharded} parameters are TP shards at tp_size {tp_size}"
    return sharded


def assert_same_state(before, after):
    assert set(before) == set(after)
    for name, entry in before.items():
        for key, tensor in entry.items():
            assert (tensor is None and after[name][key] is None) or torch.equal(tensor, after[name][key]), \
                f"{name} {key} changed"


def save_and_convert(engine, save_dir, tag="saved", inject_missing_state=False):
    """Save a checkpoint, convert it on rank 0 and return the universal tag next to it."""
    engine.save_checkpoint(save_dir, tag=tag)
    return convert_to_universal(save_dir, tag, inject_missing_state=inject_missing_state)


def state_files(save_dir, tag):
    return sorted(glob.glob(os.path.join(save_dir, tag, "zero", "*", "*.pt")))


def edit_state_file(save_dir, tag, param_name, state, edit):
    """On rank 0, replace one state file's tensor by edit(tensor), or delete the file if edit is None."""
    path = os.path.join(save_dir, tag, "zero", param_name, f"{state}.pt")
    if dist.get_rank() == 0:
        if edit is None:
            os.remove(path)
        else:
            content = torch.load(path, weights_only=False)
            if isinstance(content, dict):
                content[PARAM] = edit(content[PARAM])
            else:
                content = edit(content)
            torch.save(content, path)
        without_manifest(os.path.dirname(path))
    dist.barrier()


def assert_one_format(save_dir, tag, saved):
    """Every state file of the converted folder holds a dict with the tensor, in the parameter's
    own shape, under `param` (the format every other conversion path writes), equal to the saved
    tensor bit for bit."""
    for name, entry in saved.items():
        for key in entry:
            content = torch.load(os.path.join(save_dir, tag, "zero", name, f"{key}.pt"), weights_only=False)
            assert isinstance(content, dict), f"{name}/{key}.pt holds a {type(content).__name__}"
            assert content[PARAM].shape == entry[key].shape, (name, key, content[PARAM].shape)
            assert torch.equal(content[PARAM].cpu(), entry[key].cpu()), (name, key)


def rewrite_as_bare_tensors(save_dir, tag):
    """Turn a converted folder into the form 0.19.8's converter writes for ZeRO-3 without TP:
    each state file holds the bare flat tensor instead of a dict with it under `param`."""
    if dist.get_rank() == 0:
        for path in state_files(save_dir, tag):
            if os.path.basename(path) == "optimizer_state.pt":
                continue
            state = torch.load(path, weights_only=False)
            if isinstance(state, dict):
                torch.save(state[PARAM].flatten().clone(), path)
        without_manifest(os.path.join(save_dir, tag))  # 0.19.8's converter writes none
    dist.barrier()


def new_engine(model, config):
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def pretrained(build_model, folder, seed):
    """build_model(seed) saved where from_pretrained reads it (rank 0 writes, every rank waits)."""
    path = os.path.join(folder, f"pretrained-{build_model.__name__}-{seed}")
    if dist.get_rank() == 0 and not os.path.isdir(path):
        build_model(seed).save_pretrained(path)
    dist.barrier()
    return path


def from_pretrained(build_model, config, folder, seed, frozen=()):
    """An engine of build_model(seed) as Hugging Face builds it under ZeRO-3: from_pretrained, with the DeepSpeed config
    registered as Trainer registers it, builds the model under deepspeed.zero.Init. The parameters whose names start
    with a `frozen` prefix do not train."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    # Registered without its tensor_parallel section: transformers (5.25) refuses every weight renaming a model's
    # from_pretrained applies (Llama has some) when the registered config asks for DeepSpeed TP ("Weight
    # conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), which is not DeepSpeed's doing.
    # zero.Init reads nothing from that section; deepspeed.initialize gets the whole config.
    registered = HfDeepSpeedConfig({
        key: value
        for key, value in config.items() if key != "tensor_parallel"
    })  # noqa: F841
    module = AutoModelForCausalLM.from_pretrained(pretrained(build_model, folder, seed))
    assert all(hasattr(param, "ds_id") for param in module.parameters()), "not built under zero.Init"
    for name, param in module.named_parameters():
        param.requires_grad_(not name.startswith(frozen))
    return new_engine(module, config)
