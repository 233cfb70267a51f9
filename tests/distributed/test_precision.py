"""Mixed precision on 2 real processes: bf16 trains and reduces in fp32 (bf16_reduce in bf16); fp16's dynamic
loss scaling skips and counts overflowing steps, then trains; gpt2_tiny, whose output embedding is tied to its
input embedding, trains too, and in fp32 matches the plain single-process run."""

import os

import pytest
import torch
from transformers import AutoConfig

from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.cli import read_metrics
from tests.helpers.dist import ok, train_distributed
from tests.helpers.fsdp_units import precision_state
from tests.helpers.reference import reference_run, save_initial

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 12
BASE = FAST + [f"trainer.max_steps={STEPS}", "trainer.global_batch_size=8", "trainer.micro_batch_size=4"]
# Overflows in fp16 for the first few steps (the gradients exceed 65504 until the scale is below ~1e5).
INIT_SCALE = 2.0**20
RUNS = {
    "bf16": ["precision=bf16"],
    "bf16_reduce": ["precision=bf16_reduce", "trainer.max_steps=3"],
    "fp16": ["precision=fp16", f"precision.init_scale={INIT_SCALE}"],
    "gpt2_bf16": ["GPT2", "precision=bf16"],
    "gpt2_fp32": ["GPT2", "trainer.max_steps=6"],
}


def _gpt2(initial: str) -> list[str]:
    """gpt2_tiny, from initial weights transformers made (what the reference starts from too)."""
    return ["model=pretrained", f"model.name_or_path={initial}"]


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    hf_config = AutoConfig.for_model("gpt2", **compose(["model=gpt2_tiny"]).model.config)
    return save_initial(hf_config, str(tmp_path_factory.mktemp("gpt2_initial")))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, initial):
    out = str(tmp_path_factory.mktemp("precision"))
    expand = {"GPT2": _gpt2(initial)}
    configs = {name: compose(BASE + [o for e in extra for o in expand.get(e, [e])]) for name, extra in RUNS.items()}
    results = train_distributed(configs, 2, out, inspect=precision_state)
    return {name: {**ok(results, name), "metrics": read_metrics(os.path.join(out, name))} for name in RUNS}


@pytest.mark.parametrize(
    "name, param, reduce",
    [
        ("bf16", torch.bfloat16, torch.float32),
        ("bf16_reduce", torch.bfloat16, torch.bfloat16),
        ("fp16", torch.float16, torch.float32),
        ("gpt2_bf16", torch.bfloat16, torch.float32),
    ],
)
def test_every_unit_has_the_policy(runs, name, param, reduce):
    mp = runs[name]["mp"]
    assert len(mp) == 5 and set(mp.values()) == {(param, reduce)}  # 4 blocks and the root


@pytest.mark.parametrize("name", ["bf16", "gpt2_bf16"])
def test_bf16_trains(runs, name):
    losses = runs[name]["losses"]
    assert len(losses) == STEPS and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0


def test_bf16_computes_in_bf16(runs):
    """Close to the fp32 run of the same model, but not equal: the compute really is in bf16."""
    fp32 = torch.tensor(runs["gpt2_fp32"]["losses"])
    bf16 = torch.tensor(runs["gpt2_bf16"]["losses"][: len(fp32)])
    relative = ((bf16 - fp32).abs() / fp32).max().item()
    assert 1e-5 < relative < 1e-2


def test_fp16_skips_and_counts_overflowing_steps(runs):
    metrics = runs["fp16"]["metrics"]
    skipped = [m["skipped_steps"] for m in metrics]
    assert 0 < skipped[-1] < STEPS // 2
    # Each overflow is counted and halves the scale (at most one per step); no growth (growth_interval is 200).
    assert all(b - a in (0, 1) for a, b in zip([0, *skipped], skipped))
    for m in metrics:
        assert m["loss_scale"] == INIT_SCALE / 2 ** m["skipped_steps"]
    # The first steps overflow one after another, until the scale has come down to what fp16 holds.
    first = next(i for i, m in enumerate(metrics) if m["skipped_steps"] < m["step"])
    assert first > 0
    losses = [m["loss"] for m in metrics]
    # Skipped steps leave the weights as they were: the loss only moves with the batch until a step is taken.
    assert max(abs(loss - losses[0]) for loss in losses[: first + 1]) < 0.1
    assert losses[-1] < losses[first] - 1.0  # trains once the scale fits


def test_gpt2_keeps_tied_embeddings_and_matches_plain_pytorch(runs, initial):
    assert runs["gpt2_fp32"]["tied"] and runs["gpt2_bf16"]["tied"]
    ref_losses, ref_weights = reference_run(compose(BASE + _gpt2(initial) + RUNS["gpt2_fp32"][1:]), initial)
    losses, weights = runs["gpt2_fp32"]["losses"], runs["gpt2_fp32"]["weights"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert weights.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(weights[key], ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
