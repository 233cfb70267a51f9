"""Every single fault resumes by itself, with real processes and real signals: a worker SIGKILLed under
torchrun --max-restarts (the restarted group finds its run and ends bitwise where an uninterrupted run ends);
SIGTERM (finish the step, agree, save, `preempted`, exit 143; resumes exactly); a second SIGTERM during the save;
SIGINT (prompt, `interrupted`, 130); a rank that dies (the others stop, status.json names it, checkpoints intact),
self-spawned and under torchrun; a kill between two async saves (the first published at a step boundary, at the
latest as the second begins; resume is exact); a metrics.jsonl line cut short; a status.json left `running` by a
killed run."""

import glob
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from torch.multiprocessing import ProcessExitedException

from fsdp_research.checkpoint.resume import verify
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.sinks import JsonlSink, read_records
from fsdp_research.train.preemption import SAME_PRESS_S
from fsdp_research.train.refusals import check_trainer
from fsdp_research.train.rundir import outcome
from tests.conftest import FAST
from tests.helpers.checkpointing import complete_steps, with_overrides
from tests.helpers.cli import TRAIN, read_metrics, subprocess_env
from tests.helpers.dist import run_distributed
from tests.helpers.faults import Launch
from tests.helpers.plugins import hold_at

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, INTERVAL = 24, 6
BASE = with_overrides(
    FAST,
    f"trainer.max_steps={STEPS}",
    f"checkpoint.interval={INTERVAL}",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "checkpoint.keep_last=0",
)
SPAWN = [*BASE, "distributed.nproc_per_node=2"]


def _steps(run_dir: str) -> int:
    try:
        return len(read_metrics(run_dir))
    except (OSError, ValueError):
        return 0


def _export(run_dir: str) -> dict:
    return load_file(os.path.join(run_dir, "export", "model.safetensors"))


def _same_run(run_dir: str, baseline: str) -> None:
    """Each step logged once, with the baseline's losses to the bit, and the same exported weights."""
    got, want = read_metrics(run_dir), read_metrics(baseline)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    exported, expected = _export(run_dir), _export(baseline)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)


def _status(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "status.json")) as f:
        return json.load(f)


def _all_checkpoints_intact(run_dir: str) -> list[int]:
    root = os.path.join(run_dir, "checkpoints")
    published = [d for d in os.listdir(root) if d.startswith("step_")] if os.path.isdir(root) else []
    assert all(verify(os.path.join(root, d)) is None for d in published), published
    return complete_steps(run_dir)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def baseline(work):
    """The uninterrupted run (self-spawned; a run under torchrun computes the same, to the bit: the restart under
    torchrun is held to it)."""
    run = Launch(str(work / "spawn"), [*SPAWN, f"hydra.run.dir={work}/spawn/run"], forked=True).finish()
    assert run.returncode == 0, run.stderr[-3000:]
    return str(work / "spawn" / "run")


def test_torchrun_restart_finds_its_run_from_any_node(work, baseline):
    """Two torchrun agents, as on two nodes (each its own cwd, so its own default run dir, and its own $TMPDIR),
    one worker each; the first agent's worker SIGKILLed after the first checkpoint. The restarted group (its rank 0
    on either agent) finds the first attempt's run dir in torchrun's store, resumes from the newest checkpoint and
    ends bitwise where the uninterrupted run ends."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    rendezvous = ["--nnodes", "2", "--rdzv-backend", "c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id", "job"]
    agents = []
    for node in ("node_a", "node_b"):
        os.makedirs(work / node / "tmp")
        env = {"TMPDIR": str(work / node / "tmp")}
        agents.append(Launch(str(work / node), BASE, torchrun=1, max_restarts=1, rendezvous=rendezvous, env=env))
    runs = [str(work / node / "outputs" / "runs" / "*" / "*") for node in ("node_a", "node_b")]
    first = lambda: [d for pattern in runs for d in glob.glob(f"{pattern}/checkpoints/step_{INTERVAL}")]  # noqa: E731
    agents[0].wait_until("the first checkpoint", lambda: bool(first()))
    [step_dir] = first()
    run_dir = os.path.dirname(os.path.dirname(step_dir))
    [worker] = agents[0].workers()
    os.kill(worker, signal.SIGKILL)
    for agent in agents:
        run = agent.finish()
        assert run.returncode == 0, run.stderr[-3000:]
    with open(os.path.join(run_dir, "train.log")) as f:
        assert f"resumed from checkpoint {run_dir}/checkpoints/step_" in f.read()
    _same_run(run_dir, baseline)
    assert _status(run_dir)["status"] == "completed"
    assert not any("fsdp_research" in os.listdir(work / node / "tmp") for node in ("node_a", "node_b"))


def test_a_restarted_group_that_lost_its_run_dir_fails_instead_of_starting_over(tmp_path):
    """As torchrun starts a restarted group's rank 0 (its environment, its store: a real TCPStore holding no run
    dir), when the first attempt never recorded one: one line naming the key and the fix, exit 2, no run dir."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {
        **subprocess_env(),
        **dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1"),
        **dict(MASTER_PORT=str(store.port), TORCHELASTIC_RUN_ID="job", TORCHELASTIC_RESTART_COUNT="1"),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    run = subprocess.run([sys.executable, TRAIN, *FAST], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.strip().splitlines()[-1] == (
        "error: checkpoint.resume: torchrun restarted this group and its first attempt's run dir is not in "
        "torchrun's store; fix: give checkpoint.resume=<the run dir> on torchrun's command line"
    )
    assert not glob.glob(str(tmp_path / "outputs" / "runs" / "*" / "*" / "*.jsonl"))


@pytest.mark.parametrize(
    "override,key",
    [("trainer.agree_every=0", "trainer.agree_every"), ("trainer.preemption_grace_s=-1", "trainer.preemption_grace_s")],
)
def test_stop_keys_refused_before_any_compute(override, key):
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}: .*; fix: "):
        check_trainer(compose([override]).trainer, 1)


def _signalled(work, name: str, *signums: int):
    """A self-spawned run that gets the signals at its launcher once it has taken a few steps."""
    run_dir = str(work / name / "run")
    job = Launch(str(work / name), [*SPAWN, f"hydra.run.dir={run_dir}"])
    job.wait_until("a few steps", lambda: _steps(run_dir) >= 3)
    sent = time.monotonic()
    for signum in signums:
        job.signal(signum)
        time.sleep(0.05)
    run = job.finish()
    return run_dir, run, time.monotonic() - sent


@pytest.mark.parametrize("signums", [[signal.SIGTERM], [signal.SIGTERM, signal.SIGTERM]], ids=["once", "twice"])
def test_sigterm_saves_and_the_run_resumes_exactly(work, baseline, signums):
    name = f"sigterm{len(signums)}"
    run_dir, run, _ = _signalled(work, name, *signums)
    assert run.returncode == 143, run.stderr[-3000:]
    status = _status(run_dir)
    assert (status["status"], status["error"], status["requeue"]) == ("preempted", None, False)
    with open(os.path.join(run_dir, "train.log")) as f:
        stopped = int(f.read().split("preemption signal (SIGTERM): stopped after step ")[1].split()[0])
    assert _all_checkpoints_intact(run_dir)[-1] == stopped < STEPS
    resumed = Launch(str(work / name), [*SPAWN, f"hydra.run.dir={run_dir}"], forked=True).finish()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_run(run_dir, baseline)


def _continue_line(run, run_dir: str) -> str:
    return run.stderr.strip().splitlines()[-1].removeprefix("interrupted; ")


def test_ctrl_c_stops_with_a_checkpoint_and_says_how_to_continue(work, baseline):
    """The first Ctrl-C stops at the step boundary with a resume checkpoint (exit 130); the command the last line
    gives continues the run to where the uninterrupted one ends, bitwise."""
    run_dir, run, seconds = _signalled(work, "sigint", signal.SIGINT)
    assert run.returncode == 130 and seconds < 30, run.stderr[-3000:]
    status = _status(run_dir)
    assert (status["status"], status["signal"]) == ("preempted", "SIGINT")
    assert "Ctrl-C: stopping after this step with a resume checkpoint (Ctrl-C again: at once)" in run.stdout
    with open(os.path.join(run_dir, "train.log")) as f:
        stopped = int(f.read().split("preemption signal (SIGINT): stopped after step ")[1].split()[0])
    assert _all_checkpoints_intact(run_dir)[-1] == stopped < STEPS
    command = _continue_line(run, run_dir)
    assert command == f"to continue: {sys.executable} {TRAIN} checkpoint.resume={run_dir}"
    resumed = Launch(str(work / "sigint"), command.split()[4:], forked=True).finish()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_run(run_dir, baseline)


def test_a_second_ctrl_c_stops_at_once(work):
    """Two Ctrl-C during a step that sleeps 60 s: the second ends the run there, no checkpoint of that step."""
    run_dir = str(work / "sigint2" / "run")
    slow = ["+callbacks.slow._target_=tests.helpers.plugins.SlowStep", "+callbacks.slow.step=8"]
    job = Launch(str(work / "sigint2"), [*SPAWN, *slow, "+callbacks.slow.seconds=60", f"hydra.run.dir={run_dir}"])
    job.wait_until("the slow step", lambda: os.path.exists(os.path.join(run_dir, "slow")))
    sent = time.monotonic()
    job.signal(signal.SIGINT)
    # The second press counts from the moment the first reached the worker, not from when it was sent.
    job.wait_until("the first Ctrl-C taken", lambda: "Ctrl-C: stopping" in (work / "sigint2" / "job.out").read_text())
    time.sleep(SAME_PRESS_S + 0.5)
    job.signal(signal.SIGINT)
    run = job.finish()
    assert run.returncode == 130 and time.monotonic() - sent < 30, run.stderr[-3000:]
    assert _status(run_dir)["status"] == "interrupted"
    assert _all_checkpoints_intact(run_dir)[-1] == INTERVAL
    assert _continue_line(run, run_dir).startswith("to continue: ")


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_dead_rank_stops_the_others_and_is_named(work, launcher):
    cwd = str(work / f"dead_{launcher}")
    if launcher == "spawn":
        job = Launch(cwd, [*SPAWN, f"hydra.run.dir={cwd}/run"])
    else:
        job = Launch(cwd, [*BASE, f"hydra.run.dir={cwd}/run"], torchrun=2)
    run_dir = os.path.join(cwd, "run")
    job.wait_until("the first checkpoint", lambda: bool(complete_steps(run_dir)))
    killed = time.monotonic()
    os.kill(job.worker(1, run_dir if launcher == "spawn" else None), signal.SIGKILL)
    run = job.finish()
    assert run.returncode != 0
    assert time.monotonic() - killed < 60, "the other rank should stop well within distributed.timeout_s"
    status = _status(run_dir)
    assert status["status"] == "failed" and "rank" in status["error"] and "1" in status["error"], status
    if launcher == "spawn":
        assert status["error"].startswith("rank 1 was killed by SIGKILL"), status
    assert _all_checkpoints_intact(run_dir)


def _failing_run_signalled_as_it_records(cfg, run_dir: str) -> None:
    """run_worker on a rank of its own, its run failing at step 2, a SIGTERM sent to itself the moment rank 0 starts
    recording the failure: where torchrun's agent's SIGTERM (sent the moment another rank died) landed once, in CI."""
    from fsdp_research.jobs.launch import run_worker
    from fsdp_research.train import rundir

    write = rundir.write_status

    def signalled_first(run_dir: str, status: str, *args, **kwargs) -> None:
        if status == "failed":
            os.kill(os.getpid(), signal.SIGTERM)
        write(run_dir, status, *args, **kwargs)

    rundir.write_status = signalled_first
    run_worker(cfg, run_dir)


def test_a_sigterm_as_a_failed_run_is_recorded_ends_it_after_the_record(tmp_path):
    """Its default action had left status.json `running` (the failure unsaid); the SIGTERM still ends the process."""
    run_dir = str(tmp_path / "run")
    cfg = compose([*BASE, "+callbacks.raises._target_=tests.helpers.plugins.Raises"])
    with pytest.raises(ProcessExitedException) as ended:
        run_distributed(_failing_run_signalled_as_it_records, 1, cfg, run_dir)
    assert ended.value.signal_name == "SIGTERM"
    status = _status(run_dir)
    assert status["status"] == "failed" and "this callback fails at step 2" in status["error"], status


def _held_async(run_dir: str, step: int, release) -> list[str]:
    """Async saves, the run held after `step` while `release` is missing."""
    return [*SPAWN, "checkpoint.async=true", *hold_at(step, release), f"hydra.run.dir={run_dir}"]


def test_a_kill_between_async_saves_keeps_the_first(work):
    """The async save of step 6 is published at a step boundary once every rank has written it, at the latest as the
    next save begins (on a loaded machine the write can take 6 steps). Held after step 13, before the boundary that
    could publish step 12's save: a SIGKILL there keeps step 6's alone, and the resume from it is exact."""
    held, release, base_release = 2 * INTERVAL + 1, work / "async_release", work / "async_base_release"
    base_release.touch()  # the base has the same callbacks, never holding: the held run's code path
    base_dir, run_dir = str(work / "async_base" / "run"), str(work / "async" / "run")
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(
            lambda: Launch(str(work / "async_base"), _held_async(base_dir, held, base_release), forked=True).finish()
        )
        job = Launch(str(work / "async"), _held_async(run_dir, held, release))
        job.wait_until(f"the run held after step {held}", lambda: os.path.exists(os.path.join(run_dir, "held")))
        logged = _steps(run_dir)
        job.kill()
        assert base.result().returncode == 0
    assert complete_steps(run_dir) == [INTERVAL] and logged == held, logged
    release.touch()
    resumed = Launch(str(work / "async"), _held_async(run_dir, held, release), forked=True).finish()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_run(run_dir, base_dir)


def test_a_line_cut_short_is_skipped_with_a_warning(tmp_path, caplog):
    rows = [{"step": s, "loss": 5.0 - s} for s in (1, 2, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    with caplog.at_level(logging.WARNING):
        assert read_records(str(tmp_path)) == rows
    assert "metrics.jsonl line 4 is cut short" in caplog.text
    JsonlSink(str(tmp_path), resume_step=2).finish()  # a resume trims it without tripping over the cut line
    assert read_records(str(tmp_path)) == rows[:2]


def test_a_run_that_died_without_a_word_is_failed(tmp_path):
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    (tmp_path / "status.json").write_text(
        json.dumps({"status": "running", "error": None, "pid": dead, "host": os.uname().nodename})
    )
    assert outcome(str(tmp_path))["status"] == "failed"
    (tmp_path / "status.json").write_text(
        json.dumps({"status": "running", "error": None, "pid": os.getpid(), "host": os.uname().nodename})
    )
    assert outcome(str(tmp_path))["status"] == "running"
