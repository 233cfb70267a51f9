"""Expert parallel (parallel.ep) against the single-process reference built from what we did not write
(tests/helpers/reference.py: transformers' from_pretrained of the same initial weights, torch.optim.AdamW, DeepSeek-V3's
bias balancing written out from its formula): the same per-step losses and the same exported weights (read back by
from_pretrained; the routers' expert-score biases among them) with ep=2 on 2 ranks and ep=2 x dp_mod_ep=2 on 4,
for qwen3_moe, deepseek_v3 (latent attention, a shared expert, a dense first layer, aux-loss-free balancing) and
mixtral; hsdp and context parallel (cp=2 on the ep ranks) on qwen3_moe. A checkpoint saved at ep=2 resumes at ep=1;
`simulate` plans one ep rank; bad settings are one line before any compute."""

import pytest

from fsdp_research.jobs.compose import compose
from fsdp_research.train.parallel_checks import check_parallel
from tests.conftest import FAST
from tests.helpers.parallel import (
    BASE,
    assert_matches_reference,
    assert_resumes_at_one_rank_group,
    assert_simulated_as_planned,
    cases,
    refused,
    simulated_phases,
    trained_with_references,
)
from tests.helpers.zoo import from_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("qwen3_moe", "deepseek_v3", "mixtral")
RUNS = {2: {"ep2": ["parallel.ep=2"]}, 4: {"ep2xdp2": ["parallel.ep=2", "trainer.micro_batch_size=1"]}}
KNOBS = {
    2: {
        # The dispatch's all-to-alls again in the recomputed forward (every block; selective: what it keeps).
        "ep2+ac": ["parallel.ep=2", "activation_checkpointing=every_block"],
        "ep2+selective": ["parallel.ep=2", "activation_checkpointing=selective"],
        # ep borrowing the cp ranks (the shard dimension is dp_shard x cp): each rank routes its chunks' tokens.
        "ep2+cp2": ["parallel.ep=2", "parallel.cp=2"],
    },
    4: {"ep2+hsdp": ["parallel.ep=2", "sharding=hsdp", "sharding.replicate=2", "trainer.micro_batch_size=1"]},
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return trained_with_references(tmp_path_factory.mktemp("ep"), FAMILIES, BASE, RUNS, KNOBS, "qwen3_moe")


CASES = cases(FAMILIES, RUNS, KNOBS, "qwen3_moe")


@pytest.mark.parametrize(("family", "name", "world"), CASES)
def test_losses_and_export_match_the_single_process_reference(results, family, name, world):
    assert_matches_reference(results, family, name, world)


def test_an_ep_checkpoint_resumes_at_ep_1(results, tmp_path):
    assert_resumes_at_one_rank_group(results, BASE, "deepseek_v3", "ep2xdp2", tmp_path)


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
    # fp16's pre/post divide factors and a lone rank's own divide: expert gradients divided twice in torch 2.13.
    fp16 = ["precision.param_dtype=float16", "precision.reduce_dtype=float16"]
    assert refused(2, *moe, "parallel.ep=2", *fp16).startswith("precision.reduce_dtype: torch.float16 with parallel.ep")
    check_parallel(compose(FAST + [*moe, "parallel.ep=2", *fp16]), 4)  # 2 ranks an expert: one division


def test_the_mesh_is_printed_at_start(results):
    out, *_ = results
    log = (out / "w4" / "qwen3_moe" / "ep2xdp2" / "train.log").read_text()
    assert "mesh: dp_shard 4 (experts: dp_mod_ep 2 x ep 2)" in log


def test_simulate_plans_one_ep_rank_as_the_planner(tmp_path):
    """`fsdp-research simulate ... parallel.ep=2`: one rank of an ep x dp_mod_ep job, on the fake backend, holds the
    shards the planner predicts (its ep rank's experts sharded over dp_mod_ep), through a forward that routes."""
    args = [*from_config("qwen3_moe"), "world_size=4", "rank=3", "parallel.ep=2", "trainer.global_batch_size=32"]
    assert_simulated_as_planned(simulated_phases(args, tmp_path / "rank3.json"))
