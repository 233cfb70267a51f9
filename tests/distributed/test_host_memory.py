"""A CPU rank keeps the host memory a step frees for the next step: glibc otherwise handed a step's activations,
freed at the top of its heap, back to the OS, and the next step faulted them in again page by page (12k minor faults
a step, 4% of the issue case's step: docs/benchmarks/overhead.md). Checked by what the kernel counts: the minor
page faults of taking again 48 MiB just freed, round after round, in a rank as the trainer starts it. (A bare
process is left to chance: some runs of this test saw it fault all 12k pages every round, others none, by what
happened to lie at the top of its heap; its figures are in the failure message.)"""

import resource

import pytest
import torch
from omegaconf import OmegaConf

from fsdp_research.config.schema import typed
from fsdp_research.distributed.processes import init_distributed
from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.dist import run_distributed

pytestmark = pytest.mark.distributed

PAGES = 48 * 2**20 // 4096


def _faults_taking_again(container: dict | None) -> list[int]:
    """Minor faults of each of 6 rounds of making, writing and freeing 48 tensors of 1 MiB (a step's activations)."""
    if container is not None:
        init_distributed(typed(container).distributed, torch.device("cpu"))
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        tensors = [torch.ones(2**18) for _ in range(48)]
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del tensors
    return faults


@pytest.mark.slow  # processes of its own (~7 s)
def test_a_rank_takes_freed_memory_again_without_faulting_it_in():
    rank = OmegaConf.to_container(compose(FAST), resolve=True)
    kept = run_distributed(_faults_taking_again, 1, rank)
    bare = run_distributed(_faults_taking_again, 1, None)
    assert max(kept[3:]) < PAGES // 10, (kept, bare)
