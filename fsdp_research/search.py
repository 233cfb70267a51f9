"""Optuna searches through Hydra (hydra/sweeper=optuna) that continue where they stopped. The study lives in
SQLite in the sweep dir and trial <n> runs as job <n> of the sweep. A re-run of the same command finds the trials
that were asked but never told (the launcher died, or a signal stopped the sweep) and runs each again in its own
dir: the job resumes from its checkpoint, or, completed, returns its objective read back. Only then are new trials
asked, up to n_trials in all. Imports Optuna: only the sweeper plugin imports this module."""

import functools
import logging
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

from .config import typed
from .errors import ConfigError
from .launch import check_job
from .sweep import MULTIRUN

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


def _refuse(message: str) -> None:
    print(f"error: {message}; nothing launched", file=sys.stderr)
    sys.exit(2)


class ResumableOptuna(OptunaSweeperImpl):
    """hydra-optuna-sweeper's search, made resumable: its settings, search space and trial set-up as they are;
    the study's loop is this class's."""

    def sweep(self, arguments: list[str]) -> None:
        self._process_searchspace_config()
        space, fixed = create_params_from_overrides(self._parse_sweeper_params_config() + list(arguments))
        space = {**(self.search_space_distributions or {}), **space}
        for name in fixed:
            space.pop(name, None)
        self._check_keys(space, fixed)
        sweep_dir = str(self.config.hydra.sweep.dir)
        os.makedirs(sweep_dir, exist_ok=True)  # the SQLite file's, before any job makes it
        OmegaConf.save(self.config, os.path.join(sweep_dir, MULTIRUN))
        study = optuna.create_study(
            study_name=self.study_name,
            storage=self.storage,
            sampler=self._sampler(space),
            directions=self._get_directions(),
            load_if_exists=True,
        )
        before = study.get_trials(deepcopy=False)
        interrupted = [t for t in before if t.state == TrialState.RUNNING]
        if before:
            log.info(
                f"continuing the study in {self.storage}: {len(before) - len(interrupted)} trial(s) finished, "
                f"{len(interrupted)} interrupted (run again in their own dirs)"
            )
        for trial in interrupted:
            params = {**trial.params, **fixed}
            self._run(study, [trial.number], [tuple(f"{name}={value}" for name, value in params.items())])
        to_go = self.n_trials - len(before)
        while to_go > 0:
            batch = [study.ask() for _ in range(min(self.n_jobs, to_go))]
            failed = self._run(study, [t.number for t in batch], self._configure_trials(batch, space, fixed))
            to_go -= len(batch)
            if failed / len(batch) > self.max_failure_rate:
                log.error(f"{failed} of {len(batch)} trials failed, over max_failure_rate={self.max_failure_rate}")
                break
        self._write_results(study, sweep_dir)

    def _check_keys(self, space: dict[str, BaseDistribution], fixed: dict[str, Any]) -> None:
        """Before any trial, one line and exit 2 where a searched key is not in the config, or a trial's config
        would fail the job's own checks (a free-form group's unknown keyword): each key composed with one of its
        values, then the whole config with one value each, checked as a job checks it."""
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
        trial = self.hydra_context.config_loader.load_sweep_config(self.config, [*common, *samples])
        try:
            check_job(typed(OmegaConf.masked_copy(trial, [key for key in trial if key != "hydra"])))
        except ConfigError as err:
            _refuse(f"{err} (a key hydra.sweeper.params searches)")

    def _sampler(self, space: dict[str, BaseDistribution]) -> optuna.samplers.BaseSampler:
        """The sampler; a grid's is given the search space. A seeded one continuing a study is reseeded by the
        trials it holds (deterministic, and not the first trials' points again)."""
        if isinstance(self.sampler, functools.partial):  # GridSampler, given its grid here
            grid = {name: self._to_grid_sampler_choices(d) for name, d in space.items()}
            self.n_trials = min(self.n_trials, functools.reduce(lambda n, v: n * len(v), grid.values(), 1))
            return self.sampler(grid)
        sampler_cfg = self.config.hydra.sweeper.sampler
        held = len(optuna.load_study(study_name=self.study_name, storage=self.storage).trials) if self._exists() else 0
        if held and sampler_cfg.get("seed") is not None:
            return instantiate(sampler_cfg, seed=sampler_cfg.seed + held)
        return self.sampler

    def _exists(self) -> bool:
        return self.study_name in {s.study_name for s in optuna.get_all_study_summaries(storage=self.storage)}

    def _run(self, study: optuna.Study, numbers: list[int], overrides: Sequence[Sequence[str]]) -> int:
        """Launches trial numbers[i] with overrides[i] as job numbers[i], and tells Optuna each one's outcome: its
        objective, or failed (a job that failed, or logged no objective). Returns how many failed."""
        failed = 0
        for part in _consecutive(numbers):
            returns = self.launcher.launch(list(overrides[part]), initial_job_idx=numbers[part][0])
            for number, ret in zip(numbers[part], returns):
                try:
                    value = ret.return_value
                except Exception as err:  # the task raised: Hydra's JobReturn re-raises it here
                    log.warning(f"trial {number} failed: {err}")
                    value = None
                if value is None:
                    log.warning(f"trial {number} failed (job {number}'s status.json says why)")
                    study.tell(number, state=TrialState.FAIL)
                    failed += 1
                else:
                    study.tell(number, float(value))
        return failed

    def _write_results(self, study: optuna.Study, sweep_dir: str) -> None:
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
        OmegaConf.save(OmegaConf.create(results), os.path.join(sweep_dir, RESULTS))
        if best:
            log.info(f"best trial {best.number}: {best.value} with {best.params}")
        else:
            log.warning("no trial completed: no best trial")
