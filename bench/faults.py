"""What each fault costs: steps lost (done before the fault, not kept by a checkpoint) and the time
from the fault to the first step trained again, for real faults on 2 ranks of llama_tiny (checkpoint.interval=10):
- SIGKILL of one worker under torchrun --max-restarts 1 (torchrun restarts the group, which resumes by itself);
- SIGTERM to a self-spawned job (it saves at the step it stops at; the time is to its exit, then of a relaunch);
- SIGKILL of a whole job between two async saves (relaunched at once);
- a lost SLURM node (its slurmd and tasks killed; the job requeues itself and resumes once the node is back),
  when a cluster of 2 nodes answers (bash slurm/local_cluster.sh start --nodes 2).

    .venv/bin/python bench/faults.py [--out DIR]
"""

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness.jobs import Job, lose_node  # noqa: E402

STEPS, INTERVAL = 60, 10
BASE = [
    "precision=fp32",
    "logger=none",
    "trainer.log_interval=1",
    "trainer.eval_interval=0",
    "data.seq_len=64",
    "checkpoint.export=false",
    f"trainer.max_steps={STEPS}",
    f"checkpoint.interval={INTERVAL}",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
]


def _rows(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r for r in (json.loads(line) for line in f if line.endswith("\n")) if "loss" in r]
    except (OSError, ValueError):
        return []


def _checkpoints(run_dir: str) -> list[int]:
    return sorted(int(p.rsplit("_", 1)[1]) for p in glob.glob(os.path.join(run_dir, "checkpoints", "step_*")))


def _after_fault(run_dir: str, done: int, kept: int, fault_time: float, timeout: float = 600) -> dict:
    """Steps lost, and seconds from the fault until the run has trained a step it had not kept."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _rows(run_dir)
        # Resumed when the log is trimmed back to the checkpoint and a new step follows it.
        if (
            rows
            and rows[-1]["step"] > kept
            and len(rows) == rows[-1]["step"]
            and os.path.getmtime(os.path.join(run_dir, "metrics.jsonl")) > fault_time
        ):
            return {"steps_lost": done - kept, "seconds_to_training": time.time() - fault_time}
        time.sleep(0.05)
    raise TimeoutError(f"{run_dir} did not train again within {timeout} s")


def _torchrun_kill(out: str) -> dict:
    job = Job(f"{out}/torchrun", BASE, torchrun=2, max_restarts=1)
    runs = f"{out}/torchrun/outputs/runs/*/*"
    job.wait_until(
        "a checkpoint and a few steps",
        lambda: (
            bool(glob.glob(runs))
            and _checkpoints(glob.glob(runs)[0])
            and len(_rows(glob.glob(runs)[0])) >= INTERVAL + 4
        ),
    )
    run_dir = glob.glob(runs)[0]
    done, kept = len(_rows(run_dir)), _checkpoints(run_dir)[-1]
    fault = time.time()
    os.kill(job.worker(1), signal.SIGKILL)
    result = _after_fault(run_dir, done, kept, fault)
    assert job.ended()[0] == 0
    return result


def _sigterm(out: str) -> dict:
    run_dir = f"{out}/sigterm/run"
    overrides = [*BASE, "distributed.nproc_per_node=2", f"hydra.run.dir={run_dir}"]
    job = Job(f"{out}/sigterm", overrides)
    job.wait_until("a few steps", lambda: len(_rows(run_dir)) >= INTERVAL + 4)
    done, fault = len(_rows(run_dir)), time.time()
    job.signal(signal.SIGTERM)
    assert job.ended()[0] == 143
    exited = time.time() - fault
    kept = _checkpoints(run_dir)[-1]
    relaunched = time.time()
    again = Job(f"{out}/sigterm", overrides)
    result = _after_fault(run_dir, max(done, kept), kept, relaunched)
    assert again.ended()[0] == 0
    return {
        "steps_lost": max(done, kept) - kept,
        "seconds_to_exit": exited,
        "seconds_to_training": result["seconds_to_training"],
    }


def _async_kill(out: str) -> dict:
    run_dir = f"{out}/async/run"
    overrides = [*BASE, "distributed.nproc_per_node=2", "checkpoint.async=true", f"hydra.run.dir={run_dir}"]
    job = Job(f"{out}/async", overrides)
    job.wait_until(
        "a published save and a few steps",
        lambda: _checkpoints(run_dir) and len(_rows(run_dir)) >= _checkpoints(run_dir)[-1] + INTERVAL - 1,
    )
    done, kept, fault = len(_rows(run_dir)), _checkpoints(run_dir)[-1], time.time()
    job.kill()
    again = Job(f"{out}/async", overrides)
    result = _after_fault(run_dir, done, kept, fault)
    assert again.ended()[0] == 0
    return result


def _node_loss(out: str) -> dict | None:
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout.split()
    if len(set(nodes)) < 2:
        return None
    os.makedirs(f"{out}/slurm", exist_ok=True)
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            "--ntasks-per-node=1",
            os.path.join(ROOT, "slurm", "train.sbatch"),
            *BASE,
        ],
        cwd=f"{out}/slurm",
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "FSDP_RESEARCH_ROOT": ROOT},
    )
    job = submitted.stdout.strip().split(";")[0]
    run_dir = f"{out}/slurm/outputs/slurm/{job}"
    deadline = time.monotonic() + 300
    while not (_checkpoints(run_dir) and len(_rows(run_dir)) >= INTERVAL + 4):
        assert time.monotonic() < deadline, "the SLURM job did not get going"
        time.sleep(0.05)
    done, kept, fault = len(_rows(run_dir)), _checkpoints(run_dir)[-1], time.time()
    lose_node("node2")
    while (
        "REQUEUE"
        not in subprocess.run(["squeue", "-h", "-j", job, "-o", "%r %T"], capture_output=True, text=True).stdout
        and time.time() - fault < 120
    ):
        time.sleep(0.5)
    subprocess.run(
        ["bash", os.path.join(ROOT, "slurm", "local_cluster.sh"), "start", "--nodes", "2"],
        check=True,
        capture_output=True,
    )
    return _after_fault(run_dir, done, kept, fault)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    out = parser.parse_args().out or tempfile.mkdtemp(prefix="bench_faults_")
    results = {
        "SIGKILL of one rank under torchrun --max-restarts 1": _torchrun_kill(out),
        "SIGTERM to the job (saves, exits 143), then relaunched": _sigterm(out),
        "SIGKILL of the job between async saves, relaunched": _async_kill(out),
    }
    node = _node_loss(out)
    if node:
        results["a lost SLURM node (job requeued, node back)"] = node
    print(f"2 ranks, llama_tiny, checkpoint.interval={INTERVAL}, ~0.13 s/step; out {out}")
    for name, r in results.items():
        extra = f", {r['seconds_to_exit']:.1f} s from the signal to exit" if "seconds_to_exit" in r else ""
        print(
            f"{name:>58}: {r['steps_lost']:2d} steps lost, {r['seconds_to_training']:5.1f} s to training again{extra}"
        )


if __name__ == "__main__":
    main()
