"""Tensor parallel (parallel.tp) on a 2-D mesh with FSDP2, against the single-process reference built from what we
did not write (tests/helpers/reference.py: transformers' from_pretrained of the same initial weights,
torch.optim.AdamW, the batches read by numpy): the same per-step losses and the same exported weights (read back by
from_pretrained) with tp=2 and sequence parallel on 2 ranks, tp=2 without it, and tp=2 x dp_shard=2 on 4 ranks; for
llama, qwen2 (q/k/v biases), gemma2 (tied embeddings) and phi3 (a plan of fused projections gathered and split:
colwise_gather_output, rowwise_split_input); on llama, with activation checkpointing (full, every 2nd, selective),
hsdp (a 3-D mesh), ddp, per_linear, reshard_all, torch.compile, and the EMA and per-block norm callbacks. A
checkpoint saved at tp=2 resumes at tp=1; `simulate` plans one tp rank; bad settings are one line before any
compute."""

import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from fsdp_research.distributed.mesh import Mesh, degrees
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import apply_parallelism, planned_model
from fsdp_research.model.initialization import materialize
from tests.conftest import FAST, ROOT
from tests.helpers.cli import start
from tests.helpers.dist import ok, run_fake
from tests.helpers.parallel import (
    BASE,
    assert_export_matches,
    assert_resumes_at_one_rank_group,
    assert_simulated_as_planned,
    loading,
    refused,
    simulated_phases,
    train_families,
)
from tests.helpers.reference import reference_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("llama", "qwen2", "gemma2", "phi3")
RUNS_2 = {"tp2+sp": ["parallel.tp=2"], "tp2": ["parallel.tp=2", "parallel.sequence_parallel=false"]}
RUNS_4 = {"tp2xdp2": ["parallel.tp=2"]}
# With the other knobs, on llama: none changes a number.
KNOBS_2 = {
    "tp2+ac+callbacks": ["parallel.tp=2", "activation_checkpointing=every_block", "callbacks=[ema,grad_norms]"],
    "tp2+compile": ["parallel.tp=2", "parallel.sequence_parallel=false", "trainer.compile=true"],
}
KNOBS_4 = {
    "tp2+hsdp": ["parallel.tp=2", "sharding=hsdp", "sharding.replicate=2"],
    "tp2+ddp": ["parallel.tp=2", "sharding=ddp"],
    "tp2+per_linear+ac": ["parallel.tp=2", "sharding=per_linear", "activation_checkpointing=every_block"],
    "tp2+selective": ["parallel.tp=2", "activation_checkpointing=selective"],
    "tp2+no_sp+reshard_all+every_2nd": [
        "parallel.tp=2",
        "parallel.sequence_parallel=false",
        "sharding=reshard_all",
        "activation_checkpointing=every_2nd",
    ],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    initials, runs = train_families(out, FAMILIES, BASE, {2: RUNS_2, 4: RUNS_4}, {2: KNOBS_2, 4: KNOBS_4}, "llama")
    references = {f: reference_run(compose(loading(BASE, initials[f])), initials[f]) for f in FAMILIES}
    return out, initials, runs, references


CASES = [(f, n) for f in FAMILIES for n in [*RUNS_2, *RUNS_4]] + [("llama", n) for n in [*KNOBS_2, *KNOBS_4]]


@pytest.mark.parametrize(("family", "name"), CASES)
def test_losses_and_export_match_the_single_process_reference(results, family, name):
    out, _, runs, references = results
    ref_losses, ref_weights = references[family]
    run = ok(runs, f"{family}/{name}")
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    world = 2 if name in {**RUNS_2, **KNOBS_2} else 4
    assert_export_matches(out / f"w{world}" / family / name / "export", ref_weights)


def test_a_tp_checkpoint_resumes_at_tp_1(results, tmp_path):
    assert_resumes_at_one_rank_group(results, BASE, "llama", "tp2xdp2", tmp_path)


def test_simulate_plans_one_tp_rank_as_the_planner(tmp_path):
    """`fsdp-research simulate ... parallel.tp=2`: one rank's shards of a tp x dp job, on the fake backend, hold
    what the planner predicts (its tp part of each split Linear, sharded over the data-parallel ranks)."""
    args = ["model=llama_tiny", "world_size=4", "rank=3", "parallel.tp=2", "trainer.global_batch_size=16"]
    assert_simulated_as_planned(simulated_phases(args, tmp_path / "rank3.json"))


def test_bad_tensor_parallel_settings_are_one_line():
    assert refused(3, "parallel.tp=2").startswith("parallel.tp: 2 does not divide the world size 3")
    assert refused(4, "parallel.tp=4", "model.config.num_key_value_heads=2").startswith(
        "parallel.tp: 4 does not divide"
    )
    assert refused(2, "parallel.tp=2", "sharding=ddp_classic").startswith("sharding: ddp_classic with tensor")
    assert refused(2, "parallel.tp=2", "data.seq_len=63").startswith("parallel.sequence_parallel: data.seq_len=63")
    assert refused(2, "parallel.tp=2", "parallel.tp_plan={nothing.*:colwise}").startswith(
        "parallel.tp_plan: nothing.* names no module"
    )
    assert "style 'sideways' is not supported" in refused(
        2, "parallel.tp=2", "parallel.tp_plan={layers.*.mlp:sideways}"
    )


def _warnings_of_a_step(overrides: list[str]) -> list[str]:
    """The warnings one forward and backward of the model, sharded as the trainer shards it, raise on this rank."""
    cfg = compose([*FAST, *overrides])
    model, plan = planned_model(cfg, build_hf_config(cfg.model))
    apply_parallelism(model, plan, cfg, Mesh(degrees(cfg, dist.get_world_size()), "cpu"))
    materialize(model, torch.device("cpu"), torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=torch.zeros(1, cfg.data.seq_len, dtype=torch.long)).logits.sum().backward()
    return [str(w.message) for w in caught]


def test_sequence_parallel_hands_fsdp_no_view():
    """The last block under sequence parallel returns the gathered residual stream: a copy, so FSDP2's "returned a
    view tensor ... can cause backward to fail or produce wrong gradients" does not apply (it warned once per rank
    of each run). One rank of 2 on the fake process group: the structure, not the values."""
    caught = run_fake(_warnings_of_a_step, 2, ["parallel.tp=2"])
    assert not [m for m in caught if "returned a view tensor" in m], caught


def _run(overrides: list[str]) -> None:
    out, err = (job := start(overrides, ROOT)).communicate()
    assert job.returncode == 0, err[-3000:]


def test_a_resume_at_another_tp_layout_draws_alike_in_a_tp_group(tmp_path):
    """Dropout on: 2 steps at tp=1 (two data-parallel ranks, each its own masks), then a resume at tp=2 (one tp
    group): its ranks draw their masks from one state at every forward, as ranks holding the same activations must
    (a generator restored rank by rank gave them two)."""
    run = str(tmp_path / "run")
    _run(
        [*FAST, "model.config.attention_dropout=0.5", "distributed.nproc_per_node=2", "trainer.global_batch_size=4",
         "trainer.micro_batch_size=2", "trainer.max_steps=2", "checkpoint.interval=2", f"hydra.run.dir={run}",
         "+callbacks.rng._target_=tests.helpers.plugins.RngRecorder"]
    )  # fmt: skip
    _run([f"checkpoint.resume={run}", "trainer.max_steps=4", "parallel.tp=2"])
    ranks = [[json.loads(line) for line in open(os.path.join(run, f"rng_rank{r}.jsonl"))] for r in (0, 1)]
    assert [len(states) for states in ranks] == [2 + 4, 2 + 4]  # a micro-batch a step at tp=1, two at tp=2
    assert ranks[0][:2] != ranks[1][:2] and ranks[0][2:] == ranks[1][2:]
