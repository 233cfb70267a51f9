"""The real CLI, three ways: one process, the app's own workers (distributed.nproc_per_node=2) and torchrun.
Each launch is one run dir written by rank 0 only, with the same metrics (and the same losses: one code path)."""

import glob
import json
import os

import pytest
import torch
import yaml

from tests.conftest import FAST
from tests.helpers.cli import default_run_dirs, finish, read_metrics, start
from tests.helpers.wandb_history import exit_codes, history

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, EVAL_INTERVAL, SEQ_LEN, BATCH = 4, 2, 64, 8
OVERRIDES = FAST + [  # later overrides win
    f"trainer.max_steps={STEPS}",
    f"trainer.eval_interval={EVAL_INTERVAL}",
    "trainer.eval_batches=2",
    f"trainer.global_batch_size={BATCH}",
    "trainer.micro_batch_size=4",
]
LAUNCHES = ["single", "spawn", "torchrun"]
REQUIRED = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "samples_per_s",
    "samples_per_s_per_device",
    "tokens_per_s_per_device",
    "step_time_s",
    "peak_rss_gib",
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start the three launches at once (they are mostly process start-up), then wait for all of them.
    Each runs in its own cwd so that every file a launch creates can be accounted for."""
    cwds = {name: str(tmp_path_factory.mktemp(name)) for name in LAUNCHES}
    procs = {
        "single": start(OVERRIDES + [f"hydra.run.dir={cwds['single']}/run"], cwds["single"], real=True),
        # W&B where it matters: more than one rank, only rank 0 may log.
        "spawn": start(OVERRIDES + ["logger=wandb", "distributed.nproc_per_node=2"], cwds["spawn"], real=True),
        "torchrun": start(OVERRIDES + ["logger=wandb"], cwds["torchrun"], torchrun_nproc=2),
    }
    results = {name: finish(proc) for name, proc in procs.items()}
    for name, result in results.items():
        assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    return {name: (cwds[name], results[name]) for name in LAUNCHES}


def _eval_records(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "eval_loss" in r]


def _run_dir(runs, name) -> str:
    cwd, _ = runs[name]
    if name == "single":
        return os.path.join(cwd, "run")
    dirs = default_run_dirs(cwd)
    assert len(dirs) == 1, f"{name}: one run must be one dir, found {dirs}"
    return dirs[0]


@pytest.mark.parametrize("name", LAUNCHES)
def test_run_dir_and_metrics(runs, name):
    run_dir = _run_dir(runs, name)
    with open(os.path.join(run_dir, ".hydra", "config.yaml")) as f:
        assert yaml.safe_load(f)["trainer"]["max_steps"] == STEPS
    world = 1 if name == "single" else 2
    with open(os.path.join(run_dir, "train.log")) as f:
        log = f.read()
    assert f"on {world} rank(s)" in log and f"step {STEPS}/{STEPS}" in log and "summary:" in log

    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # log_interval=1: every step, once
    for m in metrics:
        assert REQUIRED <= m.keys(), REQUIRED - m.keys()
        assert "eval_loss" not in m
        assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * SEQ_LEN)
        assert m["samples_per_s_per_device"] == pytest.approx(m["samples_per_s"] / world)
        assert m["tokens_per_s_per_device"] == pytest.approx(m["tokens_per_s"] / world)
        assert m["peak_rss_gib"] > 0 and m["grad_norm"] > 0
    # Step times against the wall clock between the records (each stamped as its window closed): the steps are most
    # of it, the rest logging and the eval.
    elapsed = metrics[-1]["time"] - metrics[0]["time"]
    stepping = sum(m["step_time_s"] for m in metrics[1:])
    assert 0.5 * elapsed < stepping <= elapsed
    assert metrics[0]["lr"] == pytest.approx(3e-3 / 10)  # first warmup step
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3
    evals = _eval_records(run_dir)
    assert [e["step"] for e in evals] == list(range(EVAL_INTERVAL, STEPS + 1, EVAL_INTERVAL))
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]


@pytest.mark.parametrize("name", ["spawn", "torchrun"])
def test_ranks_share_one_run_dir(runs, name):
    """Ranks > 0 never make a dir, a .hydra/ or a file of their own: everything is in rank 0's run dir."""
    cwd, _ = runs[name]
    assert os.listdir(cwd) == ["outputs"]
    run_dir = _run_dir(runs, name)
    for pattern in (".hydra", "metrics.jsonl", "train.log"):
        found = glob.glob(os.path.join(cwd, "**", pattern), recursive=True)
        assert found == [os.path.join(run_dir, pattern)], found


def test_one_code_path(runs):
    """fp32 on 1 process, 2 spawned workers or 2 torchrun workers: the same losses."""
    losses = {name: [m["loss"] for m in read_metrics(_run_dir(runs, name))] for name in LAUNCHES}
    for name in ("spawn", "torchrun"):
        assert losses[name] == pytest.approx(losses["single"], rel=1e-5)


@pytest.mark.parametrize("name", ["spawn", "torchrun"])
def test_wandb_offline_run_on_rank0_only(runs, name):
    cwd, _ = runs[name]
    offline_runs = glob.glob(os.path.join(cwd, "**", "offline-run-*"), recursive=True)
    assert len(offline_runs) == 1, offline_runs
    assert os.path.dirname(offline_runs[0]) == os.path.join(_run_dir(runs, name), "wandb")
    [log_file] = glob.glob(os.path.join(offline_runs[0], "run-*.wandb"))
    assert exit_codes(log_file) == [0]
    _wandb_rows_match_metrics(log_file, _run_dir(runs, name))


def _wandb_rows_match_metrics(log_file: str, run_dir: str) -> None:
    rows, metrics = history(log_file), read_metrics(run_dir)
    assert [row["_step"] for row in rows] == [m["step"] for m in metrics]
    evals = {e["step"]: e for e in _eval_records(run_dir)}  # W&B keeps one row per step: an eval joins its step's
    for row, m in zip(rows, metrics):
        expected = {k: v for k, v in {**m, **evals.get(m["step"], {})}.items() if k != "step"}
        assert {k: row[k] for k in expected} == expected


def test_a_resume_from_an_older_step_forks_the_wandb_run(tmp_path):
    """Resumed from step 2 of a run that logged 4 (with another weight decay, so steps 3-4 train anew): W&B would keep
    the first attempt's rows 3-4 and drop the new ones. The resume logs to a new W&B run whose history is
    metrics.jsonl's (steps 1-2 as first logged, then 3-6), and the checkpoints carry the new run's id."""
    run_dir = tmp_path / "run"
    overrides = [*OVERRIDES, "logger=wandb", "checkpoint.interval=2", f"hydra.run.dir={run_dir}"]
    assert finish(start(overrides, str(tmp_path))).returncode == 0
    [first] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    first_rows = history(first)
    resume = [
        *overrides,
        "trainer.max_steps=6",
        "optim.weight_decay=0.5",
        f"checkpoint.resume={run_dir}/checkpoints/step_2",
    ]
    result = finish(start(resume, str(tmp_path)))
    assert result.returncode == 0, result.stderr[-3000:]
    [forked] = set(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))) - {first}
    assert history(first) == first_rows  # the first W&B run is left as it was
    _wandb_rows_match_metrics(forked, str(run_dir))
    retrained = read_metrics(str(run_dir))
    assert retrained[3]["loss"] != first_rows[3]["loss"]
    new_id = os.path.basename(forked)[len("run-") : -len(".wandb")]
    state = torch.load(run_dir / "checkpoints" / "step_6" / "trainer_state.pt", weights_only=False)
    assert state["wandb_run_id"] == new_id != os.path.basename(first)[len("run-") : -len(".wandb")]


def test_a_run_that_fails_closes_its_wandb_run_as_failed(tmp_path):
    """The first save fails (a file stands where the checkpoints dir goes): the run ends with a one-line error,
    status.json says failed, and its W&B run is finished with exit code 1, not left open."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory")
    result = finish(
        start([*OVERRIDES, "logger=wandb", "checkpoint.interval=2", f"hydra.run.dir={run_dir}"], str(tmp_path))
    )
    assert result.returncode == 2 and result.last_error_line().startswith("error: saving checkpoint step_2 ")
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"
    [log_file] = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert exit_codes(log_file) == [1]
    assert [row["_step"] for row in history(log_file)] == [1, 2]
