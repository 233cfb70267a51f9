"""The run directory, decided here and nowhere else: where a run lives (checkpoint.resume=<path> continues in
that run's dir), which checkpoint it resumes from, whether a fresh start may use it, and its status.json."""

import json
import logging
import os
from typing import Any

from .checkpoint import checkpoints_in, is_step_dir, verify
from .errors import ConfigError

log = logging.getLogger("fsdp_research")

STATUS = "status.json"


def resolve(resume: str, default: str) -> str:
    """The run dir: the one checkpoint.resume points into (a run dir, or one of its step dirs), else default."""
    if resume in ("auto", "never"):
        return default
    path = os.path.abspath(os.path.expanduser(resume))
    return os.path.dirname(os.path.dirname(path)) if is_step_dir(path) else path


def resume_point(resume: str, run_dir: str) -> str | None:
    """The step dir to resume from: the newest complete one (skipping broken ones, with a warning), or None.
    resume=never refuses a run dir that already holds checkpoints: they belong to another run."""
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
    """The run's status.json ({"status", "error"}); empty when absent or unreadable."""
    try:
        with open(os.path.join(run_dir, STATUS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def write_status(run_dir: str, status: str, error: str | None = None) -> None:
    """<run dir>/status.json: running, completed, preempted or failed (with the one-line reason), for sweeps
    and the report; written whole (temp + rename), so a reader never sees half of it. A command refused
    before it trained leaves an earlier run's record as it was."""
    if status == "failed" and read_status(run_dir).get("status", "running") != "running":
        return
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATUS)
    with open(path + ".tmp", "w") as f:
        json.dump({"status": status, "error": error}, f)
    os.replace(path + ".tmp", path)
