#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Train a tiny Llama (random weights, synthetic tokens) with DeepSpeed ZeRO-3; save and resume it.

    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/configs/zero3_autocast.json --steps 5

    # save after step 3, then resume with a fresh optimizer (the fork restores the saved fp32 masters)
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/configs/zero3_bf16.json \
        --steps 6 --save-dir ckpt --save-at 3
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/configs/zero3_bf16.json \
        --steps 6 --resume ckpt --resume-mode fresh-optimizer

    # convert to a universal checkpoint and resume it under AutoTP, tensor-parallel size 2
    python -m deepspeed.checkpoint.ds_to_universal --input_folder ckpt/global_step3 \
        --output_folder ckpt/global_step3_universal
    deepspeed --num_gpus 2 examples/train.py --deepspeed_config examples/configs/zero3_bf16.json \
        --steps 6 --resume ckpt --universal --tp 2

Runs on GPUs or, with DS_ACCELERATOR=cpu, on the CPU accelerator (gloo). Every step prints the loss
(mean over ranks), the step time, each rank's memory and rank 0's persistent ZeRO-3 state (weights,
masters, Adam moments; each storage counted once, so master partitions shared with the weights show)
in bytes per parameter. The data of a step depends only on the step number and the global batch, so
a resumed run, or one at another data/tensor-parallel layout, sees the same samples at the same step.
"""

import argparse
import json
import os
import sys
import time

import psutil
import torch
from tqdm import tqdm

import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state

# mode -> load_checkpoint arguments. load_fp32_weights is left out where the default applies, so the
# same modes run on upstream DeepSpeed (which has no such argument) for comparison.
RESUME_MODES = {
    "full": dict(load_optimizer_states=True),
    "fresh-optimizer": dict(load_optimizer_states=False),
    "fresh-optimizer-no-fp32": dict(load_optimizer_states=False, load_fp32_weights=False),
    "module-only": dict(load_module_only=True),
}
MOMENTS = ("exp_avg", "exp_avg_sq")


def tiny_llama(args):
    """A real Hugging Face architecture, so AutoTP finds its layers by the model's own TP plan."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=args.vocab,
                    hidden_size=args.hidden,
                    intermediate_size=2 * args.hidden,
                    num_hidden_layers=args.layers,
                    num_attention_heads=args.heads,
                    num_key_value_heads=args.heads // 2,
                    max_position_embeddings=args.seq_len))


def global_batch(step, size, seq_len, vocab):
    """The step's samples, the same for every layout: each sequence counts up from a random start."""
    gen = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, vocab, (size, 1), generator=gen)
    return (start + torch.arange(seq_len)) % vocab


def my_share(batch, engine):
    """This data-parallel rank's rows; the ranks of one tensor-parallel group share them."""
    dp_size, dp_rank = groups._get_data_parallel_world_size(), groups._get_data_parallel_rank()
    return batch.chunk(dp_size)[dp_rank].to(engine.device)


def persistent_bytes_per_param(engine):
    """Weights + masters + Adam moments on this rank, each storage counted once."""
    optimizer = engine.optimizer
    seen, total = set(), 0
    tensors = [p.ds_tensor for p in engine.module.parameters()]
    tensors += list(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    for state in optimizer.optimizer.state.values():
        tensors += [v for k, v in state.items() if k in MOMENTS]
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.device)
        if t.numel() and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total / sum(p.ds_tensor.numel() for p in engine.module.parameters())


def memory_mb_per_rank():
    """Each rank's memory: accelerator memory in use, or the process's resident set on the CPU."""
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        used = psutil.Process().memory_info().rss
    else:
        used = accelerator.memory_allocated()
    mine = torch.tensor([used / 2**20], dtype=torch.float64, device=accelerator.current_device_name())
    every = [torch.zeros_like(mine) for _ in range(deepspeed.comm.get_world_size())]
    deepspeed.comm.all_gather(every, mine)
    return [int(t.item()) for t in every]


def mean_over_ranks(value, engine):
    total = torch.tensor([value], dtype=torch.float64, device=engine.device)
    deepspeed.comm.all_reduce(total)
    return total.item() / deepspeed.comm.get_world_size()


def dump_state(engine, out_dir, label, step):
    """Write every parameter's fp32 master and Adam moments (this rank's TP shard, gathered over data
    parallelism) and the optimizer's step counts to out_dir/label.rank<r>.pt, for checking a resume."""
    params = {}
    for name, param in engine.module.named_parameters():
        entry = {"fp32": safe_get_full_fp32_param(param).clone()}
        for key in MOMENTS:
            try:
                value = safe_get_full_optimizer_state(param, key)
            except KeyError:  # a fresh optimizer has no moments before its first step
                value = None
            entry[key] = None if value is None else value.clone()
        params[name] = entry
    step_counts = sorted(float(s["step"]) for s in engine.optimizer.optimizer.state.values() if "step" in s)
    tp_size = groups.get_tensor_model_parallel_world_size() if engine.autotp_size() > 1 else 1
    tp_rank = groups.get_tensor_model_parallel_rank() if tp_size > 1 else 0
    os.makedirs(out_dir, exist_ok=True)
    torch.save(dict(params=params, step=step, optimizer_steps=step_counts, tp_rank=tp_rank, tp_size=tp_size),
               os.path.join(out_dir, f"{label}.rank{deepspeed.comm.get_rank()}.pt"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="train until this global step")
    parser.add_argument("--global-batch", type=int, help="samples per step over all ranks (default: the config's)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="AutoTP tensor-parallel size")
    parser.add_argument("--save-dir", help="save checkpoints here (tag global_step<N>)")
    parser.add_argument("--save-at",
                        type=int,
                        action="append",
                        help="step to save after (repeatable; "
                        "default: the last step)")
    parser.add_argument("--resume", metavar="DIR", help="resume from the checkpoint in DIR")
    parser.add_argument("--tag", help="checkpoint tag to resume (default: DIR/latest, or latest_universal)")
    parser.add_argument("--resume-mode", choices=RESUME_MODES, default="full")
    parser.add_argument("--universal",
                        action="store_true",
                        help="DIR holds a universal checkpoint "
                        "(ds_to_universal): resume at any data/tensor-parallel layout")
    parser.add_argument("--dump-state",
                        metavar="DIR",
                        help="write masters, moments and steps after loading "
                        "and at each save, for checking a resume bit for bit")
    parser.add_argument("--metrics", metavar="FILE", help="append one JSON line per step (rank 0)")
    parser.add_argument("--progress",
                        choices=("auto", "always", "never"),
                        default="auto",
                        help="progress bar over the steps (auto: when stderr is a terminal)")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser, args):
    """Refuse bad flags before any process group or model exists."""
    if not args.deepspeed_config:
        parser.error("--deepspeed_config is required (see examples/configs/)")
    if not os.path.isfile(args.deepspeed_config):
        parser.error(f"--deepspeed_config {args.deepspeed_config}: no such file")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.tp < 1 or args.heads % args.tp or (args.heads // 2) % args.tp:
        parser.error(f"--tp {args.tp} must divide --heads {args.heads} and its key/value heads {args.heads // 2}")
    if args.save_at and not args.save_dir:
        parser.error("--save-at needs --save-dir")
    if args.save_at and not all(0 < s <= args.steps for s in args.save_at):
        parser.error(f"--save-at {args.save_at}: each step must be in 1..--steps ({args.steps})")
    if not args.resume and (args.tag or args.universal or args.resume_mode != "full"):
        parser.error("--tag, --universal and --resume-mode need --resume DIR")
    if args.resume:
        args.tag = resume_tag(parser, args)


def resume_tag(parser, args):
    """The tag to resume: --tag, or the one the `latest` (universal: `latest_universal`) file names."""
    if not os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume}: no such directory")
    tags = sorted(e.name for e in os.scandir(args.resume) if e.is_dir())
    tag = args.tag
    if tag is None:
        latest = os.path.join(args.resume, "latest_universal" if args.universal else "latest")
        if not os.path.isfile(latest):
            parser.error(f"--resume {args.resume}: no {os.path.basename(latest)} file; pass --tag (found: {tags})")
        with open(latest) as f:
            tag = f.read().strip()
    if tag not in tags:
        parser.error(f"--resume {args.resume}: no checkpoint tagged {tag!r} (found: {tags})")
    universal = os.path.isdir(os.path.join(args.resume, tag, "zero"))
    if universal != args.universal:
        parser.error(f"{args.resume}/{tag} is {'a universal' if universal else 'a rigid'} checkpoint: "
                     f"{'add' if universal else 'drop'} --universal")
    return tag


def deepspeed_config(args, world_size):
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.global_batch:
        dp_size = world_size // args.tp
        accumulation = config.get("gradient_accumulation_steps", 1)
        if args.global_batch % (dp_size * accumulation):
            sys.exit(f"--global-batch {args.global_batch} is not a multiple of data-parallel size {dp_size} "
                     f"x gradient_accumulation_steps {accumulation}")
        config.pop("train_batch_size", None)
        config["train_micro_batch_size_per_gpu"] = args.global_batch // (dp_size * accumulation)
    if args.tp > 1:
        config["tensor_parallel"] = {"autotp_size": args.tp}
    if args.universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


def resume(engine, args):
    """Load the checkpoint; returns the step it was saved at."""
    kwargs = RESUME_MODES[args.resume_mode]
    load_path, client_state = engine.load_checkpoint(args.resume, tag=args.tag, **kwargs)
    if load_path is None:
        sys.exit(f"rank {deepspeed.comm.get_rank()}: could not load {args.resume}/{args.tag}")
    return (client_state or {}).get("step", engine.global_steps)


class Log:
    """Per-step lines on rank 0, through the progress bar when there is one."""

    def __init__(self, args, first_step, rank):
        self.rank = rank
        show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
        self.bar = tqdm(total=args.steps, initial=first_step, disable=rank != 0 or not show, unit="step")
        self.metrics = args.metrics if rank == 0 else None

    def step(self, record):
        if self.rank == 0:
            mem = "/".join(str(m) for m in record["memory_mb"])
            line = (f"step {record['step']} loss {record['loss']:.4f} time {record['time_s']:.2f}s "
                    f"mem {mem} MB (per rank) state {record['bytes_per_param']:.2f} B/param (rank 0)")
            if self.bar.disable:
                print(line, flush=True)
            else:
                self.bar.write(line)
            if self.metrics:
                with open(self.metrics, "a") as f:
                    f.write(json.dumps(record) + "\n")
        self.bar.update(1)

    def close(self):
        self.bar.close()


def train_step(engine, args, step):
    start = time.perf_counter()
    size = engine.train_micro_batch_size_per_gpu() * groups._get_data_parallel_world_size()
    ids = my_share(global_batch(step, size, args.seq_len, args.vocab), engine)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return dict(step=step,
                loss=mean_over_ranks(loss.item(), engine),
                time_s=time.perf_counter() - start,
                memory_mb=memory_mb_per_rank(),
                bytes_per_param=persistent_bytes_per_param(engine))


def main():
    args = parse_args()
    deepspeed.init_distributed()
    config = deepspeed_config(args, deepspeed.comm.get_world_size())
    model = tiny_llama(args)
    if config.get("bf16", {}).get("enabled"):
        model = model.to(torch.bfloat16)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = deepspeed.comm.get_rank()
    done = 0
    if args.resume:
        done = resume(engine, args)
        if rank == 0:
            print(f"resumed {args.resume}/{args.tag} ({args.resume_mode}) at step {done}", flush=True)
        if args.dump_state:
            dump_state(engine, args.dump_state, f"loaded-step{done}", done)
    save_at = set(args.save_at or ([args.steps] if args.save_dir else []))
    log = Log(args, done, rank)
    losses = []
    for step in range(done + 1, args.steps + 1):
        record = train_step(engine, args, step)
        losses.append(record["loss"])
        log.step(record)
        if step in save_at:
            engine.save_checkpoint(args.save_dir, client_state={"step": step})
            if args.dump_state:
                dump_state(engine, args.dump_state, f"saved-step{step}", step)
    log.close()
    if not all(torch.isfinite(torch.tensor(losses))):  # the same mean losses on every rank
        sys.exit(f"non-finite loss: {losses}")
    leave_process_group(engine)


def leave_process_group(engine):
    """Every rank releases the engine (a decoupled checkpoint writer commits its last save here), waits for the
    others, destroys the process group and leaves with os._exit(0), skipping the interpreter's finalization.
    DeepSpeed's engine is never freed (its module hooks keep it alive) and holds its gloo groups, so their worker
    threads outlive destroy_process_group; torn down during finalization, they can abort a rank with `terminate
    called without an active exception` (SIGABRT). Only after a successful run, every file closed: after an error
    the peers may be in another collective, and the barrier would hang."""
    engine.destroy()
    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
