"""Sweeps on SLURM: a Hydra multirun through the slurm launcher (one job array) and slurm/array.sbatch through
the submit script. Every job runs a few real training steps."""

import filecmp
import glob
import json
import math
import os
import shlex
import subprocess
import sys

import yaml

from fsdp_research.metrics.sinks import read_records
from tests.conftest import FAST, ROOT
from tests.helpers.cli import finish, read_metrics, start
from tests.slurm.cluster import wait_done

STEPS = 3


def _check_job(run_dir: str, ranks: int) -> None:
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["status"] == "completed", run_dir
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), run_dir
    assert all(math.isfinite(m["loss"]) for m in metrics), run_dir
    with open(os.path.join(run_dir, "train.log")) as f:
        assert f"on {ranks} rank(s)" in f.read(), run_dir


def test_optuna_search_through_the_slurm_launcher(jobs, tmp_path):
    """hydra/sweeper=optuna with the slurm launcher: 2 trials as one array of 2 jobs x 2 tasks, each job's ranks
    from SLURM, each job in its own dir of the sweep, each trial's value in the study (read through Optuna) its
    job's final eval loss; the same command again finds the study complete and submits nothing. (The launcher's
    array is the same for the basic sweeper's jobs: tests/jobs/test_search.py runs that sweeper locally.)"""
    import optuna

    sweep = tmp_path / "search"
    jobs.logs += [f"{sweep}/.submitit/*/*_log.*", f"{sweep}/*/train.log"]
    command = [
        "-m",
        "hydra/launcher=slurm",
        "hydra.launcher.tasks_per_node=2",
        f"hydra.launcher.name={jobs.name}",
        *FAST,
        f"trainer.max_steps={STEPS}",
        f"trainer.eval_interval={STEPS}",
        "trainer.eval_batches=1",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "optim.lr=tag(log, interval(1e-4, 1e-2))",
        f"hydra.sweep.dir={sweep}",
    ]
    result = finish(start(command, str(tmp_path)), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    array_jobs = {os.path.basename(d).split("_")[0] for d in glob.glob(f"{sweep}/.submitit/*_*")}
    assert len(array_jobs) == 1, f"expected one job array, found {array_jobs}"
    study = optuna.load_study(study_name="fsdp_research", storage=f"sqlite:///{sweep}/optuna.db")
    assert len(study.trials) == 2
    for trial in study.trials:
        job = str(sweep / str(trial.number))
        _check_job(job, ranks=2)
        evals = [row["eval_loss"] for row in read_records(job) if "eval_loss" in row]
        assert trial.state == optuna.trial.TrialState.COMPLETE and trial.value == evals[-1]
    again = finish(start(command, str(tmp_path)), timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {os.path.basename(d).split("_")[0] for d in glob.glob(f"{sweep}/.submitit/*_*")} == array_jobs


def test_array_script(jobs, tmp_path):
    """slurm/array.sbatch through the submit script: line i (comments and blank lines skipped) runs as task i in
    outputs/slurm/<array job id>/<i>/, with the script copied beside it."""
    lines = [
        [*FAST, f"trainer.max_steps={STEPS}", "trainer.seed=0"],
        # A quoted value with a space must reach the job as one override.
        [*FAST, f"trainer.max_steps={STEPS}", "sharding=ddp", "logger.name=run two"],
    ]
    override_file = tmp_path / "sweep.txt"
    override_file.write_text("# two jobs\n\n" + "\n\n# next\n".join(shlex.join(line) for line in lines) + "\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fsdp_research",
            "submit",
            str(override_file),
            "--parallel",
            "2",
            "--",
            f"--job-name={jobs.name}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    array_job = result.stdout.split()[3].rstrip(":")
    sweep = tmp_path / "outputs" / "slurm" / array_job
    jobs.logs += [f"{sweep}/*/slurm.out"]

    ended = wait_done(array_job, tasks=2, timeout=300)
    assert set(ended.values()) == {"COMPLETED"}, ended
    for task, line in enumerate(lines):
        run_dir = sweep / str(task)
        _check_job(str(run_dir), ranks=1)
        assert yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) == line
        assert filecmp.cmp(run_dir / "array.sbatch", os.path.join(ROOT, "slurm", "array.sbatch"), shallow=False)
        assert (run_dir / "resubmit.sh").exists()
