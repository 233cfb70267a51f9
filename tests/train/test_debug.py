"""The debug presets (conf/debug/, `python train.py debug=<option>`): each composes over the groups (an experiment's
too) and the command line still wins; one real run of each, all started at once: fast keeps nothing, overfit
drives one batch's loss towards 0 and says so, profile writes the trace where it says, anomaly names the module
whose output overflowed, limit caps steps, eval batches and data. Then the keys underneath, in process: the
anomaly checks (none installed when off), the repeated batches, the window cap, and their bad values."""

import json
import os
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

from fsdp_research.config.schema import ScheduleName
from fsdp_research.data.pipeline import Data
from fsdp_research.data.sampling import Stream, SyntheticWindows
from fsdp_research.distributed.precision import LossScaler
from fsdp_research.errors import AnomalyError, ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.train.anomaly import apply_anomaly_checks
from fsdp_research.train.refusals import check_data, check_trainer
from fsdp_research.train.state import TrainState
from tests.conftest import FAST
from tests.helpers.cli import Finished, finish, read_metrics, start

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PRESETS = ("fast", "overfit", "profile", "anomaly", "limit")
# fp32, short windows of a few stdlib files; W&B, steps, eval and checkpoints are the presets' own.
BASE = [o for o in FAST if o.startswith(("precision=", "data."))]
BLOWS_UP = [
    "model=custom",
    "model.model_type=null",
    "model._target_=tests.helpers.plugins.BlowsUp",
    "model.block_class=Block",
    "trainer.max_steps=3",
]


def test_each_preset_composes():
    cfgs = {name: compose([f"debug={name}"]) for name in PRESETS}
    assert all(cfg.logger.kind == "none" for cfg in cfgs.values())
    fast = cfgs["fast"]
    assert (fast.trainer.max_steps, fast.trainer.eval_batches) == (5, 1)
    assert not fast.checkpoint.save and not fast.checkpoint.export
    overfit = cfgs["overfit"]
    assert overfit.data.overfit_batches == 1 and overfit.schedule.name == ScheduleName.constant.value
    assert cfgs["profile"].trainer.profile_steps == 3 and not cfgs["profile"].checkpoint.save
    assert cfgs["anomaly"].trainer.detect_anomaly
    limit = cfgs["limit"]
    assert (limit.trainer.max_steps, limit.trainer.eval_batches, limit.data.max_windows) == (20, 2, 1024)
    # After experiment in the defaults: the preset overrides it; the command line overrides both.
    cfg = compose(["experiment=llama_7b_8gpu", "debug=fast", "trainer.eval_batches=3", "logger=wandb"])
    assert (cfg.model.name, cfg.trainer.max_steps, cfg.trainer.eval_batches, cfg.logger.kind) == (
        "llama_7b",
        5,
        3,
        "wandb",
    )


class Runs:
    """One real run per preset, two at a time (each on one thread: this suite runs on 2 cores); each finished
    (once) where a test asks for it."""

    WIDTH = 2

    def __init__(self, root):
        self.root, self.procs, self.done = root, {}, {}
        self.pending = list(PRESETS)
        while len(self.procs) < self.WIDTH:
            self._start_next()

    def _start_next(self) -> None:
        name = self.pending.pop(0)
        extra = {"anomaly": BLOWS_UP, "limit": ["checkpoint.export=false"]}
        overrides = [f"debug={name}", *BASE, *extra.get(name, []), f"hydra.run.dir={self.dir(name)}"]
        self.procs[name] = start(overrides, str(self.root))

    def dir(self, name: str) -> str:
        return str(self.root / name)

    def get(self, name: str) -> Finished:
        while name not in self.procs:  # finish the oldest running one to make room
            oldest = next(n for n in self.procs if n not in self.done)
            self.done[oldest] = finish(self.procs[oldest], timeout=240)
            self._start_next()
        if name not in self.done:
            self.done[name] = finish(self.procs[name], timeout=240)
            if self.pending:
                self._start_next()
        return self.done[name]

    def status(self, name: str) -> dict:
        with open(os.path.join(self.dir(name), "status.json")) as f:
            return json.load(f)

    def log(self, name: str) -> str:
        with open(os.path.join(self.dir(name), "train.log")) as f:
            return f.read()

    def records(self, name: str) -> list[dict]:
        with open(os.path.join(self.dir(name), "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        runs = Runs(tmp_path_factory.mktemp("debug"))
        yield runs
    for proc in runs.procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fast_keeps_nothing(runs):
    out = runs.get("fast")
    assert out.returncode == 0, out.stderr[-2000:]
    assert runs.status("fast")["status"] == "completed"
    assert sorted(os.listdir(runs.dir("fast"))) == [".hydra", "metrics.jsonl", "status.json", "train.log"]
    assert [row["step"] for row in read_metrics(runs.dir("fast"))] == [1, 2, 3, 4, 5]
    evals = [r for r in runs.records("fast") if "eval_loss" in r]
    assert [(r["step"], r["eval_tokens"]) for r in evals] == [(5, 8 * 64)]  # one micro-batch of 64-token windows


def test_overfit_drives_the_loss_towards_zero(runs):
    out = runs.get("overfit")
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [row["loss"] for row in read_metrics(runs.dir("overfit"))]
    assert len(losses) == 100 and losses[-1] < 0.2 * losses[0]
    assert re.search(
        r"overfit: loss [\d.]+ -> [\d.]+ \([\d.]+% of the first logged\): the model fits 1 batch", runs.log("overfit")
    )
    summary = next(r["summary"] for r in runs.records("overfit") if "summary" in r)
    assert summary["overfit_fits"] is True and summary["overfit_loss_share"] < 0.2


def test_profile_writes_the_trace_where_it_says(runs):
    out = runs.get("profile")
    assert out.returncode == 0, out.stderr[-2000:]
    path = re.search(r"profile: step .*; trace (\S+)", out.stdout).group(1)
    assert path == os.path.join(runs.dir("profile"), "profile", "trace_rank0.json")
    with open(path) as f:
        assert any(e.get("name") == "step.forward" for e in json.load(f)["traceEvents"])
    assert not os.path.exists(os.path.join(runs.dir("profile"), "checkpoints"))


def test_anomaly_names_the_module_and_the_step(runs):
    out = runs.get("anomaly")
    expected = "step 1: non-finite (inf/nan) forward output, first in layers.1.gain (trainer.detect_anomaly)"
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == f"error: AnomalyError: {expected}"
    status = runs.status("anomaly")
    assert status["status"] == "failed" and status["error"] == f"AnomalyError: {expected}"


def test_limit_caps_steps_eval_and_data(runs):
    out = runs.get("limit")
    assert out.returncode == 0, out.stderr[-2000:]
    assert read_metrics(runs.dir("limit"))[-1]["step"] == 20
    evals = [(r["step"], r["eval_tokens"]) for r in runs.records("limit") if "eval_loss" in r]
    assert evals == [(10, 2 * 8 * 64), (20, 2 * 8 * 64)]
    train, held_out = map(int, re.search(r"data: (\d+) training \+ (\d+) held-out windows", runs.log("limit")).groups())
    assert train + held_out == 1024


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, TrainState(
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0), LossScaler(compose().precision)
    )


def test_anomaly_checks_off_install_nothing():
    model, state = _tiny()
    with apply_anomaly_checks(model, state, enabled=False) as checks:
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert not torch.is_anomaly_enabled()
        checks.check_loss(torch.tensor(float("nan")))  # off: no check
    with apply_anomaly_checks(model, state, enabled=True):
        assert torch.is_anomaly_enabled() and model[2]._forward_hooks
    assert not torch.is_anomaly_enabled() and not any(m._forward_hooks for m in model.modules())


# Anomaly mode warns with the forward's traceback before its error: expected here.
@pytest.mark.filterwarnings("ignore:Error detected in")
def test_anomaly_checks_name_loss_gradient_and_backward():
    model, state = _tiny()
    state.step = 6
    with pytest.raises(AnomalyError, match=r"^step 7: non-finite \(inf/nan\) loss"):
        with apply_anomaly_checks(model, state, enabled=True) as checks:
            checks.check_loss(model(torch.ones(2, 4)).sum() * float("inf"))
    with pytest.raises(AnomalyError, match=r"^step 7: non-finite \(inf/nan\) gradient, first in parameter 2.weight "):
        with apply_anomaly_checks(model, state, enabled=True) as checks:
            model(torch.ones(2, 4)).sum().backward()
            checks.check_grads(skipped=True)  # an overflow the loss scaler skips is not an anomaly
            model[2].weight.grad[0, 0] = float("inf")
            checks.check_grads()
    # A nan that appears in backward alone: anomaly mode's error, with the step.
    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(AnomalyError, match=r"^step 7: in backward, Function '\w+' returned nan values"):
        with apply_anomaly_checks(model, state, enabled=True):
            (x * 0).sqrt().sum().backward()


def test_overfit_batches_repeat_exactly_at_any_world_size():
    data = Data(Stream([SyntheticWindows(100, 9, 50, seed=0)], [1.0], 0, 0.05), 8, overfit_batches=2)
    for step in range(6):
        batch = data.global_batch(step, 8)
        assert torch.equal(batch, data.global_batch(step % 2, 8))
        assert torch.equal(torch.cat([data.rank_batch(step * 8, 8, r, 4) for r in range(4)]), batch)
    assert not torch.equal(data.global_batch(0, 8), data.global_batch(1, 8))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["data.max_windows=-1"], "data.max_windows"),
        (["data.overfit_batches=-2"], "data.overfit_batches"),
        (["trainer.detect_anomaly=true", "trainer.compile=true"], "trainer.detect_anomaly"),
    ],
)
def test_bad_values_are_one_line(overrides, key):
    cfg = compose(overrides)
    with pytest.raises(ConfigError) as err:
        check_trainer(cfg.trainer, 1)
        check_data(cfg.data, cfg.trainer, None)
    assert err.value.key == key and "\n" not in str(err.value) and "fix: " in str(err.value)


def test_max_windows_caps_synthetic_and_store_windows():
    from fsdp_research.data.pipeline import build_data

    cfg = compose(["data=synthetic", "data.max_windows=40", "data.seq_len=8"]).data
    data = build_data(cfg, vocab_size=50, seed=0)
    assert sum(w.count for w in data.stream.windows) == 40
    assert np.array_equal(data.batch(np.arange(3)).numpy(), data.batch(np.arange(3)).numpy())
