"""Sweeps: the job dirs of a sweep (a Hydra multirun's <n>/, or a SLURM array's), and the Hydra callback that
guards one. A sweep that cannot run (zero jobs; on SLURM no sbatch or an unknown partition) fails before any
job starts; a failed job does not stop the others (it records itself in its status.json); at the end the sweep
names the failed jobs and exits non-zero."""

import os
import sys
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .errors import SubmitError
from .rundir import outcome
from .slurm import check_partition, check_sbatch


def job_dirs(sweep_dir: str) -> list[str]:
    """The sweep's job dirs (<sweep dir>/<n>/), in job order."""
    if not os.path.isdir(sweep_dir):
        return []
    names = (d for d in os.listdir(sweep_dir) if d.isdigit() and os.path.isdir(os.path.join(sweep_dir, d)))
    return [os.path.join(sweep_dir, d) for d in sorted(names, key=int)]


def job_overrides(job_dir: str) -> list[str]:
    """The command-line overrides the job ran with (Hydra's record of them), or none."""
    path = os.path.join(job_dir, ".hydra", "overrides.yaml")
    return list(OmegaConf.load(path)) if os.path.exists(path) else []


def _outcome(job_dir: str) -> tuple[str, str]:
    status = outcome(job_dir)
    if not status:
        return "unknown", "no status.json: the job never ran or was killed"
    return status["status"], status.get("error") or ""


def _empty_sweeps(task_overrides: list[str]) -> list[str]:
    """The sweeps of the command line with no values (e.g. range(0,0)): each makes the sweep zero jobs.
    Glob sweeps need Hydra's config loader to expand, so they are left to Hydra."""
    parsed = OverridesParser.create().parse_overrides(list(task_overrides))
    return [
        o.input_line
        for o in parsed
        if (o.is_choice_sweep() or o.is_range_sweep()) and not list(o.sweep_string_iterator())
    ]


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
        failed = [(job, *outcome) for job in job_dirs(sweep_dir) if (outcome := _outcome(job))[0] != "completed"]
        if failed:
            lines = [
                f"  #{os.path.basename(job)} [{' '.join(job_overrides(job))}]: {status} {error}".rstrip()
                for job, status, error in failed
            ]
            print(
                f"error: {len(failed)} job(s) of the sweep in {sweep_dir} did not complete:\n" + "\n".join(lines),
                file=sys.stderr,
            )
            sys.exit(1)
