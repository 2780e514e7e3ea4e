#!/usr/bin/env python3
# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""Fine-tune a tiny Llama with Hugging Face's Trainer under DeepSpeed ZeRO-3, checkpoint it, and resume it at
another world size.

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/configs/hf_trainer_zero3.json \\
        --output-dir out --max-steps 6 --save-steps 3
    deepspeed --num_gpus 1 examples/hf_trainer.py --deepspeed examples/configs/hf_trainer_zero3.json \\
        --output-dir out --max-steps 6 --resume out/checkpoint-3

--lora trains a PEFT LoRA adapter (Trainer then saves without the frozen base weights). The model is a random
2-layer Llama written to OUTPUT_DIR/tiny-llama and read with from_pretrained, which builds it under
deepspeed.zero.Init as for any ZeRO-3 run; the data is synthetic tokens, the same at every world size. The first
run saves OUTPUT_DIR/checkpoint-3; the second resumes it on one rank (0.19.8 refuses that resume: "The checkpoint
being loaded used a DP world size of 2 but the current world size is 1"). Runs on GPUs or, with
DS_ACCELERATOR=cpu, on the CPU accelerator (gloo; fp32: Trainer's bf16 needs a GPU).
"""

import argparse
import os

import torch

import deepspeed
import deepspeed.comm as dist


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed", required=True, help="DeepSpeed config (JSON), as Trainer's --deepspeed")
    parser.add_argument("--output-dir", required=True, help="where checkpoints (checkpoint-N) and the model go")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save-steps", type=int, default=3)
    parser.add_argument("--resume", help="a checkpoint-N folder of an earlier run, at any world size")
    parser.add_argument("--lora", action="store_true", help="train a PEFT LoRA adapter on q_proj and v_proj")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.deepspeed):
        parser.error(f"--deepspeed {args.deepspeed}: no such file")
    if args.resume and not os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume}: no such checkpoint folder (an earlier run's --output-dir/checkpoint-N)")
    return args


class SyntheticTokens(torch.utils.data.Dataset):
    """24 sequences of 8 tokens, the same at every world size."""

    def __init__(self, vocab=64, samples=24, seq_len=8):
        self.ids = torch.randint(0, vocab, (samples, seq_len), generator=torch.Generator().manual_seed(1234))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return dict(input_ids=self.ids[index], labels=self.ids[index])


def tiny_llama(folder):
    """A random tiny Llama saved where from_pretrained reads it (by rank 0, once; the same at every world size)."""
    import transformers
    if dist.get_rank() == 0 and not os.path.isdir(folder):
        torch.manual_seed(0)
        config = transformers.LlamaConfig(vocab_size=64,
                                          hidden_size=16,
                                          intermediate_size=32,
                                          num_hidden_layers=2,
                                          num_attention_heads=2,
                                          num_key_value_heads=2,
                                          max_position_embeddings=8)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    return folder


def main(argv=None):
    args = parse_args(argv)
    import transformers
    deepspeed.init_distributed()
    training_args = transformers.TrainingArguments(output_dir=args.output_dir,
                                                   per_device_train_batch_size=2,
                                                   max_steps=args.max_steps,
                                                   save_strategy="steps",
                                                   save_steps=args.save_steps,
                                                   learning_rate=1e-2,
                                                   logging_steps=1,
                                                   report_to=[],
                                                   use_cpu=deepspeed.get_accelerator().device_name() == "cpu",
                                                   deepspeed=args.deepspeed,
                                                   seed=0)
    # after TrainingArguments: from_pretrained sees ZeRO-3 and builds the model under deepspeed.zero.Init
    model = transformers.LlamaForCausalLM.from_pretrained(tiny_llama(os.path.join(args.output_dir, "tiny-llama")))
    if args.lora:
        import peft
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=SyntheticTokens())
    result = trainer.train(resume_from_checkpoint=args.resume)
    if dist.get_rank() == 0:
        resumed = f", resumed from {args.resume}" if args.resume else ""
        print(f"hf_trainer: {dist.get_world_size()} ranks, step {trainer.state.global_step}, "
              f"train loss {result.training_loss:.4f}{resumed}")


if __name__ == "__main__":
    main()
