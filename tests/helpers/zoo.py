"""Tiny models of the Hugging Face families the framework is tested on, built from their configs (no download), and
the initial weights transformers itself makes for them, written by save_pretrained."""

import torch
from transformers import AutoConfig

from tests.helpers.reference import save_initial

_DECODER = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    head_dim=16,
)
_EXPERTS = dict(num_experts_per_tok=2)
# model_type -> config; dropout off (as in modern pretraining): a run's numbers then do not depend on the layout.
FAMILIES = {
    "llama": dict(_DECODER),
    "mistral": dict(_DECODER),
    "qwen2": dict(_DECODER),
    "qwen3": dict(_DECODER),
    "gemma2": dict(_DECODER),
    "gemma3_text": dict(_DECODER),
    "phi3": dict(_DECODER, pad_token_id=0),
    "olmo2": dict(_DECODER),
    "gpt2": dict(
        vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    ),
    "gpt_neox": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
    ),
    "mixtral": dict(_DECODER, **_EXPERTS, num_local_experts=4),
    "qwen3_moe": dict(_DECODER, **_EXPERTS, num_experts=4, moe_intermediate_size=32),
    "olmoe": dict(_DECODER, **_EXPERTS, num_experts=4),
    # Latent attention (MLA: q/kv LoRA ranks, rope and nope head dims), a shared expert, a dense first layer, and a
    # router trained without an aux loss (its expert bias nudged towards balance after each step).
    "deepseek_v3": dict(
        _DECODER,
        **_EXPERTS,
        num_key_value_heads=4,
        n_routed_experts=4,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        head_dim=8,  # the rope part's: what its rotary embedding is sized by
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    ),
}
MOE = ("mixtral", "qwen3_moe", "olmoe", "deepseek_v3")


def hf_config(family: str, **changes):
    return AutoConfig.for_model(family, **{**FAMILIES[family], **changes})


def from_config(family: str) -> list[str]:
    """The overrides that build the family from its config (model=custom)."""
    return [
        "model=custom",
        f"model.model_type={family}",
        *(f"model.config.{k}={v}" for k, v in FAMILIES[family].items()),
    ]


def pretrained(path: str) -> list[str]:
    return ["model=pretrained", f"model.name_or_path={path}"]


def initial_weights(family: str, out_dir: str, **changes) -> str:
    return save_initial(hf_config(family, **changes), out_dir)


def assert_initialised_alike(ours: dict, model, again=None) -> None:
    """Our initial weights (full, by name) against what transformers' from_config made (`model`): deterministic
    parts (norm scales, biases, zero rows, state-space constants) equal, random parts of the same mean and spread.
    With `again` (from_config from another seed), deterministic is what both seeds made alike; else constants and
    tensors under 16 elements."""
    theirs = model.state_dict()
    other = again.state_dict() if again is not None else None
    assert ours.keys() == theirs.keys(), f"names differ: {sorted(ours.keys() ^ theirs.keys())[:3]}"
    for key, expected in theirs.items():
        got = ours[key]
        if not expected.is_floating_point() or expected.numel() == 0:
            assert torch.equal(got, expected), key
            continue
        got, expected = got.double(), expected.double()
        fixed = torch.equal(expected, other[key].double()) if other is not None else None
        if fixed or (fixed is None and (expected.std() == 0 or expected.numel() < 16)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
            continue
        assert torch.isfinite(got).all(), f"{key}: not finite"
        if expected.numel() < 16:  # random, too few values to compare their spread
            continue
        # Random: the same spread and mean as transformers' (both seeds' values pooled when given) within 5
        # standard errors of the difference of two samples (5% at least for the spread); rows HF zeroes (padding)
        # zero here too.
        if other is not None:
            expected = torch.cat([expected.flatten(), other[key].double().flatten()])
        n, m = got.numel(), expected.numel()
        spread = max(0.05, 5 * (1 / (2 * n) + 1 / (2 * m)) ** 0.5)
        assert abs(got.std() / expected.std() - 1) < spread, f"{key}: std {got.std():.5f} vs {expected.std():.5f}"
        tolerance = 5 * expected.std() * (1 / n + 1 / m) ** 0.5 + 1e-12
        assert abs(got.mean() - expected.mean()) < tolerance, f"{key}: mean {got.mean():.3g} vs {expected.mean():.3g}"
        zeroed = (expected == 0).reshape(-1, *got.shape).all(0)  # zero whatever the seed: padding rows
        assert (got[zeroed] == 0).all(), f"{key}: rows transformers zeroes are not zero"


def tiny_llama():
    """A tiny llama with real values, built in this process."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(hf_config("llama"))
