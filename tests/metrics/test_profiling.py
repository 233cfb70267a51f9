"""Where a step's time goes: the breakdown's arithmetic on hand-made traces (CPU and GPU), then one real
2-process run with trainer.profile_steps: the traces, the profile row, and the doctor's start-up row in
metrics.jsonl (and W&B's summary), which the readers of metrics.jsonl still read."""

import glob
import json
import os

import pytest

from fsdp_research.jobs.compose import compose
from fsdp_research.jobs.report import load_job
from fsdp_research.metrics.profiling import breakdown
from tests.conftest import FAST
from tests.helpers.cli import read_metrics
from tests.helpers.dist import ok, train_distributed
from tests.helpers.wandb_history import history, summary

pytestmark = pytest.mark.distributed


def _span(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


def test_cpu_breakdown():
    """Two 100 us steps on the training thread (tid 1); gloo works on its own thread (tid 2). Of its 30 us in
    step 1, 10 overlap an aten op (hidden); the 20 us blocking c10d call in step 2 is all exposed."""
    trace = [
        _span("ProfilerStep#1", 0, 100, "user_annotation"),
        _span("ProfilerStep#2", 100, 100, "user_annotation"),
        _span("step.data", 0, 5, "user_annotation"),
        _span("step.data", 100, 5, "user_annotation"),
        _span("step.forward", 5, 45, "user_annotation"),
        _span("step.forward", 105, 45, "user_annotation"),
        _span("step.backward", 50, 40, "user_annotation"),
        _span("step.backward", 150, 40, "user_annotation"),
        _span("step.optimizer", 90, 10, "user_annotation"),
        _span("step.optimizer", 190, 10, "user_annotation"),
        _span("aten::mm", 10, 30),
        _span("gloo:all_gather", 30, 30, "user_annotation", tid=2),
        _span("aten::mm", 110, 20),
        _span("c10d::allreduce_", 150, 20),
        # An aten op on gloo's thread is part of the collective, not compute that hides it.
        _span("aten::copy_", 40, 20, tid=2),
    ]
    got = breakdown(trace)
    assert got["steps"] == 2 and got["step_time_s"] == pytest.approx(100e-6)
    assert [got[k] for k in ("data_s", "forward_s", "backward_s", "optimizer_s")] == pytest.approx(
        [5e-6, 45e-6, 40e-6, 10e-6]
    )
    assert got["comm_s"] == pytest.approx(25e-6)  # (30 + 20) / 2 steps
    assert got["exposed_comm_s"] == pytest.approx(20e-6)  # (20 + 20) / 2
    assert got["exposed_comm_share"] == pytest.approx(0.2)


def test_gpu_breakdown_uses_device_time():
    """On GPU: NCCL kernels against compute kernels on any stream, phases from their device-side spans."""
    trace = [
        _span("ProfilerStep#1", 0, 100, "user_annotation"),
        _span("step.forward", 0, 10, "user_annotation"),
        _span("step.forward", 5, 60, "gpu_user_annotation", 7),
        _span("step.backward", 10, 5, "user_annotation"),
        _span("step.backward", 65, 30, "gpu_user_annotation", 7),
        _span("ampere_sgemm", 5, 50, "kernel", 7),
        # The next block's all-gather: 40 us, 30 of them behind the GEMM.
        _span("ncclDevKernel_AllGather_RING_LL", 25, 40, "kernel", 8),
        _span("nccl:all_gather", 20, 2, "user_annotation"),  # the host-side call: not device time
    ]
    got = breakdown(trace)
    assert got["forward_s"] == pytest.approx(60e-6) and got["backward_s"] == pytest.approx(30e-6)
    assert got["comm_s"] == pytest.approx(40e-6) and got["exposed_comm_s"] == pytest.approx(10e-6)


def test_no_complete_step_gives_nothing():
    assert breakdown([_span("aten::mm", 0, 10)]) == {}


STEPS = 3  # one warm-up step, then PROFILED
PROFILED = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    # Named "0" like a sweep's job dir, so that the sweep report can read it too.
    cfg = compose(
        FAST
        + [
            "sharding=reshard_all",
            "logger=wandb",
            f"trainer.max_steps={STEPS}",
            f"trainer.profile_steps={PROFILED}",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=2",
        ]
    )
    out = str(tmp_path_factory.mktemp("profiled"))
    ok(train_distributed({"0": cfg}, 2, out), "0")
    run_dir = os.path.join(out, "0")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return run_dir, [json.loads(line) for line in f]


def test_traces_per_rank(run):
    run_dir, _ = run
    for rank in (0, 1):
        with open(os.path.join(run_dir, "profile", f"trace_rank{rank}.json")) as f:
            names = {e["name"] for e in json.load(f)["traceEvents"]}
        assert {"step.data", "step.forward", "step.backward", "step.optimizer"} <= names
        assert sum(n.startswith("ProfilerStep#") for n in names) == PROFILED


def test_profile_row(run):
    _, rows = run
    [row] = [r for r in rows if "profile" in r]
    assert set(row) == {"step", "profile"} and row["step"] == STEPS
    profile = row["profile"]
    assert profile["steps"] == PROFILED
    for key in ("step_time_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "exposed_comm_s"):
        assert profile[key] > 0, key
    assert profile["forward_s"] + profile["backward_s"] + profile["optimizer_s"] < profile["step_time_s"]
    assert profile["exposed_comm_s"] <= profile["comm_s"]


def test_doctor_row_first(run):
    _, rows = run
    assert rows[0]["step"] == 0 and set(rows[0]) == {"step", "doctor"}
    [finding] = rows[0]["doctor"]
    assert finding["check"] == "reshard_all" and finding["symptom"] == "reshard_after_forward on everywhere"
    assert set(finding) == {"check", "symptom", "cause", "fix"}


def test_readers_skip_one_off_rows(run):
    run_dir, _ = run
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, STEPS + 1))
    job = load_job(run_dir)
    assert job["steps"] == STEPS and job["final_loss"] == read_metrics(run_dir)[-1]["loss"]


def test_wandb_summary_not_history(run):
    run_dir, rows = run
    [log_file] = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    got = summary(log_file)
    assert got["doctor"] == rows[0]["doctor"] and got["profile"]["steps"] == PROFILED
    # The history stays one row per logged step.
    assert [row["_step"] for row in history(log_file)] == list(range(1, STEPS + 1))
