"""The default job lost 25-30% of its speed for good after its first checkpoint (1 process, 2 CPU threads): the
save's collectives made a gloo worker thread run parallel copies, which gave it an OpenMP thread team of its own,
and GNU OpenMP, now managing more threads than there are cores, stopped letting the training thread's workers spin
between parallel regions: every region woke them from sleep. Checked here by what the kernel counts, not by time:
the voluntary context switches of a fixed parallel workload, before and after a run with saves."""

import os
import time

import pytest
import torch

from fsdp_research.jobs.compose import compose
from fsdp_research.train.trainer import train
from tests.conftest import FAST
from tests.helpers.dist import run_distributed

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for a thread team"),
]


def _switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as status:
            total += int(status.read().split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def _workload() -> int:
    """Voluntary context switches of this process's threads over 300 small parallel ops."""
    x = torch.ones(2**20)
    before = _switches()
    for _ in range(300):
        x.add_(1.0)
    return _switches() - before


def _run_with_saves(cfg, run_dir: str) -> dict:
    torch.set_num_threads(2)
    _workload()
    baseline = _workload()
    train(cfg, run_dir)
    torch.set_num_threads(2)
    # The fewest of a few: what lasts (the throttled team switched ~550 times in every one), not a moment's load
    # from another thread or process winding down (one of four counts at 130-370, seen in 4 of 6 runs).
    after = []
    for _ in range(4):
        after.append(_workload())
        time.sleep(0.2)
    return {"before": baseline, "after": min(after), "each": after}


@pytest.mark.slow  # a training with checkpoints each (~4 s)
@pytest.mark.parametrize("saves", ["sync", "async"])
def test_a_checkpoint_leaves_the_training_threads_as_they_were(tmp_path, saves):
    """Async saves write from a thread of the checkpointer's, set to one intra-op thread as it starts."""
    cfg = compose(FAST + ["trainer.max_steps=4", "checkpoint.interval=2", "trainer.global_batch_size=4",
                          "trainer.micro_batch_size=4", f"checkpoint.async={saves == 'async'}"])  # fmt: skip
    result = run_distributed(_run_with_saves, 1, cfg, str(tmp_path / "run"))
    # Without the fix: 546 switches after, none before; with it, a handful either way.
    assert result["after"] < 3 * result["before"] + 200, result
