# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A ZeRO-3 run saved without tensor parallelism resumes through a universal checkpoint at TP1 and
under AutoTP, with every saved tensor restored bit for bit; a folder that cannot be this model is
refused on every rank, by name, before anything is loaded."""

import os
import shutil

import pytest
import torch

import deepspeed.comm as dist
from unit.common import DistributedTest
from unit.checkpoint.universal_zero3_helpers import (MLP_PARTITION_CONFIG, TinyMLPBlocks, assert_restored_bitwise,
                                                     assert_same_state, batches, edit_state_file, full_state,
                                                     make_config, new_engine, rewrite_as_bare_tensors,
                                                     save_and_convert, step_counts, tiny_llama, token_batches, train,
                                                     train_lm)


def mlp_engine(tp_size, load_universal=False, seed=1):
    torch.manual_seed(seed)
    return new_engine(TinyMLPBlocks(), make_config(tp_size, load_universal, MLP_PARTITION_CONFIG))


def saved_mlp_run(save_dir, data):
    """Train 4 steps under ZeRO-3 without TP, save and convert. Returns the saved state, its step
    counts, the universal tag and the loss of one more step taken by the run that did not stop."""
    engine = mlp_engine(tp_size=1, seed=0)
    train(engine, data[:4])
    saved, saved_steps = full_state(engine), step_counts(engine)
    tag = save_and_convert(engine, save_dir)
    reference_loss = train(engine, data[4:])
    return saved, saved_steps, tag, reference_loss


class TestZero3UniversalIntoAutoTP(DistributedTest):
    world_size = 2

    # DP2 -> TP2 from the folder as converted is the first stop of test_layout_round_trip.
    @pytest.mark.parametrize("tp_size, file_format", [
        (1, "converted"),
        (1, "bare_0198"),
        (2, "bare_0198"),
    ])
    def test_restore_bitwise_and_resume(self, tmpdir, tp_size, file_format):
        """DP2 -> TP1 x DP2 and DP2 -> TP2, from the folder as converted and from the bare tensors
        that 0.19.8's converter writes for ZeRO-3 without TP."""
        data = batches(5)
        saved, saved_steps, tag, reference_loss = saved_mlp_run(str(tmpdir), data)
        if file_format == "bare_0198":
            rewrite_as_bare_tensors(str(tmpdir), tag)

        resumed = mlp_engine(tp_size, load_universal=True)
        # The weights alone first (the load_optimizer_states=False path), then everything.
        resumed.load_checkpoint(str(tmpdir), tag=tag, load_optimizer_states=False)
        assert_restored_bitwise(resumed, saved, saved_steps, keys=["fp32"])
        resumed.load_checkpoint(str(tmpdir), tag=tag)
        assert_restored_bitwise(resumed, saved, saved_steps)
        assert train(resumed, data[4:]) == pytest.approx(reference_loss, rel=1e-6)

    def test_hf_llama_restores_bitwise_under_autotp(self, tmpdir):
        """A tiny random Llama trained under ZeRO-3 DP2 restores bit for bit into AutoTP TP2, with
        AutoTP matching the layers itself."""
        data = token_batches(5)
        engine = new_engine(tiny_llama(seed=0), make_config())
        train_lm(engine, data[:4])
        saved, saved_steps = full_state(engine), step_counts(engine)
        tag = save_and_convert(engine, str(tmpdir))
        reference_loss = train_lm(engine, data[4:])

        resumed = new_engine(tiny_llama(seed=1), make_config(tp_size=2, load_universal=True))
        resumed.load_checkpoint(str(tmpdir), tag=tag)
        assert assert_restored_bitwise(resumed, saved, saved_steps) >= 14  # q/k/v/o, gate/up/down per layer
        assert train_lm(resumed, data[4:]) == pytest.approx(reference_loss, rel=1e-5)

    def test_bad_folder_refused_on_every_rank(self, tmpdir):
        """Wrong element count, wrong shape, a missing state file, and a problem only one rank can
        see: every rank raises an error naming the parameter, the shapes and the folder, and the
        engine keeps the state it had."""
        save_dir = str(tmpdir)
        _, _, tag, _ = saved_mlp_run(save_dir, batches(5))
        engine = mlp_engine(tp_size=2, load_universal=True)
        train(engine, batches(1))
        before, steps_before = full_state(engine), step_counts(engine)
        name = "blocks.0.up_proj.weight"
        cases = [
            ("fp32", lambda t: t.flatten()[:-1].clone(), ["(511,)", "(32, 16)"]),
            ("exp_avg", lambda t: t.reshape(16, 32).clone(), ["(16, 32)", "(32, 16)"]),
            ("exp_avg_sq", None, ["exp_avg_sq", "missing"]),
        ]
        for state, edit, expected_text in cases:
            bad_tag = f"bad_{state}"
            if dist.get_rank() == 0:
                shutil.copytree(os.path.join(save_dir, tag), os.path.join(save_dir, bad_tag))
            dist.barrier()
            edit_state_file(save_dir, bad_tag, name, state, edit)
            with pytest.raises((ValueError, FileNotFoundError)) as error:
                engine.load_checkpoint(save_dir, tag=bad_tag)
            message = str(error.value)
            for text in [name, os.path.join(save_dir, bad_tag)] + expected_text:
                assert text in message, message
            assert_same_state(before, full_state(engine))
            assert step_counts(engine) == steps_before

        # Only rank 1 is pointed at a bad folder: rank 0 must not load alone, nor wait forever.
        tag_for_rank = tag if dist.get_rank() == 0 else "bad_fp32"
        with pytest.raises((ValueError, RuntimeError)) as error:
            engine.load_checkpoint(save_dir, tag=tag_for_rank)
        if dist.get_rank() == 0:
            assert "another rank" in str(error.value), str(error.value)
        assert_same_state(before, full_state(engine))


class LayoutRoundTripPhases:
    """The stops of DP -> TP2 -> DP. Each runs in fresh ranks, as a resumed job would: DeepSpeed's
    parallel groups are process-global, so one process cannot go back from TP2 to TP1."""

    def save_dp(self, save_dir):
        data = batches(5)
        saved, saved_steps, tag, reference_loss = saved_mlp_run(save_dir, data)
        if dist.get_rank() == 0:
            torch.save(dict(saved=saved, steps=saved_steps, tag=tag, loss=reference_loss),
                       os.path.join(save_dir, "expected.pt"))
        dist.barrier()

    def tp2(self, save_dir):
        expected = torch.load(os.path.join(save_dir, "expected.pt"), weights_only=False)
        engine = mlp_engine(tp_size=2, load_universal=True)
        engine.load_checkpoint(save_dir, tag=expected["tag"])
        assert_restored_bitwise(engine, expected["saved"], expected["steps"])
        save_and_convert(engine, save_dir, tag="from_tp2")
        assert train(engine, batches(5)[4:]) == pytest.approx(expected["loss"], rel=1e-6)

    def back_to_dp(self, save_dir):
        expected = torch.load(os.path.join(save_dir, "expected.pt"), weights_only=False)
        engine = mlp_engine(tp_size=1, load_universal=True)
        engine.load_checkpoint(save_dir, tag="from_tp2_universal")
        assert_restored_bitwise(engine, expected["saved"], expected["steps"])
        assert train(engine, batches(5)[4:]) == pytest.approx(expected["loss"], rel=1e-6)


PHASES = ("save_dp", "tp2", "back_to_dp")


def next_phase(save_dir):
    """The phase this launch runs: the first one not recorded as done in save_dir."""
    done_file = os.path.join(save_dir, "phases_done")
    done = open(done_file).read().split() if os.path.exists(done_file) else []
    return PHASES[len(done)]


def record_phase_done(save_dir, phase):
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(save_dir, "phases_done"), "a") as f:
            f.write(phase + "\n")
    dist.barrier()


# At 4 ranks: DP4 -> TP2 x DP2 -> DP4, the layout change users make (about two minutes on 2 cores).
class TestLayoutRoundTrip(DistributedTest):
    exec_timeout = 300

    # Three launches of the same world size, one per phase (the harness runs a list of world sizes in turn).
    @pytest.mark.parametrize("world_size", [pytest.param([2] * 3, id="dp2"), pytest.param([4] * 3, id="dp4")])
    def test_layout_round_trip(self, tmpdir, world_size):
        """DP -> TP2 -> DP through two conversions (DP2 -> TP2 -> DP2, DP4 -> TP2xDP2 -> DP4): bit for bit at each
        stop, and after each the same loss as the run that did not stop."""
        save_dir = str(tmpdir)
        phase = next_phase(save_dir)
        getattr(LayoutRoundTripPhases(), phase)(save_dir)
        record_phase_done(save_dir, phase)
