"""Hydra wiring, for train.py, the command-line tools and the tests (the library never imports it): the schema
in Hydra's ConfigStore, the resolvers conf/ uses, and compose() for a config without @hydra.main."""

import contextlib
import difflib
import os
import shutil
from collections.abc import Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from omegaconf import DictConfig, OmegaConf

from fsdp_research.config.schema import flat, schema, sweep_direction, swept, typed
from fsdp_research.distributed.processes import launch_env
from fsdp_research.errors import ConfigError
from fsdp_research.train import rundir

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def _run_dir(resume: str, default: str) -> str:
    return rundir.resolve(resume, rundir.this_launch(default))


def _rank0_only(value: Any) -> Any:
    env = launch_env()
    return value if env is None or env.rank == 0 else None


# hydra/sweeper=optuna: an Optuna search (fsdp_research/jobs/optuna_search.py) that a re-run of the same command with
# hydra.sweep.dir=<its dir> continues. hydra-optuna-sweeper's settings, with: the study in SQLite in the sweep dir
# under a fixed name, a seeded sampler (the same command samples the same trials), the direction following
# trainer.sweep_metric, trials one after another (n_jobs: trials per batch, one SLURM array each), and a failed trial
# told as failed while the search goes on. The search space is hydra.sweeper.params (conf/hparams_search/).
OPTUNA_SWEEPER = {
    "_target_": "hydra_plugins.fsdp_research_sweeper.resumable_optuna.ResumableOptunaSweeper",
    "sampler": {"_target_": "optuna.samplers.TPESampler", "seed": 0},
    "direction": "${sweep_direction:${trainer.sweep_metric},${trainer.objective}}",
    "storage": "sqlite:///${hydra.sweep.dir}/optuna.db",
    "study_name": "fsdp_research",
    "n_trials": 20,
    "n_jobs": 1,
    "max_failure_rate": 1.0,  # the share of a batch's trials that may fail before the search stops
    "search_space": None,
    "params": None,
    "custom_search_space": None,
}


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=schema())
    # Hydra's plugin scan (re)registers hydra-optuna-sweeper's own node: it goes first, so that ours replaces it.
    Plugins.instance()
    ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OPTUNA_SWEEPER, provider="fsdp_research")
    # hydra.run.dir: resuming from a path continues in that run's directory.
    OmegaConf.register_new_resolver("run_dir", _run_dir, replace=True)
    OmegaConf.register_new_resolver("rank0_only", _rank0_only, replace=True)
    # hydra/sweeper=optuna: the study's direction follows trainer.sweep_metric (or its deprecated name); "unknown"
    # for a metric the framework does not log, refused by the sweep's checks (jobs.sweep) before any job.
    OmegaConf.register_new_resolver(
        "sweep_direction", lambda metric, old: sweep_direction(swept(metric, old)[0]) or "unknown", replace=True
    )


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python train.py <overrides>` runs with, typed (Hydra's compose API over conf/)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from fsdp_research.data.tokenizer import resolve_tokenizer

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = typed(hydra_compose(config_name="train", overrides=list(overrides)))
    resolve_tokenizer(cfg)
    return cfg


# In <run dir>/.hydra/: the overrides of each launch of the run, its first then each resume's (Hydra rewrites
# overrides.yaml at every launch with that launch's alone).
HISTORY = "overrides_history.yaml"
# What a resume cannot change: the shapes of the checkpoint's weights, the ids and the order of the data (its
# windows: their count, the held-out split, the chat rendering and packing), the eval sets. The global batch size
# may change: the data goes on from the samples consumed.
FIXED = ("model.", "data.kind", "data.paths", "data.sources", "data.text_field", "data.seq_len", "data.tokenizer",
         "data.hub_", "data.split", "data.eval_fraction", "data.max_windows", "data.max_documents",
         "data.num_sequences", "data.eval_paths", "data.eval_sources", "data.messages_field", "data.prompt_field",
         "data.completion_field", "data.chat_template", "data.loss_on", "data.truncation", "data.packing",
         "data.document_masking", "trainer.seed")  # fmt: skip
# A resume's weights are the checkpoint's; the MoE balancing rate is a training setting.
CHANGEABLE = ("model.load_weights", "model.moe.")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _merged(overrides: Sequence[str]) -> list[str]:
    """Each key's last override, in the order of those (Hydra refuses a key given twice)."""
    last = {}
    for override in overrides:
        last.pop(_key(override), None)
        last[_key(override)] = override
    return list(last.values())


def _check_fixed(before: DictConfig, now: DictConfig) -> None:
    old, new = (flat(OmegaConf.to_container(c, resolve=True)) for c in (before, now))
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(FIXED) and not key.startswith(CHANGEABLE) and old.get(key) != new.get(key):
            raise ConfigError(
                key,
                f"cannot change on a resume ({old.get(key)!r} -> {new.get(key)!r}): the checkpoint's weights and "
                "data position are the run's",
                "resume without it, or start a new run with it (checkpoint.resume=never)",
            )


def _record(folder: str, history: list[list[str]], cfg: DictConfig) -> None:
    OmegaConf.save(OmegaConf.create(history), os.path.join(folder, HISTORY))
    OmegaConf.save(OmegaConf.create([o for launch in history for o in launch]), os.path.join(folder, "overrides.yaml"))
    OmegaConf.save(cfg, os.path.join(folder, "config.yaml"))


def continue_run(cfg: DictConfig) -> DictConfig:
    """The config train.py runs. With checkpoint.resume=<a run or step dir> (one run, not a sweep), the run as it
    was: its own overrides (as it started, then each resume's), then this command's, which win; one that cannot
    change on a resume is refused (ConfigError). Every rank reads the run's history (torchrun's ranks other than 0
    have no run dir of Hydra's), so all compose the same config; rank 0 keeps it in the run dir's .hydra/
    (overrides.yaml: every launch's overrides in order; config.yaml: the config run)."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig
    from hydra.errors import HydraException
    from hydra.types import RunMode

    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        return cfg
    now = list(hydra.overrides.task)
    resuming = cfg.checkpoint.resume not in ("auto", "never")
    run_dir = rundir.resolve(cfg.checkpoint.resume, hydra.runtime.output_dir)
    folder = os.path.join(run_dir, ".hydra")
    path = os.path.join(folder, HISTORY)
    history = OmegaConf.to_container(OmegaConf.load(path)) if os.path.exists(path) else None
    if resuming and (not os.path.isdir(run_dir) or set(os.listdir(run_dir)) <= {".hydra"}):  # Hydra has just made it
        if history is None and hydra.output_subdir:  # not left made: a mistyped path would look like a run
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(run_dir)
        raise ConfigError(
            "checkpoint.resume",
            f"{cfg.checkpoint.resume} does not exist (or holds no run)",
            "give a run dir or one of its checkpoints/step_<N> dirs",
        )
    if not resuming or history is None:
        # A fresh start (no checkpoint to continue from) begins the history anew; a requeued or restarted run
        # (checkpoint.resume=auto with checkpoints) keeps it.
        fresh = not os.path.isdir(os.path.join(run_dir, "checkpoints")) or not os.listdir(f"{run_dir}/checkpoints")
        if hydra.output_subdir and (fresh or history is None):
            OmegaConf.save(OmegaConf.create([now]), path)
        return cfg
    before = _merged([o for launch in history for o in launch])
    try:
        was = hydra_compose(config_name="train", overrides=[*before, *rundir.search_path(hydra)])
        composed = hydra_compose(config_name="train", overrides=[*_merged(before + now), *rundir.search_path(hydra)])
    except HydraException as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(
            "checkpoint.resume", f"the run's overrides no longer compose ({first})", "fix conf/"
        ) from None
    if hydra.output_subdir:  # what this launch of Hydra wrote over, back until the resume is accepted
        _record(folder, history, was)
    _check_fixed(was, composed)
    if hydra.output_subdir:
        _record(folder, [*history, now], composed)
        given = ", ".join(before) or "the defaults"
        print(f"continuing the run with its own config ({given}); given now, and winning: {', '.join(now)}")
    return composed


def _nearest(word: str, choices: Sequence[str]) -> str | None:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _known_keys() -> list[str]:
    """Every key of the default config (inside an initialized Hydra): what an unknown key is held against."""
    from hydra import compose as hydra_compose

    return list(flat(OmegaConf.to_container(hydra_compose(config_name="train"))))


def _unknown_key(key: str) -> ConfigError:
    near = _nearest(key, _known_keys())
    if near:
        return ConfigError(key, f"no such key (did you mean {near}?)", f"use {near}")
    return ConfigError(key, "no such key", "python train.py --cfg job lists the keys")


def _composition_error(err: Exception, overrides: Sequence[str]) -> ConfigError:
    """Hydra's error as one line naming the key (or group) and the fix."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(err)
    if isinstance(err, MissingConfigException) and "Could not find '" in text:
        group, option = text.split("Could not find '", 1)[1].split("'", 1)[0].rsplit("/", 1)
        options = [line.strip() for line in text.split("Available options in", 1)[-1].splitlines()[1:]]
        options = options[: next((i for i, o in enumerate(options) if o.startswith("Config search")), len(options))]
        near = _nearest(option, options)
        problem = f"no option {option!r}" + (f" (did you mean {near}?)" if near else "")
        return ConfigError(group, problem, f"use one of {', '.join(options)}")
    if isinstance(err, OverrideParseException):
        override = text.split("'", 2)[1] if text.count("'") >= 2 else text.splitlines()[0]
        return ConfigError(
            override.split("=", 1)[0], f"cannot parse {override!r}", "write <key>=<value>, e.g. trainer.max_steps=100"
        )
    cause = err.__cause__
    key = getattr(cause, "full_key", None) or ""
    if "Could not override" in text or "not in" in str(cause):
        return _unknown_key(key)
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), "")
    if "ListConfig" in str(cause):
        return ConfigError(key, f"{value!r} is not a list", f"write {key}=[{value}] (brackets; commas between items)")
    return ConfigError(
        key or "command line", str(cause or err).strip().splitlines()[0], "give a value of the key's type"
    )


def check_command_line(args: Sequence[str]) -> None:
    """The overrides of `python train.py <args>` compose: else ConfigError, one line naming the key (an unknown
    one with the nearest known, a `+` for a key no schema has, a list without brackets, an option a group does not
    have). Hydra's flags and a sweep (-m, whose values are lists) are Hydra's to parse."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException

    if any(arg.startswith("-") for arg in args):
        return
    # Hydra's own keys are its to check, but for the search path (a user project's conf/), which composition needs.
    overrides = [a for a in args if not a.lstrip("+~").startswith(("hydra.", "hydra/")) or "hydra.searchpath=" in a]
    register_configs()
    structure = schema()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        try:
            hydra_compose(config_name="train", overrides=overrides)
        except HydraException as err:
            raise _composition_error(err, overrides) from None
        for override in overrides:
            if override.startswith("+") and not override.startswith("++"):
                parent, _, name = override[1:].split("=", 1)[0].rpartition(".")
                node = OmegaConf.select(structure, parent) if parent else structure
                # A structured group (not a free-form one: a plug-in's kwargs, model.config) has no room for new keys.
                if isinstance(node, DictConfig) and OmegaConf.is_struct(node) is not False and name not in node:
                    raise _unknown_key(override[1:].split("=", 1)[0])
