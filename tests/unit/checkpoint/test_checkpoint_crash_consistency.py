# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""A rank killed (SIGKILL) at any moment of save_checkpoint costs at most that save: a load of `latest` restores
the checkpoint saved before or the new one, complete and bit for bit, never an error or a mix of the two.

DistributedTest cannot survive a killed rank, so these tests launch their ranks themselves: this file runs as a
script in 2 processes (CPU accelerator, gloo), each of which imports DeepSpeed once and forks a child per trial.
In a trial both ranks train, save tag "a", train one more step and save again, tag "b" or "a" once more, while one
rank kills itself at a seeded point of that save (its k-th Python call, k a seeded fraction of the calls of a
whole save) or before its n-th rename (where a save commits). A fresh pair of children per trial then loads
`latest` and compares the masters, both Adam moments and the step counts with what each save held. Every child
is killed after TRIAL_TIMEOUT_S, so a rank that hangs fails its trial instead of the session."""

import datetime
import glob
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="forks rank processes after importing torch")

TESTS_DIR = Path(__file__).resolve().parents[2]
TRIAL_TIMEOUT_S = 30  # per child (a job takes about a second); a whole launch gets LAUNCH_TIMEOUT_S
LAUNCH_TIMEOUT_S = 600
# (stage, precision): DeepSpeed's defaults first (ZeRO-3, fp32, default persistence threshold).
CELLS = [(3, "fp32"), (3, "bf16"), (2, "bf16"), (1, "fp32"), (0, "fp32")]
# Kill points, as fractions of a save's Python calls: a seeded draw from each third of it.
POINTS = [random.Random(third).uniform(third / 3, (third + 1) / 3) for third in range(3)]


def _trials():
    """The first cell: each rank killed at each point of a save of a new tag and of the tag `latest` names, and
    rank 0 (the rank that publishes) killed before each rename of either save. The other cells: rank 1 killed
    midway through a save of a new tag."""
    stage, precision = CELLS[0]
    first = [
        dict(stage=stage, precision=precision, second_tag=second_tag, victim=victim, point=point)
        for second_tag in ("b", "a") for victim in (0, 1) for point in POINTS
    ] + [
        dict(stage=stage, precision=precision, second_tag=second_tag, victim=0, rename=rename)
        for second_tag, renames in (("b", 3), ("a", 5)) for rename in range(1, renames + 1)
    ]
    others = [
        dict(stage=stage, precision=precision, second_tag="b", victim=1, point=POINTS[1])
        for stage, precision in CELLS[1:]
    ]
    # The fast checkpoint engine (its Python file writer), synchronous like the default one. (Under ZeRO-1/2 without
    # an mpu, 0.19.8's fast engine fails before saving: its writer factory reads a missing dp_rank.)
    fast = dict(stage=3, precision="fp32", second_tag="a", victim=1, point=POINTS[1], writer=dict(type="python"))
    return first + others + [fast]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(jobs, workdir, world_size=2):
    """Run the jobs ({"name": ..., "run": "save" | "load" | ..., ...}) one after another in `world_size` ranks,
    each in a child forked per rank; returns {(job name, rank): result} from the children's RESULT lines."""
    for job in jobs:
        job["port"] = _free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ,
                   RANK=str(rank),
                   LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1",
                   CROSS_RANK="0",
                   CROSS_SIZE="1",
                   DS_ACCELERATOR="cpu",
                   PYTHONPATH=os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
        for name in ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):  # no LOCAL_SIZE: no shm collectives
            env.pop(name, None)
        with open(os.path.join(workdir, f"rank{rank}.log"), "w") as log:
            procs.append(
                subprocess.Popen([sys.executable, __file__, json.dumps(jobs)], env=env, stdout=log, stderr=log))
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
    results = {}
    for rank in range(world_size):
        for line in Path(workdir, f"rank{rank}.log").read_text().splitlines():
            if line.startswith("RESULT "):
                name, result = json.loads(line[len("RESULT "):])
                results[name, rank] = result
    return results


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """Every trial's save (with a kill), then its load of `latest`; then, at 1 rank, a save under a tag that a
    trial left saved or half-saved at 2 ranks; saves to a save_dir that each rank sees apart (as without a shared
    file system), and under a tag per rank; and saves with the decoupled engine and with DataStates. Returns the
    trials and {(job name, rank): result}."""
    workdir = tmp_path_factory.mktemp("killed_saves")
    trials = _trials()
    for i, trial in enumerate(trials):
        trial["dir"] = str(workdir / f"trial{i}")
    resaved = next(t for t in trials if t["stage"] == 3 and t["victim"] == 1 and t.get("point") == POINTS[2])
    jobs = [dict(t, name=f"save{i}", run="save") for i, t in enumerate(trials)]
    jobs += [dict(t, name=f"load{i}", run="load") for i, t in enumerate(trials)]
    jobs += [
        dict(resaved, name="resave", run="resave", world_size=1, env=dict(WORLD_SIZE="1")),
        # Each rank the local rank 0 of a node of its own, with a save_dir of its own.
        dict(stage=3, precision="fp32", dir=str(workdir / "unshared"), name="unshared", env=dict(LOCAL_RANK="0")),
        # One node: a save_dir per rank, then a tag per rank.
        dict(stage=3, precision="fp32", dir=str(workdir / "per_rank"), name="per_rank"),
        dict(stage=3, precision="fp32", dir=str(workdir / "decoupled"), name="decoupled"),
        dict(stage=3, precision="fp32", dir=str(workdir / "datastates"), name="datastates"),
        dict(stage=3, precision="fp32", dir=str(workdir / "file_system"), name="file_system"),
        dict(stage=3, precision="fp32", dir=str(workdir / "same_again"), name="same_again"),
        # Each rank the first of a node of its own, with node-local storage
        dict(stage=3, precision="fp32", dir=str(workdir / "node_local"), name="node_local", env=dict(LOCAL_RANK="0")),
    ]
    results = _launch(jobs, str(workdir))
    # Then, in the trial killed between the renames of its re-save of "a": tag "a" loaded by name, and the next save
    results.update(_launch([dict(_between_renames(trials), name="tidy", run="tidy")], str(workdir)))
    return dict(trials=trials, resaved=resaved, workdir=workdir, results=results)


def _between_renames(trials):
    """The trial whose publisher was killed after moving the re-saved tag's folder aside (a.old) and before renaming
    the new one (a.new) into its place."""

    def left(trial):
        ckpt = os.path.join(trial["dir"], "ckpt")
        return sorted(n for n in os.listdir(ckpt) if n.startswith("a")) if os.path.isdir(ckpt) else []

    found = [t for t in trials if "rename" in t and left(t) == ["a.new", "a.old"]]
    assert found, "no trial was killed between the renames of its re-save"
    return found[0]


def _described(trial):
    kill = f"at {trial['point']:.2f}" if "point" in trial else f"before its rename {trial['rename']}"
    engine = ", fast engine" if "writer" in trial else ""
    return (f"stage {trial['stage']} {trial['precision']}{engine}, rank {trial['victim']} killed {kill} of a save of "
            f"tag {trial['second_tag']!r}")


def test_latest_loads_the_previous_or_the_new_checkpoint_whole(killed_saves):
    trials, results = killed_saves["trials"], killed_saves["results"]
    loads = [{results.get((f"load{i}", rank), "no result") for rank in (0, 1)} for i in range(len(trials))]
    bad = [
        f"{_described(trial)}: latest loads {sorted(loaded)}" for trial, loaded in zip(trials, loads)
        if loaded not in ({"previous"}, {"new"})
    ]
    assert not bad, f"{len(bad)} of {len(trials)} trials:\n" + "\n".join(bad)


def test_saving_again_at_another_world_size_leaves_no_file_of_the_earlier_save(killed_saves):
    """A 1-rank save under the tag a 2-rank save (killed) wrote to: that tag then holds the 1-rank save's files
    only, and it loads exactly."""
    assert killed_saves["results"].get(("resave", 0)) == "new", killed_saves["results"].get(("resave", 0))
    tag_dir = os.path.join(killed_saves["resaved"]["dir"], "ckpt", killed_saves["resaved"]["second_tag"])
    assert not glob.glob(os.path.join(tag_dir, "*rank_1_*")), sorted(os.listdir(tag_dir))


def test_each_node_publishes_its_files_without_a_shared_file_system(killed_saves):
    """Each rank saves to a folder of its own, as each node of a job whose save_dir is not shared (with
    use_node_local_storage off), twice under one tag: each rank's folder then holds its second save, and nothing
    is left in a staging folder."""
    results = [killed_saves["results"].get(("unshared", rank)) for rank in (0, 1)]
    assert results == [["a"], ["a"]], results


def test_each_rank_publishes_a_save_dir_or_a_tag_of_its_own(killed_saves):
    """On one node, each rank saves to a save_dir of its own, then under a tag of its own (tag_validation warns):
    each rank's files end in its tag's folder."""
    results = [killed_saves["results"].get(("per_rank", rank)) for rank in (0, 1)]
    assert results == [[["a"], ["t0", "t1"]]] * 2, results


def test_decoupled_engines_write_into_the_tag_folder_as_before(killed_saves):
    """The decoupled engine (two saves before a step, a save then cleanup without a step) and DataStates write into
    the tags' own folders, not staged: each tag's folder holds its files and DataStates' tag loads exactly."""
    for rank in (0, 1):
        decoupled = killed_saves["results"].get(("decoupled", rank))
        assert decoupled == ["a", "b", "c", "latest"], decoupled
        datastates = killed_saves["results"].get(("datastates", rank))
        assert datastates == ["DataStatesCheckpointEngine", ["a"]], datastates


def test_a_tag_loaded_by_name_falls_back_and_the_next_save_clears_what_interrupted_saves_left(killed_saves):
    """A kill between the renames of a re-save of tag "a" left a.new and a.old without a: a load of tag "a" by name
    (as accelerate's load_state loads "pytorch_model") reads a.old, the previous save, whole. The next save, of tag
    "c", clears the leftovers of interrupted saves (a.new; a.old becomes a; a staging folder; a removal a kill cut
    short), not a folder of the user's named like one (holding a DeepSpeed file), and "a" still loads the same
    save. Interrupted saves are known by the record each leaves (.<tag>.deepspeed-save)."""
    results = [killed_saves["results"].get(("tidy", rank)) for rank in (0, 1)]
    assert results == [["previous", ["a", "c", "latest", "notes.old"], "previous"]] * 2, results


def test_each_node_names_its_saves_in_latest_with_node_local_storage(killed_saves):
    """With checkpoint.use_node_local_storage, each node (here each rank, as the first rank of a node with a save_dir
    of its own) writes `latest` in its save_dir, so a resume from `latest` loads the new save on every node: with
    only global rank 0 writing it, the other nodes find no `latest` and leave rank 0 waiting in the load. Where a
    node has no `latest` (saved so by 0.19.8), every rank refuses, naming the way out."""
    results = [killed_saves["results"].get(("node_local", rank)) for rank in (0, 1)]
    assert results == ["new", "new"], results


def test_saving_a_tag_again_unchanged_writes_no_second_copy(killed_saves):
    """A save of tag "a", then another of "a" with nothing trained between (as Hugging Face's Trainer saves a ZeRO-3
    checkpoint twice under one tag): the second links each of the tag's files (same inode) instead of writing a
    second copy beside it; after a step, a save of "a" writes new files; `latest` loads it exactly."""
    results = [killed_saves["results"].get(("same_again", rank)) for rank in (0, 1)]
    assert results == [[True, False, "new"]] * 2, results


def test_saves_sync_as_configured_and_complete_where_folders_cannot_be_renamed(killed_saves):
    """checkpoint.sync_files (default true) decides whether a save calls fsync; on a file system that refuses to
    rename folders (EXDEV, as gcsfuse's default and some FUSE mounts refuse), a re-save of tag "a" still completes,
    file by file, with one warning, and `latest` loads it exactly with no staging folder left; with
    checkpoint.staged_save false a save writes into its tag's folder and renames none, as 0.19.8 does."""
    results = [killed_saves["results"].get(("file_system", rank)) for rank in (0, 1)]
    assert results == [[True, 0, "new", ["a", "latest"], True]] * 2, results


# ----- the ranks -------------------------------------------------------------------------------------------------


def _state(engine):
    """Masters, Adam moments (gathered: alike on every rank), this rank's optimizer step counts and the engine's."""
    from unit.checkpoint.zero_resume_helpers import masters, moments, steps
    params = dict(engine.module.named_parameters())
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in params.values()):
        return dict(masters=masters(engine),
                    moments=moments(engine),
                    steps=steps(engine),
                    global_steps=engine.global_steps)
    state = engine.optimizer.state  # no ZeRO, fp32: the parameters are the masters
    return dict(masters={
        n: p.detach().clone()
        for n, p in params.items()
    },
                moments={
                    n: {
                        k: state[p][k].clone()
                        for k in ("exp_avg", "exp_avg_sq")
                    }
                    for n, p in params.items()
                },
                steps=steps(engine),
                global_steps=engine.global_steps)


def _engine(job, writer=None, **config):
    import deepspeed
    from unit.checkpoint.zero_resume_helpers import make_config, make_engine
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=TRIAL_TIMEOUT_S * 2 // 3))
    config = dict(make_config(job["stage"], job["precision"]), **config)
    if writer:
        config["checkpoint"] = {"writer": writer}
    return make_engine(config)


def _calls(fn):
    """The number of Python calls fn() makes."""
    count = [0]

    def profile(frame, event, arg):
        count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def _kill_at(calls=None, rename=None):
    """SIGKILL this process at its `calls`-th Python call from now, or as it calls os.rename or os.replace for
    the `rename`-th time."""
    count = [0]

    def profile(frame, event, arg):
        if calls is not None or (event == "c_call" and arg in (os.rename, os.replace)):
            count[0] += 1
        if count[0] >= (calls or rename):
            os.kill(os.getpid(), signal.SIGKILL)

    sys.setprofile(profile)


def _save(job):
    """Save tag "a", train a step, save job["second_tag"] with the victim killed at job["point"] of that save
    (or before its job["rename"]-th rename)."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import train
    save_dir = os.path.join(job["dir"], "ckpt")
    engine = _engine(job, job.get("writer"))
    train(engine, 2)
    engine.save_checkpoint(os.path.join(job["dir"], "warmup"), tag="a")  # a first save also imports modules
    previous = _state(engine)
    calls = _calls(lambda: engine.save_checkpoint(save_dir, tag="a"))
    train(engine, 1)
    torch.save(dict(previous=previous, new=_state(engine)), os.path.join(job["dir"], f"expected{dist.get_rank()}.pt"))
    dist.barrier()
    if dist.get_rank() == job["victim"]:
        _kill_at(calls=int(job["point"] * calls) if "point" in job else None, rename=job.get("rename"))
    engine.save_checkpoint(save_dir, tag=job["second_tag"])
    sys.setprofile(None)
    return "saved"


def _resave(job):
    """At 1 rank, save under the tag the 2-rank trial saved last, then load `latest`: "new" if exact."""
    from unit.checkpoint.zero_resume_helpers import assert_same, train
    save_dir = os.path.join(job["dir"], "ckpt")
    engine = _engine(job)
    train(engine, 1)
    saved = _state(engine)
    engine.save_checkpoint(save_dir, tag=job["second_tag"])
    resumed = _engine(job)
    resumed.load_checkpoint(save_dir)
    assert_same(_state(resumed), saved)
    return "new"


def _decoupled(job):
    """The decoupled engine: save tags "a" and "b" before a step, train a step, save "c" and clean up without one.
    Returns the save_dir's listing, where each tag's folder holds this rank's optimizer file."""
    from unit.checkpoint.zero_resume_helpers import train
    save_dir = os.path.join(job["dir"], "ckpt")
    engine = _engine(job, dict(type="python", decoupled=True))
    train(engine, 1)
    engine.save_checkpoint(save_dir, tag="a")
    engine.save_checkpoint(save_dir, tag="b")
    train(engine, 1)
    engine.save_checkpoint(save_dir, tag="c")
    engine.checkpoint_engine.cleanup()
    return [name for name in sorted(os.listdir(save_dir)) if name == "latest" or _own_files(save_dir, name)]


def _own_files(save_dir, tag):
    import deepspeed.comm as dist
    return glob.glob(os.path.join(save_dir, tag, f"*rank_{dist.get_rank()}_*optim_states.pt"))


def _datastates(job):
    """DataStates (a stand-in for its module: synchronous torch.save) saves tag "a": returns the engine's name and
    the tags whose folders hold this rank's files, after checking that "a" loads exactly."""
    import types
    from unit.checkpoint.zero_resume_helpers import assert_same, train

    class StandIn:

        def __init__(self, config, rank):
            pass

        def save(self, state_dict, path):
            torch.save(state_dict, path)

        def load(self, path, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=False)

        def wait(self, persist=True):
            pass

    sys.modules["datastates"] = types.SimpleNamespace(CheckpointEngine=StandIn)
    engine = _engine(job, datastates_ckpt={})
    train(engine, 2)
    saved = _state(engine)
    save_dir = os.path.join(job["dir"], "ckpt")
    engine.save_checkpoint(save_dir, tag="a")
    train(engine, 1)
    resumed = _engine(job, datastates_ckpt={})
    resumed.load_checkpoint(save_dir, tag="a")
    assert_same(_state(resumed), saved)
    return [
        type(engine.checkpoint_engine).__name__, [t for t in sorted(os.listdir(save_dir)) if _own_files(save_dir, t)]
    ]


def _unshared(job):
    """Each rank saves tag "a" twice, a step apart, to a save_dir of its own, as if on a node that does not share
    it. Returns the save_dir's entries named a* if "a" holds the second save, else the step it holds."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import train
    engine = _engine(job)
    save_dir = os.path.join(job["dir"], f"rank{dist.get_rank()}")
    for _ in range(2):
        train(engine, 1)
        engine.save_checkpoint(save_dir, tag="a")
    saved = torch.load(os.path.join(save_dir, "a", f"zero_pp_rank_{dist.get_rank()}_mp_rank_00_model_states.pt"),
                       weights_only=False)["global_steps"]
    return [t for t in sorted(os.listdir(save_dir)) if t.startswith("a")] if saved == engine.global_steps else saved


def _per_rank(job):
    """Each rank saves tag "a" to a save_dir of its own, then tag "t<rank>" to a shared one: returns the tags
    whose folders hold this rank's files in each."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import train
    engine = _engine(job)
    train(engine, 1)
    own, shared = os.path.join(job["dir"], f"rank{dist.get_rank()}"), os.path.join(job["dir"], "shared")
    engine.save_checkpoint(own, tag="a")
    engine.save_checkpoint(shared, tag=f"t{dist.get_rank()}")
    dist.barrier()
    return [[t for t in sorted(os.listdir(d)) if glob.glob(os.path.join(d, t, "*model_states.pt"))]
            for d in (own, shared)]


def _tidy(job):
    """In a trial's save_dir that a kill left holding a.new and a.old: load tag "a" by name, add leftovers (a staging
    folder, a cut-short removal) and a folder of the user's named like one, save tag "c" and load "a" again.
    Returns [what the first load loaded, the save_dir's listing after the save, what the second load loaded]."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import train
    save_dir = os.path.join(job["dir"], "ckpt")
    first = _loaded(job, tag="a")
    if dist.get_rank() == 0:  # what a save of "b" killed while writing leaves, and a folder of the user's
        for leftover in ("b.tmp", "b.removing-0123abcd", "notes.old"):
            os.makedirs(os.path.join(save_dir, leftover))
            Path(save_dir, leftover, "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"partial")
        Path(save_dir, ".b.deepspeed-save").touch()
    dist.barrier()
    engine = _engine(job)
    train(engine, 1)
    engine.save_checkpoint(save_dir, tag="c")
    dist.barrier()
    listing = [name for name in sorted(os.listdir(save_dir)) if not name.endswith(".py") and name[0] != "."]
    return [first, listing, _loaded(job, tag="a")]


def _node_local(job):
    """Each rank saves tags "a" and "b" a step apart into a save_dir of its own with node-local storage, then a fresh
    engine loads `latest`: "new" if it holds the state of "b", bit for bit."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import assert_same, train
    config = dict(checkpoint=dict(use_node_local_storage=True))
    engine = _engine(job, **config)
    save_dir = os.path.join(job["dir"], f"node{dist.get_rank()}")
    for tag in ("a", "b"):
        train(engine, 1)
        engine.save_checkpoint(save_dir, tag=tag)
    saved = _state(engine)
    resumed = _engine(job, **config)
    resumed.load_checkpoint(save_dir)
    assert_same(_state(resumed), saved)
    # A checkpoint saved where only global rank 0 wrote `latest` (0.19.8): every rank refuses, none waits
    if dist.get_rank() == 1:
        os.remove(os.path.join(save_dir, "latest"))
    dist.barrier()
    try:
        _engine(job, **config).load_checkpoint(save_dir)
        return "loaded without latest"
    except ValueError as exc:
        return "new" if "pass the tag" in str(exc) else str(exc)


def _file_system(job):
    """Save tag "a" with sync_files at its default and off, counting os.fsync calls; then save "a" again while
    os.rename refuses folders (EXDEV) and load `latest`. Returns [whether the default synced, the fsync calls with
    sync_files off, "new" if the load is exact, the save_dir's folders and files but scripts]."""
    import errno
    from unittest import mock
    from unit.checkpoint.zero_resume_helpers import assert_same, train
    save_dir = os.path.join(job["dir"], "ckpt")
    engine = _engine(job)
    train(engine, 1)
    fsyncs = []
    with mock.patch("os.fsync", side_effect=lambda fd: fsyncs.append(fd)):
        engine.save_checkpoint(save_dir, tag="a")
        synced = len(fsyncs)
        engine._config.checkpoint_sync_files = False
        engine.save_checkpoint(save_dir, tag="a")
    engine._config.checkpoint_sync_files = True
    train(engine, 1)
    rename = os.rename

    def files_only(src, dst):
        if os.path.isdir(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        rename(src, dst)

    with mock.patch("os.rename", files_only):
        engine.save_checkpoint(save_dir, tag="a")
    saved = _state(engine)
    resumed = _engine(job)
    resumed.load_checkpoint(save_dir)
    assert_same(_state(resumed), saved)
    listing = [n for n in sorted(os.listdir(save_dir)) if not n.endswith(".py")]
    # checkpoint.staged_save false: written into the tag's folder, as 0.19.8 does (renaming no folder)
    engine._config.checkpoint_staged_save = False
    folders_renamed = []

    def record_folders(src, dst):
        if os.path.isdir(src):
            folders_renamed.append(src)
        rename(src, dst)

    with mock.patch("os.rename", record_folders):
        engine.save_checkpoint(save_dir, tag="b")
    return [
        synced > 0,
        len(fsyncs) - synced, "new", listing, folders_renamed == [] and bool(_own_files(save_dir, "b"))
    ]


def _same_again(job):
    """Save tag "a" twice with no step between, then once more after a step. Returns [whether the second save's
    files (this rank's) are the first's, linked; whether the third's are; "new" if `latest` loads exactly]."""
    from unit.checkpoint.zero_resume_helpers import assert_same, train
    save_dir = os.path.join(job["dir"], "ckpt")
    engine = _engine(job)
    train(engine, 1)

    def inodes():
        return {path: os.stat(path).st_ino for path in _own_files(save_dir, "a") + _own_model_files(save_dir, "a")}

    engine.save_checkpoint(save_dir, tag="a")
    first = inodes()
    engine.save_checkpoint(save_dir, tag="a")
    linked = inodes() == first
    train(engine, 1)
    engine.save_checkpoint(save_dir, tag="a")
    relinked = any(inodes()[path] == inode for path, inode in first.items())
    saved = _state(engine)
    resumed = _engine(job)
    resumed.load_checkpoint(save_dir)
    assert_same(_state(resumed), saved)
    return [linked and len(first) == 2, relinked, "new"]


def _own_model_files(save_dir, tag):
    import deepspeed.comm as dist
    return glob.glob(os.path.join(save_dir, tag, f"zero_pp_rank_{dist.get_rank()}_*model_states.pt"))


def _load(job):
    """Load `latest`: "previous" or "new" when the state is the one of that save, bit for bit."""
    return _loaded(job)


def _loaded(job, tag=None):
    """Load `latest` (or the tag): "previous" or "new" when the state is the one of that save, bit for bit."""
    import deepspeed.comm as dist
    from unit.checkpoint.zero_resume_helpers import assert_same
    engine = _engine(job)
    engine.load_checkpoint(os.path.join(job["dir"], "ckpt"), tag=tag)
    loaded = _state(engine)
    expected = torch.load(os.path.join(job["dir"], f"expected{dist.get_rank()}.pt"), weights_only=False)
    for name in ("previous", "new"):
        try:
            assert_same(loaded, expected[name])
            return name
        except AssertionError:
            pass
    return "a mix"


def _run_job(job):
    """In a forked child: run the job, print its RESULT (or the error), and exit without cleanup."""
    os.environ.update(MASTER_PORT=str(job["port"]), **job.get("env", {}))
    os.makedirs(job["dir"], exist_ok=True)
    run = dict(save=_save,
               load=_load,
               resave=_resave,
               unshared=_unshared,
               per_rank=_per_rank,
               decoupled=_decoupled,
               datastates=_datastates,
               tidy=_tidy,
               node_local=_node_local,
               file_system=_file_system,
               same_again=_same_again)
    try:
        result = run[job.get("run", job["name"])](job)
    except BaseException as exc:  # noqa: B036 (a peer's death raises in the collective this rank waits in)
        result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    print("RESULT " + json.dumps([job["name"], result]), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _import_once():
    """Import here, before forking, what each child would import again: DeepSpeed and what its first
    initialize() imports (torch's compiler stack, for Muon's torch.compile'd kernels and the optimizers)."""
    import gc
    import importlib
    import unit.checkpoint.zero_resume_helpers  # noqa: F401
    for name in ("torch._dynamo", "torch._inductor.compile_fx", "deepspeed.runtime.zero.muon.muon_optimizer"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.freeze()  # the children's gc.collect() calls then skip what was imported here


def _serve(jobs):
    """This rank's jobs, each in a child forked from this process (which imported DeepSpeed once), killed after
    TRIAL_TIMEOUT_S."""
    _import_once()
    for job in jobs:
        if int(os.environ["RANK"]) >= job.get("world_size", 2):
            continue
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_job(job)
        deadline = time.monotonic() + TRIAL_TIMEOUT_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                print("RESULT " + json.dumps([job["name"], "timed out"]), flush=True)
                break
            time.sleep(0.02)


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
