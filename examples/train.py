#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0
"""A small decoder-only transformer trained with DeepSpeed on synthetic tokens.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/configs/zero3_autocast.json --steps 5

Runs on GPUs or, with DS_ACCELERATOR=cpu, on the CPU accelerator (gloo). Prints one line per step:
loss, step time and this rank's persistent ZeRO-3 state (weights, masters, Adam moments) in bytes per
parameter, counting each storage once, so the shared master partitions of the fork show.
"""

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

import deepspeed


class Block(torch.nn.Module):

    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(torch.nn.Module):

    def __init__(self, vocab, hidden, layers, heads, seq_len):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(seq_len, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x[:, :-1]))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def synthetic_batch(step, batch, seq_len, vocab, device):
    """Deterministic per step and rank: the same data order on every run."""
    gen = torch.Generator().manual_seed(1000 * step + deepspeed.comm.get_rank())
    # a learnable pattern: each sequence counts up from a random start
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    return ((start + torch.arange(seq_len)) % vocab).to(device)


def persistent_bytes_per_param(engine):
    """Weights + masters + Adam moments on this rank, each storage counted once."""
    optimizer = engine.optimizer
    seen, total = set(), 0
    tensors = [p.ds_tensor for p in engine.module.parameters()]
    tensors += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    for state in optimizer.optimizer.state.values():
        tensors += [v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total / sum(p.ds_tensor.numel() for p in engine.module.parameters())


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see examples/configs/)")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main():
    args = parse_args()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)
    model = TinyGPT(args.vocab, args.hidden, args.layers, args.heads, args.seq_len)
    if config.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = deepspeed.comm.get_rank()
    batch = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = engine(synthetic_batch(step, batch, args.seq_len, args.vocab, engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if rank == 0:
            print(
                f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} time {time.perf_counter() - start:.2f}s "
                f"state {persistent_bytes_per_param(engine):.2f} B/param (rank 0)",
                flush=True)
    if not all(torch.isfinite(torch.tensor(losses))):
        sys.exit(f"non-finite loss: {losses}")


if __name__ == "__main__":
    main()
