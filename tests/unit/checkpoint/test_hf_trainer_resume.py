# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""ZeRO-3 resumes the way most users reach them: Hugging Face's Trainer with a model from `from_pretrained` (built
under deepspeed.zero.Init, as Trainer's ZeRO-3 config makes it) and a PEFT LoRA adapter, saved by
Trainer's checkpointing at one data-parallel size and resumed with `train(resume_from_checkpoint=...)` at another.

The state right after Trainer's load (each trainable parameter's fp32 master, both Adam moments, the optimizer's step
counts, the lr scheduler and Trainer's global step) must equal, bit for bit, the state the first run had when it
saved. For a PEFT model Trainer saves with exclude_frozen_parameters=True and loads with load_module_strict=False: the
frozen base weights are not in the checkpoint, and must keep the values `from_pretrained` gave them.

A test runs two launches (upstream's world_size lists): the first trains and saves, the second resumes. The model is
a tiny random Llama written to a local folder, so nothing is downloaded."""

import os

import pytest
import torch

import deepspeed.comm as dist
from unit.checkpoint.zero_resume_helpers import assert_same, masters, moments, weights
from unit.common import DistributedTest

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SAVE_STEP = 3
SAMPLES, SEQ_LEN, VOCAB = 24, 8, 64
DS_CONFIG = {
    "zero_optimization": {
        "stage": 3
    },  # DeepSpeed's defaults otherwise
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "steps_per_print": 10**6,
    "bf16": {
        "enabled": "auto"
    },  # Trainer's bf16 flag: bf16 weights with fp32 masters
}


def tiny_llama(folder):
    """A random 2-layer Llama saved where from_pretrained reads it (once, by rank 0)."""
    if dist.get_rank() == 0 and not os.path.isdir(folder):
        config = transformers.LlamaConfig(vocab_size=VOCAB,
                                          hidden_size=16,
                                          intermediate_size=32,
                                          num_hidden_layers=2,
                                          num_attention_heads=2,
                                          num_key_value_heads=2,
                                          max_position_embeddings=SEQ_LEN)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    dist.barrier()
    return folder


class TokenDataset(torch.utils.data.Dataset):

    def __init__(self):
        gen = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (SAMPLES, SEQ_LEN), generator=gen)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, index):
        return dict(input_ids=self.ids[index], labels=self.ids[index])


def optimizer_steps(engine):
    return [float(state["step"]) for state in engine.optimizer.optimizer.state.values() if "step" in state]


def trainer_state(trainer):
    """What a resume must restore, gathered the same way on every rank (collectives: call on every rank)."""
    engine = trainer.model_wrapped
    return dict(masters=masters(engine),
                moments=moments(engine),
                optimizer_steps=optimizer_steps(engine),
                weights=weights(engine),
                lr_scheduler=trainer.lr_scheduler.state_dict(),
                global_step=trainer.state.global_step)


class KeepState(transformers.TrainerCallback):
    """trainer_state at the save (the state saved) or at the start of the resumed training, right after Trainer's
    load (the state loaded)."""

    def __init__(self, when):
        self.when, self.trainer, self.state = when, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.when == "loaded":
            self.state = trainer_state(self.trainer)

    def on_save(self, args, state, control, **kwargs):
        if self.when == "saved" and state.global_step == SAVE_STEP:
            self.state = trainer_state(self.trainer)


def run_trainer(model_dir, output_dir, lora, when, max_steps, resume_from=None, bf16=False):
    args = transformers.TrainingArguments(output_dir=output_dir,
                                          bf16=bf16,
                                          per_device_train_batch_size=2,
                                          max_steps=max_steps,
                                          save_steps=SAVE_STEP,
                                          save_strategy="steps",
                                          learning_rate=1e-2,
                                          lr_scheduler_type="linear",
                                          warmup_steps=2,
                                          logging_steps=10**6,
                                          report_to=[],
                                          use_cpu=True,
                                          deepspeed=DS_CONFIG,
                                          seed=0)
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    assert all(hasattr(param, "ds_id") for param in model.parameters()), "not built under zero.Init"
    if lora:
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    keep = KeepState(when)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[keep])
    keep.trainer = trainer
    trainer.train(resume_from_checkpoint=resume_from)
    return keep


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full_fine_tune"])
class TestTrainerResumeAtAnotherSize(DistributedTest):
    world_size = 2

    @pytest.mark.world_size([2, 1])
    def test_2_to_1(self, class_tmpdir, tmp_path, lora):
        self.resumes(str(class_tmpdir), str(tmp_path), lora, saved_world=2)

    @pytest.mark.world_size([1, 2])
    def test_1_to_2(self, class_tmpdir, tmp_path, lora):
        self.resumes(str(class_tmpdir), str(tmp_path), lora, saved_world=1)

    @staticmethod
    def resumes(shared_dir, output_dir, lora, saved_world, bf16=False):
        model_dir = tiny_llama(os.path.join(shared_dir, "tiny-llama"))
        reference = os.path.join(output_dir, "saved_state.pt")
        if dist.get_world_size() == saved_world:
            kept = run_trainer(model_dir, output_dir, lora, "saved", max_steps=SAVE_STEP, bf16=bf16)
            if dist.get_rank() == 0:
                torch.save(kept.state, reference)
            dist.barrier()
            return
        saved = torch.load(reference, weights_only=False)
        checkpoint = os.path.join(output_dir, f"checkpoint-{SAVE_STEP}")
        kept = run_trainer(model_dir,
                           output_dir,
                           lora,
                           "loaded",
                           max_steps=SAVE_STEP + 1,
                           resume_from=checkpoint,
                           bf16=bf16)
        engine = kept.trainer.model_wrapped
        assert engine.bfloat16_enabled() == bf16 and engine.zero_optimization_stage() == 3
        loaded = kept.state
        # every weight: the trainable ones as saved, the frozen base weights (never trained, left out of a LoRA
        # checkpoint) as from_pretrained gave them in both runs
        for key in ("masters", "moments", "weights"):
            assert_same(loaded[key], saved[key], key)
        assert loaded["optimizer_steps"] == saved["optimizer_steps"] and saved["optimizer_steps"]
        assert loaded["lr_scheduler"] == saved["lr_scheduler"]
        assert loaded["global_step"] == saved["global_step"] == SAVE_STEP
        if lora:
            assert len(loaded["masters"]) == 8 and all("lora_" in name for name in loaded["masters"])


class TestTrainerLoraResumeBf16(DistributedTest):
    """Trainer's bf16 (bf16 weights, fp32 masters), LoRA, 2 -> 1."""
    world_size = 2

    @pytest.mark.world_size([2, 1])
    def test_2_to_1(self, class_tmpdir, tmp_path):
        TestTrainerResumeAtAnotherSize.resumes(str(class_tmpdir), str(tmp_path), lora=True, saved_world=2, bf16=True)
