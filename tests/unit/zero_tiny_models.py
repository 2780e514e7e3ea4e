# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Tiny models, data and configs shared by the tests (the role of upstream's simple_model.py)."""

import torch


class TinyMLP(torch.nn.Module):
    """A few Linear layers and a loss: small enough for 2 CPU ranks, big enough to partition."""

    def __init__(self, hidden=16, nlayers=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(nlayers))
        self.loss_fn = torch.nn.MSELoss()

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.loss_fn(x, y)


def fixed_batch(hidden=16, batch=4, dtype=torch.float32, device="cpu", seed=1234):
    """One reproducible batch (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, hidden, generator=gen)
    y = torch.tanh(torch.randn(batch, hidden, generator=gen))
    return x.to(device=device, dtype=dtype), y.to(device=device, dtype=dtype)


# The `settings` cell axis: DeepSpeed's defaults first, then non-default values that widen coverage. At the
# default stage3_param_persistence_threshold (1e5 elements) every parameter of the tiny test models is persistent
# (kept gathered, re-gathered after each step and load); at 0 none is.
SETTINGS = {
    "defaults": {},
    "persistence_threshold=0": {
        "stage3_param_persistence_threshold": 0
    },
}


def zero3_config(precision="fp32", lr=1e-2, settings="defaults", **zero_overrides):
    """A ZeRO-3 config at DeepSpeed's defaults, or at the SETTINGS entry named. precision: fp32 | autocast (fp32
    weights, bf16 autocast) | bf16 (fp32 masters) | bf16_master (bf16 weights with bf16 master weights and
    optimizer states) | fp16 (fp32 masters, dynamic loss scale from 2**8)."""
    zero = {"stage": 3, **SETTINGS[settings]}
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": lr,
                "torch_adam": True
            }
        },
        "zero_optimization": zero,
    }
    if precision == "autocast":
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "bf16_master":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision != "fp32":
        raise ValueError(f"unknown precision {precision}")
    zero.update(zero_overrides)
    return config


def model_dtype(precision):
    return {"bf16": torch.bfloat16, "bf16_master": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
