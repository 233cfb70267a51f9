"""Sweeps that search and resume, as a user runs them: `python train.py -m ...` in a process of its own
(the local launcher runs the jobs in it), Optuna's study read back through Optuna, a real SIGKILL of the launcher
and its job and a real SIGTERM, then the same command run again with hydra.sweep.dir=<its dir>. The faulted
sweeps and one bad sweep start a real interpreter; the rest are forked from the suite's forkserver."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from fsdp_research.cli.report import main as report
from tests.conftest import FAST
from tests.helpers.cli import read_metrics
from tests.helpers.faults import Launch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 6
# A resume checkpoint every 2 steps: a job killed during step 5 resumes from step 4.
SHORT = [*FAST, f"trainer.max_steps={STEPS}", "checkpoint.interval=2", "checkpoint.export=true"]
# One eval, at the end: the objective.
EVAL = ["trainer.eval_interval=6", "trainer.eval_batches=1"]


def _fault(signal: str, job: int, step: int, marker: str) -> list[str]:
    return [
        "+callbacks.fault._target_=tests.helpers.plugins.SweepFault",
        f"+callbacks.fault.step={step}",
        f"+callbacks.fault.job={job}",
        f"+callbacks.fault.signal={signal}",
        f"+callbacks.fault.marker={marker}",
    ]


def _sweep(tmp_path, name: str, overrides: list[str]):
    """The sweep command in <tmp>/<name>/ with its sweep dir <tmp>/<name>/sweep; returns (command, sweep dir)."""
    sweep = str(tmp_path / name / "sweep")
    return ["-m", *overrides, f"hydra.sweep.dir={sweep}"], sweep


def _run(tmp_path, name: str, command: list[str], timeout: float = 300, real: bool = False):
    """The command's run to its end; forked from the suite's forkserver unless `real` (its launch is the point:
    the faults' signals reach a real interpreter, and one bad sweep's exit code is a real process's)."""
    return Launch(str(tmp_path / name), command, forked=not real).finish(timeout)


def _trials(sweep: str) -> list:
    """The study's trials as Optuna reads them back (imported here: 2 s of every collection of the suite)."""
    import optuna

    study = optuna.load_study(study_name="fsdp_research", storage=f"sqlite:///{sweep}/optuna.db")
    return sorted(study.trials, key=lambda t: t.number)


def _job_overrides(job_dir: str) -> list[str]:
    return list(OmegaConf.load(os.path.join(job_dir, ".hydra", "overrides.yaml")))


def _reference(tmp_path, job_dir: str) -> Launch:
    """The same job (its recorded overrides, without the fault), run once without a break, in <tmp>/reference."""
    overrides = [o for o in _job_overrides(job_dir) if not o.startswith("+callbacks.fault")]
    return Launch(str(tmp_path / "reference"), [*overrides, f"hydra.run.dir={tmp_path / 'reference'}"], forked=True)


def _assert_resumed_exactly(job_dir: str, reference) -> None:
    """The job, killed after its step-4 checkpoint and run again, ends as the reference (the same job run once
    without a break) ends: the steps after the checkpoint's losses and the exported weights, bitwise."""
    assert reference.returncode == 0, reference.stderr[-2000:]
    resumed = {row["step"]: row["loss"] for row in read_metrics(job_dir)}
    once = {row["step"]: row["loss"] for row in reference.metrics()}
    assert sorted(resumed) == sorted(once) == list(range(1, STEPS + 1))
    assert [resumed[s] for s in (5, 6)] == [once[s] for s in (5, 6)]
    mine = load_file(os.path.join(job_dir, "export", "model.safetensors"))
    theirs = load_file(os.path.join(reference.run_dir, "export", "model.safetensors"))
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def _evals(job_dir: str) -> list[float]:
    """The job's eval losses, as its metrics.jsonl holds them."""
    with open(os.path.join(job_dir, "metrics.jsonl")) as f:
        return [row["eval_loss"] for row in map(json.loads, f) if "eval_loss" in row]


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_optuna_search_of_four_trials(tmp_path, capsys):
    """4 trials on the local launcher, one searched value failing its job: Optuna holds each job's final eval loss
    (read here from the job's metrics.jsonl) or FAIL; optimization_results.yaml names the best; the report adds
    the trial table, the best trial and the objective plots."""
    command, sweep = _sweep(
        tmp_path,
        "search",
        [
            *SHORT,
            *EVAL,
            "checkpoint.interval=0",
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=4",
            "optim.lr=tag(log, interval(1e-4, 1e-2))",
            # 16 is not a multiple of 5: those trials fail their job's config check.
            "trainer.micro_batch_size=choice(8, 5)",
        ],
    )
    result = _run(tmp_path, "search", command)
    trials = _trials(sweep)
    assert len(trials) == 4
    states = {t.state.name for t in trials}
    assert states == {"COMPLETE", "FAIL"}, trials
    for trial in trials:
        job = os.path.join(sweep, str(trial.number))
        assert f"optim.lr={trial.params['optim.lr']}" in _job_overrides(job)
        if trial.params["trainer.micro_batch_size"] == 5:
            assert trial.state.name == "FAIL"
            continue
        assert trial.state.name == "COMPLETE" and trial.value == _evals(job)[-1]
    # A failed trial fails the sweep at its end, after every trial ran.
    assert result.returncode == 1 and "did not complete" in result.stderr
    best = min((t for t in trials if t.value is not None), key=lambda t: t.value)
    results = OmegaConf.load(os.path.join(sweep, "optimization_results.yaml"))
    assert results.best_trial == best.number and results.best_value == best.value
    assert dict(results.best_params) == best.params
    assert report([sweep]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("trial "))
    assert lines[header].split() == ["trial", "state", "eval_loss", "optim.lr", "trainer.micro_batch_size"]
    rows = [line.split() for line in lines[header + 1 : header + 5]]
    assert [(int(r[0]), r[1]) for r in rows] == [(t.number, t.state.name.lower()) for t in trials]
    assert lines[header + 5].startswith(f"best trial: {best.number} (minimize eval_loss: {best.value:.6g})")
    assert os.path.getsize(os.path.join(sweep, "report.png")) > 0


@pytest.mark.parametrize("search", [False, True], ids=["grid", "optuna"])
def test_a_killed_sweep_continues_where_it_stopped(tmp_path, search):
    """3 jobs; the launcher and its job SIGKILLed during step 5 of job 1; the same command again: job 0 untouched
    (its metrics.jsonl's bytes), job 1 resumed from its step-4 checkpoint to exactly where it ends unbroken, job 2
    run. For Optuna the study holds 3 complete trials, each with its job's eval loss."""
    marker = str(tmp_path / "killed")
    space = (
        ["hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "optim.lr=interval(1e-3, 1e-2)"]
        if search
        else ["trainer.seed=0,1,2"]
    )
    command, sweep = _sweep(tmp_path, "sweep", [*SHORT, *EVAL, *space, *_fault("SIGKILL", 1, 5, marker)])
    killed = _run(tmp_path, "sweep", command, real=True)
    assert killed.returncode == -9 and os.path.exists(marker), killed.stderr[-2000:]
    assert not os.path.exists(os.path.join(sweep, "2"))
    first = _bytes(os.path.join(sweep, "0", "metrics.jsonl"))

    # Not beside the re-run: two trainings on two cores take twice as long as one after the other.
    reference = _reference(tmp_path, os.path.join(sweep, "1")).finish()
    again = _run(tmp_path, "sweep", command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"sweep dir: {sweep}; after a crash, the same command with hydra.sweep.dir={sweep}" in killed.stdout
    assert f"continuing the sweep in {sweep}" in again.stdout
    assert "job 0 completed earlier: not run again" in again.stdout or search
    assert _bytes(os.path.join(sweep, "0", "metrics.jsonl")) == first
    _assert_resumed_exactly(os.path.join(sweep, "1"), reference)
    assert [r["step"] for r in read_metrics(os.path.join(sweep, "2"))] == list(range(1, STEPS + 1))
    if search:
        trials = _trials(sweep)
        assert [t.state.name for t in trials] == ["COMPLETE"] * 3
        assert all(t.value == _evals(os.path.join(sweep, str(t.number)))[-1] for t in trials)


def test_a_signal_stops_the_sweep_and_the_rerun_continues(tmp_path):
    """SIGTERM to the launcher's group during job 0 of 2: the job saves and the sweep ends there (143, job 1 never
    started), saying how to continue; the same command then resumes job 0 and runs job 1. A report of the sweep
    reads one sweep."""
    marker = str(tmp_path / "signalled")
    command, sweep = _sweep(tmp_path, "sweep", [*SHORT, "trainer.seed=0,1", *_fault("SIGTERM", 0, 3, marker)])
    stopped = _run(tmp_path, "sweep", command, real=True)
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    assert f"re-run the same command with hydra.sweep.dir={sweep}" in stopped.stderr
    assert not os.path.exists(os.path.join(sweep, "1"))
    assert [r["step"] for r in read_metrics(os.path.join(sweep, "0"))] == [1, 2, 3]

    again = _run(tmp_path, "sweep", command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [r["step"] for r in read_metrics(os.path.join(sweep, "0"))] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_metrics(os.path.join(sweep, "1"))] == list(range(1, STEPS + 1))
    assert report([sweep]) == 0


def test_a_diverged_trial_is_told_failed_and_the_search_continues(tmp_path):
    """A learning rate that makes the loss nan: the trial's job completes with a nan eval loss, which Optuna is
    told as a failed trial (not a value, which it refuses); the same command again continues the study."""
    command, sweep = _sweep(
        tmp_path,
        "nan",
        [
            *FAST,
            "trainer.max_steps=2",
            "trainer.eval_interval=2",
            "trainer.eval_batches=1",
            "hydra/sweeper=optuna",
            "hydra.sweeper.n_trials=1",
            "optim.lr=interval(1e6, 1e7)",
        ],
    )
    first = _run(tmp_path, "nan", command)
    assert first.returncode == 0, first.stderr[-2000:]
    assert [t.state.name for t in _trials(sweep)] == ["FAIL"]
    assert "trial 0 failed (no finite eval_loss)" in first.stdout
    assert f"the sweep is done; its table and plots: fsdp-research report {sweep}" in first.stdout
    again = _run(tmp_path, "nan", command)
    assert again.returncode == 0 and f"continuing the sweep in {sweep}" in again.stdout, again.stderr[-2000:]
    assert [t.state.name for t in _trials(sweep)] == ["FAIL"]


def test_bad_sweeps_fail_in_one_line_before_any_job(tmp_path):
    """A searched key the config lacks, a metric the jobs do not log (or under trainer.objective, its deprecated
    name), one whose direction is not given, a sweep dir another command made: one line, exit 2, no job run."""
    _, sweep = _sweep(tmp_path, "made", [])
    os.makedirs(sweep)
    basic = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    OmegaConf.save(
        OmegaConf.create(
            {"hydra": {"overrides": {"task": ["trainer.seed=0,1", "optim.lr=0.01"]}, "sweeper": {"_target_": basic}}}
        ),
        os.path.join(sweep, "multirun.yaml"),
    )
    cases = {
        "key": (["hydra/sweeper=optuna", *EVAL, "trainer.nope=interval(0.1, 0.2)"], "trainer.nope cannot be searched"),
        "metric": (["hydra/sweeper=optuna", "optim.lr=interval(1e-3, 1e-2)"], "logs no eval metrics"),
        # The deprecated name is still read.
        "old_name": (
            ["hydra/sweeper=optuna", "optim.lr=interval(1e-3, 1e-2)", "trainer.objective=eval_loss"],
            "trainer.objective: is eval_loss, but trainer.eval_interval=0 logs no eval metrics",
        ),
        # Any metrics.jsonl key, its direction given where the framework does not know it.
        "direction": (
            ["hydra/sweeper=optuna", *EVAL, "optim.lr=interval(1e-3, 1e-2)", "trainer.sweep_metric=eval_rewards/acc"],
            "trainer.sweep_metric=eval_rewards/acc is not a metric whose direction the framework knows",
        ),
        "resume": (["trainer.seed=0,1"], "it had optim.lr=0.01"),
        "resume_as_search": (
            ["trainer.seed=0,1", "optim.lr=0.01", "hydra/sweeper=optuna", *EVAL],
            f"hydra.sweeper._target_ was {basic}, is hydra_plugins.fsdp_research_sweeper",
        ),
        "grid_sampler": (
            [
                "hydra/sweeper=optuna",
                *EVAL,
                "optim.lr=choice(0.01, 0.02)",
                "+hydra.sweeper.sampler._partial_=true",
                "hydra.sweeper.sampler._target_=optuna.samplers.GridSampler",
            ],
            "GridSampler is not supported",
        ),
    }
    launched = {}
    for name, (overrides, _) in cases.items():  # all at once: each is refused before any job
        command, sweep_dir = _sweep(tmp_path, name, [*FAST, *overrides])
        if name.startswith("resume"):
            command[-1] = f"hydra.sweep.dir={sweep}"
            sweep_dir = sweep
        launched[name] = (Launch(str(tmp_path / name), command, forked=name != "key"), sweep_dir)
    for name, (launch, sweep_dir) in launched.items():
        result, expected = launch.finish(), cases[name][1]
        errors = result.error_lines()
        assert result.returncode == 2 and len(errors) == 1 and expected in errors[0], (name, result.stderr[-2000:])
        assert not os.path.exists(os.path.join(sweep_dir, "0")), name
