"""The planner's terms for objective=grpo. A trained sequence is a prompt and its completion (data.seq_len +
max_completion_length tokens), the loss takes the completion's logits alone (and holds the entropy's copy of them),
and a step generates first: a micro-batch's KV cache, the parameters gathered (the whole model's with
gather_for_generation), the sampling's temporaries over the vocabulary. Against torch's FSDP memory tracker on fake
ranks (as tests/planner/test_plan.py; rank 0 of 2) for a mid-size llama: a micro-batch's generation and the update
on rollouts as it leaves them, each one's peak and parameters gathered within 10% (the update's activations and
temporaries too); the KV cache to the byte against transformers' DynamicCache."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from fsdp_research.cli.plan import main
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.planner.memory import memory, step_moments
from fsdp_research.planner.run import run_settings
from fsdp_research.planner.summary import summary_for
from tests.helpers.chats import chat_tokenizer
from tests.helpers.memory import measure_step_memory

GRPO = ["model=llama_mid", "precision=fp32", "data=prompts", "objective=grpo", "logger=none"]
BATCH = ["trainer.micro_batch_size=8", "trainer.global_batch_size=16"]
CASES = {
    "mid-64+32": ["data.seq_len=64", "objective.max_completion_length=32"],
    "mid-64+32-each_token_gathered": [
        "data.seq_len=64",
        "objective.max_completion_length=32",
        "objective.gather_for_generation=false",
    ],
    # Where the logits weigh (16k x 8 x 97 fp32 logits are 48 MiB), the blocks checkpointed.
    "mid-vocab16k-32+96-every_block": [
        "model.config.vocab_size=16384",
        "data.seq_len=32",
        "objective.max_completion_length=96",
        "activation_checkpointing=every_block",
    ],
}
WORLD = 2


def _config(name: str):
    return compose(GRPO + BATCH + CASES[name])


@pytest.fixture(scope="module")
def measured():
    return measure_step_memory({name: _config(name) for name in CASES}, WORLD, fake=True)


def _planned(cfg, part: str) -> dict[str, int]:
    """The plan's peak, parameters gathered and activations with temporaries (the KV cache one of them) over the
    moments of the generation or of the update."""
    moments = [
        parts
        for name, parts in step_moments(summary_for(cfg), run_settings(cfg, WORLD, "cpu"))
        if name.startswith("generation") == (part == "generation")
    ]
    return {
        "peak": max(sum(v for k, v in parts.items() if k != "host") for parts in moments),
        "gathered": max(parts.get("gathered", 0) for parts in moments),
        "activations_and_temporaries": max(
            sum(parts.get(k, 0) for k in ("activations", "temporaries", "kv_cache")) for parts in moments
        ),
    }


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", CASES)
def test_generation_and_update_within_10_percent_of_the_tracker(name, measured):
    """The generation's activations are not compared: the tracker files the root's all-gather buffer (before the
    root's forward) as activations, 64 MiB of 80 for the 16k vocabulary."""
    cfg = _config(name)
    every = ("peak", "gathered", "activations_and_temporaries")
    for part, groups in (("generation", every[:2]), ("step", every)):
        planned, found = _planned(cfg, part), measured[name][part]
        off = {g: f"{planned[g] / found[g]:.3f}" for g in groups if abs(planned[g] / found[g] - 1) > 0.10}
        assert not off, f"{part}: planned / measured outside 1 +- 10%: {off}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_kv_cache_is_transformers_dynamic_cache(precision):
    """Keys and values of every block for a micro-batch's prompt and completion positions, in the compute dtype
    (grouped-query attention: the key-value heads' width): the cache of a forward over them all (a generation's
    holds one position fewer, its last token never fed)."""
    cfg = compose(GRPO + [f"precision={precision}", "trainer.micro_batch_size=3", "data.seq_len=20"])
    positions = cfg.data.seq_len + cfg.objective.max_completion_length
    model = AutoModelForCausalLM.from_config(build_hf_config(cfg.model)).to(getattr(torch, cfg.precision.param_dtype))
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 512, (3, positions)), cache=cache, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert memory(summary_for(cfg), run_settings(cfg, WORLD, "cpu")).kv_cache == held


def test_plan_shows_the_kv_cache_and_where_generating_peaks(capsys, tmp_path):
    """The command's rows: the sequence as prompt and completion, the KV cache. llama_70b on 64 ranks peaks while it
    generates with the whole model gathered (134.6 GiB of 147); not so without gather_for_generation."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "2 + 2 ="}\n')
    data = [f"data.paths=[{tmp_path}/prompts.jsonl]", f"data.tokenizer={chat_tokenizer(str(tmp_path / 'tok'))}"]
    overrides = ["model=llama_70b", "data=prompts", *data, "objective=grpo", "trainer.eval_interval=0"]
    overrides += ["objective.reward_funcs=[tests.helpers.rewards.digits]", "objective.max_completion_length=1024"]
    overrides += ["trainer.global_batch_size=64", "trainer.micro_batch_size=1", "activation_checkpointing=every_block"]
    for gather in ("true", "false"):
        assert main([*overrides, f"objective.gather_for_generation={gather}", "world_size=64", "--device", "cuda"]) == 0
    gathered, each_token = capsys.readouterr().out.split("llama_70b:")[1:]
    assert "micro-batch 1 x 1152 tokens (128 prompt + 1024 completion)" in gathered
    # Keys and values of 80 blocks, 1024 wide (8 key-value heads of 128), bf16, for 1152 positions.
    assert re.search(r"KV cache \(generation\)\s+0\.352   1 x 1152 positions", gathered)
    assert re.search(r"gathered in flight \(bfloat16\)\s+134\.6\d   the whole model while generating", gathered)
    assert re.search(r"peak\s+147\.\d+   at: generation: the last token", gathered)
    assert re.search(r"peak\s+30\.\d+   at: backward", each_token)
