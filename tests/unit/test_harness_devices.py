# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The harness skips, with the reason, the multi-rank tests a node cannot run (tests/unit/common.py):
off the CPU every rank needs a device of its own. Runs here without any accelerator."""

from types import SimpleNamespace

import pytest

from unit import common
from unit.common import device_shortfall


@pytest.mark.parametrize("accelerator, devices, world_size, local_size, expected", [
    ("cpu", 0, 4, 2, None),
    ("cuda", 2, 2, 2, None),
    ("cuda", 8, 4, 4, None),
    ("cuda", 1, 2, 2, "needs 2 cuda devices, one per rank; this node has 1"),
    ("cuda", 0, 1, 1, "needs 1 cuda devices, one per rank; this node has 0"),
    ("cuda", 8, 4, 2, "simulates 2 nodes on one machine"),
])
def test_device_shortfall(accelerator, devices, world_size, local_size, expected):
    reason = device_shortfall(accelerator, devices, world_size, local_size)
    if expected is None:
        assert reason is None
    else:
        assert reason.startswith(expected)


class _TwoRanks(common.DistributedTest):  # not collected: the name does not start with Test
    world_size = 2

    def test_body(self):
        pass


def _request(funcargs=None):
    return SimpleNamespace(node=SimpleNamespace(funcargs=funcargs or {}, get_closest_marker=lambda name: None),
                           function=SimpleNamespace(__name__="test_body"),
                           path=__file__)


def test_one_gpu_node_skips_a_two_rank_test_before_starting_ranks(monkeypatch):
    monkeypatch.setattr(common, "_accelerator_devices", lambda: ("cuda", 1))
    monkeypatch.setattr(common, "run_ranks", lambda spec, timeout: pytest.fail("ranks were started"))
    with pytest.raises(pytest.skip.Exception, match="needs 2 cuda devices, one per rank; this node has 1"):
        _TwoRanks()(_request())


def test_enough_devices_start_the_ranks(monkeypatch):
    started = []
    monkeypatch.setattr(common, "_accelerator_devices", lambda: ("cuda", 2))
    monkeypatch.setattr(common, "run_ranks", lambda spec, timeout: started.append(spec["world_size"]))
    _TwoRanks()(_request())
    assert started == [2]


def test_a_world_size_list_launches_each_size_in_turn(monkeypatch):
    """Upstream's idiom, kept: a list of world sizes runs the test once per entry, in order (e.g. 4 ranks save a
    checkpoint that 2 ranks then load); the process group times out well before the test does."""
    launched = []
    monkeypatch.setattr(common, "_accelerator_devices", lambda: ("cpu", 1))
    monkeypatch.setattr(
        common, "run_ranks", lambda spec, timeout: launched.append(
            (spec["world_size"], spec["local_size"], spec["pg_timeout_s"], timeout)))
    _TwoRanks()(_request(funcargs=dict(world_size=[4, 2])))
    timeout = _TwoRanks.exec_timeout
    assert launched == [(4, 4, common.default_pg_timeout(timeout), timeout),
                        (2, 2, common.default_pg_timeout(timeout), timeout)]
    assert common.default_pg_timeout(600) == 200 and common.default_pg_timeout(60) == 30


class TestClassTmpdir(common.DistributedTest):
    """Upstream's class_tmpdir: one folder shared by the class's tests, passed to the ranks."""
    world_size = 1

    def test_first_writes(self, class_tmpdir):
        class_tmpdir.join("shared.txt").write("from the first test")

    def test_second_reads(self, class_tmpdir):
        assert class_tmpdir.join("shared.txt").read() == "from the first test"
