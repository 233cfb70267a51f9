"""Callbacks in real 2-rank runs through the CLI: every hook, a skip and a stop asked by one rank and agreed by all,
spikes skipped, a callback that raises, per-block gradient norms, the z-loss logged; WSD's lr curve and its extension
on resume; EMA resumed bitwise."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.sinks import read_records
from tests.conftest import FAST
from tests.helpers.checkpointing import assert_bitwise_equal, checkpoint_tensors, train, with_overrides
from tests.helpers.schedules import expected_multiplier

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

RUN = with_overrides(
    FAST,
    "distributed.nproc_per_node=2",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "checkpoint.interval=4",
)
CALLBACKS = "+callbacks.recorder._target_=tests.helpers.plugins.Recorder"
SIGNAL = ["+callbacks.sig._target_=tests.helpers.plugins.SignalAt", "+callbacks.sig.step=5"]
RUNS = {
    # A skip asked by rank 1 at step 3 and a stop after step 6, with every shipped callback and the z-loss.
    "hooks": [
        "trainer.max_steps=10",
        "trainer.eval_interval=3",
        "loss.z_loss=1e-4",
        "callbacks=[spike,grad_norms,ema]",
        "callbacks.grad_norms.every=2",
        CALLBACKS,
        "+callbacks.ask._target_=tests.helpers.plugins.AskOnOneRank",
        "+callbacks.ask.skip_at=3",
        "+callbacks.ask.stop_at=6",
    ],
    "raises": ["trainer.max_steps=4", "+callbacks.boom._target_=tests.helpers.plugins.Raises"],
    # SIGTERM on rank 0 only, during step 5; then the same after saves that took longer than a grace of 0 s.
    "signal": ["trainer.max_steps=10", *SIGNAL],
    "past_grace": ["trainer.max_steps=10", "checkpoint.interval=2", "trainer.preemption_grace_s=0", *SIGNAL],
    # The lr 300x higher at step 9's update: step 10's loss spikes, and its update is skipped.
    "spike": [
        "trainer.max_steps=12",
        "schedule._target_=tests.helpers.plugins.spike_lr",
        "callbacks=spike",
        "callbacks.spike.skip=true",
        "callbacks.spike.min_steps=4",
        "callbacks.spike.threshold=4",
        CALLBACKS,
    ],
    "wsd": [
        "distributed.nproc_per_node=1",
        "trainer.max_steps=20",
        "schedule=wsd",
        "schedule.warmup_steps=2",
        "schedule.decay_ratio=0.25",
        "checkpoint.interval=10",
    ],  # fmt: skip
    # Step 6's update skipped (asked by rank 1): the average stays as it was; the head's weights logged each step.
    "ema": [
        "trainer.max_steps=8",
        "callbacks=ema",
        "callbacks.ema.decay=0.9",
        "callbacks.ema.export=true",
        "checkpoint.export=true",
        "checkpoint.export_dtype=float32",
        "+callbacks.ask._target_=tests.helpers.plugins.AskOnOneRank",
        "+callbacks.ask.skip_at=6",
        "+callbacks.weights._target_=tests.helpers.plugins.WeightLog",
        "+callbacks.weights.name=lm_head.weight",
    ],  # fmt: skip
    # Resumed at step 4 with another lr: step 5 is taken with it.
    "lr": [
        "trainer.max_steps=5",
        "schedule=constant",
        "schedule.warmup_steps=0",
        "optim.lr=1e-3",
        "checkpoint.export=true",
        "checkpoint.export_dtype=float32",
    ],  # fmt: skip
}
# Resumed from the checkpoint before the last: (run, step it resumes from, overrides changed).
RESUMED = {
    "wsd": ("wsd", 10, ["trainer.max_steps=30"]),
    "ema": ("ema", 4, []),
    "lr": ("lr", 4, ["optim.lr=5e-2"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work, cache = tmp_path_factory.mktemp("plugins"), str(tmp_path_factory.getbasetemp() / "hf_datasets")

    def first(name):
        return train(str(work / name), RUN + RUNS[name], cache)

    def resumed(name):
        source, step, changes = RESUMED[name]
        original = done[source].result()
        run_dir = str(work / f"{name}_resumed")
        shutil.copytree(original.run_dir, run_dir)
        for entry in os.listdir(os.path.join(run_dir, "checkpoints")):
            if int(entry.split("_")[1]) > step:
                shutil.rmtree(os.path.join(run_dir, "checkpoints", entry))
        for entry in ("export", "export_ema"):
            shutil.rmtree(os.path.join(run_dir, entry), ignore_errors=True)
        return train(run_dir, RUN + with_overrides(RUNS[source], *changes), cache)

    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(first, name) for name in RUNS}
        later = {f"{name}_resumed": pool.submit(resumed, name) for name in RESUMED}
        return {name: future.result() for name, future in {**done, **later}.items()}


def _ok(run):
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _seen(run, rank):
    with open(os.path.join(run.run_dir, f"seen_rank{rank}.json")) as f:
        return json.load(f)


def test_every_hook_is_called_and_skip_and_stop_are_agreed(runs):
    run = _ok(runs["hooks"])
    for rank in (0, 1):
        seen = _seen(run, rank)
        sums = {int(k): v for k, v in seen["checksums"].items()}
        assert sorted(sums) == [1, 2, 3, 4, 5, 6]  # stopped after step 6, asked by rank 1 only
        assert sums[3] == sums[2] and sums[4] != sums[3] and sums[2] != sums[1]  # step 3's update skipped
        assert [k for k, v in seen["skipped"].items() if v] == ["3"]
        assert seen["hooks"] == [
            "setup", "on_train_start@0", "on_eval@3", "on_save@4:step_4", "on_eval@6", "on_save@6:step_6",
            "on_train_end",
        ]  # fmt: skip
    assert json.load(open(os.path.join(run.run_dir, "status.json")))["status"] == "completed"
    assert os.path.isdir(os.path.join(run.run_dir, "checkpoints", "step_6"))


def test_shipped_callbacks_log_their_records(runs):
    records = read_records(_ok(runs["hooks"]).run_dir)
    blocks = [r for r in records if "grad_norm/block_0" in r]
    assert [r["step"] for r in blocks] == [2, 4, 6] and all(len(r) == 5 for r in blocks)  # step + 4 blocks
    assert [r["step"] for r in records if "ema_eval_loss" in r] == [3, 6]
    losses = [r for r in records if "loss" in r]
    assert all(0 < r["z_loss"] < 0.01 for r in losses)


def test_a_callback_that_raises_fails_the_run_naming_it(runs):
    run = runs["raises"]
    assert run.returncode == 1
    status = json.load(open(os.path.join(run.run_dir, "status.json")))
    assert status["status"] == "failed"
    assert "callback 'boom' (Raises.on_step_end) raised ValueError: this callback fails at step 2" in status["error"]


def _stopped(run) -> tuple[dict, str, list[int]]:
    """status.json, the train.log line of the stop, and the checkpoints left."""
    assert run.returncode == 143, run.stderr[-3000:]
    with open(os.path.join(run.run_dir, "train.log")) as f:
        [line] = [line for line in f if "preemption signal" in line]
    status = json.load(open(os.path.join(run.run_dir, "status.json")))
    steps = sorted(int(name.split("_")[1]) for name in os.listdir(os.path.join(run.run_dir, "checkpoints")))
    return status, line.split("INFO] ")[1].strip(), steps


def test_a_signal_stops_every_rank_after_the_step_it_came_in(runs):
    """No step after it is taken: the ranks agree on it at that step's boundary."""
    status, line, steps = _stopped(runs["signal"])
    assert (status["status"], status["requeue"], "past_grace" in status) == ("preempted", False, False)
    assert line == "preemption signal (SIGTERM): stopped after step 5 with a resume checkpoint"
    assert steps == [4, 5] and [m["step"] for m in runs["signal"].metrics() if "loss" in m][-1] == 5


def test_a_save_that_would_end_past_the_grace_is_skipped_and_said(runs):
    status, line, steps = _stopped(runs["past_grace"])
    assert line.startswith("preemption signal (SIGTERM): stopped after step 5 without a checkpoint"), line
    assert status["status"] == "preempted" and "past trainer.preemption_grace_s=0" in status["past_grace"], status
    assert steps == [2, 4]


def test_a_spike_is_logged_and_its_step_skipped(runs):
    run = _ok(runs["spike"])
    spikes = [r for r in read_records(run.run_dir) if "spike_skipped" in r]
    assert spikes and spikes[0]["step"] == 10 and spikes[0]["spike_skipped"] is True
    assert spikes[0]["spike_loss_z"] > 4
    for rank in (0, 1):
        sums = _seen(run, rank)["checksums"]
        assert sums["10"] == sums["9"] and sums["9"] != sums["8"]


def _lrs(run) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in run.metrics() if "lr" in r}


def test_wsd_lr_curve_and_its_extension_on_resume(runs):
    lrs = _lrs(_ok(runs["wsd"]))
    expected = {
        s + 1: 3e-3 * expected_multiplier("wsd", s, 20, warmup=2, floor=0.0, decay_ratio=0.25) for s in range(20)
    }
    assert lrs == pytest.approx(expected)
    assert lrs[16] == pytest.approx(3e-3) and lrs[17] < 3e-3  # decay over the last 5 steps (0-based 15..19)
    # Resumed at step 10 with max_steps=30: the stable phase goes on to step 23, then 8 steps of decay.
    extended = _lrs(_ok(runs["wsd_resumed"]))
    assert extended == pytest.approx(
        {**{s: lrs[s] for s in range(1, 11)}, **{s + 1: 3e-3 * expected_multiplier("wsd", s, 30, warmup=2, floor=0.0,
                                                                         decay_ratio=0.25) for s in range(10, 30)}}
    )  # fmt: skip
    assert extended[23] == pytest.approx(3e-3) and extended[24] < 3e-3


def test_ema_resumes_bitwise(runs):
    whole, resumed = _ok(runs["ema"]), _ok(runs["ema_resumed"])
    a = checkpoint_tensors(os.path.join(whole.run_dir, "checkpoints", "step_8"))
    b = checkpoint_tensors(os.path.join(resumed.run_dir, "checkpoints", "step_8"))
    assert any(k.startswith("callbacks.ema.weights.") for k in a)
    assert_bitwise_equal(a, b)
    from safetensors.torch import load_file

    ema = load_file(os.path.join(whole.run_dir, "export_ema", "model.safetensors"))
    assert_bitwise_equal(ema, load_file(os.path.join(resumed.run_dir, "export_ema", "model.safetensors")))
    live = load_file(os.path.join(whole.run_dir, "export", "model.safetensors"))
    assert not torch.equal(ema["lm_head.weight"], live["lm_head.weight"])


def test_ema_is_the_average_of_the_steps_taken(runs):
    """The exported average of the head against one computed here from the head's weights after every step (the
    step skipped left out), in float64."""
    from safetensors.torch import load_file

    run = _ok(runs["ema"])
    logged = torch.load(os.path.join(run.run_dir, "weights.pt"))
    assert logged["skipped"] == [6] and torch.equal(logged["values"][6], logged["values"][5])
    expected = logged["values"][0].double()
    for step in range(1, 9):
        if step not in logged["skipped"]:
            expected = 0.9 * expected + 0.1 * logged["values"][step].double()
    ema = load_file(os.path.join(run.run_dir, "export_ema", "model.safetensors"))["lm_head.weight"]
    torch.testing.assert_close(ema.double(), expected, rtol=0, atol=1e-6)
    # Had the skipped step entered the average, it would be off by more than that.
    assert (ema.double() - 0.9 * expected - 0.1 * logged["values"][6].double()).abs().max() > 1e-5


def test_a_changed_lr_wins_on_resume(runs):
    """Resumed at step 4 with optim.lr=5e-2 after a run at 1e-3 (constant schedule): step 5 logs and takes the new
    rate. AdamW's update (decay included) is the rate times what the state and gradients give, the same for both:
    the step from the checkpoint's weights is 50 times the one the run at 1e-3 took."""
    from safetensors.torch import load_file

    run, resumed = _ok(runs["lr"]), _ok(runs["lr_resumed"])
    assert _lrs(run) == pytest.approx({s: 1e-3 for s in range(1, 6)})
    assert _lrs(resumed) == pytest.approx({**{s: 1e-3 for s in range(1, 5)}, 5: 5e-2})
    with open(os.path.join(resumed.run_dir, "train.log")) as f:
        assert "resumed with the config's values: optim.lr: 0.001 -> 0.05" in f.read()
    at_4 = checkpoint_tensors(os.path.join(run.run_dir, "checkpoints", "step_4"))
    slow = load_file(os.path.join(run.run_dir, "export", "model.safetensors"))
    fast = load_file(os.path.join(resumed.run_dir, "export", "model.safetensors"))
    for name, weight in fast.items():
        start = at_4[f"model.{name}"]
        # Steps of ~0.05; 50 x the rounding of weights near 1 (the norms') is ~3e-6.
        torch.testing.assert_close(weight - start, 50 * (slow[name] - start), rtol=0, atol=1e-5, msg=name)


def _ema_logits(cfg, batch):
    """Logits of the sharded model with the EMA's weights swapped in, after a forward that left every unit
    gathered (no_reshard): the EMA here is half the live weights."""
    import types

    import torch.distributed as dist

    from fsdp_research.callbacks.ema import EMA
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model
    from tests.helpers.dist import full_state

    init_distributed(cfg.distributed, torch.device("cpu"))
    model, _ = build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), dist.get_world_size())
    ema = EMA(decay=0.5)
    ema.setup(types.SimpleNamespace(model=model))
    with torch.no_grad():
        for average in ema.weights.values():
            average.mul_(0.5)
        model(input_ids=batch)  # every unit stays gathered with the live weights
        with ema.swapped():
            averaged = model(input_ids=batch).logits
        live = model(input_ids=batch).logits
    return {"averaged": averaged, "live": live, "weights": full_state(model)}


def test_ema_evaluates_its_own_weights_even_where_units_stay_gathered():
    from tests.helpers.dist import run_distributed

    cfg = compose(FAST + ["sharding=no_reshard"])
    batch = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    got = run_distributed(_ema_logits, 2, cfg, batch)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **cfg.model.config))
    model.load_state_dict({k: v * 0.5 for k, v in got["weights"].items()})
    with torch.no_grad():
        torch.testing.assert_close(got["averaged"], model(input_ids=batch).logits, rtol=1e-5, atol=1e-5)
        model.load_state_dict(got["weights"])
        torch.testing.assert_close(got["live"], model(input_ids=batch).logits, rtol=1e-5, atol=1e-5)
