"""Hydra callback for sweeps: a sweep that cannot run (zero jobs; on SLURM no sbatch or an unknown partition)
fails before any job starts; a failed job does not stop the others (the trainer records it in its status.json
and returns); at the end the sweep names the failed jobs and exits non-zero."""
import json
import os
import sys
from typing import Any, List, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .slurm_submit import SubmitError, check_partition, check_sbatch


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


def _empty_sweeps(task_overrides: List[str]) -> List[str]:
    """The sweeps of the command line with no values (e.g. range(0,0)): each makes the sweep zero jobs.
    Glob sweeps need Hydra's config loader to expand, so they are left to Hydra."""
    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    return [o.input_line for o in parsed
            if (o.is_choice_sweep() or o.is_range_sweep()) and not list(o.sweep_string_iterator())]


def check_sweep(config: DictConfig) -> None:
    """Raises SubmitError when the sweep would launch no job, or could not be submitted to SLURM."""
    empty = _empty_sweeps(config.hydra.overrides.task)
    if empty:
        raise SubmitError(f"a sweep of zero jobs: {' '.join(empty)} has no values")
    launcher = config.hydra.launcher
    if launcher._target_.endswith("SlurmLauncher"):
        check_sbatch()
        if launcher.partition:
            check_partition(launcher.partition)


class SweepStatus(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_sweep(config)
        except SubmitError as err:
            # Hydra would otherwise fail later, inside the launcher, with a traceback.
            print(f"error: {err}; nothing launched", file=sys.stderr)
            sys.exit(2)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = config.hydra.sweep.dir
        failed = [(job, status, error) for job, status, error in job_statuses(sweep_dir) if status != "completed"]
        if failed:
            lines = [f"  #{job} [{_overrides(sweep_dir, job)}]: {status} {error}".rstrip()
                     for job, status, error in failed]
            print(f"error: {len(failed)} job(s) of the sweep in {sweep_dir} did not complete:\n" + "\n".join(lines),
                  file=sys.stderr)
            sys.exit(1)
