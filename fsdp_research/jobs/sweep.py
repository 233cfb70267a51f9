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

from fsdp_research.config.schema import sweep_direction, swept
from fsdp_research.errors import ConfigError, SubmitError
from fsdp_research.jobs.slurm import check_partition, check_sbatch
from fsdp_research.metrics.sinks import read_records
from fsdp_research.train.rundir import outcome

# Where a sweep's launcher records the command it ran (Hydra's record); a re-run compares its own against it.
MULTIRUN = "multirun.yaml"


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


def sweep_value(run_dir: str, name: str) -> float | None:
    """The run's value of trainer.sweep_metric, from its metrics.jsonl: the key's last value (the last eval loss,
    the last logged loss, ...), or the summary's median tokens/s; None when the run logged none."""
    records = read_records(run_dir)
    if name == "tokens_per_s":
        values = [r["summary"].get("median_tokens_per_s") for r in records if "summary" in r]
    else:
        values = [r[name] for r in records if name in r]
    values = [v for v in values if v is not None]
    return float(values[-1]) if values else None


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


def is_search(config: DictConfig) -> bool:
    """Whether the sweep is an Optuna search (hydra/sweeper=optuna): its jobs' objective is what it optimizes."""
    return str(config.hydra.sweeper.get("_target_", "")).endswith("ResumableOptunaSweeper")


# The sweeper's settings that decide which trials a search's job dirs hold: a re-run must keep them.
SEARCH_KEYS = ("_target_", "study_name", "storage", "params", "search_space", "custom_search_space")


def _search_settings(config: DictConfig) -> dict[str, Any]:
    sweeper = config.hydra.get("sweeper")
    sweeper = OmegaConf.to_container(sweeper, resolve=False) if sweeper is not None else {}
    return {key: sweeper.get(key) for key in SEARCH_KEYS}


def _check_resume(config: DictConfig) -> None:
    """A sweep dir that holds a sweep is continued only by the command that started it: the same task overrides
    (the same jobs), the same sweeper and search (study, storage, space); the launcher, n_trials, n_jobs, the
    sampler and other hydra.* keys may differ."""
    path = os.path.join(config.hydra.sweep.dir, MULTIRUN)
    if not os.path.exists(path):
        return
    made = OmegaConf.load(path)
    before, now = list(made.hydra.overrides.task), list(config.hydra.overrides.task)
    gone, new = [o for o in before if o not in now], [o for o in now if o not in before]
    parts = ([f"it had {' '.join(gone)}"] if gone else []) + ([f"this has {' '.join(new)}"] if new else [])
    if not parts and before != now:  # the order numbers a grid's jobs: another order is another sweep
        parts = [f"the same overrides in another order: {' '.join(before)}"]
    settings, mine = _search_settings(made), _search_settings(config)
    parts += [
        f"hydra.sweeper.{key} was {settings[key]}, is {mine[key]}" for key in SEARCH_KEYS if settings[key] != mine[key]
    ]
    if parts:
        raise SubmitError(
            f"hydra.sweep.dir={config.hydra.sweep.dir} holds a sweep of another command ({'; '.join(parts)}): re-run "
            "that command to continue it, or give a new hydra.sweep.dir"
        )


def _check_search(config: DictConfig) -> None:
    """An Optuna search needs its extra installed and an objective every trial logs."""
    try:
        import hydra_plugins.hydra_optuna_sweeper  # noqa: F401
        import optuna  # noqa: F401
    except ImportError:
        raise SubmitError(
            "hydra/sweeper=optuna needs Optuna: pip install -e '.[sweep]' (scripts/setup.sh installs it)"
        ) from None
    metric, key = swept(str(config.trainer.sweep_metric), config.trainer.get("objective"))
    if metric.startswith("eval_") and not config.trainer.eval_interval:
        raise ConfigError(
            key,
            f"is {metric}, but trainer.eval_interval=0 logs no eval metrics",
            "set trainer.eval_interval>0, or trainer.sweep_metric=loss|tokens_per_s",
        )
    direction, known = str(config.hydra.sweeper.direction), sweep_direction(metric)
    if known is None and direction not in ("minimize", "maximize"):
        raise ConfigError(
            "hydra.sweeper.direction",
            f"{key}={metric} is not a metric whose direction the framework knows",
            "set hydra.sweeper.direction=minimize or maximize",
        )
    if known is not None and direction != known:
        raise ConfigError(
            "hydra.sweeper.direction",
            f"is {direction}, but {key}={metric} is to {known}",
            f"leave hydra.sweeper.direction out: it follows {key}",
        )


def check_sweep(config: DictConfig) -> None:
    """Raises SubmitError or ConfigError when the sweep would launch no job, continue another command's sweep,
    search without Optuna or an objective, or could not be submitted to SLURM."""
    empty = _empty_sweeps(config.hydra.overrides.task)
    if empty:
        raise SubmitError(f"a sweep of zero jobs: {' '.join(empty)} has no values")
    _check_resume(config)
    if is_search(config):
        _check_search(config)
    launcher = config.hydra.launcher
    if launcher._target_.endswith("SlurmLauncher"):
        check_sbatch()
        if launcher.partition:
            check_partition(launcher.partition)


class SweepStatus(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_sweep(config)
        except (SubmitError, ConfigError) as err:
            # Hydra would otherwise fail later, inside the launcher, with a traceback.
            print(f"error: {err}; nothing launched", file=sys.stderr)
            sys.exit(2)
        sweep_dir = config.hydra.sweep.dir
        if os.path.exists(os.path.join(sweep_dir, MULTIRUN)):
            print(f"continuing the sweep in {sweep_dir}", flush=True)
        else:
            print(
                f"sweep dir: {sweep_dir}; after a crash, the same command with hydra.sweep.dir={sweep_dir} "
                "continues it",
                flush=True,
            )

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
        print(f"the sweep is done; its table and plots: fsdp-research report {sweep_dir}", flush=True)
