"""Process orchestration, beside the recipe: train.py's entry (check the config once, then train here or in
distributed.nproc_per_node workers of this app's own), what every run records in status.json, how each
process exits (exit code 2 for bad input), requeueing a preempted SLURM job, and naming sweep jobs."""

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from torch.multiprocessing import ProcessExitedException

from fsdp_research.checkpoint.resume import checkpoints_in
from fsdp_research.config.schema import typed
from fsdp_research.data.tokenizer import resolve_tokenizer
from fsdp_research.distributed import forkserver
from fsdp_research.distributed.processes import dead_ranks, device_for, launch_env, members, spawn, starts_own_workers
from fsdp_research.errors import AnomalyError, CheckpointError, ConfigError, RewardError
from fsdp_research.jobs.sweep import sweep_value
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train import rundir
from fsdp_research.train.preemption import REQUEUE, HeldAfter, requeue
from fsdp_research.train.refusals import checked_plan
from fsdp_research.train.trainer import train

log = logging.getLogger("fsdp_research")

# Exit codes, as shells report a process a signal ended: Ctrl-C (SIGINT), SIGTERM.
INTERRUPTED, TERMINATED = 130, 143


def one_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def _failure(err: BaseException) -> str:
    """Why a run failed, in one line: the error, after the ranks on this node whose process is gone, if any
    (a rank that died makes the others fail in their next collective)."""
    dead = dead_ranks() if dist.is_initialized() else []
    return (f"rank(s) {', '.join(map(str, dead))} died; then " if dead else "") + one_line(err)


def run_worker(cfg: Any, run_dir: str) -> dict[str, Any]:
    """Train on this process's rank in run_dir; rank 0 records the outcome in status.json. Returns the outcome:
    {"status": completed or preempted, "requeue": whether the signal asks for it}."""
    env = launch_env()
    outcome: dict[str, Any] = {"status": "failed"}
    error = None
    held = HeldAfter()
    try:
        with held:
            result = train(cfg, run_dir)
        outcome = {"status": "completed"}
        if result.stop:
            outcome = {"status": "preempted", "requeue": result.stop == REQUEUE}
            if result.past_grace:
                outcome["past_grace"] = result.past_grace
        if result.signal:
            outcome["signal"] = result.signal
        return outcome
    except KeyboardInterrupt:
        outcome = {"status": "interrupted"}
        raise
    except BaseException as err:
        error = _failure(err)
        raise
    finally:
        try:
            if env is None or env.rank == 0:
                details = {key: value for key, value in outcome.items() if key != "status"}
                rundir.write_status(run_dir, outcome["status"], error, **details, ranks=members())
        finally:
            _release_and_leave(held)


def _release_and_leave(held: HeldAfter) -> None:
    """The held signals delivered (a Ctrl-C's KeyboardInterrupt raises here), the process group left either way."""
    try:
        held.release()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_worker(cfg: Any, run_dir: str) -> None:
    try:
        run_worker(cfg, run_dir)
    except (ConfigError, CheckpointError) as err:
        # Every rank raises these alike (checks run everywhere, checkpoint failures are made collective):
        # rank 0 says it once.
        _say_once(f"error: {err}")
        sys.exit(2)
    except (AnomalyError, RewardError) as err:
        _say_once(f"error: {one_line(err)}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED)
    _leave()


def _say_once(line: str) -> None:
    """Rank 0 prints the line; the others wait for it to exit first: the first worker to exit stops the rest, and
    a rank 1 quicker than rank 0 (still writing status.json) left the line unsaid."""
    if launch_env().rank == 0:
        print(line, file=sys.stderr)
    else:  # until the launcher stops it, once rank 0 has exited (its SIGTERM: no checkpoint to save now)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(30)


def _leave() -> None:
    """A worker whose run completed, everything written and closed, leaves without the interpreter's teardown,
    where gloo's threads can abort the process ("terminate called without an active exception", seen on torchrun's
    rank 1) and fail a finished run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_resumable(run_dir: str, code: int, why: str = "") -> None:
    """Exit with code after a run that stopped or failed; its last line says how to continue it (rank 0's; a sweep's
    job: the sweep's line says how)."""
    env = launch_env()
    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    if (env is None or env.rank == 0) and not (hydra and hydra.mode == RunMode.MULTIRUN):
        saved = checkpoints_in(os.path.join(run_dir, "checkpoints"))
        command = "the same torchrun command" if env is not None else f"{sys.executable} {sys.argv[0]}"
        resume = " ".join([*(rundir.search_path(hydra) if hydra else []), f"checkpoint.resume={run_dir}"])
        # Without a checkpoint there is nothing to continue: the error stays the last line.
        lines = [why] if why else []
        lines += [f"to continue: {command} {resume}"] if saved else []
        if lines:
            print("; ".join(lines), file=sys.stderr, flush=True)
    elif why:
        print(why, file=sys.stderr, flush=True)
    sys.exit(code)


def _record_death(run_dir: str, err: ProcessExitedException) -> None:
    """A worker that crashed or was killed is named in status.json (a config error or a Ctrl-C has said why)."""
    if err.exit_code in (2, INTERRUPTED):
        return
    how = f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
    before = rundir.read_status(run_dir).get("error")
    rundir.write_status(run_dir, "failed", f"rank {err.error_index} {how}" + (f"; {before}" if before else ""))


def run_spawned(cfg: DictConfig, world_size: int, run_dir: str) -> None:
    """Train cfg in run_dir on world_size worker processes of this node, as torchrun would; raises
    ProcessExitedException when a worker fails (a bad config: exit code 2, said once on stderr). CPU workers are
    forked from a forkserver that imports the trainer once for all of them (CUDA cannot be forked: spawn)."""
    cpu = device_for(cfg.trainer.device, 0).type == "cpu"
    preload = forkserver.PRELOAD if cpu else ()
    spawn(_spawned_worker, world_size, OmegaConf.to_container(cfg, resolve=True), run_dir, preload=preload)


def check_job(cfg: DictConfig) -> None:
    """The workers' own checks, once, in this process (before workers start, or a search's trials): raises
    ConfigError."""
    resolve_tokenizer(cfg)
    hf_config = build_hf_config(cfg.model)
    checked_plan(cfg, cfg.distributed.nproc_per_node, hf_config, device_for(cfg.trainer.device, 0), values=False)


def _check_before_spawning(cfg: DictConfig, run_dir: str) -> None:
    """A bad value fails with one message, before any worker starts."""
    try:
        check_job(cfg)
    except ConfigError as err:
        rundir.write_status(run_dir, "failed", one_line(err))
        raise


def _name_sweep_job(logger_cfg: DictConfig) -> None:
    """In a sweep, W&B groups the jobs by sweep and names each by its overrides, unless set."""
    hydra = HydraConfig.get()
    logger_cfg.group = logger_cfg.group or os.path.relpath(hydra.sweep.dir, "outputs/multirun").replace("/", "_")
    logger_cfg.name = logger_cfg.name or hydra.job.override_dirname or f"job{hydra.job.num}"


def _run(cfg: DictConfig, run_dir: str) -> dict[str, Any]:
    """Train here, or in nproc_per_node workers when no launcher started this process; returns the outcome."""
    if starts_own_workers(cfg.distributed):
        _check_before_spawning(cfg, run_dir)
        try:
            run_spawned(cfg, cfg.distributed.nproc_per_node, run_dir)
        except ProcessExitedException as err:
            _record_death(run_dir, err)
            raise
        return rundir.read_status(run_dir)
    return run_worker(OmegaConf.to_container(cfg, resolve=True), run_dir)


def _result(trainer_cfg: DictConfig, run_dir: str) -> float | None:
    """What the job returns to the sweeper: its trainer.sweep_metric, on rank 0 only (one trial per job, not per
    rank); None for a run that logged none."""
    env = launch_env()
    return sweep_value(run_dir, trainer_cfg.sweep_metric) if env is None or env.rank == 0 else None


def _in_launcher() -> bool:
    """Whether this sweep's jobs run in the sweep's own process (the basic and local launchers): a signal to the
    job is the sweep's. Under SLURM each job ends alone, and the array goes on."""
    return str(HydraConfig.get().launcher._target_).endswith("BasicLauncher")


def _stop_sweep(why: str, run_dir: str) -> None:
    """A signal stops the sweep, not just its job: the launcher ends here, and the same command with
    hydra.sweep.dir=<this sweep's dir> continues it (this job from its checkpoint)."""
    sweep_dir = HydraConfig.get().sweep.dir
    print(
        f"the sweep stops at job {os.path.basename(run_dir)} ({why}); to continue it, re-run the same command with "
        f"hydra.sweep.dir={sweep_dir}",
        file=sys.stderr,
    )


def launch(cfg: DictConfig, output_dir: str) -> float | None:
    """Entry from train.py, with Hydra's output dir; returns the run's trainer.sweep_metric to a sweeper.
    Bad input exits 2 with one line on stderr. In a sweep a failed job is recorded (status.json) and the sweep goes
    on (the sweep callback fails it at its end); a job already completed (a sweep run again) is not run again; a
    signal stops the whole sweep."""
    cfg = typed(cfg)
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    if multirun:
        _name_sweep_job(cfg.logger)
    run_dir = rundir.resolve(cfg.checkpoint.resume, output_dir)
    if multirun and rundir.read_status(run_dir).get("status") == "completed":
        print(f"job {HydraConfig.get().job.num} completed earlier: not run again")
        return _result(cfg.trainer, run_dir)
    try:
        resolve_tokenizer(cfg)  # a tokenizer that does not load is bad input, said as such
        rundir.check_restart(cfg.checkpoint.resume)
        outcome = _run(cfg, run_dir)
    except KeyboardInterrupt:  # a second Ctrl-C, in a run of this process alone
        _exit_resumable(run_dir, INTERRUPTED, "interrupted")
    except (ConfigError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        return
    except ProcessExitedException as err:  # the worker has said why
        # A SIGTERM or Ctrl-C that ended the workers (before they caught it, or Ctrl-C) stops a local sweep too.
        signalled = err.exit_code == INTERRUPTED or err.signal_name in ("SIGTERM", "SIGINT")
        stop_sweep = multirun and signalled and _in_launcher()
        if stop_sweep:
            _stop_sweep(err.signal_name or "SIGINT", run_dir)
        if stop_sweep or (not multirun and err.exit_code == 2):  # a bad config has said why
            sys.exit(err.exit_code or 1)
        if not multirun:
            _exit_resumable(run_dir, err.exit_code or 1)
        return
    # A failed run, not bad input: one line, exit 1; resuming would fail the same way.
    except (AnomalyError, RewardError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        if not multirun:
            sys.exit(1)
        return
    except Exception:
        if not multirun:
            traceback.print_exc()
            _exit_resumable(run_dir, 1)
        log.exception("job failed")
        return
    return _after(cfg, run_dir, outcome, multirun)


def _after(cfg: DictConfig, run_dir: str, outcome: dict[str, Any], multirun: bool) -> float | None:
    """What a launch returns or how it exits, once its run has ended: the objective of a completed run; a run
    stopped by a signal exits (requeued under SLURM where the signal asks for it), and stops a local sweep."""
    preempted = outcome.get("status") == "preempted"
    if multirun and not _in_launcher():
        # Under SLURM: a job a signal stopped returns no objective; its status.json says preempted, and the
        # sweep run again resumes it.
        return None if preempted else _result(cfg.trainer, run_dir)
    if not (preempted or (multirun and outcome.get("signal"))):
        env = launch_env()
        if not multirun and (env is None or env.rank == 0):
            print("\n".join(rundir.written(run_dir)), flush=True)
        if not multirun and env is not None:  # a worker of torchrun or srun: nothing is waiting for a result
            _leave()
        return _result(cfg.trainer, run_dir)
    if multirun:
        _stop_sweep(outcome.get("signal") or "signal", run_dir)
    env = launch_env()
    if not outcome.get("requeue"):
        # Stopped by SIGTERM or Ctrl-C, resumable: the scheduler that sent it decides what comes next, or the user.
        _exit_resumable(run_dir, INTERRUPTED if outcome.get("signal") == "SIGINT" else TERMINATED)
    if requeue() if env is None or env.rank == 0 else "SLURM_JOB_ID" in os.environ:
        # Requeued: end without returning a result, so a launcher waiting on this job (submitit) keeps
        # waiting for the requeued run instead of taking this one as its result.
        sys.exit(0)
