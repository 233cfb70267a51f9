"""One code path for every launch: a single process (a 1-rank group), torchrun, this app's own workers
(distributed.nproc_per_node), or tasks started by SLURM's srun."""

import contextlib
import ctypes
import datetime
import os
import random
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_research.config.schema import DistributedConfig
from fsdp_research.errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def _free_port() -> int:
    """A free port for a new group's store, chosen below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) can be taken by any outgoing connection (gloo's, another job's) before the store binds it, which
    failed a run with EADDRINUSE; one outside that range only by another explicit choice (drawn apart from OS
    entropy, never from the training's random state)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.SystemRandom()
    for _ in range(64 if ephemeral > 20000 else 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", draw.randrange(20000, ephemeral)))
            except OSError:
                continue
            return s.getsockname()[1]
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


def starts_own_workers(cfg: DistributedConfig) -> bool:
    """Whether this process starts its ranks itself (distributed.nproc_per_node), no launcher having started it."""
    return launch_env() is None and cfg.nproc_per_node > 1


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
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError("trainer.device", f"{requested!r} is not a device it runs on", "use auto, cpu or cuda")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        # Where SLURM binds one GPU per task, every task sees one device (cuda:0), whatever its local rank.
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device(requested)


def cores_per_rank() -> int:
    """This rank's share of the node's cores: ranks sharing a node split them."""
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_STEP_TASKS_PER_NODE", "1").split("(")[0].split(",")[0])
    return max(1, len(os.sched_getaffinity(0)) // local)


def _limit_cpu_threads() -> None:
    """torch's default (every core per process) oversubscribes the node as soon as two ranks run on it. An
    explicit OMP_NUM_THREADS wins (torchrun sets 1); set here too, since OpenMP read the environment as torch
    loaded, and a forkserver's child loaded it with the server's."""
    requested = os.environ.get("OMP_NUM_THREADS")
    if requested is None:
        torch.set_num_threads(cores_per_rank())
    elif requested.isdigit() and int(requested) > 0:
        torch.set_num_threads(int(requested))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_freed_host_memory() -> None:
    """Keep a step's freed host memory for the next step. glibc hands memory freed at the top of its heap back to
    the OS once more than its trim threshold is free, and a CPU step frees its activations there: each step then
    faults ~48 MB back in, page by page (12k minor faults a step; docs/benchmarks/overhead.md). A
    fixed mmap threshold at glibc's own dynamic ceiling (32 MiB), since setting the trim threshold stops glibc
    raising it. Explicit MALLOC_*_ settings win; not glibc: nothing to do."""
    if any(name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 1 << 30)


@contextlib.contextmanager
def new_threads_single_threaded() -> Iterator[None]:
    """A thread that runs its first parallel torch op inside this context keeps one intra-op thread for good (torch
    sets a thread's OpenMP thread count on its first parallel op, from the process-wide setting). Wrapped around
    checkpoint I/O, whose collectives make gloo's worker threads copy plans and metadata large enough to run in
    parallel: a second OpenMP thread team makes GNU OpenMP stop spinning between the training thread's parallel
    regions (it throttles once it manages more threads than there are cores), and a 1-process CPU run lost 25-30%
    of its speed for good after its first checkpoint."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def backend_for(backend: str, device: torch.device) -> str:
    """The process group's backend for distributed.backend on `device`; ConfigError for NCCL without CUDA."""
    if backend == "auto":
        return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if "nccl" in backend and (device.type != "cuda" or not dist.is_nccl_available()):
        raise ConfigError(
            "distributed.backend", f"{backend} needs CUDA devices and this run is on {device.type}", "use auto or gloo"
        )
    return backend


def init_distributed(cfg: DistributedConfig, device: torch.device) -> None:
    """Join (or create) the process group; a no-op when the caller already made one."""
    if dist.is_initialized():
        return
    if device.type == "cpu":
        _limit_cpu_threads()
        _keep_freed_host_memory()
    env = launch_env() or LaunchEnv(0, 1, 0, "127.0.0.1", _free_port())
    # On CUDA, CPU tensors' collectives (cpu_offload's gradient norm and inf check) go to gloo.
    backend = backend_for(cfg.backend, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = None
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True),
            timeout=timeout,
        )
        rendezvous = {"store": _group_store(store)}
    else:
        rendezvous = {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    dist.init_process_group(
        backend,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
        **rendezvous,
    )
    if store is not None and env.rank == 0:
        store.add(_GENERATION, 1)  # every rank of this group has read it: the next group gets the next one
    if torch.device("cpu") in dist.group.WORLD._device_types:
        _settle_worker_threads(None)
    global _members
    _members = [None] * env.world_size
    dist.all_gather_object(_members, (_node(), os.getpid()))


def _settle_worker_threads(group: dist.ProcessGroup | None) -> None:
    """Give a gloo group's worker threads one intra-op thread for good (see new_threads_single_threaded), once,
    as the group is made: a few collectives whose results the workers copy (an ATen op: the thread's first
    sets its OpenMP thread count) while the process-wide count is 1. Overlapping them reaches each of gloo's
    workers, which take queued work in turn."""
    world = dist.get_world_size(group)
    with new_threads_single_threaded():
        works = []
        for _ in range(8):
            outputs = [torch.empty(max(1, 2**18 // world)) for _ in range(world)]
            works.append(dist.all_gather(outputs, torch.zeros_like(outputs[0]), group=group, async_op=True))
        for work in works:
            work.wait()


def gloo_group() -> dist.ProcessGroup:
    """A new gloo group (every rank calls this at the same point), its worker threads settled."""
    group = dist.new_group(backend="gloo")
    _settle_worker_threads(group)
    return group


# (the default group, the control group made for it): see control_group().
_control: tuple[Any, dist.ProcessGroup] | None = None


def control_group() -> dist.ProcessGroup:
    """The one gloo group of this app's control traffic (the step-boundary agreement, the checkpoints' barriers
    and checks): the default group itself where that is gloo, else one gloo group, made at the first call (a
    collective) and kept: CPU-side collectives that never sync a GPU or wait behind NCCL traffic."""
    global _control
    world = dist.group.WORLD
    if _control is None or _control[0] is not world:
        # The fake backend (fsdp-research simulate) serves as it is: it has no peers to reach.
        _control = (world, world if dist.get_backend() in ("gloo", "fake") else gloo_group())
    return _control[1]


# How many groups have formed on torchrun's store (see _group_store).
_GENERATION = "fsdp_research/groups_formed"


def _group_store(store: dist.Store) -> dist.Store:
    """torchrun's store, under a prefix of this group's own: the store outlives a failed group, and a group torchrun
    restarts would otherwise find the dead group's addresses there ("Gloo connectFullMesh failed"). The prefix is
    how many groups formed before: every rank reads it before the group forms, and rank 0 counts the group once it
    has (TORCHELASTIC_RESTART_COUNT cannot serve: an agent whose workers stop for another node's failure restarts
    them without counting it, so the ranks of one group can see different counts)."""
    return dist.PrefixStore(f"fsdp_research/group_{store.add(_GENERATION, 0)}", store)


# (node, pid) of every rank of the group this process joined: what names a rank that died.
_members: list | None = None


def _node() -> str:
    """This process's node: SLURM's name for it in a job step (several nodes may share a host), else the host."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def members() -> list:
    """[node, pid] of each rank, in rank order."""
    return [list(m) for m in _members or []]


def dead_ranks() -> list[int]:
    """The ranks on this node whose process has gone (others' nodes cannot be asked)."""
    node = _node()
    return [rank for rank, (n, pid) in enumerate(_members or []) if n == node and not _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


def restarted() -> bool:
    """Whether this process belongs to a group its launcher restarted (torchrun after a failure, a requeued
    SLURM job): its run goes on in the run dir it had."""
    env = os.environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", 0) or 0) > 0 or int(env.get("SLURM_RESTART_COUNT", 0) or 0) > 0


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


def _worker(local_rank: int, fn: Callable, nprocs: int, port: int, args: tuple, env: dict, cwd: str) -> None:
    # A forkserver's child inherits the server's environment and folder, not its caller's: both come along.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    fn(*args)


# What this app's own launcher passes on to its workers, as torchrun and srun do.
FORWARDED = (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1, signal.SIGINT)


def spawn(fn: Callable, nprocs: int, *args: Any, preload: tuple[str, ...] = ()) -> None:
    """Run fn(*args) in nprocs fresh worker processes on this node, as torchrun would: a signal this process gets
    is passed on to them; raises ProcessExitedException if any fails (the others are stopped). With `preload`
    (modules), the workers are forked from a forkserver that imported them once (CPU only: CUDA cannot be
    forked), each worker still a new process: ~0.1 s a start instead of importing torch and transformers anew."""
    if preload:
        mp.set_forkserver_preload(list(preload))
    context = mp.start_processes(
        _worker,
        args=(fn, nprocs, _free_port(), args, dict(os.environ), os.getcwd()),
        nprocs=nprocs,
        start_method="forkserver" if preload else "spawn",
        join=False,
    )

    def forward(signum, frame) -> None:
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    # Signals reach the main thread only (a caller on another thread, e.g. a test's pool, forwards nothing).
    main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED} if main else {}
    try:
        while not context.join():
            pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
