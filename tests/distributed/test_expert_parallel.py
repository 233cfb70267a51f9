"""Expert parallel (parallel.ep) against the single-process reference built from what we did not write
(tests/helpers/reference.py: transformers' from_pretrained of the same initial weights, torch.optim.AdamW, DeepSeek-V3's
bias balancing written out from its formula): the same per-step losses and the same exported weights (read back by
from_pretrained; the routers' expert-score biases among them) with ep=2 on 2 ranks and ep=2 x dp_mod_ep=2 on 4,
for qwen3_moe, deepseek_v3 (latent attention, a shared expert, a dense first layer, aux-loss-free balancing) and
mixtral; hsdp on qwen3_moe. A checkpoint saved at ep=2 resumes at ep=1; `simulate` plans one ep rank; bad
settings are one line before any compute."""

import pytest
import torch

from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.sinks import read_records
from tests.helpers.dist import ok, train_distributed
from tests.helpers.parallel import (
    BASE,
    assert_export_matches,
    assert_simulated_as_planned,
    loading,
    refused,
    simulated_phases,
    train_families,
)
from tests.helpers.reference import reference_run
from tests.helpers.zoo import from_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")
RUNS = {2: {"ep2": ["parallel.ep=2"]}, 4: {"ep2xdp2": ["parallel.ep=2", "trainer.micro_batch_size=1"]}}
KNOBS = {
    2: {
        # The dispatch's all-to-alls again in the recomputed forward (every block; selective: what it keeps).
        "ep2+ac": ["parallel.ep=2", "activation_checkpointing=every_block"],
        "ep2+selective": ["parallel.ep=2", "activation_checkpointing=selective"],
    },
    4: {"ep2+hsdp": ["parallel.ep=2", "sharding=hsdp", "sharding.replicate=2", "trainer.micro_batch_size=1"]},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    initials, runs = train_families(out, FAMILIES, BASE, RUNS, KNOBS, "qwen3_moe")
    norms = {f: [] for f in FAMILIES}
    references = {
        f: (*reference_run(compose(loading(BASE, initials[f])), initials[f], norms=norms[f]), norms[f])
        for f in FAMILIES
    }
    return out, initials, runs, references


CASES = [(f, n, w) for w in (2, 4) for f in FAMILIES for n in RUNS[w]] + [
    ("qwen3_moe", n, w) for w in KNOBS for n in KNOBS[w]
]


@pytest.mark.parametrize(("family", "name", "world"), CASES)
def test_losses_and_export_match_the_single_process_reference(results, family, name, world):
    out, _, runs, references = results
    ref_losses, ref_weights, ref_norms = references[family]
    run = ok(runs, f"{family}/{name}")
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    # AdamW hides a gradient's scale from the weights: the experts' gradients divided as the others' are.
    norms = [r["grad_norm"] for r in read_records(str(out / f"w{world}" / family / name)) if "grad_norm" in r]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert_export_matches(out / f"w{world}" / family / name / "export", ref_weights)


def test_an_ep_checkpoint_resumes_at_ep_1(results, tmp_path):
    out, initials, runs, _ = results
    step_2 = out / "w4" / "deepseek_v3" / "ep2xdp2" / "checkpoints" / "step_2"
    cfg = compose(loading(BASE, initials["deepseek_v3"]) + [f"checkpoint.resume={step_2}", "checkpoint.export=false"])
    resumed = train_distributed({"resumed": cfg}, 2, str(tmp_path))
    assert ok(resumed, "resumed")["losses"] == pytest.approx(ok(runs, "deepseek_v3/ep2xdp2")["losses"][2:], rel=1e-5)


def test_bad_expert_parallel_settings_are_one_line():
    moe = from_config("qwen3_moe")
    assert refused(2, "parallel.ep=2").startswith("parallel.ep: LlamaForCausalLM has no fused experts")
    assert refused(6, *moe, "parallel.ep=3", "trainer.global_batch_size=48").startswith(
        "parallel.ep: 3 does not divide the 4 experts"
    )
    assert refused(2, *moe, "parallel.ep=4").startswith("parallel.ep: 4 does not divide the 2 ranks")
    assert refused(4, *moe, "parallel.ep=2", "parallel.tp=2").startswith("parallel.tp: expert parallel with tensor")
    assert refused(2, *moe, "parallel.ep=2", "sharding=ddp_classic").startswith("sharding: ddp_classic with expert")
    assert refused(2, *moe, "parallel.ep=2", "trainer.compile=true").startswith("trainer.compile: torch.compile with")


def test_the_mesh_is_printed_at_start(results):
    out, *_ = results
    log = (out / "w4" / "qwen3_moe" / "ep2xdp2" / "train.log").read_text()
    assert "mesh: dp_shard 4 (experts: dp_mod_ep 2 x ep 2)" in log


def test_simulate_plans_one_ep_rank_as_the_planner(tmp_path):
    """`fsdp-research simulate ... parallel.ep=2`: one rank of an ep x dp_mod_ep job, on the fake backend, holds the
    shards the planner predicts (its ep rank's experts sharded over dp_mod_ep), through a forward that routes."""
    args = [*from_config("qwen3_moe"), "world_size=4", "rank=3", "parallel.ep=2", "trainer.global_batch_size=32"]
    assert_simulated_as_planned(simulated_phases(args, tmp_path / "rank3.json"))
