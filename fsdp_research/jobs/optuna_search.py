"""Optuna searches through Hydra (hydra/sweeper=optuna) that continue where they stopped. The study lives in
SQLite in the sweep dir and trial <n> runs as job <n> of the sweep. A re-run of the same command finds the trials
that were asked but never told (the launcher died, or a signal stopped the sweep) and runs each again in its own
dir: the job resumes from its checkpoint, or, completed, returns its objective read back. Only then are new trials
asked, up to n_trials in all. Imports Optuna: only the sweeper plugin imports this module."""

import functools
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

import optuna
from hydra.errors import HydraException
from hydra.utils import instantiate
from hydra_plugins.hydra_optuna_sweeper._impl import OptunaSweeperImpl, create_params_from_overrides
from omegaconf import OmegaConf
from optuna.distributions import BaseDistribution, CategoricalDistribution
from optuna.trial import TrialState

from fsdp_research.config.schema import swept, typed
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.launch import check_job
from fsdp_research.jobs.sweep import MULTIRUN, job_overrides
from fsdp_research.train.rundir import read_status

log = logging.getLogger(__name__)

RESULTS = "optimization_results.yaml"


def _sample(distribution: BaseDistribution) -> Any:
    """One value the distribution can take (to compose a config with it)."""
    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    return distribution.low


def _consecutive(numbers: Sequence[int]) -> list[slice]:
    """The runs of consecutive trial numbers, as slices: the launcher numbers a batch's jobs from its first."""
    starts = [i for i in range(len(numbers)) if i == 0 or numbers[i] != numbers[i - 1] + 1]
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [len(numbers)])]


def _refuse(message: str, outcome: str = "nothing launched") -> None:
    print(f"error: {message}; {outcome}", file=sys.stderr)
    sys.exit(2)


class ResumableOptuna(OptunaSweeperImpl):
    """hydra-optuna-sweeper's search, made resumable: its settings, search space and trial set-up as they are;
    the study's loop is this class's."""

    def sweep(self, arguments: list[str]) -> None:
        if isinstance(self.sampler, functools.partial):  # GridSampler: a grid is the basic sweeper's
            _refuse(
                "hydra.sweeper.sampler: GridSampler is not supported; fix: for a grid use the basic sweeper "
                "(python train.py -m key=a,b,c), which resumes too"
            )
        self._process_searchspace_config()
        space, fixed = create_params_from_overrides(self._parse_sweeper_params_config() + list(arguments))
        space = {**(self.search_space_distributions or {}), **space}
        for name in fixed:
            space.pop(name, None)
        self._check_keys(space, fixed)
        self.sweep_dir = str(self.config.hydra.sweep.dir)
        os.makedirs(self.sweep_dir, exist_ok=True)  # the SQLite file's, before any job makes it
        OmegaConf.save(self.config, os.path.join(self.sweep_dir, MULTIRUN))
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=self.sampler,
            directions=self._get_directions(),
            load_if_exists=True,
        )
        before = study.get_trials(deepcopy=False)
        study.sampler = self._sampler(len(before))
        interrupted = [t for t in before if t.state == TrialState.RUNNING]
        if before:
            log.info(
                f"continuing the study in {self.storage}: {len(before) - len(interrupted)} trial(s) finished, "
                f"{len(interrupted)} interrupted (run again in their own dirs)"
            )
        # Killed between ask and its values: no job ever ran it.
        for trial in [t for t in interrupted if space and not t.params]:
            study.tell(trial.number, state=TrialState.FAIL)
            interrupted.remove(trial)
        if interrupted:
            self._run(study, [t.number for t in interrupted], [self._overrides_of(t) for t in interrupted])
        to_go = self.n_trials - len(before)
        while to_go > 0:
            batch = [study.ask() for _ in range(min(self.n_jobs, to_go))]
            failed = self._run(study, [t.number for t in batch], self._configure_trials(batch, space, fixed))
            to_go -= len(batch)
            if failed / len(batch) > self.max_failure_rate:
                log.error(f"{failed} of {len(batch)} trials failed, over max_failure_rate={self.max_failure_rate}")
                break
        self._write_results(study)

    def _check_keys(self, space: dict[str, BaseDistribution], fixed: dict[str, Any]) -> None:
        """Before any trial, one line and exit 2 where a searched key is not in the config, or (when the jobs run
        here, under the basic launcher: the machine and world size they will have) a trial's config would fail
        the job's own checks, e.g. a free-form group's unknown keyword: each key composed with one of its values,
        then the whole config with one value each, checked as a job checks it."""
        common = [f"{name}={value}" for name, value in fixed.items()]
        samples = [f"{name}={_sample(distribution)}" for name, distribution in space.items()]
        for name, sample in zip(space, samples):
            try:
                self.hydra_context.config_loader.load_sweep_config(self.config, [*common, sample])
            except HydraException as err:
                reason = str(err).strip().splitlines()[0]
                _refuse(
                    f"hydra.sweeper.params: {name} cannot be searched ({reason}); fix: name a key of the config "
                    "(python train.py --cfg job lists them), or a config group"
                )
        if not str(self.config.hydra.launcher._target_).endswith("BasicLauncher"):
            return
        trial = self.hydra_context.config_loader.load_sweep_config(self.config, [*common, *samples])
        try:
            check_job(typed(OmegaConf.masked_copy(trial, [key for key in trial if key != "hydra"])))
        except ConfigError as err:
            _refuse(f"{err} (a key hydra.sweeper.params searches)")

    def _sampler(self, held: int) -> optuna.samplers.BaseSampler:
        """The sampler of a study holding `held` trials; a seeded one continuing a study is reseeded by them
        (deterministic, and not the first trials' points again)."""
        sampler_cfg = self.config.hydra.sweeper.sampler
        if held and sampler_cfg.get("seed") is not None:
            return instantiate(sampler_cfg, seed=sampler_cfg.seed + held)
        return self.sampler

    def _job_dir(self, number: int) -> str:
        return os.path.join(self.sweep_dir, str(number))

    def _overrides_of(self, trial: optuna.trial.FrozenTrial) -> list[str]:
        """An interrupted trial's overrides, as it was started: its values and the fixed ones it was asked with
        (its user attributes), in its job dir's recorded order when that holds the same."""
        overrides = [f"{name}={value}" for name, value in {**trial.params, **trial.user_attrs}.items()]
        recorded = job_overrides(self._job_dir(trial.number))
        return recorded if sorted(recorded) == sorted(overrides) else overrides

    def _check_dirs(self, numbers: list[int], overrides: Sequence[Sequence[str]]) -> None:
        """A trial's job dir that holds a run of other values (a study not this sweep's: another study_name or
        storage, a deleted optuna.db) is refused before it is launched: its result would be told as the trial's."""
        for number, mine in zip(numbers, overrides):
            recorded = job_overrides(self._job_dir(number))
            if recorded and sorted(recorded) != sorted(mine):
                differ = " ".join(sorted(set(recorded) ^ set(mine)))
                _refuse(
                    f"{self._job_dir(number)} holds a run of other values than trial {number} of the study in "
                    f"{self.storage} ({differ}); fix: give a new hydra.sweep.dir, or the sweep's own optuna.db",
                    f"trial {number} not launched",
                )

    def _run(self, study: optuna.Study, numbers: list[int], overrides: Sequence[Sequence[str]]) -> int:
        """Launches trial numbers[i] with overrides[i] as job numbers[i], and tells Optuna each one's outcome: its
        objective, or failed (a job that failed, or logged no finite objective); a job a signal stopped (under
        SLURM: the array goes on) is left to the re-run, which resumes it. Returns how many failed."""
        self._check_dirs(numbers, overrides)
        failed = 0
        for part in _consecutive(numbers):
            returns = self.launcher.launch(list(overrides[part]), initial_job_idx=numbers[part][0])
            for number, ret in zip(numbers[part], returns):
                try:
                    value = ret.return_value
                except Exception as err:  # the task raised: Hydra's JobReturn re-raises it here
                    log.warning(f"trial {number}'s job raised: {err}")
                    value = None
                if value is not None and math.isfinite(value):
                    study.tell(number, float(value))
                    continue
                status = read_status(self._job_dir(number)).get("status")
                if status in ("preempted", "interrupted"):
                    log.warning(f"trial {number} {status}: left running, for the sweep's re-run to resume")
                    continue
                metric = swept(self.config.trainer.sweep_metric, self.config.trainer.get("objective"))[0]
                why = "status.json says why" if status != "completed" else f"no finite {metric}"
                log.warning(f"trial {number} failed ({why})")
                study.tell(number, state=TrialState.FAIL)
                failed += 1
        return failed

    def _write_results(self, study: optuna.Study) -> None:
        complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        best = study.best_trial if complete else None
        results = {
            "name": "optuna",
            "best_params": dict(best.params) if best else None,
            "best_value": best.value if best else None,
            "best_trial": best.number if best else None,
            "trials": len(study.trials),
            "complete": len(complete),
        }
        OmegaConf.save(OmegaConf.create(results), os.path.join(self.sweep_dir, RESULTS))
        if best:
            log.info(f"best trial {best.number}: {best.value} with {best.params}")
        else:
            log.warning("no trial completed: no best trial")
