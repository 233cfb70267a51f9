"""Hydra callback for sweeps: a failed job does not stop the others (the trainer records it in its
status.json and returns); at the end the sweep names the failed jobs and exits non-zero."""
import json
import os
import sys
from typing import Any, List, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def job_statuses(sweep_dir: str) -> List[Tuple[str, str, str]]:
    """(job dir name, status, error) for every job dir of the sweep, in job order."""
    jobs = sorted((d for d in os.listdir(sweep_dir) if d.isdigit()), key=int) if os.path.isdir(sweep_dir) else []
    out = []
    for job in jobs:
        try:
            with open(os.path.join(sweep_dir, job, "status.json")) as f:
                status = json.load(f)
            out.append((job, status["status"], status.get("error") or ""))
        except (OSError, ValueError):
            out.append((job, "unknown", "no status.json: the job never ran or was killed"))
    return out


def _overrides(sweep_dir: str, job: str) -> str:
    path = os.path.join(sweep_dir, job, ".hydra", "overrides.yaml")
    return " ".join(OmegaConf.load(path)) if os.path.exists(path) else ""


class SweepStatus(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        failed = [(job, status, error) for job, status, error in job_statuses(sweep_dir) if status != "completed"]
        if failed:
            lines = [f"  #{job} [{_overrides(sweep_dir, job)}]: {status} {error}".rstrip()
                     for job, status, error in failed]
            print(f"error: {len(failed)} job(s) of the sweep in {sweep_dir} did not complete:\n" + "\n".join(lines),
                  file=sys.stderr)
            sys.exit(1)
