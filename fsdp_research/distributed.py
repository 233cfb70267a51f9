"""One code path for every launch: a single process (a 1-rank group), torchrun, this app's own workers
(distributed.nproc_per_node), or tasks started by SLURM's srun."""

import datetime
import os
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .config import DistributedConfig


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_master_addr() -> str:
    nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ["SLURM_JOB_NODELIST"]
    try:
        return subprocess.run(
            ["scontrol", "show", "hostnames", nodes], check=True, capture_output=True, text=True
        ).stdout.split()[0]
    except (OSError, subprocess.CalledProcessError):
        return nodes.split(",")[0]


def launch_env() -> LaunchEnv | None:
    """The rank layout given by torchrun / our spawner (RANK, WORLD_SIZE) or by srun (SLURM_PROCID within a
    job step); None for a plain single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", 0)),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_STEP_ID" in env and int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1))) > 1:
        job = int(env["SLURM_JOB_ID"])
        return LaunchEnv(
            int(env["SLURM_PROCID"]),
            int(env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"])),
            int(env["SLURM_LOCALID"]),
            _slurm_master_addr(),
            20000 + job % 20000,
        )
    return None


def planned_world_size(cfg: DistributedConfig) -> int:
    """The world size this launch will have, known before any process group exists."""
    env = launch_env()
    return env.world_size if env else cfg.nproc_per_node


def planned_nodes() -> int:
    """How many nodes this launch spans, as its launcher says: torchrun (WORLD_SIZE over LOCAL_WORLD_SIZE) or
    an srun step; 1 for a single process or this app's own workers."""
    env = os.environ
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        return -(-int(env["WORLD_SIZE"]) // int(env["LOCAL_WORLD_SIZE"]))
    if "SLURM_STEP_ID" in env:
        return int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES", 1))
    return 1


def device_for(requested: str, local_rank: int) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def cores_per_rank() -> int:
    """This rank's share of the node's cores: ranks sharing a node split them."""
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0])
    return max(1, len(os.sched_getaffinity(0)) // local)


def _limit_cpu_threads() -> None:
    """torch's default (every core per process) oversubscribes the node as soon as two ranks run on it. An
    explicit OMP_NUM_THREADS wins (torchrun sets 1)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(cores_per_rank())


def init_distributed(cfg: DistributedConfig, device: torch.device) -> None:
    """Join (or create) the process group; a no-op when the caller already made one."""
    if dist.is_initialized():
        return
    if device.type == "cpu":
        _limit_cpu_threads()
    env = launch_env() or LaunchEnv(0, 1, 0, "127.0.0.1", _free_port())
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        device_id=device if device.type == "cuda" else None,
    )


def broadcast_object(obj: Any) -> Any:
    """Rank 0's value of obj, on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_rank0(fn: Callable[[], Any]) -> Any:
    """fn() run by rank 0 alone, its result on every rank; an exception it raises is raised on every rank, so
    no rank is left waiting for one that failed."""
    outcome = None
    if dist.get_rank() == 0:
        try:
            outcome = (fn(), None)
        except Exception as err:
            outcome = (None, err)
    result, error = broadcast_object(outcome)
    if error is not None:
        raise error
    return result


def _worker(local_rank: int, fn: Callable, nprocs: int, port: int, args: tuple) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)


def spawn(fn: Callable, nprocs: int, *args: Any) -> None:
    """Run fn(*args) in nprocs fresh worker processes on this node, as torchrun would; raises if any fails."""
    mp.start_processes(_worker, args=(fn, nprocs, _free_port(), args), nprocs=nprocs, start_method="spawn")
