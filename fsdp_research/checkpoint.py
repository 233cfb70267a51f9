"""Resume checkpoints. Every rank writes its own shard with torch.distributed.checkpoint (no rank ever holds
the whole model) into checkpoints/.tmp_step_<N>/; once all ranks are done, rank 0 writes a manifest and
renames the directory to step_<N>. A checkpoint without a valid manifest never existed, so a process killed
at any moment leaves the previous one loadable."""

import json
import logging
import os
import random
import re
import shutil
from collections.abc import Collection
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .distributed import new_threads_single_threaded
from .errors import CheckpointError

log = logging.getLogger("fsdp_research")

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"


def is_step_dir(path: str) -> bool:
    """Whether path names a checkpoint (checkpoints/step_<N>) rather than a run dir."""
    return bool(_STEP_DIR.match(os.path.basename(os.path.normpath(path))))


def checkpoints_in(root: str) -> list[tuple[int, str]]:
    """Published step dirs under root, newest first (not yet verified)."""
    if not os.path.isdir(root):
        return []
    found = [
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := _STEP_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    ]
    return sorted(found, reverse=True)


def verify(step_dir: str) -> str | None:
    """None when the checkpoint is complete and readable; otherwise what is wrong with it."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"no valid {MANIFEST} ({type(err).__name__})"
    for name, size in files.items():
        try:  # a file can go between two looks (the run pruning this checkpoint as another process reads it)
            actual = os.path.getsize(os.path.join(step_dir, name))
        except OSError:
            return f"missing {name}"
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size}"
    try:
        dcp.FileSystemReader(step_dir).read_metadata()
    except Exception as err:  # a garbled pickle can raise almost anything
        return f"unreadable DCP metadata ({type(err).__name__})"
    return None


def _pinned_stager():
    """On CUDA, async saves stage into pinned host memory that is kept and reused from one save to the next (no
    fresh host allocations each time; device-to-host copies at full speed); elsewhere DCP's default staging."""
    if not torch.cuda.is_available():
        return None
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(
        StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True
        )
    )


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _mismatches(step_dir: str, state: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Tensor keys that are missing, unexpected or of another shape between the checkpoint and this run: one
    list per kind, empty ones left out."""
    saved = {
        k: tuple(v.size)
        for k, v in dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata.items()
        if hasattr(v, "size")
    }
    ours = {f"model.{k}": tuple(v.shape) for k, v in state["model"].items() if hasattr(v, "shape")}
    ours.update(
        {
            f"optim.state.{fqn}.{name}": tuple(v.shape)
            for fqn, s in state["optim"]["state"].items()
            for name, v in s.items()
            if hasattr(v, "shape") and v.dim() > 0
        }
    )
    saved = {k: v for k, v in saved.items() if k.startswith("model.") or (k.startswith("optim.state.") and len(v) > 0)}
    missing = [f"missing {k}" for k in sorted(ours.keys() - saved.keys())]
    unexpected = [f"unexpected {k}" for k in sorted(saved.keys() - ours.keys())]
    reshaped = [
        f"{k} is {list(saved[k])} in the checkpoint, {list(ours[k])} here"
        for k in sorted(ours.keys() & saved.keys())
        if ours[k] != saved[k]
    ]
    return [kind for kind in (missing, unexpected, reshaped) if kind]


class Checkpointer:
    def __init__(self, cfg: DictConfig, run_dir: str, extra_files: dict[str, str], pinned: bool = True):
        """extra_files: name -> text, written into every checkpoint by rank 0 (configs for offline export).
        pinned=False: async saves stage as DCP does by default (bench/checkpoint.py's comparison)."""
        self.cfg = cfg
        self.root = os.path.join(run_dir, "checkpoints")
        self.rank = dist.get_rank()
        self.extra_files = extra_files
        self.is_async = bool(cfg["async"])
        # A gloo group of its own: CPU-side collectives on any backend stay off the training group. Async writes
        # run collectives from a background thread, so they get one more: two threads interleaving collectives
        # on one group (the step-boundary agreement runs every step) deadlock.
        self.group = dist.new_group(backend="gloo")
        self._async_group = dist.new_group(backend="gloo") if self.is_async else None
        self._pending: tuple[Any, int, str] | None = None
        self._stager = _pinned_stager() if self.is_async and pinned else None

    def due(self, step: int, max_steps: int) -> bool:
        return step == max_steps or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    def save(self, step: int, model: torch.nn.Module, optimizer, trainer_state: dict[str, Any], callbacks=None) -> None:
        """callbacks: the callbacks' state (fsdp_research.callbacks.hooks.Callbacks.state_dict()), saved with DCP."""
        self.wait()
        tmp = os.path.join(self.root, f".tmp_step_{step}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        error = None
        try:
            os.makedirs(tmp, exist_ok=True)
            torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{self.rank}.pt"))
            if self.rank == 0:
                torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
                for name, text in self.extra_files.items():
                    with open(os.path.join(tmp, name), "w") as f:
                        f.write(text)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            error = err
        self._check_all(step, tmp, error)
        state = {"model": model_state, "optim": optim_state, **({"callbacks": callbacks} if callbacks else {})}
        try:
            with new_threads_single_threaded():
                if self.is_async:
                    future = dcp.async_save(
                        state, checkpoint_id=tmp, process_group=self._async_group, async_stager=self._stager
                    )
                    self._pending = (future, step, tmp)
                    return
                # DCP gathers every rank's write result, so a failure on any rank raises on all of them.
                dcp.save(state, checkpoint_id=tmp, process_group=self.group)
        except (Exception, dcp.CheckpointException) as err:  # the latter is a BaseException
            self._fail(step, tmp, err)
        self._publish(step, tmp)

    def finished_step(self) -> int:
        """The step of the async save in flight once this rank has written its part, else 0 (what this rank
        tells the others at a step boundary)."""
        if self._pending is None:
            return 0
        future, step, _ = self._pending
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
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def wait(self) -> None:
        """Finish and publish the async save in flight, if any."""
        if self._pending is None:
            return
        future, step, tmp = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:
            self._fail(step, tmp, err)
        self._publish(step, tmp)

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
                    shutil.rmtree(final)
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
        them, as its metrics.jsonl did; left, they would win the next resume) and all but the keep_last newest."""
        found = checkpoints_in(self.root)
        abandoned = [path for s, path in found if s > step]
        kept = [path for s, path in found if s <= step]
        for old in abandoned + (kept[self.cfg.keep_last :] if self.cfg.keep_last > 0 else []):
            shutil.rmtree(old, ignore_errors=True)

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

    def load(
        self,
        step_dir: str,
        model: torch.nn.Module,
        optimizer,
        callbacks: dict[str, Any] | None = None,
        configured: Collection[str] = ("weight_decay", "betas", "eps"),
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Load model, optimizer, the callbacks' state (into callbacks: name -> state_dict, those the checkpoint
        has) and this rank's RNG state (DCP reshards to this world size); returns (the trainer state, the callbacks'
        loaded state). The group keys in `configured` keep the config's values. Checks every tensor key and shape
        first, so a mismatch changes nothing."""
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        saved = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
        kept = {n: v for n, v in (callbacks or {}).items() if any(k.startswith(f"callbacks.{n}.") for k in saved)}
        for name in sorted((callbacks or {}).keys() - kept.keys()):
            log.info(f"callback {name}: the checkpoint has no state of it, it starts afresh")
        if kept:
            state["callbacks"] = kept
        kinds = _mismatches(step_dir, state)
        if kinds:
            # A few of each kind: another optimizer shows as keys both missing and unexpected.
            shown = [problem for kind in kinds for problem in kind[:3]]
            more = sum(map(len, kinds)) - len(shown)
            raise CheckpointError(
                f"checkpoint {step_dir} does not fit this model/optimizer: {'; '.join(shown)}"
                + (f"; ... {more} more" if more else "")
            )
        with new_threads_single_threaded():
            dcp.load(state, checkpoint_id=step_dir)
        # The config's hyperparameters win over the checkpoint's (which DCP copies into the groups, and maps onto
        # the last group where the checkpoint has fewer); the learning rate is the schedule's.
        kept = [{k: g[k] for k in configured if k in g} for g in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group, values in zip(optimizer.param_groups, kept):
            group.update(values)
        rng = os.path.join(step_dir, f"rng_rank{self.rank}.pt")
        if os.path.exists(rng):  # absent when resuming at a larger world size
            _set_rng_state(torch.load(rng, weights_only=False))
        log.info(f"resumed from checkpoint {step_dir}")
        return torch.load(os.path.join(step_dir, TRAINER_STATE), weights_only=False), state.get("callbacks", {})


def config_files(cfg: DictConfig, hf_config) -> dict[str, str]:
    """What an offline export needs besides the weights: the model config (a transformers model's) and the run's
    config."""
    files = {"train_config.yaml": OmegaConf.to_yaml(cfg, resolve=True)}
    if hf_config is not None:
        files["config.json"] = hf_config.to_json_string()
    return files
