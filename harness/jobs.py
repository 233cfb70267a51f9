"""Real jobs: `python train.py <overrides>` (or torchrun) in a session of its own, its worker processes found by
their rank, signals sent for real; a node of the local SLURM cluster (slurm/local_cluster.sh) lost."""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# slurm/local_cluster.sh's state dir.
LOCAL_CLUSTER = os.environ.get("SLURM_LOCAL_DIR", "/var/tmp/fsdp_research_slurm")


def job_env() -> dict[str, str]:
    """This process's environment without any launcher's rank layout (a job started from a job is a job of its own)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WANDB_DIR")
        and not k.startswith("SLURM_")
    }
    env["WANDB_SILENT"] = "true"
    return env


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError):
                continue
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def train_command(overrides: Sequence[str], torchrun: int = 0, max_restarts: int = 0, rendezvous=()) -> list[str]:
    """`python train.py <overrides>`, or under torchrun with `torchrun` workers (`rendezvous`: its arguments for one
    agent of several)."""
    command = [sys.executable]
    if torchrun:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(torchrun)]
        command += ["--max-restarts", str(max_restarts), "--monitor-interval", "0.5", *rendezvous]
    return [*command, os.path.join(ROOT, "train.py"), *overrides]


class Job:
    """A training job in cwd, with `env` added; its output to <cwd>/job.out and job.err."""

    def __init__(
        self,
        cwd: str,
        overrides: Sequence[str],
        torchrun: int = 0,
        max_restarts: int = 0,
        rendezvous: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ):
        self._open(cwd, env)
        with open(self._out, "w") as out, open(self._err, "w") as err:
            self.proc = subprocess.Popen(
                train_command(overrides, torchrun, max_restarts, rendezvous),
                cwd=cwd,
                env=self.env,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def _open(self, cwd: str, env: dict[str, str] | None) -> None:
        self.cwd, self.env = cwd, {**job_env(), **(env or {})}
        os.makedirs(cwd, exist_ok=True)
        self._out, self._err = os.path.join(cwd, "job.out"), os.path.join(cwd, "job.err")

    def wait_until(self, what: str, check: Callable[[], bool], timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert self.proc.poll() is None, f"the job ended (exit {self.proc.returncode}) before {what}"
            assert time.monotonic() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.01)

    def worker(self, rank: int, run_dir: str | None = None) -> int:
        """The pid of the worker process of that rank: a child of torchrun with RANK in its environment, or as the
        run's status.json lists its ranks (this app's own workers take their rank after they start)."""
        if run_dir is not None:
            with open(os.path.join(run_dir, "status.json")) as f:
                return json.load(f)["ranks"][rank][1]
        for pid in children(self.proc.pid):
            if _rank_of(pid) == rank:
                return pid
        raise AssertionError(f"no worker of rank {rank} under pid {self.proc.pid}")

    def workers(self) -> list[int]:
        """The pids of this launcher's worker processes."""
        return children(self.proc.pid)

    def signal(self, signum: int) -> None:
        """To the launcher only (python train.py, or torchrun), as a scheduler or a shell's kill does."""
        os.kill(self.proc.pid, signum)

    def ended(self, timeout: float = 300) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it ends; SIGKILLed first if it has not within timeout."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        with open(self._out) as out, open(self._err) as err:
            return self.proc.returncode, out.read(), err.read()

    def kill(self) -> None:
        """SIGKILL the whole job, every process of it."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def stop_controller(state_dir: str = LOCAL_CLUSTER, timeout: float = 60) -> None:
    """slurmctld SIGTERMed and waited for (its state is saved; `local_cluster.sh start` recovers it): the requests
    it was retrying in memory go with it."""
    with open(os.path.join(state_dir, "run", "slurmctld.pid")) as f:
        pid = int(f.read().strip())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.2)


def lose_node(node: str, state_dir: str = LOCAL_CLUSTER) -> None:
    """The node's slurmd, its step daemons and its tasks, SIGKILLed: as if the machine went away."""
    with open(os.path.join(state_dir, "run", f"slurmd-{node}.pid")) as f:
        os.kill(int(f.read().strip()), signal.SIGKILL)
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"SLURMD_NODENAME={node}".encode() in f.read().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue
