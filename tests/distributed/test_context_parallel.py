"""Context parallel (parallel.cp) against the single-process reference built from what we did not write
(tests/helpers/reference.py: transformers' from_pretrained of the same initial weights, torch.optim.AdamW): the same
per-step losses, gradient norms and exported weights (read back by from_pretrained) at 256 tokens with cp=2 on 2
ranks, cp=2 x tp=2 and cp=2 x dp_shard=2 on 4, for llama and qwen2 (q/k/v biases); on llama with activation
checkpointing (every block: the recomputed forward splits again; selective), hsdp and an evaluation of whole
sequences. A checkpoint saved at cp=2 resumes at cp=1; the mesh is printed; `simulate` plans one cp rank; bad settings
are one line before any compute."""

import pytest
import torch

from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.sinks import read_records
from tests.helpers.dist import run_distributed
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
from tests.helpers.zoo import from_config, hf_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("llama", "qwen2")
# 256 tokens: each of 2 x cp chunks long enough for positions far apart.
LONG = [*BASE, "data.seq_len=256"]
RUNS = {2: {"cp2": ["parallel.cp=2"]}, 4: {"cp2xtp2": ["parallel.cp=2", "parallel.tp=2"], "cp2xdp2": ["parallel.cp=2"]}}
KNOBS = {
    2: {
        "cp2+ac+eval": ["parallel.cp=2", "activation_checkpointing=every_block", "trainer.eval_interval=2"],
        "cp2+selective": ["parallel.cp=2", "activation_checkpointing=selective"],
        "eval": ["trainer.eval_interval=2"],  # the evaluation above, without cp
    },
    4: {
        "cp2+hsdp": ["parallel.cp=2", "sharding=hsdp", "sharding.replicate=2", "trainer.micro_batch_size=1"],
        "cp4": ["parallel.cp=4", "trainer.micro_batch_size=4"],
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return trained_with_references(tmp_path_factory.mktemp("cp"), FAMILIES, LONG, RUNS, KNOBS, "llama")


CASES = cases(FAMILIES, RUNS, KNOBS, "llama")


@pytest.mark.parametrize(("family", "name", "world"), CASES)
def test_losses_and_export_match_the_single_process_reference(results, family, name, world):
    assert_matches_reference(results, family, name, world)


def test_evaluation_splits_the_sequences_as_training_does(results):
    """Eval under cp (each rank its chunks of the held-out windows) gives the loss eval without cp gives."""
    out, *_ = results

    def evals(name: str) -> dict[int, float]:
        return {r["step"]: r["eval_loss"] for r in read_records(str(out / "w2" / "llama" / name)) if "eval_loss" in r}

    split, whole = evals("cp2+ac+eval"), evals("eval")
    assert list(split) == [2, 4]
    assert split == pytest.approx(whole, rel=1e-5)


def test_a_cp_checkpoint_resumes_at_cp_1(results, tmp_path):
    assert_resumes_at_one_rank_group(results, LONG, "llama", "cp2xtp2", tmp_path)


def test_the_mesh_is_printed_at_start(results):
    out, *_ = results
    log = (out / "w4" / "llama" / "cp2xtp2" / "train.log").read_text()
    assert "mesh: dp_shard 1 x cp 2 (FSDP over dp_shard x cp) x tp 2" in log


def test_bad_context_parallel_settings_are_one_line():
    assert refused(3, "parallel.cp=2").startswith("parallel.cp: 2 does not divide the 3 ranks")
    assert refused(2, "parallel.cp=4").startswith("parallel.cp: 4 does not divide the 2 ranks")
    assert refused(2, "parallel.cp=0").startswith("parallel.cp: 0 does not divide")
    dynamic = "+model.config.rope_parameters={rope_type:dynamic,factor:2.0,rope_theta:10000.0}"
    assert refused(2, *from_config("llama"), dynamic, "parallel.cp=2").startswith(
        "parallel.cp: LlamaForCausalLM has RoPE scaled by the sequence length"
    )
    assert refused(2, "parallel.cp=2", "data.seq_len=62").startswith(
        "parallel.cp: data.seq_len=62 does not split into 2 x cp = 4 chunks"
    )
    assert refused(2, *from_config("gemma2"), "parallel.cp=2").startswith(
        "parallel.cp: Gemma2ForCausalLM has sliding-window layers"
    )
    assert refused(4, *from_config("llama"), "model.config.num_attention_heads=2", "parallel.cp=4").startswith(
        "parallel.cp: 4 does not divide the 2 attention heads"
    )
    assert refused(2, "parallel.cp=2", "sharding=ddp").startswith("sharding: ddp with cp is not supported")
    assert refused(2, "parallel.cp=2", "trainer.compile=true").startswith("trainer.compile: torch.compile with")
    assert refused(2, "parallel.cp=2", "data.document_masking=true").startswith("data: packed documents")


def test_simulate_plans_one_cp_rank_as_the_planner(tmp_path):
    """`fsdp-research simulate ... parallel.cp=2`: one rank of a cp x dp_shard job, on the fake backend, holds the
    shards the planner predicts."""
    args = ["model=llama_tiny", "world_size=4", "rank=3", "parallel.cp=2", "trainer.global_batch_size=16"]
    assert_simulated_as_planned(simulated_phases(args, tmp_path / "rank3.json"))


def _split_against_whole(cases: list[tuple[str, int]]) -> list[str]:
    """On each of 2 ranks, for each (attention implementation, key-value heads): transformers' llama on whole
    sequences against a copy split over cp=2 (its tokens, positions and attention gathered): the split one's logits
    are the whole one's at this rank's positions, its gradients averaged over the ranks the whole one's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.context_parallel import apply_cp, split_of
    from fsdp_research.distributed.processes import init_distributed

    init_distributed(typed(compose([])).distributed, torch.device("cpu"))
    checked = []
    for attention, kv in cases:
        config = hf_config("llama", num_key_value_heads=kv, attn_implementation=attention)
        torch.manual_seed(0)
        whole, split = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
        split.load_state_dict(whole.state_dict())
        apply_cp(split, init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)))
        cp = split_of(split)
        tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(1))
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        logits = whole(input_ids=inputs).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        local_inputs, local_labels, positions = cp.local(inputs, labels)
        with cp.splitting():
            local = split(input_ids=local_inputs, position_ids=positions).logits
            torch.nn.functional.cross_entropy(local.flatten(0, 1), local_labels.flatten()).backward()
        torch.testing.assert_close(local, logits[:, positions[0]], rtol=1e-5, atol=1e-5)
        for (name, p), q in zip(split.named_parameters(), whole.parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad / 2, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        # Outside a training step: the family's attention on whole sequences.
        torch.testing.assert_close(split(input_ids=inputs).logits, logits, rtol=1e-5, atol=1e-5)
        checked.append(f"{attention}/{kv}")
    return checked


def test_split_attention_equals_whole_sequence_attention():
    """Query heads split over cp with key-value heads split too (4), one each way (2), and too few to split (1: each
    query head's own copy), under sdpa and eager."""
    cases = [("sdpa", 4), ("sdpa", 2), ("eager", 1)]
    assert run_distributed(_split_against_whole, 2, cases) == ["sdpa/4", "sdpa/2", "eager/1"]
