"""Tiny models of the Hugging Face families the framework is tested on, built from their configs (no download), and
the initial weights transformers itself makes for them, written by save_pretrained."""

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
