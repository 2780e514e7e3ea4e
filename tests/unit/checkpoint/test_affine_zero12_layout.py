# Copyright (c) DeepSpeed Team.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The ZeRO-1/2 flat-group layout as affine maps, checked against stage_1_and_2 itself.

``zero_flat_layout`` restates arithmetic that lives inline in ``DeepSpeedZeroOptimizer.__init__``,
so a test that restated it again would check the code against a copy of itself. Two independent
references are used instead: offsets worked out by hand from reading ``__init__`` (the derivation
is in each case's comment), and a real ``DeepSpeedZeroOptimizer`` built in a subprocess under
torch's fake process group at world sizes 2, 3 and 4, whose own ``round_robin_bit16_offsets``,
``round_robin_bit16_indices``, ``partition_size`` and flat buffers are compared with the layout.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from deepspeed.checkpoint.affine import ZERO_NCCL_START_ALIGNMENT_FACTOR, zero_flat_layout, zero_flat_param_maps
from deepspeed.checkpoint.affine_transfer import plan_transfer
from unit.checkpoint.affine_plan_helpers import apply_plan

# (numels, requires_grad, world_size, element_size, parameter_alignment, round_robin) -> (offsets, partition)
HAND_WORKED = [
    # Plain concatenation: 0, 5, 9; 11 elements padded to a multiple of 2 * 3 = 12, so 4 per rank.
    (([5, 4, 2], None, 3, 2, False, False), ([0, 5, 9], 4)),
    # #8280's case: the zero-element parameter is dropped before the round robin, leaving 3, 5, 7.
    # Round robin over 2 ranks takes positions 0, 2 then 1: 3, 7, 5 -> 3 at 0, 7 at 3, 5 at 10;
    # 15 elements padded to a multiple of 4 is 16, 8 per rank. Round-robining the raw list would
    # put 5 at 3 and 7 at 8.
    (([3, 0, 5, 7], None, 2, 2, False, True), ([0, None, 10, 3], 8)),
    # The same under parameter_alignment with 2-byte elements: 16 // gcd(16, 2) = 8 after every
    # parameter but the last: 3 at 0 (pad to 8), 7 at 8 (pad to 16), 5 at 16; 21 -> 24, 12 per rank.
    (([3, 0, 5, 7], None, 2, 2, True, True), ([0, None, 16, 8], 12)),
    # fp32 parameters align to 16 // 4 = 4: 3 at 0 (to 4), 7 at 4 (to 12), 5 at 12; 17 -> 20, 10 each.
    (([3, 0, 5, 7], None, 2, 4, True, True), ([0, None, 12, 4], 10)),
    # A frozen first parameter is dropped before the round robin too: the optimized list is the
    # second and third, which round robin keeps in order: 0 and 4; 8 elements, 4 per rank.
    (([4, 4, 4], [False, True, True], 2, 2, False, True), ([None, 0, 4], 4)),
    # Four ranks, round robin over six parameters: positions 0, 4, 1, 5, 2, 3 -> numels 1, 5, 2, 6,
    # 3, 4 at 0, 1, 6, 8, 14, 17; 21 elements padded to a multiple of 8 is 24, 6 per rank.
    (([1, 2, 3, 4, 5, 6], None, 4, 2, False, True), ([0, 6, 14, 17, 1, 8], 6)),
]


@pytest.mark.parametrize('arguments,expected', HAND_WORKED, ids=[str(case[0]) for case in HAND_WORKED])
def test_zero_flat_layout_matches_hand_worked_offsets(arguments, expected):
    numels, requires_grad, world_size, element_size, parameter_alignment, round_robin = arguments
    assert zero_flat_layout(numels, world_size, element_size, parameter_alignment, round_robin,
                            requires_grad) == expected


_OPTIMIZER_SCRIPT = r'''
import json, sys
import torch, torch.distributed as torch_dist
from torch.testing._internal.distributed.fake_pg import FakeStore
world_size = int(sys.argv[1])
torch_dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
import deepspeed.comm as dist
dist.init_distributed(dist_backend='gloo', auto_mpi_discovery=False)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
results = []
for case in json.loads(sys.argv[2]):
    groups = []
    for numels, flags in case['groups']:
        groups.append([torch.nn.Parameter(torch.arange(n, dtype=torch.float32).to(getattr(torch, case['dtype'])),
                                          requires_grad=flag) for n, flag in zip(numels, flags)])
    params = [param for group in groups for param in group]
    optimizer = DeepSpeedZeroOptimizer(torch.optim.SGD([{'params': group} for group in groups], lr=0.1),
                                       param_names={param: str(index) for index, param in enumerate(params)},
                                       timers=None, optimizer_params={}, dp_process_group=torch_dist.group.WORLD,
                                       round_robin_gradients=case['round_robin'],
                                       parameter_alignment=case['parameter_alignment'])
    out = {'nccl': optimizer.nccl_start_alignment_factor, 'groups': []}
    for index, group in enumerate(groups):
        trainable = optimizer.bit16_groups[index]
        offsets = []
        for param in group:
            position = next((k for k, held in enumerate(trainable) if held is param), None)
            offsets.append(None if position is None else
                           optimizer.round_robin_bit16_offsets[index][optimizer.round_robin_bit16_indices[index][position]])
        out['groups'].append({'offsets': offsets, 'partition': optimizer.partition_size[index],
                              'flat': optimizer.bit16_groups_flat[index].float().tolist()})
    results.append(out)
print('RESULT' + json.dumps(results))
'''

GROUPS = [
    ([3, 0, 5, 7, 1, 9], [True, True, False, True, True, True]),
    ([4, 6, 2, 13], [True, True, True, False]),
    ([11, 2, 8, 5, 1], [True] * 5),
]
CASES = [{
    'groups': GROUPS,
    'dtype': dtype,
    'round_robin': round_robin,
    'parameter_alignment': alignment
} for dtype in ('bfloat16', 'float32') for round_robin in (False, True) for alignment in (False, True)]

# Launcher and harness variables that would make the subprocess's DeepSpeed join (or wait for) a job's ranks, e.g.
# the CPU accelerator's shm collectives when LOCAL_SIZE equals the fake world size.
_JOB_VARIABLES = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_SIZE', 'LOCAL_WORLD_SIZE', 'CROSS_RANK', 'CROSS_SIZE',
                  'MASTER_ADDR', 'MASTER_PORT')


def _one_process_env():
    env = {name: value for name, value in os.environ.items() if name not in _JOB_VARIABLES}
    env['DS_ACCELERATOR'] = 'cpu'
    return env


@pytest.mark.parametrize('world_size', [2, 3, 4])
def test_zero_flat_layout_is_what_a_real_deepspeed_zero_optimizer_builds(world_size):
    """A real optimizer (3 param groups, frozen and empty parameters, bf16 and fp32, round robin and
    parameter alignment on and off), built under torch's fake process group in a subprocess so no
    process group outlives it. Its flat buffer is also compared element for element, with each
    parameter's values placed where the layout says and zeros everywhere else."""
    pytest.importorskip('torch.testing._internal.distributed.fake_pg')
    run = subprocess.run([sys.executable, '-c', _OPTIMIZER_SCRIPT,
                          str(world_size), json.dumps(CASES)],
                         capture_output=True,
                         text=True,
                         env=_one_process_env(),
                         timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith('RESULT')]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    for case, built in zip(CASES, json.loads(lines[-1][len('RESULT'):])):
        assert built['nccl'] == ZERO_NCCL_START_ALIGNMENT_FACTOR
        element_size = torch.tensor([], dtype=getattr(torch, case['dtype'])).element_size()
        for (numels, flags), group in zip(case['groups'], built['groups']):
            offsets, partition = zero_flat_layout(numels, world_size, element_size, case['parameter_alignment'],
                                                  case['round_robin'], flags)
            assert (offsets, partition) == (group['offsets'], group['partition']), case
            expected = torch.zeros(partition * world_size)
            for numel, offset in zip(numels, offsets):
                if offset is not None:
                    expected[offset:offset + numel] = torch.arange(numel, dtype=torch.float32)
            assert torch.tensor(group['flat']).tolist() == expected.tolist(), case


def _flat_partitions(params, requires_grad, world_size, element_size, parameter_alignment, round_robin):
    """Each rank's flat partition, laid out from the offsets the hand-worked cases pin down."""
    offsets, partition = zero_flat_layout([param.numel() for param in params], world_size, element_size,
                                          parameter_alignment, round_robin, requires_grad)
    flat = torch.zeros(partition * world_size)
    for param, offset in zip(params, offsets):
        if offset is not None:
            flat[offset:offset + param.numel()] = param
    return [flat[rank * partition:(rank + 1) * partition].clone() for rank in range(world_size)]


@pytest.mark.parametrize('round_robin', [False, True])
@pytest.mark.parametrize('parameter_alignment', [False, True])
@pytest.mark.parametrize('degrees', [(4, 2), (2, 4), (4, 3), (3, 5)],
                         ids=lambda degrees: f'{degrees[0]}to{degrees[1]}')
def test_zero_flat_reshard_moves_every_parameter_to_its_new_place(degrees, parameter_alignment, round_robin):
    """Per-parameter plans, executed into narrowed views of the target partitions, give the target
    layout exactly; padding stays zero, frozen and empty parameters are in no map."""
    source_degree, target_degree = degrees
    numels = [3, 0, 5, 7, 1, 9, 16, 2]
    requires_grad = [True, True, True, False, True, True, True, True]
    params = [torch.randn(numel) for numel in numels]
    sources = _flat_partitions(params, requires_grad, source_degree, 2, parameter_alignment, round_robin)
    expected = _flat_partitions(params, requires_grad, target_degree, 2, parameter_alignment, round_robin)
    targets = [torch.zeros_like(buffer) for buffer in expected]
    source_maps = zero_flat_param_maps(numels, source_degree, 2, parameter_alignment, round_robin, requires_grad)
    target_maps = zero_flat_param_maps(numels, target_degree, 2, parameter_alignment, round_robin, requires_grad)
    for numel, flag, source, target in zip(numels, requires_grad, source_maps, target_maps):
        if not (flag and numel):
            assert source is None and target is None
            continue
        (source_map, source_bases), (target_map, target_bases) = source, target
        source_map.validate_coverage()
        plan = plan_transfer(target_map, source_map)
        apply_plan(plan, {
            rank: sources[rank].narrow(0, base, source_map.shard_shapes[rank][0])
            for rank, base in source_bases.items()
        }, {
            rank: targets[rank].narrow(0, base, target_map.shard_shapes[rank][0])
            for rank, base in target_bases.items()
        })
    for rank in range(target_degree):
        assert torch.equal(targets[rank], expected[rank])


@pytest.mark.parametrize('arguments', [([1], 0, 2), ([1], 2, 0), ([1, -1], 2, 2)])
def test_zero_flat_layout_refuses_impossible_input(arguments):
    with pytest.raises(ValueError):
        zero_flat_layout(*arguments)
    with pytest.raises(ValueError, match='requires_grad'):
        zero_flat_layout([1, 2], 2, 2, requires_grad=[True])
