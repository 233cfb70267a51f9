"""Tools for the checkpoint tests: the real CLI in a process group of its own (so a test can SIGKILL the whole
job, workers included), what a run leaves behind (metrics, checkpoint tensors, file listings), and models
built in spawned worker processes."""

import hashlib
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from fsdp_research.checkpoint.resume import checkpoints_in, verify
from fsdp_research.config.schema import typed
from fsdp_research.distributed.processes import device_for, init_distributed
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import build_sharded_model
from tests.conftest import ROOT
from tests.helpers.cli import read_metrics, subprocess_env
from tests.helpers.dist import full_state, run_distributed
from tests.helpers.forked import Forked


def with_overrides(base: Sequence[str], *changes: str) -> list[str]:
    """base with each `key=value` of changes replacing the same key (Hydra refuses a key given twice)."""
    keys = {c.split("=", 1)[0] for c in changes}
    return [o for o in base if o.split("=", 1)[0] not in keys] + list(changes)


@dataclass
class Run:
    run_dir: str
    returncode: int
    stdout: str
    stderr: str

    def metrics(self) -> list[dict]:
        return read_metrics(self.run_dir)

    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.startswith("error:")]


class Job:
    """`python train.py <overrides> hydra.run.dir=<run_dir>` (forked: tests/helpers/forked.py), in a new session;
    its output goes to <logs>.stdout and .stderr (default: beside the run dir), so a run dir holds only what the run
    wrote."""

    def __init__(self, run_dir: str, overrides: Sequence[str], hf_cache: str, logs: str | None = None):
        self.run_dir = run_dir
        logs = logs or run_dir.rstrip("/")
        self._logs = (logs + ".stdout", logs + ".stderr")
        env = {**subprocess_env(), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "HF_DATASETS_CACHE": hf_cache}
        args = [*overrides, f"hydra.run.dir={run_dir}"]
        self.proc = Forked(os.path.join(ROOT, "train.py"), args, ROOT, env, new_session=True, logs=self._logs)

    def finish(self, timeout: float = 300) -> Run:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        with open(self._logs[0]) as out, open(self._logs[1]) as err:
            return Run(self.run_dir, self.proc.returncode, out.read(), err.read())

    def kill(self) -> None:
        self.proc.kill_job()

    def kill_when(self, path: str, timeout: float = 240) -> Run:
        """SIGKILL the whole job as soon as `path` exists; fails if the job ends first."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(path):
            assert self.proc.poll() is None, f"the run ended (exit {self.proc.returncode}) before {path} existed"
            assert time.monotonic() < deadline, f"no {path} after {timeout}s"
            time.sleep(0.005)
        assert self.proc.poll() is None, "the run ended before it could be killed"
        self.kill()
        return self.finish()


def train(run_dir: str, overrides: Sequence[str], hf_cache: str, logs: str | None = None) -> Run:
    return Job(run_dir, overrides, hf_cache, logs).finish()


def complete_steps(run_dir: str) -> list[int]:
    """Steps of the published checkpoints that verify, oldest first."""
    return sorted(step for step, path in checkpoints_in(os.path.join(run_dir, "checkpoints")) if verify(path) is None)


def checkpoint_tensors(step_dir: str) -> dict[str, torch.Tensor]:
    """Every tensor a resume checkpoint holds (model and optimizer state), read in this process alone."""
    metadata = dcp.FileSystemReader(step_dir).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in metadata.items() if hasattr(v, "size")}
    dcp.load(state, checkpoint_id=step_dir, no_dist=True)
    return state


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def snapshot(root: str) -> dict[str, tuple]:
    """Every file under root: (size, mtime, content hash)."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            found[os.path.relpath(path, root)] = (os.path.getsize(path), os.stat(path).st_mtime_ns, digest)
    return found


def _build_each(configs: dict[str, dict], batch: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    first = typed(next(iter(configs.values())))
    device = device_for(first.trainer.device, 0)
    init_distributed(first.distributed, device)
    built = {}
    for name, cfg in configs.items():
        cfg = typed(cfg)
        model, _ = build_sharded_model(cfg, build_hf_config(cfg.model), device, dist.get_world_size())
        with torch.no_grad():
            built[name] = {"weights": full_state(model), "logits": model(input_ids=batch.to(device)).logits.cpu()}
    return built


def build_distributed(
    configs: dict[str, dict], world_size: int, batch: torch.Tensor
) -> dict[str, dict[str, torch.Tensor]]:
    """Build each config's sharded model (build_sharded_model) on `world_size` spawned processes; returns its
    full initial weights and its logits on `batch`."""
    return run_distributed(_build_each, world_size, configs, batch)


def newest_complete(run_dir: str) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None
