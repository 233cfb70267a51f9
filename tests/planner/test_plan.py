"""The memory planner (fsdp_research.planner). (a) Its prediction against what torch's FSDP memory tracker
(torch.distributed._tools.fsdp2_mem_tracker) measures in one step of rank 0 of 2 or 4 ranks (CPU), for llama_tiny and
a mid-size llama (hidden 512, 8 blocks, grouped-query attention), with and without activation checkpointing, with
AdamW and with Muon: every category the tracker keeps apart, and the total peak, within 10%. The ranks are torch's
fake process group (one process; collectives move no data, so a rank allocates as on real ranks), held byte for byte
to 4 real gloo ranks by one anchor; the expert-parallel cases run on real ranks (their all-to-all sizes come from the
routing). (b) The llama_7b plan for 8 ranks, without allocating it.

Compared: sharded parameters, sharded gradients, optimizer state, parameters gathered in flight (the tracker's
Unsharded Param + All Gather), gradients unsharded in flight (Unsharded Grad + Reduce Scatter), the total peak, and
activations + temporaries together. The tracker's Temp alone is not compared, nor, with checkpointing, its
Activation: it files recomputed activations as Temp (checkpoint_wrapper runs inside the FSDP unit, and the tracker
only notices recomputation through FSDP's pre-forward hook), autograd's parameter gradients are Temp until
FSDP's post-backward takes them, and on gloo a reduce-scatter input is now and then filed as Temp. Their sum is what
both sides mean by it. The knobs of speed and memory (selective checkpointing, explicit prefetch, the loss in chunks,
reshard to groups of 2 at 4 ranks) are held to the same 10%.
"""

import re
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from fsdp_research.callbacks.ema import EMA
from fsdp_research.cli.common import checked_config
from fsdp_research.cli.plan import main
from fsdp_research.config.sizes import parse_size
from fsdp_research.distributed.pipeline import ZERO_BUBBLE
from fsdp_research.distributed.sharding import local_shard
from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.hardware import (
    CUDA_CONTEXT_GIB,
    HOST_MEMORY_GBS,
    NCCL_COMMUNICATOR_GIB,
    NCCL_COMMUNICATOR_INIT_S,
    gpu,
)
from fsdp_research.optim.muon import newton_schulz
from fsdp_research.planner.activations import block_activation_bytes, recompute_share
from fsdp_research.planner.budget import budget
from fsdp_research.planner.calibrate import ADAMW_BYTES, cpu_hardware, cpu_optimizer_rate
from fsdp_research.planner.fit import candidates, fit
from fsdp_research.planner.format import GIB
from fsdp_research.planner.memory import memory, step_moments
from fsdp_research.planner.optimizer import muon_flops, muon_temporaries, ns_flops
from fsdp_research.planner.pipeline import pipeline_shape
from fsdp_research.planner.resident import callback_bytes, extra_groups
from fsdp_research.planner.run import run_settings
from fsdp_research.planner.summary import summary_for
from fsdp_research.planner.timing import gpu_hardware, step_time
from fsdp_research.planner.traffic import traffic
from tests.helpers.dist import run_distributed
from tests.helpers.memory import measure_step_memory
from tests.helpers.timing import measure_step_times, prepared

pytestmark = pytest.mark.distributed

MID = ["model=llama_mid"]
MOE = [
    "model=custom", "model.model_type=qwen3_moe", "model.config.vocab_size=8192", "model.config.hidden_size=256",
    "model.config.intermediate_size=512", "model.config.moe_intermediate_size=256", "model.config.num_experts=8",
    "model.config.num_experts_per_tok=2", "model.config.num_hidden_layers=4", "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=4", "precision=fp32", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
    "data.seq_len=256",
]  # fmt: skip
# The knobs in fp32 (MID32): their terms do not depend on the precision, and bf16 matmuls have no fast path on CPUs
# without AVX-512 BF16 (2.4 GFLOP/s against 80 in fp32: a llama_mid step takes a minute there); bf16 is held by
# llama_tiny and mid.
MID32 = MID + ["precision=fp32"]
CASES = {
    "llama_tiny": [],
    "llama_tiny-fp32-no_reshard-every_block": [
        "precision=fp32",
        "sharding=no_reshard",
        "activation_checkpointing=every_block",
    ],
    "mid": MID,
    "mid-fp32-reshard_all-every_2nd": MID32 + ["sharding=reshard_all", "activation_checkpointing=every_2nd"],
    # Muon's one momentum per matrix beside AdamW's two moments for the rest; Newton-Schulz in fp32 (its bytes are
    # ns_dtype's: bf16's iterations took 100 s of a CPU without AVX-512 BF16, fp32's 5).
    "mid-fp32-muon": MID32 + ["optim=muon", "optim.ns_dtype=float32"],
    # The knobs: op-level checkpointing, explicit prefetch, the loss in chunks (a vocabulary where the
    # logits weigh: 16k x 1024 tokens of fp32 log-probabilities are 64 MiB a rank).
    "mid-fp32-selective": MID32 + ["activation_checkpointing=selective"],
    "mid-fp32-selective-every_2nd-mm3": MID32
    + [
        "activation_checkpointing=selective",
        "activation_checkpointing.stride=2",
        "activation_checkpointing.mm_save_every=3",
    ],
    "mid-fp32-prefetch": MID32 + ["sharding.prefetch_forward=2", "sharding.prefetch_backward=3"],
    "mid-fp32-vocab16k": MID32 + ["model.config.vocab_size=16384"],
    # The head's gradients of two chunks at once were missing: 13% under the tracker's temporaries in fp32 (bf16 hid
    # it: 6% under then, 8% over now; the bf16 logits' fp32 copies are held by mid).
    "mid-fp32-vocab16k-chunks": MID32 + ["model.config.vocab_size=16384", "loss.chunks=8"],
}
# Reshard to groups of 2 after forward needs a shard group of 4.
CASES_4 = {
    "mid-4-fp32-reshard2": MID32 + ["trainer.micro_batch_size=4", "sharding.reshard_after_forward=2"],
    # Tensor parallel: tp 2 x dp_shard 2 (fp32: gloo's bf16 collectives are fragile), with sequence parallel and
    # without.
    "mid-4-tp2-sp": MID32 + ["parallel.tp=2"],
    "mid-4-tp2": MID32 + ["parallel.tp=2", "parallel.sequence_parallel=false"],
    # Expert parallel: a rank gathers its ep rank's experts (an MoE of qwen3_moe's shapes, 8 experts, top-2).
    "moe-4-ep2": MOE + ["parallel.ep=2"],
    "moe-4-ep4": MOE + ["parallel.ep=4"],
    # Context parallel: a rank's activations of half of each sequence (attention: half the heads, every token).
    "mid-4-cp2": MID32 + ["parallel.cp=2"],
    "mid-4-cp2-tp2": MID32 + ["parallel.cp=2", "parallel.tp=2", "trainer.global_batch_size=8"],
    # Pipeline parallel: pp 2 x dp_shard 2 by 1F1B, 4 micro-batches; each stage's rank against its plan.
    "mid-4-fp32-pp2": MID32 + ["parallel.pp=2", "trainer.micro_batch_size=2"],
}
# What the planner does not model of an MoE block yet: its activations (a block not llama's counts Korthikanti's).
MOE_UNMODELLED = ("activations", "activations_and_temporaries", "peak")
# LoRA on the mid-size llama's weights (written by the fixture): gradients and AdamW state of the adapters alone.
LORA = "mid-fp32-lora"
WORLD = 2


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> str:
    from transformers import AutoModelForCausalLM

    from fsdp_research.model.architecture import build_hf_config

    path = str(tmp_path_factory.mktemp("lora_base"))
    AutoModelForCausalLM.from_config(build_hf_config(compose(MID).model)).save_pretrained(path)
    return path


def _config(name: str, lora_base: str):
    if name == LORA:
        # Its weights' values are not what is measured (nor can fake ranks check them as loaded): made, not loaded.
        overrides = [f"model.name_or_path={lora_base}", "model.lora.r=8", "model.load_weights=false", "precision=fp32"]
        return compose(["model=pretrained", *overrides, "logger=none"])
    return compose({**CASES, **CASES_4}[name] + ["logger=none"])


# On real ranks: the expert-parallel cases (a rank's all-to-all sizes are read from the routing, which fake ranks do
# not move) and pipeline parallel (every stage's rank). The others on fake ranks (one process as rank 0), held to real
# ranks by ANCHOR.
REAL = ("moe-4-ep2", "moe-4-ep4", "mid-4-fp32-pp2")
ANCHOR = "mid-4-cp2-tp2"


def _world(name: str) -> int:
    return 4 if name in CASES_4 else WORLD


@pytest.fixture(scope="module")
def measured(lora_base):
    found = measure_step_memory({name: _config(name, lora_base) for name in REAL}, 4)
    for world in (WORLD, 4):
        names = [name for name in [*CASES, LORA, *CASES_4] if _world(name) == world and name not in REAL]
        found |= measure_step_memory({name: _config(name, lora_base) for name in names}, world, fake=True)
    return found


@pytest.mark.slow
def test_fake_ranks_measure_what_real_ranks_do(measured):
    """The anchor of the fake-rank measurements: tensor and context parallel and FSDP on 4 real ranks allocate what
    rank 0 of 4 fake ranks does, every group within 0.1% (measured: equal but for 2 KiB more activations, of 101 MB,
    on the real ranks)."""
    real = measure_step_memory({ANCHOR: _config(ANCHOR, None)}, 4)[ANCHOR]
    fake = measured[ANCHOR]
    off = {group: (real[group], fake[group]) for group in real if abs(fake[group] - real[group]) > 1e-3 * real[group]}
    assert not off, f"group: (real, fake) bytes {off}"


def _predicted(cfg, world: int, stage: int = 0):
    summary, run = summary_for(cfg, stage), run_settings(cfg, world, "cpu", stage)
    mem = memory(summary, run)
    moments = dict(step_moments(summary, run))
    together = max(p.get("activations", 0) + p.get("temporaries", 0) for p in moments.values())
    step = moments["optimizer step"]
    predicted = {
        # The tracker files what the step allocates as optimizer state: Muon's updates, its slices sent back and
        # the matrix in flight; AdamW's per-tensor temporaries.
        "optimizer_step": step["optimizer"] + step["temporaries"],
        "sharded_params": mem.sharded_params,
        "sharded_grads": mem.sharded_grads,
        "optimizer": mem.optimizer,
        "gathered": mem.gathered,
        "unsharded_grads": mem.unsharded_grads,
        "peak": mem.peak,
        "activations_and_temporaries": together,
    }
    if not any(summary.checkpointed):
        predicted["activations"] = mem.activations
    # The k-rank shards that reshard_after_forward=k keeps from forward to backward are allocated outside FSDP's
    # all-gather: the tracker files them as activations.
    kept = run.compute_bytes * sum(
        u.shard_numel(k) for u in summary.units if (k := u.kept_after_forward()) not in (None, 1)
    )
    predicted["gathered"] -= kept
    for group in ("activations", "activations_and_temporaries"):
        if group in predicted:
            predicted[group] += kept
    return predicted


@pytest.mark.slow
@pytest.mark.parametrize("name", [*CASES, LORA, *CASES_4])
def test_prediction_within_10_percent_of_the_tracker(name, measured, lora_base):
    """Every group of the plan against the tracker's; pipeline parallel: each stage's rank against its own plan."""
    cfg, unmodelled = _config(name, lora_base), MOE_UNMODELLED if name.startswith("moe") else ()
    stages = measured[name].get("stages", [measured[name]])
    for stage, found in enumerate(stages):
        predicted = _predicted(cfg, _world(name), stage)
        ratios = {group: predicted[group] / found[group] for group in predicted if group not in unmodelled}
        off = {group: f"{ratio:.3f}" for group, ratio in ratios.items() if abs(ratio - 1) > 0.10}
        assert not off, f"stage {stage}: predicted / measured outside 1 +- 10%: {off}"


@pytest.mark.slow
def test_tensor_parallel_lowers_llama_70b_peak_on_1024_ranks(capsys):
    """tp=8 with sequence parallel at the same micro-batch: each rank holds 1/8 of the blocks' parameters and
    activations, and of the norms' and residual stream's with sequence parallel; the plan says so."""
    base = ["model=llama_70b", "trainer.global_batch_size=1024", "trainer.micro_batch_size=1", "data.seq_len=4096"]
    peaks = {}
    for tp, sp in ((1, "true"), (8, "false"), (8, "true")):
        cfg = compose([*base, f"parallel.tp={tp}", f"parallel.sequence_parallel={sp}"])
        peaks[tp, sp] = memory(summary_for(cfg), run_settings(cfg, 1024, "cuda")).peak
    assert peaks[8, "true"] < peaks[8, "false"] < peaks[1, "true"] / 2
    assert main([*base, "world_size=1024", "parallel.tp=8", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "shard group 128, 81 FSDP units, tp 8 with sequence parallel" in out
    assert "tensor parallel (activations, tp group)" in out


@pytest.mark.slow
def test_expert_parallel_gathers_a_rank_s_experts_of_deepseek_v3_671b(capsys):
    """DeepSeek-V3's shapes on 1,024 ranks: with ep 64 a rank gathers 4 of each MoE layer's 256 experts, not all of
    them; the same shards; the routed tokens' all-to-all is priced."""
    base = ["model=deepseek_v3_671b", "trainer.global_batch_size=1024", "trainer.micro_batch_size=1"]
    plans = {}
    for ep in (1, 64):
        cfg = compose([*base, f"parallel.ep={ep}"])
        plans[ep] = memory(summary_for(cfg), run_settings(cfg, 1024, "cuda"))
    assert plans[64].sharded_params == pytest.approx(plans[1].sharded_params, rel=1e-3)
    assert plans[64].gathered < plans[1].gathered / 4 and plans[64].peak < plans[1].peak / 1.5
    assert main([*base, "world_size=1024", "parallel.ep=64", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "671.03B parameters (37.55B active per token: 8 of 256 experts; ep 64: a rank gathers 4 experts" in out
    assert "expert parallel (routed tokens, ep group)" in out
    # --fit searches ep: at 4096 tokens only a split of the experts fits an H100.
    fit = [*base, "world_size=1024", "data.seq_len=4096", "--device", "cuda", "--gpu", "h100", "--fit", "80"]
    assert main(fit) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best: "))
    assert " parallel.ep=64 " in best


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"), [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)]
)
def test_pipeline_bubble_and_micro_batches_in_flight_as_the_papers_count_them(schedule, stages_per_rank):
    """The schedule's bubble from its action list (torch's own for the looped ones) is the textbook's, with a
    backward twice a forward: (pp - 1) / (m + pp - 1) for GPipe and 1F1B (GPipe, Huang et al. 2019), divided by the
    stages a rank for the interleaved (Narayanan et al. 2021: (pp - 1) / (v m + pp - 1)); 1F1B's rank r holds
    pp - r micro-batches' activations, GPipe's all m, the interleaved's first rank pp (1 + (pp - 1) / (v pp))."""
    for pp, m in ((2, 4), (4, 8), (8, 16)):
        shape = pipeline_shape(schedule, pp, m, stages_per_rank)
        assert shape.bubble == pytest.approx((pp - 1) / (stages_per_rank * m + pp - 1))
        if schedule == "1F1B":
            assert shape.in_flight == tuple(pp - r for r in range(pp))
        if schedule == "GPipe":
            assert shape.in_flight == (m,) * pp
        if schedule == "Interleaved1F1B":
            assert shape.in_flight[0] == pytest.approx(pp * (1 + (pp - 1) / (stages_per_rank * pp)))


def test_zero_bubble_schedules_wait_least():
    """The zero-bubble schedules (weight gradients apart, filling the waits) below Interleaved1F1B's bubble, which is
    below 1F1B's, read from torch's action lists (DualPipeV's overlapped forward and backward one after the other);
    their activations held until the weight pass: every rank's peak pp micro-batches' worth of its layers, 1F1B's
    first rank's (ZB-V's claim, Qi et al. 2024), its loss's logits until the input pass (one at a time)."""
    for pp, m in ((2, 4), (4, 8)):
        bubble = {s: pipeline_shape(s, pp, m, 1 if s == "1F1B" else 2).bubble for s in ("1F1B", "Interleaved1F1B")}
        for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
            shape = pipeline_shape(schedule, pp, m, 2)
            assert shape.bubble < bubble["Interleaved1F1B"] < bubble["1F1B"]
            assert shape.losses == 1
            if schedule != "DualPipeV":  # its overlapped pairs hold one more forward's, half the layers' worth
                assert shape.in_flight == (pp,) * pp


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("LoopedBFS", 2)]
    + [("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)],
)
def test_pipeline_ranks_receive_what_torchs_schedules_send_them(schedule, stages_per_rank):
    """The pipeline's row of the traffic: per micro-batch, the receives torch's schedule runs on each rank (its
    RECV_F and RECV_B actions, lowered by torch's own runtime; the single-stage schedules, which torch lowers only
    with real stages: a middle stage receives its input and its output's gradient, an end one of them), each the
    micro-batch's hidden states in the compute dtype, whole under sequence parallel too (a stage's last block gathers
    its output); a V's two middle stages meet on one rank, no receive."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    pp, micro_steps = 4, 8
    overrides = ["parallel.pp=4", f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={stages_per_rank}"]
    overrides += ["trainer.micro_batch_size=1", "trainer.global_batch_size=8", "model.config.num_hidden_layers=8"]
    cfg = compose(overrides)
    if stages_per_rank == 1:
        expected = [1, 2, 2, 1]
    else:
        ops = get_schedule_ops(schedule, pp, micro_steps, stages_per_rank, with_comms=True)
        kinds = [[o.computation_type.value for a in rank if a for o in (a.sub_actions or (a,))] for rank in ops]
        expected = [sum(k in ("RECV_F", "RECV_B") for k in rank) / micro_steps for rank in kinds]
    runs = [run_settings(cfg, pp, "cpu", stage) for stage in range(pp)]
    assert [run.micro_steps for run in runs] == [micro_steps] * pp
    assert [run.pp_receives for run in runs] == expected
    hidden = cfg.model.config.hidden_size * 2  # bf16
    received = traffic(summary_for(cfg, 1), runs[1]).axes[-1]
    assert received == micro_steps * expected[1] * cfg.data.seq_len * hidden
    if stages_per_rank == 1:  # tp 2 with sequence parallel (the default): each tp rank receives the whole
        tp = compose([*overrides, "parallel.tp=2"])
        assert traffic(summary_for(tp, 1), run_settings(tp, 2 * pp, "cpu", 1)).axes[-1] == received


@pytest.mark.parametrize(
    ("schedule", "stages_per_rank"),
    [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)],
)
def test_pipeline_ranks_are_planned_by_their_stages(schedule, stages_per_rank):
    """Tied embeddings at pp 2 (the first stage keeps the head's weight for its passthrough, the last the
    embedding): the first rank embeds, the last holds the head and the loss, by the stages each holds (a V holds
    both ends on the first rank). One stage a rank: torch's schedule accumulates its gradients unsharded to the last
    micro-batch; several (views of one module): FSDP reduces after each; the zero-bubble schedules keep every unit
    gathered and its gradients unsharded over the step. GPipe's last stage holds every micro-batch's loss, 1F1B's
    one."""
    cfg = compose(
        ["model.config.tie_word_embeddings=true", "parallel.pp=2", "trainer.micro_batch_size=2"]
        + [f"parallel.pp_schedule={schedule}", f"parallel.pp_stages_per_rank={stages_per_rank}"]
    )
    first, last = summary_for(cfg, 0), summary_for(cfg, 1)
    v = schedule == "ZBVZeroBubble"
    assert (first.embeds_here, first.loss_here, last.embeds_here, last.loss_here) == (True, v, False, not v)
    assert (first.head_flops_per_token > 0) == v and (last.head_flops_per_token > 0) != v
    run, zero_bubble = run_settings(cfg, 4, "cpu", 1), schedule in ZERO_BUBBLE
    assert run.defer_grad_sync == (stages_per_rank == 1 or zero_bubble)
    assert (
        all(not u.reshard_after_forward for u in last.units)
        if zero_bubble
        else any(u.reshard_after_forward for u in last.units)
    )
    assert run.losses == (run.micro_steps if schedule == "GPipe" else 1)


@pytest.mark.slow
def test_pipeline_parallel_fits_llama_405b_on_512_gpus(capsys):
    """Llama-3.1-405B on 512 H100s as torchtitan runs it (FSDP 8 x TP 8 x PP 8 by 1F1B, full activation
    checkpointing, 8k tokens): each pipeline rank's peak fits 80 GiB, about half the peak of the same FSDP group of 8
    without pipeline stages (hsdp replicating it 8 times), which fits no H100; the plan names the stages."""
    base = ["model=llama_405b", "trainer.global_batch_size=512", "trainer.micro_batch_size=1", "data.seq_len=8192"]
    base += ["parallel.tp=8", "activation_checkpointing=every_block"]
    flat = compose([*base, "sharding=hsdp", "sharding.replicate=8"])
    flat_peak = memory(summary_for(flat), run_settings(flat, 512, "cuda")).peak / GIB
    assert main([*base, "world_size=512", "parallel.pp=8", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"pipeline: pp 8 by 1F1B, 64 micro-batches; peak by pipeline rank (.*) GiB .* bubble 10%", out)
    peaks = [float(p) for p in line.group(1).split(", ")]
    assert len(peaks) == 8 and max(peaks) < 80 < flat_peak and max(peaks) < flat_peak / 1.9
    assert "pipeline bubble (waiting on other stages)" in out


def test_plan_refuses_to_compare_pipeline_stages_shardings(capsys):
    assert main(["model=llama_tiny", "world_size=2", "parallel.pp=2", "trainer.micro_batch_size=2", "--compare"]) == 2
    assert capsys.readouterr().err.startswith("error: parallel.pp: --compare does not compare pipeline stages'")


@pytest.mark.slow
def test_fit_searches_pipeline_stages_as_plan_plans_them(found_7b):
    """--fit's pipeline configs (llama_7b on 8 H100s: pp 2, 4 and 8 by 1F1B, with tp and hsdp) are configs the
    trainer takes (its checks, as `plan` runs them); the smallest of each pp, planned again from its overrides, has
    `plan`'s largest pipeline rank's peak and the slowest rank's step, and no fewer micro-batches than stages."""
    staged = [c for c in found_7b if c.settings["parallel.pp"] > 1]
    assert {c.settings["parallel.pp"] for c in staged} == {2, 4, 8}
    assert {c.settings["sharding"] for c in staged} == {"blockwise", "hsdp"} and {
        c.settings["parallel.tp"] for c in staged
    } > {1}
    chosen = {}  # the smallest peak of each pp
    for c in staged:
        if c.memory.peak < chosen.setdefault(c.settings["parallel.pp"], c).memory.peak:
            chosen[c.settings["parallel.pp"]] = c
    for c in chosen.values():
        cfg = checked_config([*FIT_7B, *c.overrides(compose(FIT_7B))], 8, stages=True)[0]
        pp = cfg.parallel.pp
        assert run_settings(cfg, 8, "cuda").micro_steps >= pp
        stages = [(summary_for(cfg, s), run_settings(cfg, 8, "cuda", s)) for s in range(pp)]
        assert max(memory(m, run).peak for m, run in stages) == c.memory.peak
        assert max(step_time(m, run, _h100()).total for m, run in stages) == pytest.approx(c.time.total, rel=1e-12)


@pytest.mark.slow
def test_context_parallel_splits_llama_7b_activations_at_32k_tokens(capsys):
    """32k tokens a sequence on 16 ranks: cp 4 leaves a rank a quarter of each sequence's activations (the same
    shards), prices attention's all-to-alls, and --fit, searching cp, picks a split of the sequence."""
    base = ["model=llama_7b", "trainer.global_batch_size=16", "trainer.micro_batch_size=1", "data.seq_len=32768"]
    base.append("model.config.max_position_embeddings=32768")
    plans = {}
    for cp in (1, 4):
        cfg = compose([*base, f"parallel.cp={cp}"])
        plans[cp] = memory(summary_for(cfg), run_settings(cfg, 16, "cuda"))
    assert plans[4].sharded_params == plans[1].sharded_params
    assert plans[4].activations == pytest.approx(plans[1].activations / 4, rel=0.01)
    assert main([*base, "world_size=16", "parallel.cp=4", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "cp 4 (8192 tokens of each sequence a rank)" in out
    assert "context parallel (attention, cp group)" in out
    assert main([*base, "world_size=16", "--device", "cuda", "--gpu", "h100", "--fit", "80"]) == 0
    best = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("best: "))
    assert " parallel.cp=" in best


@pytest.mark.slow
def test_llama_7b_on_8_ranks(capsys):
    """Sharded parameters, gradients and AdamW state: 16 bytes per parameter over 8 ranks; the command prints the
    plan and the side-by-side table without allocating anything."""
    overrides = ["model=llama_7b", "trainer.global_batch_size=64"]
    cfg = compose(overrides)
    summary = summary_for(cfg)
    mem = memory(summary, run_settings(cfg, 8, "cuda"))
    state = mem.sharded_params + mem.sharded_grads + mem.optimizer
    assert summary.n_params == pytest.approx(6.74e9, rel=0.01)
    assert state / GIB == pytest.approx(summary.n_params * 16 / 8 / GIB, rel=0.01)
    assert 12 < state / GIB < 13.5 and state < mem.peak < 2 * state
    assert main([*overrides, "world_size=8", "--device", "cuda", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "llama_7b: 6.74B parameters, 32 blocks; blockwise on 8 rank(s)" in out
    for row in ("blockwise", "reshard_all", "no_reshard", "root_only", "per_linear", "ddp", "hsdp (2x4)"):
        assert f"\n{row} " in out


def test_checkpointing_trades_activations_for_recompute():
    cfg = compose(["activation_checkpointing=every_2nd"])
    summary, run = summary_for(cfg), run_settings(cfg, 1, "cpu")
    assert summary.checkpointed == (True, False, True, False)
    assert recompute_share(summary.checkpointed) == pytest.approx(1 / 6)
    assert recompute_share((True,) * 4) == pytest.approx(1 / 3)
    every, half, none = (memory(summary, run, ckpt).activations for ckpt in ((True,) * 4, None, (False,) * 4))
    assert every < half < none


@pytest.mark.parametrize("tp,sp,per_token", [(8, True, 34 / 8 * 1024), (16, False, (10 + 24 / 16) * 1024)])
def test_korthikanti_activations_of_a_block_not_llama_s(tp, sp, per_token):
    """A family whose block the planner does not know: Korthikanti et al.'s (10 + 24/t) x h x e/2 bytes a token,
    34/t with sequence parallel (h 1024, 16-bit), not rounded down by t first."""
    m = replace(summary_for(compose([])), model_type="gpt2", hidden=1024, sdpa=True, tp=tp, sequence_parallel=sp)
    assert block_activation_bytes(m, 2, 4096) == per_token


def test_bad_batch_is_refused_like_the_trainer(capsys):
    assert main(["world_size=8"]) == 2
    assert capsys.readouterr().err.startswith("error: trainer.global_batch_size: 16 is not divisible")


def test_accumulation_shows_both_ways_of_reducing(capsys):
    """defer_grad_sync=true holds every unit's unsharded gradient (fp32: 4 bytes a parameter on every rank,
    whatever the world size) and reduce-scatters once; the default reduce-scatters each micro-batch. Across
    replicas the all-reduce is once per step either way."""
    overrides = ["model=llama_7b", "trainer.global_batch_size=128", "sharding=hsdp", "sharding.replicate=2"]
    cfg = compose(overrides)
    summary, run = summary_for(cfg), run_settings(cfg, 8, "cuda")
    assert run.micro_steps == 2 and not run.defer_grad_sync
    deferred = replace(run, defer_grad_sync=True)
    held = memory(summary, deferred).unsharded_grads - memory(summary, run).unsharded_grads
    assert held == pytest.approx(4 * summary.n_params, rel=0.01)
    assert memory(summary, deferred).peak > memory(summary, run).peak + 15 * GIB
    assert traffic(summary, run).reduce_scatter == pytest.approx(2 * traffic(summary, deferred).reduce_scatter)
    assert traffic(summary, run).all_reduce == traffic(summary, deferred).all_reduce
    assert main([*overrides, "world_size=8", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "gradient accumulation over 2 micro-batches" in out
    assert re.search(r"defer_grad_sync=false \(reduce-scatter each micro-batch\) .* this run", out)
    assert "defer_grad_sync=true (unsharded gradients held to the last)" in out


# The time model against measured step times: configs of the mid-size llama whose costs differ in compute
# (checkpointing, selective checkpointing, the batch, the loss in chunks) and in communication (micro-batches,
# resharding), on 2 CPU ranks in fp32, rates calibrated in the same processes.
TIMED_BASE = MID32 + ["data.seq_len=64", "trainer.global_batch_size=16", "trainer.micro_batch_size=8"]
TIMED = {
    "plain": [],
    "every_block": ["activation_checkpointing=every_block"],
    "selective": ["activation_checkpointing=selective"],
    "micro_2": ["trainer.micro_batch_size=2"],
    "micro_4-reshard_all": ["trainer.micro_batch_size=4", "sharding=reshard_all"],
    "batch_32": ["trainer.global_batch_size=32"],
    "every_block-micro_2": ["activation_checkpointing=every_block", "trainer.micro_batch_size=2"],
    "vocab16k": ["model.config.vocab_size=16384"],
    "vocab16k-chunks": ["model.config.vocab_size=16384", "loss.chunks=8"],
}


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    for position, index in enumerate(order):
        ranks[index] = position
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _ranks(a), _ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


@pytest.fixture(scope="module")
def timed():
    configs = {name: compose(TIMED_BASE + o + ["logger=none"]) for name, o in TIMED.items()}
    return configs, measure_step_times(configs, WORLD, 2, (512, 512, 1376))


@pytest.mark.slow
def test_time_model_orders_configs_as_measured(timed):
    configs, measured = timed
    hw = cpu_hardware(measured["rates"])
    predicted = {n: step_time(summary_for(c), run_settings(c, WORLD, "cpu"), hw).total for n, c in configs.items()}
    names = list(configs)
    rho = spearman([predicted[n] for n in names], [measured["times"][n] for n in names])
    table = "\n".join(f"{n:24s} predicted {predicted[n]:.3f} s  measured {measured['times'][n]:.3f} s" for n in names)
    print(f"{table}\nSpearman {rho:.3f}")
    assert rho >= 0.8, table


FIT_7B = ["model=llama_7b", "trainer.global_batch_size=64", "data.seq_len=4096"]


def _h100(link: str = "nvlink"):
    return gpu_hardware(gpu("h100"), 2, link, cpu_optimizer_rate())


@pytest.fixture(scope="module")
def found_7b():
    """--fit's every config of FIT_7B on 8 H100s (seconds of planning: one search for the tests that read it)."""
    return candidates(compose(FIT_7B), 8, "cuda", _h100())


def test_fit_searches_only_what_the_objective_takes():
    """An objective that reads no loss group, splits no sequence and has no loss from the last stage (the base
    class): --fit offers neither the loss in chunks, context parallel nor pipeline stages, which the run would refuse;
    the next-token loss is offered all three at 8k tokens."""
    long = ["data.seq_len=8192", "model.config.max_position_embeddings=8192"]
    long += ["trainer.global_batch_size=4", "trainer.micro_batch_size=1"]
    offered = {}
    for name, extra in {"lm": [], "own": ["objective._target_=fsdp_research.objectives.Objective"]}.items():
        found = candidates(compose([*long, *extra]), 4, "cuda", _h100())
        offered[name] = {
            (c.settings["loss.chunks"] > 1, c.settings["parallel.cp"] > 1, c.settings["parallel.pp"] > 1) for c in found
        }
    assert offered["own"] == {(False, False, False)}
    assert {(True, False, False), (False, True, False), (False, False, True)} <= offered["lm"]


@pytest.mark.parametrize("cap", ["24", "24GiB", "24G", "24576MiB"])
def test_fit_takes_the_cap_as_people_write_it(cap):
    """GiB bare, or with its unit."""
    assert parse_size(cap, "--fit", "", unit=GIB) == 24 * GIB  # as plan --fit reads it


@pytest.mark.slow
def test_fit_picks_what_fits_and_a_larger_cap_is_never_slower(found_7b, capsys):
    """llama_7b on 8 H100s: the best config of each cap, planned again from the `best:` line the command prints,
    fits it less the headroom (10% and the CUDA context); the best of a larger cap is never predicted slower."""
    cfg = compose(FIT_7B)
    best = [fit(found_7b, budget(cap, 0.1, True), cfg)[0].tokens_per_s for cap in (12, 16, 24, 40, 80, 141)]
    assert best == sorted(best) and best[0] < best[-1]
    assert main([*FIT_7B, "--fit", "24GiB", "world_size=8", "--device", "cuda", "--top", "3"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "plan --fit 24 GiB less 10% headroom and 0.75 GiB of CUDA context (20.85 GiB) per rank" in "\n".join(out)
    rows = out[out.index(next(line for line in out if line.startswith("rank"))) + 1 : -1]
    assert len(rows) == 3 and out[-1].startswith("best: ") and " distributed.nproc_per_node=8 " in out[-1]
    again = compose(out[-1].removeprefix("best: ").split())
    peak = memory(summary_for(again), run_settings(again, 8, "cuda")).peak
    assert peak <= (24 * 0.9 - CUDA_CONTEXT_GIB) * GIB and f"{peak / GIB:.2f}" in rows[0]
    assert out[-1].endswith(" " + " ".join(w for w in rows[0].split()[4:] if "=" in w))  # the first row's overrides


@pytest.mark.slow
def test_headroom_keeps_more_free(capsys):
    """--headroom 30%: the pick's peak stays under 24 x 0.7 - 0.75 GiB, below the default's pick."""
    picks = {}
    for headroom in (None, "30%"):
        flags = ["--headroom", headroom] if headroom else []
        assert main([*FIT_7B, "--fit", "24", *flags, "world_size=8", "--device", "cuda", "--top", "1"]) == 0
        best = capsys.readouterr().out.strip().splitlines()[-1].removeprefix("best: ").split()
        again = compose(best)
        picks[headroom] = memory(summary_for(again), run_settings(again, 8, "cuda")).peak
    assert picks["30%"] <= (24 * 0.7 - CUDA_CONTEXT_GIB) * GIB < picks[None]


@pytest.mark.slow
def test_fit_nothing_fits_names_the_smallest(capsys):
    assert main([*FIT_7B, "world_size=8", "--device", "cuda", "--fit", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --fit: no config fits 2 GiB less 10% headroom and 0.75 GiB ")
    assert "sharding.cpu_offload=true" in err[0] and "; fix: " in err[0]


@pytest.mark.parametrize(
    "flags,key",
    [
        (["--fit", "0", "--device", "cuda"], "--fit"),
        (["--fit", "24XB", "--device", "cuda"], "--fit"),
        (["--fit", "24", "--headroom", "1.5", "--device", "cuda"], "--headroom"),
        (["--fit", "24", "--headroom", "ten", "--device", "cuda"], "--headroom"),
        (["--headroom", "0.2", "--device", "cuda"], "--headroom"),
        (["--measure", "--device", "cuda"], "--measure"),
        (["--fit", "8", "--gpu", "h1000"], "--gpu"),  # --gpu plans for GPUs: no --device cuda needed
        (["--device", "cpu", "--gpu", "h100"], "--gpu"),
        # This CPU's rates cannot be measured on 64 processes: plan for GPUs instead.
        (["--fit", "8", "world_size=64", "trainer.global_batch_size=64", "trainer.micro_batch_size=1"], "world_size"),
    ],
)
def test_fit_bad_flags(flags, key, capsys):
    """One line, before anything is planned or printed (the plan printed first for a bad --gpu or world_size)."""
    assert main(["world_size=2", *flags]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {key}: ") and err.count("\n") == 1
    assert out == ""


@pytest.mark.slow
def test_fit_measure_ranks_by_measured_speed(capsys, tmp_path, monkeypatch):
    """On this machine: CPU rates calibrated on 2 processes, the top 3 trained a few steps each on 2 processes,
    listed by measured tokens/s; `best:` is the measured fastest."""
    monkeypatch.chdir(tmp_path)
    args = ["trainer.global_batch_size=8", "world_size=2", "--fit", "1", "--top", "3", "--measure"]
    assert main(args) == 0
    out = capsys.readouterr().out
    measured = re.findall(r"^\s+\d\s+([\d,]+) tokens/s measured \(([\d,]+) predicted\)\s+(.*)$", out, re.M)
    assert len(measured) == 3
    speeds = [float(m[0].replace(",", "")) for m in measured]
    assert speeds == sorted(speeds, reverse=True)
    assert out.strip().splitlines()[-1] == (
        f"best: trainer.global_batch_size=8 distributed.nproc_per_node=2 {measured[0][2]}"
    )
    assert len(list((tmp_path / "outputs" / "plan").glob("*/*/[0-2]"))) == 3


# What a run spends beyond the model's state and compute.


class DeclaresState:
    """A user's callback that declares its state and must not be built by the planner."""

    def __init__(self, copies: int = 1):
        raise AssertionError("the planner built a callback")

    def on_step_end(self, run, step, metrics):
        pass

    @classmethod
    def planned_bytes(cls, rank, copies: int = 1) -> int:
        return copies * rank.param_bytes


def _ema_bytes_and_groups(containers: dict) -> dict:
    """Per config, on this rank: the bytes EMA's averaged weights take (their storages) and the process groups
    the sharded model's build added."""
    found = {}
    for name, container in containers.items():
        groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 1
        _, model, _, _ = prepared(container)
        added = len(dist.distributed_c10d._world.pg_map) - groups
        ema = EMA()
        ema.setup(SimpleNamespace(model=model))
        storages = {
            local_shard(w).untyped_storage().data_ptr(): local_shard(w).untyped_storage().nbytes()
            for w in ema.weights.values()
        }
        found[name] = {"ema": sum(storages.values()), "groups": added}
    return found


RESIDENT_4 = {
    "mid-4-ema": MID + ["trainer.micro_batch_size=4", "callbacks=[ema]"],
    "mid-4-fp32-reshard2": CASES_4["mid-4-fp32-reshard2"],
}


@pytest.mark.slow
def test_resident_state_as_measured():
    """On 4 CPU ranks: EMA's averaged copy (its weights' storages) within 10% of what the planner counts, and
    reshard_after_forward=2 adds the process groups the planner counts (a DeviceMesh of two groups per unit: 14
    for the mid-size llama's 7 resharded blocks), none for the plain plan."""

    configs = {name: compose(o + ["logger=none"]) for name, o in RESIDENT_4.items()}
    measured = run_distributed(
        _ema_bytes_and_groups, 4, {n: OmegaConf.to_container(c, resolve=True) for n, c in configs.items()}
    )
    ema = configs["mid-4-ema"]
    planned = callback_bytes(summary_for(ema), run_settings(ema, 4, "cpu"))
    assert planned == pytest.approx(measured["mid-4-ema"]["ema"], rel=0.10)
    for name, cfg in configs.items():
        assert extra_groups(summary_for(cfg), run_settings(cfg, 4, "cpu")) == measured[name]["groups"]
    assert measured["mid-4-fp32-reshard2"]["groups"] == 14


def test_callbacks_declare_their_state(capsys):
    """EMA keeps an fp32 copy of the rank's parameters: 3.14 GiB per rank for llama_7b on 8 ranks, in the peak
    and on its own row; a user's callback is asked through its class (never built), with its config keys."""
    base = ["model=llama_7b", "trainer.global_batch_size=64"]
    plain, ema = compose(base), compose([*base, "callbacks=[ema]"])
    mine = compose(
        [*base, "+callbacks.mine._target_=tests.planner.test_plan.DeclaresState", "+callbacks.mine.copies=2"]
    )
    peaks = [memory(summary_for(c), run_settings(c, 8, "cuda")) for c in (plain, ema, mine)]
    copy = 4 * summary_for(plain).n_params / 8
    assert peaks[1].callbacks == pytest.approx(copy, rel=0.01) and peaks[2].callbacks == 2 * peaks[1].callbacks
    assert peaks[1].peak - peaks[0].peak == peaks[1].callbacks and peaks[2].peak - peaks[0].peak == peaks[2].callbacks
    offloaded = run_settings(ema, 8, "cuda")
    assert memory(summary_for(ema), replace(offloaded, cpu_offload=True)).callbacks == 0  # with the params, in host
    assert main([*base, "callbacks=[ema]", "world_size=8", "--device", "cuda"]) == 0
    assert re.search(r"callbacks' state \(ema\)\s+3\.14", capsys.readouterr().out)


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (64, 64)])
def test_newton_schulz_flops_as_counted(shape):
    """The planner's Newton-Schulz FLOPs are what torch's FlopCounterMode counts of muon.newton_schulz."""

    counter = FlopCounterMode(display=False)
    with counter:
        newton_schulz(torch.randn(*shape), steps=5, dtype=torch.float32)
    assert ns_flops(*shape, 5) == counter.get_total_flops()


def test_muon_step_time_exposed_and_orthogonalized():
    """llama_7b on 8 H100s: Muon's all-to-alls wait in the optimizer step (not hidden behind backward) and its
    Newton-Schulz runs at the device's rate: its step is slower than AdamW's by both."""
    adamw, muon = compose(FIT_7B), compose([*FIT_7B, "optim=muon"])
    hw = _h100()
    times = {}
    for name, cfg in (("adamw", adamw), ("muon", muon)):
        summary, run = summary_for(cfg), run_settings(cfg, 8, "cuda")
        times[name] = step_time(summary, run, hw)
    m, run = summary_for(muon), run_settings(muon, 8, "cuda")

    exchange = traffic(m, run).all_to_all / hw.intra_bps
    assert times["muon"].communication == pytest.approx(times["adamw"].communication)
    assert times["muon"].whole_matrices >= exchange + muon_flops(m, run) / hw.flops
    assert times["muon"].total - times["adamw"].total > 0.1  # 4.110 s against 4.108 s before


def test_muon_planned_temporaries_fit_its_rounds():
    """Muon's step holds its updates and the slices sent back (2 x the sharded matrices) and one matrix in flight."""
    cfg = compose(["model=llama_7b", "trainer.global_batch_size=64", "optim=muon"])
    m, run = summary_for(cfg), run_settings(cfg, 8, "cuda")
    sliced = 4 * sum(-(-r // 8) * c for r, c in m.whole_shapes)
    assert 2 * sliced < muon_temporaries(m, run) < 2 * sliced + 16 * max(r * c for r, c in m.whole_shapes)


def test_reshard_to_k_costs_communicators():
    """16 ranks, reshard to 8 after forward: 2 NCCL communicators per resharded unit on CUDA (memory from the
    hardware table, and their creation at start-up), none on gloo."""
    cfg = compose(["model=llama_7b", "trainer.global_batch_size=128", "sharding.reshard_after_forward=8"])
    m = summary_for(cfg)
    groups = extra_groups(m, run_settings(cfg, 16, "cuda"))
    assert groups == 2 * 31  # every block but the last, resident
    assert memory(m, run_settings(cfg, 16, "cuda")).communicators == groups * NCCL_COMMUNICATOR_GIB * GIB
    assert memory(m, run_settings(cfg, 16, "cpu")).communicators == 0
    assert step_time(m, run_settings(cfg, 16, "cuda"), _h100("ib")).startup == groups * NCCL_COMMUNICATOR_INIT_S


def test_cpu_offload_shares_the_host():
    """cpu_offload on 8 H100s: the optimizer steps at the CPU's measured rate (one core per rank), the copies and
    the step through a host memory the node's 8 ranks share. The rate, calibrated on one 4M-element tensor,
    predicts an AdamW step over a rank's shards of a llama_7b block (25M parameters), timed here, within 50%
    (measured within 10% on an idle machine; the two cores here are shared)."""
    hw = _h100()
    assert hw.host_bps == HOST_MEMORY_GBS * 1e9 / 8 and hw.optimizer_bps <= hw.host_bps
    shards = [(512, 4096)] * 4 + [(1376, 4096)] * 3
    params = [torch.zeros(*shape, requires_grad=True) for shape in shards]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, foreach=False)
    threads = torch.get_num_threads()
    optimizer.step()
    seconds, rates = [], []
    # Calibration and step alternated, the quickest of each taken: a neighbour's load slows one of them, not both.
    for _ in range(3):
        rates.append(cpu_optimizer_rate.__wrapped__())
        torch.set_num_threads(1)
        try:
            for _ in range(3):
                start = time.perf_counter()
                optimizer.step()
                seconds.append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
    numel = sum(p.numel() for p in params)
    predicted = ADAMW_BYTES * numel / max(rates)
    assert predicted == pytest.approx(min(seconds), rel=0.5)
    cfg = compose(["model=llama_mid"])
    m = summary_for(cfg)
    run = replace(run_settings(cfg, 8, "cuda"), cpu_offload=True, foreach=False)
    assert step_time(m, run, hw).optimizer == pytest.approx(ADAMW_BYTES * m.n_params / 8 / hw.optimizer_bps, rel=0.01)


@pytest.mark.slow
def test_fit_on_the_users_card(capsys):
    """--gpu l4 (24 GiB cards of the table) plans at its speed; a cap below the default h100's without --gpu says
    so; --gpu-memory/--gpu-tflops describe a card the table lacks; a plan at the data's default sequence length says
    so; llama_7b on one 24 GiB card takes cpu_offload, and the table shows the host memory it needs."""
    one = ["model=llama_7b", "world_size=1", "trainer.global_batch_size=1", "trainer.micro_batch_size=1"]
    assert main([*one, "data.seq_len=2048", "--fit", "24", "--gpu", "l4", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "llama_7b on 1 rank(s) of l4" in out and "note:" not in out
    header = next(line for line in out.splitlines() if line.startswith("rank"))
    assert header.split()[:8] == ["rank", "tokens/s", "step", "(s)", "peak", "(GiB)", "host", "(GiB)"]
    assert "sharding.cpu_offload=true" in out
    l4_speed = float(out.splitlines()[out.splitlines().index(header) + 1].split()[1].replace(",", ""))
    assert main([*one, "data.seq_len=2048", "--fit", "24", "--device", "cuda", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "note: --fit 24 at an h100's speed (80 GiB): for a smaller card give --gpu (" in out
    assert main([*one, "--fit", "24", "--gpu-memory", "24GiB", "--gpu-tflops", "121", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "of h100 (as given)" in out
    assert "note: planned at data.seq_len=128, the data group's default" in out
    assert l4_speed > 0


def _one_rank_timing() -> float:
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.planner.calibrate import measure_rates

    cfg = compose(MID32)
    init_distributed(cfg.distributed, torch.device("cpu"))
    rates = measure_rates(64, 64, 64, torch.float32)
    m = summary_for(cfg)
    return step_time(m, run_settings(cfg, 1, "cpu"), cpu_hardware(rates)).total


def test_one_rank_is_timed_without_a_link():
    """`plan --fit` on one rank (the default world size): nothing to time a link with, and nothing sent over one."""
    assert 0 < run_distributed(_one_rank_timing, 1) < float("inf")
