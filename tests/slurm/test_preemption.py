"""Preemption on SLURM: a run of slurm/train.sbatch (2 tasks) is signalled twice, once through the batch shell
(scancel --signal=USR2 --batch, which the script forwards) and once straight to its tasks. Each time the ranks
save a checkpoint at the step they stopped at and requeue the job; it resumes in the same run dir and ends with
the same weights as an uninterrupted run."""

import os
import re
import subprocess

import torch
from safetensors.torch import load_file

from tests.conftest import FAST, ROOT
from tests.helpers.cli import finish, read_metrics, start
from tests.slurm.cluster import states, wait_done, wait_for

# Enough steps that the run is still going when signalled; no periodic checkpoint, only the preemption saves.
STEPS = 150
OVERRIDES = [
    *FAST,
    f"trainer.max_steps={STEPS}",
    "checkpoint.interval=1000",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
]
SIGNALS = (["--batch"], [])


def _logged_steps(run_dir: str) -> int:
    try:
        return len(read_metrics(run_dir))
    except (OSError, ValueError):  # not written yet, or a line half written
        return 0


def test_preempted_run_resumes_to_the_same_weights(jobs, tmp_path):
    job = jobs.sbatch(["--ntasks-per-node=2", os.path.join(ROOT, "slurm", "train.sbatch"), *OVERRIDES], str(tmp_path))
    run_dir = str(tmp_path / "outputs" / "slurm" / job)
    jobs.logs.append(f"{run_dir}/slurm.out")
    log = os.path.join(run_dir, "train.log")
    stopped_at = []
    baseline = None
    for restart, signal_args in enumerate(SIGNALS):
        first = stopped_at[-1] + 3 if stopped_at else 3  # a few steps of this incarnation
        wait_for(
            f"step {first} of incarnation {restart}", lambda: _logged_steps(run_dir) >= first, timeout=180, interval=0.3
        )
        subprocess.run(["scancel", "--signal=USR2", *signal_args, job], check=True)
        stop = wait_for(
            "the preemption checkpoint",
            lambda: re.findall(r"preemption signal \(SIGUSR2\): stopped after step (\d+)", open(log).read())[restart:],
            timeout=60,
        )
        stopped_at.append(int(stop[0]))
        assert stopped_at[-1] >= first
        assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{stopped_at[-1]}"))
        if baseline is None:  # the uninterrupted run, locally on 2 processes, while the job waits in the queue
            baseline = start(
                [*OVERRIDES, "distributed.nproc_per_node=2", f"hydra.run.dir={tmp_path}/baseline"], str(tmp_path)
            )
    ended = wait_done(job, tasks=1, timeout=240)
    assert ended == {job: "COMPLETED"}
    assert states(job)[job] == ["REQUEUED", "REQUEUED", "COMPLETED"]

    text = open(log).read()
    for step in stopped_at:
        assert f"resumed from checkpoint {run_dir}/checkpoints/step_{step}" in text
    assert f"job {job} (restart {len(SIGNALS)})" in open(os.path.join(run_dir, "slurm.out")).read()  # SLURM's count
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    finished = finish(baseline, timeout=240)
    assert finished.returncode == 0, finished.stderr[-3000:]
    resumed = load_file(os.path.join(run_dir, "export", "model.safetensors"))
    expected = load_file(os.path.join(tmp_path, "baseline", "export", "model.safetensors"))
    assert resumed.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(resumed[name], tensor, rtol=0, atol=1e-6, msg=name)
