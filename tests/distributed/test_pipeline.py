"""Pipeline parallel (parallel.pp) against the single-process reference built from what we did not write
(tests/helpers/reference.py: transformers' from_pretrained of the same initial weights, torch.optim.AdamW): the same
per-step losses and gradient norms, and the final checkpoint's weights (every stage's, read back by torch's DCP
reader), with pp=2 by 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble and ZBVZeroBubble on 2 ranks and
pp=2 x dp_shard=2 and pp=2 x tp=2 on 4, for llama and qwen2 (q/k/v biases), on llama LoopedBFS, DualPipeV, the
zero-bubble schedules with dp and tp, activation checkpointing and hsdp, and qwen2 with tied embeddings (one weight on
the first and last stage, on one rank in a V) by 1F1B and the three zero-bubble schedules. 4 layers: a V's 4 stages
of 6 units give each rank a layer. A pp=2 checkpoint resumes at pp=1 and exports (`fsdp-research export`) as
the reference's weights; the mesh and the whole model are printed; packed documents stay apart on every stage; what
is not supported yet is one line before any compute."""

import pytest
import torch

from fsdp_research.checkpoint.hf_export import load_checkpoint_weights
from tests.helpers.dist import ok
from tests.helpers.parallel import (
    BASE,
    assert_export_matches,
    assert_resumes_at_one_rank_group,
    refused,
    trained_with_references,
)
from tests.helpers.zoo import from_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

FAMILIES = ("llama", "qwen2")
PP = BASE
INTERLEAVED = ["parallel.pp=2", "parallel.pp_stages_per_rank=2", "trainer.micro_batch_size=1"]
IZB = [*INTERLEAVED, "parallel.pp_schedule=InterleavedZeroBubble"]
# A V: stages 0 and 3 on rank 0, 1 and 2 on rank 1 (torch's V schedules run no eval: FAST has none).
ZBV = [*INTERLEAVED, "parallel.pp_schedule=ZBVZeroBubble"]
DUALPIPEV = [*INTERLEAVED, "parallel.pp_schedule=DualPipeV"]
RUNS = {
    2: {
        "pp2": ["parallel.pp=2", "trainer.eval_interval=2"],
        "pp2-gpipe": ["parallel.pp=2", "parallel.pp_schedule=GPipe"],
        # 2 stages a rank (4 in all: the embedding, each layer, the head), 4 micro-batches in 2 rounds.
        "pp2-interleaved": [*INTERLEAVED, "parallel.pp_schedule=Interleaved1F1B"],
        # The zero-bubble ones: weight gradients apart from input gradients (FSDP's reduction deferred to the end).
        # Its eval of the same samples as pp2's (eval_batches x micro_batch_size).
        "pp2-izb": [*IZB, "trainer.eval_interval=2", "trainer.eval_batches=8"],
        "pp2-zbv": ZBV,
    },
    # One sample a micro-batch: each pipeline's 2 samples of the step are 2 micro-batches, one per stage.
    4: {"pp2xdp2": ["parallel.pp=2", "trainer.micro_batch_size=1"], "pp2xtp2": ["parallel.pp=2", "parallel.tp=2"]},
}
# Packed documents (their masks and positions recomputed on each stage from the position ids it is given), against
# the 1-rank run with the same; activation checkpointing within a stage, against the reference.
KNOBS = {
    1: {
        "docmask": ["data.document_masking=true", "trainer.eval_interval=2"],
        "init": ["model.load_weights=false"],
        "eval": ["trainer.eval_interval=2"],
        "zloss": ["loss.z_loss=0.01", "trainer.eval_interval=2"],
    },
    2: {
        "pp2+docmask": ["parallel.pp=2", "data.document_masking=true", "trainer.eval_interval=2"],
        "pp2+ac": ["parallel.pp=2", "activation_checkpointing=every_block"],
        # Each stage's blocks' forwards compiled, as without pp.
        "pp2+compile": ["parallel.pp=2", "trainer.compile=true"],
        "pp2+init": ["parallel.pp=2", "model.load_weights=false"],
        "pp2-loopedbfs": [*INTERLEAVED, "parallel.pp_schedule=LoopedBFS"],
        "pp2-dualpipev": DUALPIPEV,
        # A block recomputed in the input pass and again in the weight pass.
        "pp2-zbv+ac": [*ZBV, "activation_checkpointing=every_block"],
        # The logged stats: each step's micro-batches' (torch calls the loss once more to learn its shapes).
        "pp2+zloss": ["parallel.pp=2", "loss.z_loss=0.01", "trainer.eval_interval=2"],
        # bf16 parameters, fp32 reduction: torch's FSDP stage (1F1B) sums micro-batches' gradients in fp32.
        "pp2-bf16": ["parallel.pp=2", "precision=bf16", "trainer.micro_batch_size=1"],
        "pp2-zbv-bf16": [*ZBV, "precision=bf16"],
    },
    4: {
        "pp2+hsdp": ["parallel.pp=2", "sharding=hsdp", "sharding.replicate=2", "trainer.micro_batch_size=1"],
        # Each schedule with FSDP over 2 ranks a stage (2 micro-batches a rank; DualPipeV's 4 at global batch 8).
        "pp2xdp2-gpipe": ["parallel.pp=2", "parallel.pp_schedule=GPipe", "trainer.micro_batch_size=1"],
        "pp2xdp2-interleaved": [*INTERLEAVED, "parallel.pp_schedule=Interleaved1F1B"],
        "pp2xdp2-loopedbfs": [*INTERLEAVED, "parallel.pp_schedule=LoopedBFS"],
        "pp2xdp2-dualpipev": [*DUALPIPEV, "trainer.global_batch_size=8"],
        "pp2xdp2-izb": IZB,
        "pp2xdp2-zbv": ZBV,
        # Sequence parallel with several stages a rank is refused.
        "pp2xtp2-izb": [*IZB, "parallel.tp=2", "parallel.sequence_parallel=false"],
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp")
    return trained_with_references(out, FAMILIES, PP, RUNS, KNOBS, "llama", num_hidden_layers=4)


CASES = [(f, n, w) for w in sorted(RUNS) for f in FAMILIES for n in RUNS[w]] + [
    ("llama", "pp2+ac", 2),
    ("llama", "pp2+compile", 2),
    ("llama", "pp2-loopedbfs", 2),
    ("llama", "pp2-dualpipev", 2),
    ("llama", "pp2-zbv+ac", 2),
    ("llama", "pp2xdp2-gpipe", 4),
    ("llama", "pp2xdp2-interleaved", 4),
    ("llama", "pp2xdp2-loopedbfs", 4),
    ("llama", "pp2xdp2-izb", 4),
    ("llama", "pp2xdp2-zbv", 4),
    ("llama", "pp2xtp2-izb", 4),
]


@pytest.mark.parametrize(("family", "name", "world"), CASES)
def test_losses_norms_and_weights_match_the_single_process_reference(results, family, name, world):
    from fsdp_research.metrics.sinks import read_records

    out, _, runs, references = results
    ref_losses, ref_weights, ref_norms = references[family]
    run_dir = out / f"w{world}" / family / name
    torch.testing.assert_close(
        torch.tensor(ok(runs, f"{family}/{name}")["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0
    )
    norms = [r["grad_norm"] for r in read_records(str(run_dir)) if "grad_norm" in r]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    saved = load_checkpoint_weights(str(run_dir / "checkpoints" / "step_4"))
    assert saved.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(saved[key], ref, rtol=1e-4, atol=2e-5, msg=lambda m: f"{key}: {m}")
    assert_export_matches(run_dir / "export", ref_weights)  # each stage's tensors written by its own ranks


# Tied: the embedding's and the head's gradients summed between the end ranks (1F1B, InterleavedZeroBubble), or one
# parameter on rank 0, which holds both ends of a V.
TIED = {"pp2": [], "pp2-izb": IZB, "pp2-zbv": ZBV, "pp2-dualpipev": DUALPIPEV}


def test_dualpipev_with_fsdp_over_2_ranks_a_stage(results):
    """DualPipeV needs 2 pp micro-batches a rank: pp=2 x dp_shard=2 at global batch 8, against the reference at 8
    (losses and norms 1e-5, its export)."""
    from fsdp_research.jobs.compose import compose
    from fsdp_research.metrics.sinks import read_records
    from tests.helpers.parallel import loading
    from tests.helpers.reference import reference_run

    out, initials, runs, _ = results
    norms = []
    eight = compose(loading(PP, initials["llama"]) + ["trainer.global_batch_size=8"])
    losses, weights = reference_run(eight, initials["llama"], norms=norms)
    run_dir = out / "w4" / "llama" / "pp2xdp2-dualpipev"
    torch.testing.assert_close(
        torch.tensor(ok(runs, "llama/pp2xdp2-dualpipev")["losses"]), torch.tensor(losses), rtol=1e-5, atol=0
    )
    logged = [r["grad_norm"] for r in read_records(str(run_dir)) if "grad_norm" in r]
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=1e-5, atol=0)
    assert_export_matches(run_dir / "export", weights)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """qwen2 with tie_word_embeddings (as Qwen2.5's small models): the reference, and pp=2 on 2 ranks."""
    from fsdp_research.jobs.compose import compose
    from tests.helpers.dist import train_distributed
    from tests.helpers.parallel import loading
    from tests.helpers.reference import reference_run, save_initial
    from tests.helpers.zoo import hf_config

    out = tmp_path_factory.mktemp("tied")
    initial = save_initial(hf_config("qwen2", tie_word_embeddings=True, num_hidden_layers=4), str(out / "initial"))
    base, norms = loading(PP, initial), []
    # First: it builds the store.
    runs = train_distributed({n: compose(base + ["parallel.pp=2", *o]) for n, o in TIED.items()}, 2, str(out))
    losses, weights = reference_run(compose(base), initial, norms=norms)
    return out, (losses, weights, norms), runs


@pytest.mark.parametrize("name", TIED)
def test_tied_embeddings_are_one_weight_across_the_end_stages(tied, name, tmp_path):
    """The embedding on the first stage and the head on the last hold one weight: its gradient summed between them,
    counted once in the norm; losses, norms and the exported weights (one tensor, as save_pretrained writes a tied
    model) as the reference's."""
    from fsdp_research.cli.export import main as export
    from fsdp_research.metrics.sinks import read_records

    out, (losses, weights, norms), runs = tied
    torch.testing.assert_close(torch.tensor(ok(runs, name)["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
    logged = [r["grad_norm"] for r in read_records(str(out / name)) if "grad_norm" in r]
    torch.testing.assert_close(torch.tensor(logged), torch.tensor(norms), rtol=1e-5, atol=0)
    saved = load_checkpoint_weights(str(out / name / "checkpoints" / "step_4"))
    assert torch.equal(saved["model.embed_tokens.weight"], saved["lm_head.weight"])
    assert_export_matches(out / name / "export", weights)  # the run's own: the tied weight from the first stage
    if name == "pp2":
        assert export([str(out / name), str(tmp_path / "hf")]) == 0
        assert_export_matches(tmp_path / "hf", weights)


def test_packed_documents_are_kept_apart_on_every_stage(results):
    _, _, runs, _ = results
    staged, whole = ok(runs, "llama/pp2+docmask")["losses"], ok(runs, "llama/docmask")["losses"]
    assert staged == pytest.approx(whole, rel=1e-5)


def test_the_checkpoint_exports_every_stage_as_hugging_face(results, tmp_path):
    """`fsdp-research export <run dir> <out>` of a pp checkpoint: from_pretrained reads the reference's weights back."""
    from fsdp_research.cli.export import main as export

    out, _, _, references = results
    assert export([str(out / "w4" / "llama" / "pp2xdp2"), str(tmp_path / "hf")]) == 0
    assert_export_matches(tmp_path / "hf", references["llama"][1])


def _evals(out, world: int, family: str, name: str) -> dict[int, float]:
    from fsdp_research.metrics.sinks import read_records

    return {r["step"]: r["eval_loss"] for r in read_records(str(out / f"w{world}" / family / name)) if "eval_loss" in r}


@pytest.mark.parametrize("family", FAMILIES)
def test_eval_through_the_pipeline_is_the_1_rank_eval(results, family):
    """The held-out loss through the stages (micro_steps micro-batches at a time, padded with samples weighted 0), of
    windows and of packed documents, as 1 rank evaluates it."""
    out, *_ = results
    staged = _evals(out, 2, family, "pp2")
    assert list(staged) == [2, 4]
    assert _evals(out, 2, family, "pp2-izb") == pytest.approx(staged, rel=1e-5)
    if family == "llama":
        assert staged == pytest.approx(_evals(out, 1, "llama", "eval"), rel=1e-5)
        packed = _evals(out, 2, "llama", "pp2+docmask")
        assert list(packed) == [2, 4] and packed == pytest.approx(_evals(out, 1, "llama", "docmask"), rel=1e-5)


def test_a_step_s_stats_are_its_micro_batches_as_at_1_rank(results):
    """The z-loss logged each step (the first, and the first after an eval, included) as 1 rank logs it."""
    from fsdp_research.metrics.sinks import read_records

    out, *_ = results
    logged = [
        [r["z_loss"] for r in read_records(str(out / f"w{world}" / "llama" / name)) if "z_loss" in r]
        for world, name in ((1, "zloss"), (2, "pp2+zloss"))
    ]
    assert len(logged[0]) == 4 and logged[1] == pytest.approx(logged[0], rel=1e-5)


def test_the_weight_pass_sums_bf16_gradients_in_fp32(results):
    """Under bf16 parameters, ZBV's weight passes (after FSDP's post-backward) leave their gradients in FSDP's fp32
    accumulator: the losses of torch's own FSDP stage by 1F1B (a sum in bf16 moves them by 1e-5)."""
    _, _, runs, _ = results
    assert ok(runs, "llama/pp2-zbv-bf16")["losses"] == pytest.approx(ok(runs, "llama/pp2-bf16")["losses"], rel=1e-6)


def test_a_stage_is_initialised_as_the_whole_model(results):
    """From the config alone (model.load_weights=false): each stage's weights as the whole model's on 1 rank."""
    _, _, runs, _ = results
    assert ok(runs, "llama/pp2+init")["losses"] == pytest.approx(ok(runs, "llama/init")["losses"], rel=1e-5)


def test_a_pp_checkpoint_resumes_at_pp_1(results, tmp_path):
    assert_resumes_at_one_rank_group(results, PP, "llama", "pp2xdp2", tmp_path)


def test_the_mesh_and_the_whole_model_are_printed_at_start(results):
    """The mesh, and the whole model's parameters (not the first stage's: MFU counts what a token meets in all)."""
    from transformers import AutoModelForCausalLM

    out, initials, *_ = results
    log = (out / "w4" / "llama" / "pp2xdp2" / "train.log").read_text()
    assert "mesh: pp 2 x dp_shard 2" in log
    whole = AutoModelForCausalLM.from_pretrained(initials["llama"]).num_parameters()
    assert f": {whole / 1e6:.2f}M parameters, " in log


@pytest.mark.parametrize(
    ("points", "layers"),
    [([], [[0, 1, 2, 3], [4, 5, 6, 7]]), (["layers.6"], [[0, 1, 2, 3, 4, 5], [6, 7]]), (["model.layers.3"], None)],
)
def test_split_points_place_the_stages_where_they_say(points, layers):
    """parallel.pp_split_points (torchtitan's): the stage after a point begins at the layer it names (by the base
    model's name or the model's); the embedding with the first stage, the head with the last; empty: the units
    (embedding, layers, head) as evenly as they divide."""
    from fsdp_research.jobs.compose import compose
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import planned_model

    cfg = compose(["model=llama_mid", "parallel.pp=2", f"parallel.pp_split_points=[{','.join(points)}]"])
    stages = [planned_model(cfg, build_hf_config(cfg.model), values=False, stage=s)[0] for s in (0, 1)]
    held = [[int(k) for k in model.model.layers.keys()] for model in stages]
    assert held == (layers or [[0, 1, 2], [3, 4, 5, 6, 7]])
    assert stages[0].model.embed_tokens is not None and stages[1].model.embed_tokens is None
    assert isinstance(stages[1].lm_head, torch.nn.Linear) and not isinstance(stages[0].lm_head, torch.nn.Linear)


@pytest.mark.parametrize(
    ("world", "overrides", "expected"),
    [
        (3, ["parallel.pp=2"], "parallel.pp: 2 does not divide the world size 3"),
        (2, ["parallel.pp=2", "parallel.pp_schedule=Zigzag"], "parallel.pp_schedule: 'Zigzag' is unknown"),
        (2, ["parallel.pp=2", "sharding=reshard_all"], "sharding: reshard_all with pipeline parallel is not supported"),
        (
            4,
            [*INTERLEAVED, "parallel.pp_schedule=Interleaved1F1B", "parallel.tp=2", "trainer.global_batch_size=8"],
            "parallel.sequence_parallel: with Interleaved1F1B's several stages a rank",
        ),
        (
            2,
            ["parallel.pp=2", "parallel.pp_schedule=ZBVZeroBubble"],
            "parallel.pp_stages_per_rank: 1 with ZBVZeroBubble, which runs exactly 2 stages (a V) a rank",
        ),
        (2, [*ZBV, "trainer.eval_interval=2"], "trainer.eval_interval: eval through ZBVZeroBubble is not supported"),
        (2, [*IZB, "trainer.compile=true"], "trainer.compile: torch.compile with InterleavedZeroBubble is not"),
        (
            2,
            [*ZBV, "activation_checkpointing=selective"],
            "activation_checkpointing: selective checkpointing with ZBVZeroBubble is not supported",
        ),
        (2, [*DUALPIPEV, "trainer.global_batch_size=2"], "2 micro-batches a step are fewer than DualPipeV's 4 stages"),
        (
            4,
            [*ZBV, "parallel.tp=2", "trainer.global_batch_size=8"],
            "parallel.sequence_parallel: with ZBVZeroBubble's several stages a rank",
        ),
        (
            2,
            ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
            "parallel.pp_stages_per_rank: 1 with Interleaved1F1B",
        ),
        (
            2,
            ["parallel.pp=2", "parallel.pp_stages_per_rank=2"],
            "parallel.pp_stages_per_rank: 2 with 1F1B, which runs one",
        ),
        (
            2,
            [*INTERLEAVED, "parallel.pp_schedule=Interleaved1F1B", "trainer.global_batch_size=5"],
            "5 micro-batches a step do not divide into Interleaved1F1B's 2 rounds",
        ),
        (
            2,
            ["parallel.pp=2", "trainer.eval_interval=2", "trainer.sample_prompts=[hello]"],
            "trainer.sample_prompts: samples through the pipeline",
        ),
        (
            2,
            ["parallel.pp=2", "trainer.global_batch_size=2", "trainer.micro_batch_size=2"],
            "1 micro-batches a step are fewer than the pipeline's 2 ranks",
        ),
        (
            8,
            ["parallel.pp=8", "trainer.global_batch_size=16", "trainer.micro_batch_size=1"],
            "parallel.pp: 8 stages for",
        ),
        (2, ["parallel.pp=2", "model=custom", "model.model_type=gemma"], "gemma is not split-tested"),
        (
            2,
            ["parallel.pp=2", "parallel.pp_split_points=[layers.4]"],
            "parallel.pp_split_points: ['layers.4'] are not 1 of the model's layers in order (layers.0 .. 3)",
        ),
        (2, ["parallel.pp=2", "parallel.pp_split_points=[layers.0]"], "pipeline rank 0 would hold none of the 4"),
        (2, ["parallel.pp_split_points=[layers.1]"], "parallel.pp_split_points: split points without pipeline"),
        (2, ["parallel.pp=2", "callbacks=ema"], "callbacks: callbacks with pipeline parallel are not supported yet"),
        (2, ["parallel.pp=2", "trainer.detect_anomaly=true"], "trainer.detect_anomaly: anomaly checks with pipeline"),
        (
            2,
            [
                "parallel.pp=2",
                *from_config("qwen2"),
                "model.config.use_sliding_window=true",
                "model.config.max_window_layers=1",
            ],
            "layers of several attention types (full_attention, sliding_attention) are not split",
        ),
    ],
)
def test_what_pipeline_parallel_does_not_take_is_refused(world, overrides, expected):
    assert expected in refused(world, "trainer.eval_interval=0", "checkpoint.export=false", *overrides)
