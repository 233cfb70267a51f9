"""The run directory, decided here and nowhere else: where a run lives (checkpoint.resume=<path> continues in
that run's dir; a group torchrun restarts finds the dir its first attempt chose), which checkpoint it resumes from,
whether a fresh start may use it, and its status.json."""

import datetime
import json
import logging
import os
import socket
from typing import Any

import torch.distributed as dist

from fsdp_research.checkpoint.resume import checkpoints_in, is_step_dir, verify
from fsdp_research.distributed.processes import restarted
from fsdp_research.errors import ConfigError

log = logging.getLogger("fsdp_research")

STATUS = "status.json"
# What a run writes, as its last lines name it (besides its checkpoints).
_OUTPUTS = (("metrics", "metrics.jsonl"), ("log", "train.log"), ("export", "export"), ("W&B", "wandb"))


# Where rank 0 of a torchrun job's first attempt leaves its run dir: torchrun's own store (the agents'), under a key
# of no attempt's prefix, outlives the attempts, reaches every node and goes with the job.
_RUN_DIR_KEY = "fsdp_research/run_dir"
# Why a restarted torchrun group could not find its run dir (said by check_restart, before any compute).
_lost: str | None = None
# Whether this launch continues a run an earlier attempt of the same torchrun job started (its run dir was in
# torchrun's store): a restart, whatever this agent's restart count says.
_continued = False


def _torchrun_store() -> dist.Store | None:
    """A client of torchrun's store where the workers reach the agents' (TORCHELASTIC_USE_AGENT_STORE); None
    outside torchrun or where each attempt's rank 0 hosts a store of its own."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    timeout = datetime.timedelta(seconds=60)
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)


def this_launch(default: str) -> str:
    """The run dir of this launch when nothing names one: under torchrun, the one its first attempt chose (a
    restarted group goes on with that run, whichever node its rank 0 is on now), else default. Called by every
    rank when Hydra makes the run dir (rank 0's is the run's)."""
    global _lost, _continued
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return default
    store = _torchrun_store()
    # The store lives as long as the torchrun job: a run dir in it is an earlier attempt's. Asked first, since an
    # agent restarts its workers for another node's failure without counting it (TORCHELASTIC_RESTART_COUNT 0).
    if store is not None and store.check([_RUN_DIR_KEY]):
        _continued = True
        return store.get(_RUN_DIR_KEY).decode()
    if not restarted():
        if store is not None and int(os.environ.get("RANK", 0)) == 0:
            store.set(_RUN_DIR_KEY, os.path.abspath(default))
        return default
    _lost = "torchrun restarted this group and its first attempt's run dir is not in torchrun's store" + (
        "" if store is not None else " (this rendezvous gives the workers no agent store)"
    )
    return default


def check_restart(resume: str) -> None:
    """A restarted torchrun group that lost its run dir (and is not told it by checkpoint.resume) stops here
    instead of training from step 0 elsewhere."""
    if _lost is not None and resume in ("auto", "never"):
        raise ConfigError("checkpoint.resume", _lost, "give checkpoint.resume=<the run dir> on torchrun's command line")


def resolve(resume: str, default: str) -> str:
    """The run dir: the one checkpoint.resume points into (a run dir, or one of its step dirs), else default."""
    if resume in ("auto", "never"):
        return default
    path = os.path.abspath(os.path.expanduser(resume))
    return os.path.dirname(os.path.dirname(path)) if is_step_dir(path) else path


def resume_point(resume: str, run_dir: str) -> str | None:
    """The step dir to resume from: the newest complete one (skipping broken ones, with a warning), or None.
    resume=never refuses a run dir that already holds checkpoints: they belong to another run (unless this is a
    restart of the run, by torchrun or a SLURM requeue: they are its own)."""
    if resume == "never" and (restarted() or _continued):
        resume = "auto"
    if resume == "never":
        if checkpoints_in(os.path.join(run_dir, "checkpoints")):
            raise ConfigError(
                "checkpoint.resume",
                f"is never, but {run_dir} already holds checkpoints",
                "use a new hydra.run.dir, or checkpoint.resume=auto to continue that run",
            )
        return None
    path = run_dir if resume == "auto" else os.path.abspath(os.path.expanduser(resume))
    if resume != "auto" and not os.path.isdir(path):
        raise ConfigError(
            "checkpoint.resume",
            f"{path} does not exist",
            "give a run dir or a checkpoints/step_<N> dir, or use auto/never",
        )
    candidates = [path] if is_step_dir(path) else [d for _, d in checkpoints_in(os.path.join(path, "checkpoints"))]
    for step_dir in candidates:
        problem = verify(step_dir)
        if problem is None:
            return step_dir
        log.warning(f"skipping checkpoint {step_dir}: {problem}")
    if resume != "auto":
        raise ConfigError(
            "checkpoint.resume",
            f"no complete checkpoint in {path}",
            "point it at a complete step dir, or use auto/never",
        )
    return None


def read_status(run_dir: str) -> dict[str, Any]:
    """The run's status.json ({"status", "error", ...}); empty when absent or unreadable."""
    try:
        with open(os.path.join(run_dir, STATUS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def outcome(run_dir: str) -> dict[str, Any]:
    """The run's status as a reader should take it: a run recorded as running whose process on this host is gone
    died without a word (SIGKILL, OOM, a lost node), so it failed."""
    status = read_status(run_dir)
    if status.get("status") == "running" and status.get("host") == socket.gethostname():
        if not os.path.exists(f"/proc/{status.get('pid')}"):
            return {**status, "status": "failed", "error": f"died without a word (pid {status.get('pid')} is gone)"}
    return status


def write_status(run_dir: str, status: str, error: str | None = None, **details: Any) -> None:
    """<run dir>/status.json: running (with the pid and host of rank 0), completed, preempted (with whether it
    asks to be requeued), interrupted or failed (with the one-line reason), for sweeps and the report; written
    whole (temp + rename), so a reader never sees half of it. A command refused before it trained leaves an
    earlier run's record as it was."""
    if status == "failed" and read_status(run_dir).get("status", "running") not in ("running", "failed"):
        return
    if status == "running":
        details = {**details, "pid": os.getpid(), "host": socket.gethostname()}
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATUS)
    with open(path + ".tmp", "w") as f:
        json.dump({"status": status, "error": error, **details}, f)
    os.replace(path + ".tmp", path)


def search_path(hydra) -> list[str]:
    """The command's hydra.searchpath override (a user project's conf/), from Hydra's record of a launch: what
    composing the run again needs too."""
    return [o for o in hydra.overrides.hydra if o.lstrip("+").startswith("hydra.searchpath=")]


def written(run_dir: str) -> list[str]:
    """What a finished run leaves in its dir, each by its path, and how to plot it: the run's last lines."""
    found = [
        f"{what} {os.path.join(run_dir, name)}"
        for what, name in _OUTPUTS
        if os.path.exists(os.path.join(run_dir, name))
    ]
    steps = checkpoints_in(os.path.join(run_dir, "checkpoints"))
    if steps:
        found.append(f"checkpoints {os.path.join(run_dir, 'checkpoints')} (newest step_{steps[0][0]})")
    return [f"wrote: {', '.join(found)}", f"plot it: fsdp-research report {run_dir}"]
