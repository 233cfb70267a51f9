"""Resuming a run as a user types it: `python train.py checkpoint.resume=<run dir> trainer.max_steps=N` continues
the run with its own config (its groups and keys as it started, then the overrides given now, which win), keeps
the history of overrides in .hydra/, refuses what cannot change on a resume, and a path that does not exist."""

import json
import os

import numpy as np
import pytest
import yaml

from fsdp_research.data.pipeline import build_data
from fsdp_research.jobs.compose import compose
from tests.conftest import FAST, ROOT
from tests.helpers.checkpointing import with_overrides
from tests.helpers.cli import command, finish, read_metrics, start

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FIRST = with_overrides(
    FAST,
    "optim.lr=1e-3",
    "schedule=constant",
    "schedule.warmup_steps=0",
    "trainer.log_interval=2",
    "trainer.max_steps=4",
    "checkpoint.interval=4",
    "distributed.nproc_per_node=1",
)


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("resume") / "run")
    first = finish(start([*FIRST, f"hydra.run.dir={run_dir}"], ROOT))
    assert first.returncode == 0, first.stderr[-3000:]
    return run_dir, first


@pytest.fixture(scope="module")
def run_dir(first):
    return first[0]


def test_a_run_says_where_it_is_and_what_it_wrote(first, tmp_path):
    """The first line is the run dir; the last ones what it wrote and how to plot it; the report of the run."""
    run_dir, run = first
    lines = run.stdout.strip().splitlines()
    assert lines[0] == f"run dir: {run_dir}"
    assert lines[-2] == (
        f"wrote: metrics {run_dir}/metrics.jsonl, log {run_dir}/train.log, checkpoints {run_dir}/checkpoints "
        "(newest step_4)"
    )
    assert lines[-1] == f"plot it: fsdp-research report {run_dir}"
    out = str(tmp_path / "run.png")
    report = command(["report", run_dir, "--out", out])
    assert report.returncode == 0, report.stderr
    header, row = report.stdout.splitlines()[:2]
    assert header.split()[:4] == ["job", "overrides", "loss", "eval_loss"] and row.split()[-2:] == ["4", "completed"]
    assert os.path.getsize(out) > 10_000


def test_a_resume_continues_with_the_runs_own_config(run_dir, tmp_path):
    before = open(os.path.join(run_dir, ".hydra", "overrides.yaml")).read()
    bad = {
        "seq_len": start([f"checkpoint.resume={run_dir}", "data.seq_len=32"], ROOT),
        "missing": start([f"checkpoint.resume={tmp_path / 'nope'}"], ROOT),
        "max_windows": start([f"checkpoint.resume={run_dir}", "data.max_windows=50"], ROOT),
    }
    refused = {name: finish(proc) for name, proc in bad.items()}
    assert refused["seq_len"].returncode == 2 and refused["seq_len"].last_error_line() == (
        "error: data.seq_len: cannot change on a resume (64 -> 32): the checkpoint's weights and data position are "
        "the run's; fix: resume without it, or start a new run with it (checkpoint.resume=never)"
    )
    assert refused["missing"].returncode == 2 and refused["missing"].last_error_line() == (
        f"error: checkpoint.resume: {tmp_path / 'nope'} does not exist (or holds no run); fix: give a run dir or "
        "one of its checkpoints/step_<N> dirs"
    )
    assert not os.path.exists(tmp_path / "nope")  # a mistyped path is not left made
    # A window count moves the held-out split into what was trained on.
    assert refused["max_windows"].returncode == 2
    assert refused["max_windows"].last_error_line().startswith("error: data.max_windows: cannot change on a resume")
    assert open(os.path.join(run_dir, ".hydra", "overrides.yaml")).read() == before
    resumed = finish(start([f"checkpoint.resume={run_dir}", "trainer.max_steps=8"], ROOT))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing the run with its own config (" in resumed.stdout
    assert "given now, and winning: checkpoint.resume=" in resumed.stdout
    # The constant schedule at 1e-3, a row every 2 steps: the run's own, not the defaults (cosine, every 10).
    rows = read_metrics(run_dir)
    assert [(r["step"], r["lr"]) for r in rows] == [(2, 1e-3), (4, 1e-3), (6, 1e-3), (8, 1e-3)]
    with open(os.path.join(run_dir, ".hydra", "overrides.yaml")) as f:
        history = yaml.safe_load(f)
    assert history == [*FIRST, f"checkpoint.resume={run_dir}", "trainer.max_steps=8"]
    with open(os.path.join(run_dir, ".hydra", "config.yaml")) as f:
        config = yaml.safe_load(f)
    assert (config["schedule"]["name"], config["trainer"]["max_steps"]) == ("constant", 8)


def test_a_resume_at_another_global_batch_size_reads_on_from_the_samples_trained(tmp_path):
    """Batch-size warm-up: 4 steps at a global batch of 8, then a resume at 16 for 2 steps. The model's inputs are
    the first 4 x 8 + 2 x 16 windows of the epoch order, each once and in order (at 16, reading from step x batch
    size skipped 32 of them); metrics.jsonl counts the samples trained on."""
    run_dir = str(tmp_path / "run")
    record = "+callbacks.inputs._target_=tests.helpers.plugins.InputRecorder"
    overrides = [*FIRST, record, "trainer.global_batch_size=8", "trainer.micro_batch_size=8", "trainer.log_interval=1"]
    first = finish(start([*overrides, f"hydra.run.dir={run_dir}"], ROOT))
    assert first.returncode == 0, first.stderr[-3000:]
    more = ["trainer.max_steps=6", "trainer.global_batch_size=16"]
    resumed = finish(start([f"checkpoint.resume={run_dir}", *more], ROOT))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(os.path.join(run_dir, "inputs_rank0.jsonl")) as f:
        seen = [window for line in f for window in json.loads(line)]
    cfg = compose(overrides)
    windows = build_data(cfg.data, 0, cfg.trainer.seed).batch(np.arange(64))[:, :-1]
    assert seen == windows.tolist()
    assert [m["samples"] for m in read_metrics(run_dir)] == [8, 16, 24, 32, 48, 64]
