"""Schedules as the config names them (cosine, linear, constant, WSD, inverse_sqrt, `_target_`), checked against
formulas written out (tests/helpers/schedules.py) and torch's own schedulers."""

import pytest
import torch

from fsdp_research.jobs.compose import compose
from fsdp_research.optim import build_optimizer
from fsdp_research.optim.schedules import multiplier
from tests.helpers.schedules import expected_multiplier
from tests.helpers.zoo import tiny_llama


@pytest.mark.parametrize(
    "name, shape",
    [("cosine", None), ("linear", None), ("constant", None), ("inverse_sqrt", None)]
    + [("wsd", s) for s in ("linear", "cosine", "sqrt")],
)
def test_schedule_shapes(name, shape):
    extra = [f"schedule.decay_shape={shape}", "schedule.min_lr_ratio=0.1"] if shape else []
    s = compose([f"schedule={name}", *extra]).schedule
    for step in range(100):
        assert multiplier(s, step, 100) == pytest.approx(expected_multiplier(name, step, 100, shape=shape or "linear"))


@pytest.mark.parametrize(
    "name, shape", [("cosine", None), ("linear", None)] + [("wsd", s) for s in ("linear", "cosine", "sqrt")]
)
def test_schedules_against_transformers_step_by_step(name, shape):
    """The convention, against transformers' schedules: after warmup, the multiplier of update s (0-based) is
    theirs at s, so the last of max_steps updates is one step above min_lr_ratio (which step max_steps, never
    taken, would have); in warmup ours is theirs at s + 1 (the first update is not at lr 0), from 0 (their WSD's
    from min_lr_ratio)."""
    from transformers import optimization as hf

    total, warmup, floor = 50, 5, 0.0 if name == "linear" else 0.1
    extra = [f"schedule.decay_shape={shape}", "schedule.decay_ratio=0.4"] if shape else []
    cfg = compose([f"schedule={name}", "schedule.warmup_steps=5", f"schedule.min_lr_ratio={floor}", *extra]).schedule
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    if name == "cosine":
        theirs = hf.get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, total, min_lr_rate=floor)
    elif name == "linear":
        theirs = hf.get_linear_schedule_with_warmup(opt, warmup, total)
    else:
        decay = round(0.4 * total)
        kind = {"sqrt": "1-sqrt"}.get(shape, shape)
        theirs = hf.get_wsd_schedule(opt, warmup, decay, num_stable_steps=total - decay - warmup, decay_type=kind,
                                     min_lr_ratio=floor)  # fmt: skip
    curve = [fn(s) for s in range(total + 1) for fn in theirs.lr_lambdas]
    ours = [multiplier(cfg, s, total) for s in range(total)]
    # Their WSD warms up from min_lr_ratio, ours (every schedule) from 0.
    start = floor if name == "wsd" else 0.0
    assert ours[:warmup] == pytest.approx([(c - start) / (1 - start) for c in curve[1 : warmup + 1]])
    assert ours[warmup:] == pytest.approx(curve[warmup:total])
    assert ours[-1] > floor and curve[total] == pytest.approx(floor)


def test_schedule_target_function_and_lr_scheduler_class():
    model = tiny_llama()
    fn = compose(["schedule._target_=tests.helpers.plugins.spike_lr", "+schedule.at=2", "+schedule.factor=5"])
    optimizer, scheduler = build_optimizer(model, fn)
    lrs = []
    for _ in range(4):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([3e-3, 3e-3, 1.5e-2, 3e-3])
    # The group's own keys go to a function whose signature names them.
    _, scheduler = build_optimizer(
        model, compose(["schedule._target_=tests.helpers.plugins.warm", "schedule.warmup_steps=4"])
    )
    assert scheduler.get_last_lr()[0] == pytest.approx(3e-3 / 4)
    cls = compose(["schedule._target_=torch.optim.lr_scheduler.StepLR", "+schedule.step_size=2", "+schedule.gamma=0.5"])
    _, scheduler = build_optimizer(model, cls)
    assert type(scheduler) is torch.optim.lr_scheduler.StepLR and scheduler.step_size == 2


def test_a_resume_takes_the_configs_rates_and_schedule(tmp_path):
    """Muon with AdamW for the rest, a StepLR: three steps at the saved config, then a resume with optim.lr,
    optim.others.lr, an lr_scale and the StepLR's gamma changed. The groups' rates are the new config's at step 3,
    by StepLR's formula (lr x gamma ^ (3 // 2)), and the changes are named."""
    from omegaconf import OmegaConf

    from fsdp_research.optim.resume import continue_schedule

    step_lr = ["schedule._target_=torch.optim.lr_scheduler.StepLR", "+schedule.step_size=2"]
    scaled = "optim.param_groups=[{{match: '*embed_tokens*', lr_scale: {}}}]"
    saved = compose(["optim=muon", *step_lr, "+schedule.gamma=0.5", scaled.format(1)])
    now = compose(
        ["optim=muon", *step_lr, "+schedule.gamma=0.1", "optim.lr=0.05", "optim.others.lr=1e-2", scaled.format(0.5)]
    )
    model = tiny_llama()
    blocks = [f"model.layers.{i}" for i in range(len(model.model.layers))]
    optimizer, scheduler = build_optimizer(model, saved, blocks)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    OmegaConf.save(saved, tmp_path / "train_config.yaml")
    optimizer_state, scheduler_state = optimizer.state_dict(), scheduler.state_dict()
    optimizer, scheduler = build_optimizer(model, now, blocks)
    base_lrs = list(scheduler.base_lrs)
    optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(scheduler_state)
    scheduler = continue_schedule(scheduler, now, base_lrs, str(tmp_path))
    embed = id(model.model.embed_tokens.weight)
    expected = [
        0.1 * (0.05 if i == 0 else 1e-2 * (0.5 if any(id(p) == embed for p in g["params"]) else 1))
        for i, g in enumerate(optimizer.param_groups)
    ]
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx(expected)
    assert scheduler.get_last_lr() == pytest.approx(expected) and scheduler.last_epoch == 3


def test_spike_monitor_keeps_non_finite_values_out_of_its_window():
    from fsdp_research.callbacks.spike import SpikeMonitor

    class Run:
        skips = 0

        def skip_step(self):
            self.skips += 1

        def log(self, values, step):
            pass

    run, monitor = Run(), SpikeMonitor(window=10, threshold=6, skip=True, min_steps=3)
    values = [float("inf"), 3.0, 2.9, 3.1, 3.0, 2.95, float("nan"), 3.05, 2.9, 3.0]
    for step, value in enumerate(values, 1):
        monitor.on_before_optimizer_step(run, step, {"loss": value, "grad_norm": 1.0 + 0.01 * step})
    assert run.skips == 2 and float("inf") not in monitor.history["loss"]  # the inf and the nan only


class _Steps:
    """What the spike monitor sees of a run: the skips it asks for, the records it logs."""

    def __init__(self):
        self.skips, self.records = [], []

    def skip_step(self):
        self.skips.append(self.step)

    def log(self, values, step):
        self.records.append({"step": step, **values})


def _feed(monitor, losses) -> _Steps:
    run = _Steps()
    for run.step, loss in enumerate(losses, 1):
        monitor.on_before_optimizer_step(run, run.step, {"loss": loss, "grad_norm": 1.0})
    return run


@pytest.mark.parametrize("cap", [5, 1])
def test_a_lasting_level_shift_is_not_skipped_for_ever(cap, caplog):
    """50 losses at 2.00, then 200 at 2.10: the window follows the new level (every value enters it), so only the
    first few steps of the shift are spikes, and no more than max_consecutive_skips in a row are skipped."""
    from fsdp_research.callbacks.spike import SpikeMonitor

    monitor = SpikeMonitor(window=100, threshold=6.0, skip=True, min_steps=10, max_consecutive_skips=cap)
    run = _feed(monitor, [2.0] * 50 + [2.1] * 200)
    spikes = [r["step"] for r in run.records]
    # z of the new level's k-th value against 50 old and k - 1 new ones: sqrt(50 / (k - 1)); over 6 for k <= 2.
    assert spikes == [51, 52]
    assert run.skips == spikes[:cap] and len(monitor.history["loss"]) == 100
    assert [r["spike_skipped"] for r in run.records] == [s in run.skips for s in spikes]
    warned = [r.message for r in caplog.records if "not skipped" in r.message]
    expected = (
        "spike at step 52 not skipped: 1 steps in a row were (callbacks.spike.max_consecutive_skips=1); "
        "a lasting shift, not a spike?"
    )
    assert warned == ([] if cap >= 2 else [expected])
