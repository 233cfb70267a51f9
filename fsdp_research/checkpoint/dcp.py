"""Resume checkpoints saved and pruned. Every rank writes its own shard with torch.distributed.checkpoint (no rank
ever holds the whole model) into checkpoints/.tmp_step_<N>/; once all ranks are done, rank 0 writes a manifest and
renames the directory to step_<N>. A checkpoint without a valid manifest never existed, so a process killed
at any moment leaves the previous one loadable (checkpoint.resume finds, verifies and loads them)."""

import io
import itertools
import json
import logging
import os
import random
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict

from fsdp_research.checkpoint.resume import MANIFEST, TRAINER_STATE, checkpoints_in, state_options, verify
from fsdp_research.distributed.processes import control_group, gloo_group, new_threads_single_threaded
from fsdp_research.errors import CheckpointError

log = logging.getLogger("fsdp_research")

# Checkpointers made in this process, counted alike on every rank (all make them at the same points): the key of
# each one's cached save plans (an object's id could be reused, and differently on each rank).
_checkpointers = itertools.count()
_STAGER_KEEPS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)
# Where pruned checkpoints wait to be removed: renamed (atomic) first, so no resume ever sees half of one.
_TRASH = ".trash_"


def _stager(pinned: bool) -> DefaultStager:
    """What makes the host copy of the state for an async save, so training goes on while it is written. Pinned
    (on CUDA): into pinned host memory kept and reused from one save to the next (no fresh host allocations each
    time; device-to-host copies at full speed). Otherwise DCP's default staging, a stager per save as DCP makes it
    (its reuse of host copies from save to save is only relied on for pinned memory)."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
        )
    )


def _rng_state() -> bytes:
    """This rank's RNG states, pickled: saved with DCP under a key of the rank's own (one object in the rank's
    shard file, no file of its own)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _written(*args, **kwargs) -> None:
    """dcp.save on the writer's thread with new threads single-threaded until it ends: the gloo workers its
    collectives wake run their first parallel copies within it (in the saving thread's window alone, they raced the
    writer and sometimes took a thread team of two: test_threads' async case, 3 of 5 runs)."""
    with new_threads_single_threaded():
        dcp.save(*args, **kwargs)


class Checkpointer:
    def __init__(self, cfg: DictConfig, run_dir: str, extra_files: dict[str, str], pinned: bool = True):
        """extra_files: name -> text, written into every checkpoint by rank 0 (configs for offline export).
        pinned=False: async saves stage as DCP does by default (bench/checkpoint.py's comparison)."""
        self.cfg = cfg
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank = dist.get_rank()
        self.extra_files = extra_files
        self.is_async = bool(cfg["async"])
        self.group = control_group()
        self._pending: tuple[Any, int, str, float] | None = None
        # The wall time of the last complete save (started to published): what a stop's save will take.
        self.last_save_s = 0.0
        self._saved_step = 0
        self._pruning: threading.Thread | None = None
        # Repeated saves of the same state reuse the plan DCP gathered at the first (no plan to the coordinator
        # and back): keyed by this checkpointer, so no other run in the process shares it.
        self._plan_key = f"{DefaultSavePlanner.__name__}:{next(_checkpointers)}"
        if self.is_async:
            # Async writes run collectives from a thread of their own, so they get a group of their own: two
            # threads interleaving collectives on one group deadlock. The one thread is kept from save to save,
            # and set to one intra-op thread as it starts (see new_threads_single_threaded).
            self._async_group = gloo_group()
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
            with new_threads_single_threaded():
                self._writer.submit(torch.get_num_threads).result()
            self._pinning = pinned and torch.cuda.is_available()
            # A kept stager crashes on its second save before torch 2.13 (pytorch#183413): one per save there.
            self._pinned = _stager(pinned=True) if self._pinning and _STAGER_KEEPS else None

    def due(self, step: int, max_steps: int, stop: bool = False) -> bool:
        """Whether to save after `step`: every interval, at the end, at a stop; never with checkpoint.save=false."""
        if not self.cfg.save:
            return False
        return stop or step == max_steps or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer,
        trainer_state: dict[str, Any],
        callbacks: dict | None = None,
        objective: dict | None = None,
    ) -> None:
        """callbacks: the callbacks' state (fsdp_research.callbacks.hooks.Callbacks.state_dict()), objective: the
        objective's (Objective.state_dict()), saved with DCP."""
        self.wait()
        started = time.perf_counter()
        tmp = os.path.join(self.root, f".tmp_step_{step}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        model_state, optim_state = get_state_dict(model, optimizer, options=state_options(model))
        error = None
        try:
            os.makedirs(tmp, exist_ok=True)
            if self.rank == 0:
                torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
                for name, text in self.extra_files.items():
                    with open(os.path.join(tmp, name), "w") as f:
                        f.write(text)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            error = err
        self._check_all(step, tmp, error)
        state = {"model": model_state, "optim": optim_state, "rng": {f"rank_{self.rank}": _rng_state()}}
        if callbacks:
            state["callbacks"] = callbacks
        if objective:
            state["objective"] = objective
        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key
        try:
            with new_threads_single_threaded():
                if self.is_async:
                    staged = (self._pinned or _stager(self._pinning)).stage(state)
                    future = self._writer.submit(
                        _written, staged, checkpoint_id=tmp, process_group=self._async_group, planner=planner
                    )
                    future.add_done_callback(lambda done: setattr(done, "written_at", time.perf_counter()))
                    self._pending = (future, step, tmp, started)
                    self._saved_step = step
                    return
                # DCP gathers every rank's write result, so a failure on any rank raises on all of them.
                dcp.save(state, checkpoint_id=tmp, process_group=self.group, planner=planner)
        except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
            self._fail(step, tmp, err)
        self._publish(step, tmp)
        self.last_save_s, self._saved_step = time.perf_counter() - started, step

    def saved(self, step: int) -> bool:
        """Whether step's checkpoint was saved (async: is being written) by this checkpointer."""
        return self._saved_step == step

    def finished_step(self) -> int:
        """The step of the async save in flight once this rank has written its part, else 0 (what this rank
        tells the others at a step boundary)."""
        if self._pending is None:
            return 0
        future, step, _, _ = self._pending
        return step if future.done() else 0

    def publish_finished(self, step: int) -> None:
        """Publish the save in flight if it is the one every rank has finished (step: the smallest finished_step
        over the ranks, agreed at a step boundary): a kill after this loses at most checkpoint.interval steps."""
        if self._pending is not None and step and self._pending[1] == step:
            self.wait()

    def close(self, failed: bool) -> None:
        """At the end of a run: finish the save in flight; after a failure, abandon it (its collectives could
        wait on ranks that are gone; it was never published, so nothing is lost)."""
        if failed:
            self._pending = None
        else:
            self.wait()
        if self.is_async:
            self._writer.shutdown(wait=not failed)
            if self._pinned is not None:
                self._pinned.close()
        if self._pruning is not None:
            self._pruning.join()

    def wait(self) -> None:
        """Finish and publish the async save in flight, if any."""
        if self._pending is None:
            return
        future, step, tmp, started = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:
            self._fail(step, tmp, err)
        self._publish(step, tmp)
        self.last_save_s = getattr(future, "written_at", time.perf_counter()) - started

    def _publish(self, step: int, tmp: str) -> None:
        self._barrier()  # every rank's shard is on disk
        error = None
        if self.rank == 0:
            try:
                files = {name: os.path.getsize(os.path.join(tmp, name)) for name in os.listdir(tmp)}
                with open(os.path.join(tmp, MANIFEST), "w") as f:
                    json.dump({"step": step, "world_size": dist.get_world_size(), "files": files}, f)
                    f.flush()
                    os.fsync(f.fileno())
                final = os.path.join(self.root, f"step_{step}")
                if os.path.exists(final):  # resumed from an older step: this save replaces that future
                    os.rename(final, self._trash_path(step))
                os.rename(tmp, final)
                self._prune(step)
                log.info(f"saved checkpoint {final}")
            except OSError as err:
                error = err
        self._check_all(step, tmp, error)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _check_all(self, step: int, tmp: str, error: Exception | None) -> None:
        """Fail on every rank if any rank failed, so no rank is left waiting in a collective."""
        failed = torch.tensor([0 if error is None else 1])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed.item():
            self._fail(step, tmp, error or OSError("another rank could not write its part"))

    def _prune(self, step: int) -> None:
        """Once step_<step> is complete: drop the checkpoints after it (a run resumed from an older one abandoned
        them, as its metrics.jsonl did; left, they would win the next resume) and all but the keep_last newest.
        Renamed away at once, removed by a thread of rank 0's (a large checkpoint takes a while to delete, and no
        rank waits for that)."""
        found = checkpoints_in(self.root)
        abandoned = [(s, path) for s, path in found if s > step]
        kept = [(s, path) for s, path in found if s <= step]
        for s, old in abandoned + (kept[self.cfg.keep_last :] if self.cfg.keep_last > 0 else []):
            os.rename(old, self._trash_path(s))
        if self._pruning is not None:
            self._pruning.join()
        trash = [os.path.join(self.root, name) for name in os.listdir(self.root) if name.startswith(_TRASH)]
        self._pruning = threading.Thread(target=_remove, args=(trash,), name="checkpoint-pruning", daemon=True)
        self._pruning.start()

    def _trash_path(self, step: int) -> str:
        return os.path.join(self.root, f"{_TRASH}{step}_{os.getpid()}_{time.monotonic_ns()}")

    def _fail(self, step: int, tmp: str, err: BaseException) -> None:
        # Measured before the partial checkpoint goes: a full disk often says no more than "unexpected pos".
        free = shutil.disk_usage(os.path.dirname(self.root)).free
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, dcp.CheckpointException):  # its text is every failed rank's traceback
            err = next(iter(err.failures.values()))[0]
        previous = next((d for _, d in checkpoints_in(self.root) if verify(d) is None), None)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"saving checkpoint step_{step} in {self.root} failed ({type(err).__name__}: "
            f"{reason}; {free / 2**20:.1f} MiB free there); the previous checkpoint "
            f"({previous or 'none'}) is intact"
        ) from err


def _remove(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def config_files(cfg: DictConfig, hf_config) -> dict[str, str]:
    """What an offline export needs besides the weights: the model config (a transformers model's) and the run's
    config."""
    files = {"train_config.yaml": OmegaConf.to_yaml(cfg, resolve=True)}
    if hf_config is not None:
        files["config.json"] = hf_config.to_json_string()
    return files
