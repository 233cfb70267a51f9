"""Which of transformers' causal-LM model types are decoder-only text families, a tiny config for each, and whether
transformers itself builds, saves, loads and runs it.

Nothing is downloaded: a tiny config is the family's own defaults (AutoConfig.for_model) shrunk by one rule per
attribute name (RULES), plus a few per-family OVERRIDES where a family ties its sizes together in its own way.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import tempfile
import time
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM, POSITIONS = 512, 64, 128, 4, 2, 16, 256
EXPERTS, TOP_K, MOE_INTERMEDIATE = 4, 2, 32
LAYERS, MIXED_LAYERS = 2, 3
WINDOW = 32  # sliding windows, chunks and blocks: under the test sequence, so that windowing really happens
BATCH, SEQ = 2, 64

# ---------------------------------------------------------------------------------------------------------------------
# Which model types are decoder-only text families

# BERT-style encoders: their "CausalLM" is the bidirectional encoder run with is_decoder=True.
_ENCODERS = (
    "bert",
    "bert-generation",
    "big_bird",
    "camembert",
    "data2vec-text",
    "electra",
    "ernie",
    "megatron-bert",
    "rembert",
    "roberta",
    "roberta-prelayernorm",
    "roc_bert",
    "roformer",
    "xlm-roberta",
    "xlm-roberta-xl",
    "xmod",
)
_DRAFTER = "not standalone: speculative-decoding drafter, runs on the target model's embeddings and shared KV"
# What the configs do not say themselves.
_EXPLICIT = {
    **dict.fromkeys(_ENCODERS, "encoder: BERT-style encoder, its CausalLM is the encoder with is_decoder=True"),
    "trocr": "encoder-decoder: the text decoder of a VisionEncoderDecoder (cross-attends an image encoder)",
    "fuyu": "multimodal: image patches projected straight into the decoder (no vision sub-config to see)",
    "gemma4_assistant": _DRAFTER,
    "gemma4_unified_assistant": _DRAFTER,
}
_MODALITY = re.compile(r"vision|audio|image|video|speech|vq")


def _exclusion(model_type: str) -> str | None:
    if model_type in _EXPLICIT:
        return _EXPLICIT[model_type]
    config = AutoConfig.for_model(model_type)
    if config.is_encoder_decoder:
        return "encoder-decoder: config.is_encoder_decoder, its CausalLM is the decoder half"
    # Text-only families with sub-configs of their own (dbrx, mpt, blt) name none of these.
    modal = [name for name in getattr(config, "sub_configs", {}) if _MODALITY.search(name)]
    if modal:
        return f"multimodal: sub-configs {', '.join(modal)}"
    return None


def _quietly(function, *args, **kwargs):
    # Default configs of big models warn about their own token ids and rope settings; none of it matters here.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        return function(*args, **kwargs)
    finally:
        transformers.logging.set_verbosity(verbosity)


EXCLUDED: dict[str, str] = {
    t: reason for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if (reason := _quietly(_exclusion, t)) is not None
}
FAMILIES: list[str] = [t for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if t not in EXCLUDED]

# ---------------------------------------------------------------------------------------------------------------------
# The shrinking rule: one per attribute name, applied to a number in the family's default to_dict()


@dataclasses.dataclass
class _Context:
    default: dict[str, Any]  # the (sub-)config's default to_dict()
    layers: int  # the tiny layer count


def _to(value):
    return lambda v, c: value


def _at_most(value):
    return lambda v, c: min(v, value)


def _kv_heads(heads_key):
    # Keep the family's kind of attention: multi-query stays multi-query, multi-head stays multi-head, GQA gets 2.
    def rule(v, c):
        heads = c.default.get(heads_key)
        return 1 if v == 1 else HEADS if v is None or v == heads or heads is None else KV_HEADS

    return rule


def _vocab_like(v, c):
    # Side vocabularies (per-layer embeddings, hashed n-grams, padded vocabularies) scale with the vocabulary.
    return min(VOCAB, max(16, round(v * VOCAB / c.default.get("vocab_size", VOCAB))))


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _top_k(v, c):
    # Some families default top-k to None (deepseek_v2): top-2 wherever there are experts to choose from.
    if v is None:
        return TOP_K if any(_is_number(c.default.get(k)) for k in _EXPERT_COUNTS) else None
    return min(v, TOP_K)


def _head_dim(v, c):
    # Multi-head latent attention ropes only a part of the head: its head_dim is the rotary part.
    return HEAD_DIM // 2 if v is not None and v == c.default.get("qk_rope_head_dim") else HEAD_DIM


# None defaults that the tiny config fills in: transformers itself computes head_dim = hidden / heads (16 here
# too) where it reads a None, except where it does not (ministral, hunyuan).
# Likewise num_key_value_heads = num_attention_heads (nemotron).
_FILL_NONE = ("head_dim", "num_experts_per_tok", "num_key_value_heads")


def _names(rule, *names):
    return dict.fromkeys(names, rule)


RULES = {
    "vocab_size": _to(VOCAB),
    "num_attention_heads_per_layer": _to(HEADS),  # laguna: one per layer
    "unpadded_vocab_size": _to(VOCAB),  # the logits' width (inkling): no padding in a vocabulary of 512
    **_names(
        _vocab_like,
        "vocab_size_per_layer_input",
        "output_vocab_size",
        "encoder_hash_byte_group_vocab",
        "ngram_vocab_size_base",
    ),
    **_names(
        _to(HIDDEN),
        "hidden_size",
        "n_embd",
        "d_model",
        "emb_dim",
        "embedding_dim",
        "lru_width",
        "attention_hidden_size",
        "word_embed_proj_dim",
        "router_hidden_size",
        "hidden_size_global",  # blt: the global transformer's width, seen from its local encoder and decoder
    ),
    **_names(_to(HEAD_DIM), "hidden_size_per_layer_input", "ple_embed_dim"),
    **_names(
        _to(INTERMEDIATE),
        "intermediate_size",
        "ffn_dim",
        "dff",
        "dim_ff",
        "d_inner",
        "ffn_hidden_size",
        "feed_forward_size",
        "intermediate_size_mlp",
        "dense_intermediate_size",
        "prefix_dense_intermediate_size",
        "mamba_d_ssm",
    ),
    **_names(
        lambda v, c: MOE_INTERMEDIATE if v else v,  # 0 means "no shared expert"
        "moe_intermediate_size",
        "expert_ffn_hidden_size",
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "shared_experts_intermediate_size",
        "shared_intermediate_size",
    ),
    **_names(
        _to(HEADS),
        "num_attention_heads",
        "n_head",
        "n_heads",
        "attention_heads",
        "num_heads",
        "swa_num_attention_heads",
        "linear_num_heads",
        "linear_num_value_heads",
        "indexer_n_heads",
    ),
    "num_key_value_heads": _kv_heads("num_attention_heads"),
    "num_kv_heads": _kv_heads("num_attention_heads"),
    "num_query_groups": _kv_heads("num_attention_heads"),
    "kv_n_heads": _kv_heads("n_heads"),  # dbrx's attn_config: heads live in the parent, so GQA by default
    "swa_num_key_value_heads": _kv_heads("swa_num_attention_heads"),
    "linear_num_key_heads": _kv_heads("linear_num_value_heads"),
    "indexer_kv_heads": _kv_heads("indexer_n_heads"),
    "index_n_heads": _to(KV_HEADS),
    "head_dim": _head_dim,
    **_names(
        _to(HEAD_DIM),
        "d_head",
        "attention_head_size",
        "dim_head",
        "attention_head_dim",
        "kv_channels",
        "swa_head_dim",
        "index_head_dim",
        "indexer_head_dim",
        "linear_head_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "mamba_d_head",
        "mamba_head_dim",
        "mamba_headdim",
        "v_head_dim",
        "qk_head_dim",
        "d_rel",
    ),
    # Multi-head latent attention: qk_head_dim = nope + rope.
    **_names(_to(HEAD_DIM // 2), "qk_nope_head_dim", "qk_rope_head_dim", "rotary_dim"),
    **_names(lambda v, c: 32 if v else v, "kv_lora_rank", "q_lora_rank", "o_lora_rank"),
    **_names(_at_most(8), "laurel_rank", "adapter_rank", "gated_norm_rank", "loop_gate_rank", "hc_lowrank", "o_groups"),
    **_names(
        _at_most(POSITIONS),
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "max_seq_len",
        "context_length",
        "original_max_position_embeddings",
        "model_max_length",
        "position_bias_max_distance",
        "rel_extent",
    ),
    # Experts.
    **_names(_at_most(EXPERTS), "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "zero_expert_num": _at_most(2),
    **_names(
        _top_k,
        "num_experts_per_tok",
        "moe_k",
        "moe_topk",
        "moe_top_k",
        "top_k_experts",
        "num_experts_per_token",
    ),
    **_names(_at_most(1), "n_shared_experts", "num_shared_experts", "moe_num_shared_experts"),
    # Grouped routing: 2 groups of 2 experts, the best group chosen, so top-2 still finds 2 experts.
    **_names(_at_most(2), "n_group", "num_expert_group"),
    "topk_group": _at_most(1),
    # Layer patterns: every kind of layer within the first 3.
    **_names(_at_most(1), "first_k_dense_replace", "num_dense_layers", "moe_layer_start_index", "attn_layer_offset"),
    **_names(_at_most(1), "expert_layer_offset", "n_layers_per_attn_res_block"),
    **_names(
        _at_most(2),
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "global_attn_every_n_layers",
        "no_rope_layer_interval",
        "attn_layer_period",
        "expert_layer_period",
        "layer_group_size",
        "interleave_moe_layer_step",
        "decoder_sparse_step",
        "moe_layer_interval",
    ),
    "moe_layer_end_index": lambda v, c: c.layers - 1,
    "max_window_layers": lambda v, c: min(v, c.layers),
    # State spaces, linear attention and convolutions.
    **_names(_at_most(8), "state_size", "mamba_d_state", "ssm_state_size", "time_step_rank", "mamba_dt_rank"),
    **_names(_at_most(2), "n_groups", "mamba_n_groups", "mamba_ngroups"),
    **_names(_to(2 * HIDDEN // HEAD_DIM), "mamba_n_heads", "mamba_num_heads", "n_mamba_heads"),  # expand 2
    **_names(_at_most(WINDOW), "chunk_size", "mamba_chunk_size"),
    # Windows, chunks and blocks of attention.
    **_names(
        _at_most(WINDOW),
        "sliding_window",
        "sliding_window_size",
        "attention_window_size",
        "window_size",
        "local_attention",
        "attention_chunk_size",
        "local_attention_window_len",
        "keep_window_size",
        "block_size",
        "index_topk",
    ),
    **_names(_at_most(16), "index_block_size", "lsh_attn_chunk_length", "local_attn_chunk_length"),
    "index_topk_blocks": _at_most(2),
    **_names(_at_most(16), "block_multiple_of", "ffn_round_up_to_multiple_of", "make_ngram_vocab_size_divisible_by"),
}

# Attributes that count layers, and per-layer structures beyond lists as long as the layer count.
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_blocks")
_LAYER_INDICES = (
    "moe_layers",
    "mlp_only_layers",
    "full_attn_idxs",
    "hybrid_layer_ids",
    "attn_layer_indices",
    "local_layer_ids",
    "ple_layer_ids",
)
_NOT_PER_LAYER = ("time_step_limit", "ssm_multipliers", "mlp_multipliers", "encoder_hash_byte_group_size")
# The mere presence of these (with a true value) makes layers of more than one kind.
_MIXING = (
    "first_k_dense_replace",
    "num_dense_layers",
    "attn_layer_period",
    "expert_layer_period",
    "sliding_window_pattern",
    "_sliding_window_pattern",
    "global_attn_every_n_layers",
    "no_rope_layer_interval",
    "layer_group_size",
    "block_types",
    "moe_layer_start_index",
    "interleave_moe_layer_step",
)
# Router jitter noise is as random in training as dropout is.
_DROPOUT = re.compile(r"dropout|pdrop|layerdrop|jitter")
_TOKEN_ID = re.compile(r"_token_ids?$|_token_index$|^(mask|unk)_index$")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_dropout(key: str, v) -> bool:
    return _is_number(v) and bool(_DROPOUT.search(key))


def _layer_plan(d: dict[str, Any]) -> tuple[int, list[int]] | tuple[None, None]:
    """The default layer count and which of its layers to keep: the first layer of every kind, then the earliest
    others up to 2 (or 3 where layers differ), so that per-layer lists, layer-index lists and per-layer configs are
    all cut the same way."""
    count = next((d[k] for k in _LAYER_COUNTS if _is_number(d.get(k))), None)
    if count is None:
        # nemotron_h and reformer count their layers by their per-layer list.
        count = next((len(d[k]) for k in ("layers_block_type", "attn_layers") if isinstance(d.get(k), list)), None)
    if count is None:
        return None, None
    per_layer = [
        v
        for k, v in d.items()
        if isinstance(v, list) and len(v) == count and k not in _NOT_PER_LAYER and k not in _LAYER_INDICES
    ]
    indices = [set(v) for k, v in d.items() if k in _LAYER_INDICES and isinstance(v, list)]
    overrides = d.get("per_layer_config") or {}
    kinds = [
        (
            tuple(repr(lst[i]) for lst in per_layer),
            tuple(i in idx for idx in indices),
            repr(overrides.get(f"{i:02d}")),
        )
        for i in range(count)
    ]
    chosen = sorted({kind: i for i, kind in reversed(list(enumerate(kinds)))}.values())
    mixed = len(chosen) > 1 or any(d.get(k) for k in _MIXING)
    wanted = max(len(chosen), MIXED_LAYERS if mixed else LAYERS)
    chosen = sorted(chosen + [i for i in range(count) if i not in chosen][: wanted - len(chosen)])
    return count, chosen


def _shrink_rope(rope: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, v in rope.items():
        if isinstance(v, dict):  # one set of parameters per layer type
            out[key] = _shrink_rope(v)
        elif key == "original_max_position_embeddings" and _is_number(v):
            out[key] = min(v, POSITIONS)
        elif key == "mrope_section" and isinstance(v, list):
            # Sections of the rotary half of a head: scaled to 16 // 2, the first ones rounded up.
            total = sum(v)
            out[key] = [max(1, math.floor(s * (HEAD_DIM // 2) / total)) for s in v]
            out[key][0] += HEAD_DIM // 2 - sum(out[key])
        else:
            out[key] = v
    return out


def _fields(config: PretrainedConfig) -> set[str]:
    # What the config class takes. Everything else in to_dict() is derived in __post_init__ (MLA's head_dim,
    # qk_head_dim, zamba2's hybrid_layer_ids, ...) or an alias: passing it would override the derivation.
    return {f.name for f in dataclasses.fields(type(config))} | {"per_layer_config"}


def _shrink(config: PretrainedConfig, dropout: bool) -> dict[str, Any]:
    """The changes that make a (sub-)config with default values tiny, as keyword arguments of its class."""
    d = config.to_dict()
    count, chosen = _layer_plan(d)
    context = _Context(d, len(chosen) if chosen else LAYERS)
    sub_configs = getattr(config, "sub_configs", {}) or {}
    changes = {}

    def scalar(key, v, at=context):
        if not dropout and _is_dropout(key, v):
            return 0.0
        if key in RULES and (_is_number(v) or (v is None and key in _FILL_NONE)):
            return RULES[key](v, at)
        return v

    fields = _fields(config)
    # attribute_map stores some fields under another name (qwen3_moe's num_experts as num_local_experts).
    stored_as = {target: name for name, target in getattr(config, "attribute_map", {}).items() if name in fields}
    none_by_default = {f.name for f in dataclasses.fields(type(config)) if f.default is None}
    for key, v in d.items():
        field = key if key in fields else stored_as.get(key)
        if field is None:
            continue
        if field in none_by_default and v is not None and not isinstance(v, (list, dict)):
            continue  # filled in by __post_init__ (kv heads, head_dim, zamba's widths): derived again from the rest
        if key in sub_configs and isinstance(getattr(config, key, None), PretrainedConfig):
            # A text family's own sub-config (dbrx, mpt, blt): shrunk by the same rules, passed as a dict.
            new = _shrink(getattr(config, key), dropout) or v
        elif key == "rope_parameters" and isinstance(v, dict):
            new = _shrink_rope(v)
        elif key == "per_layer_config" and isinstance(v, dict) and chosen:
            width = len(next(iter(v), "00"))
            new = {}
            for j, i in enumerate(chosen):
                if (layer := v.get(str(i).zfill(width))) is not None:
                    # A layer's own values shrink against each other (its kv heads against its heads).
                    layer_context = _Context({**d, **layer}, context.layers)
                    new[str(j).zfill(width)] = {k: scalar(k, x, layer_context) for k, x in layer.items()}
        elif key in _LAYER_COUNTS and _is_number(v) and chosen:
            new = len(chosen)
        elif key in _LAYER_INDICES and isinstance(v, list) and chosen:
            new = [j for j, i in enumerate(chosen) if i in v]
        elif _TOKEN_ID.search(key):
            # Special tokens inside the tiny vocabulary.
            new = [x % VOCAB for x in v] if isinstance(v, list) else v % VOCAB if _is_number(v) else v
        elif isinstance(v, list) and count and len(v) == count and key not in _NOT_PER_LAYER:
            new = [scalar(key, v[i]) for i in chosen]
        else:
            new = scalar(key, v)
        if new != v:
            changes[field] = new
    return changes


# Families whose sizes are tied together in ways a rule per name cannot see, or that transformers cannot build as
# the rules leave them (see WORKAROUNDS).
OVERRIDES: dict[str, dict[str, Any]] = {
    # DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig no longer declares; the hub's configs
    # still carry it (a transformers bug for default configs only).
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # clip_qkv=None breaks clamp(): hub's 8
    # Default configs without experts (None) or RoPE ({}): the hub's configs have them.
    "dots1": dict(n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1),
    "cohere_compass_text": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}}
    ),
    # Gemma 3n's last layers reuse the KV of the last earlier layer of their kind: 2 of each kind, the last 2 shared.
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        intermediate_size=[INTERMEDIATE] * 4,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
    ),
    # LFM2's convolutions and attention: its default is all-attention, and lfm2_moe's (None) cannot build.
    "lfm2": dict(num_hidden_layers=3, full_attn_idxs=[1], layer_types=["conv", "full_attention", "conv"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"]),
    # attention_layers is derived from attention_types: [global, local] once.
    "gpt_neo": dict(num_layers=2, attention_types=[[["global", "local"], 1]]),
    # xLSTM's cache rounds the query/key width (hidden x qk_dim_factor 0.5) up to a multiple of 64 and its layers do
    # not: a width of 128 keeps them equal.
    "xlstm": dict(hidden_size=2 * HIDDEN, embedding_dim=2 * HIDDEN),
    # Dory's to_dict() lists every layer as (attention, mlp) blocks, so twice the layers: 1 input, 1 recurrent and
    # 1 output layer.
    "dory": dict(
        num_hidden_layers=6,
        n_input_layers=2,
        n_recurrent_layers=2,
        n_output_layers=2,
        layer_types=["sliding_attention", "mlp", "full_attention", "mlp", "sliding_attention", "mlp"],
    ),
    # Mamba-2: heads x head_dim = expand x hidden.
    "mamba2": dict(num_heads=2 * HIDDEN // HEAD_DIM),
    # Causal (CLM) rather than its masked-LM default; reformer's LM head requires is_decoder.
    "xlm": dict(causal=True),
    # hash_seed: the same LSH buckets in every forward, as its docs advise for tests; axial positions multiply to the
    # 64 tokens of the test, as training requires.
    "reformer": dict(is_decoder=True, axial_pos_shape=[8, 8], axial_pos_embds_dim=[16, 48], hash_seed=0),
    # Zamba ties its one shared attention block across its hybrid layers, and cannot build with only one of them.
    "zamba": dict(num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2),
    # All-Mamba by default, which their caches cannot run (get_seq_length needs an attention layer).
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"]
    ),
    # Its indexed-attention layers need the QSA indexer, whose sizes default to None.
    "qwen4_exp_text": dict(
        indexer_n_heads=KV_HEADS,
        indexer_kv_heads=1,
        indexer_head_dim=HEAD_DIM,
        indexer_budget=32,
        indexer_compress_ratio=4,
    ),
}


# Bugs of transformers' own that the tiny config steps around (in OVERRIDES or by a rule), and how: mostly default
# configs that transformers cannot build (the hub's checkpoints set these values); zamba's and xlstm's only at small
# sizes.
WORKAROUNDS: dict[str, str] = {
    "dbrx": "DbrxAttention reads attn_config.rope_theta, no longer a DbrxAttentionConfig field; clip_qkv=None "
    "breaks clamp(): both set in attn_config",
    "dots1": "n_routed_experts, num_experts_per_tok and n_shared_experts default to None: set",
    "deepseek_v2": "num_experts_per_tok defaults to None (topk(k=None)): top-2",
    "cohere_compass_text": "rope_parameters defaults to {} (KeyError 'full_attention'): set",
    "lfm2_moe": "layer_types defaults to None, which the model indexes: set",
    "ministral": "head_dim defaults to None and the attention takes None ** -0.5: 16",
    "hunyuan_v1_dense": "head_dim defaults to None and the attention takes None ** -0.5: 16",
    "hunyuan_v1_moe": "head_dim defaults to None and the attention takes None ** -0.5: 16",
    "nemotron": "num_key_value_heads defaults to None, which the attention divides by: = heads",
    "bamba": "all-Mamba by default (attn_layer_indices=None) and its cache cannot run that: one attention layer",
    "granitemoehybrid": "all-Mamba by default and its cache cannot run that: one attention layer",
    "qwen4_exp_text": "its indexed-attention layers need the QSA indexer, whose sizes default to None: set",
    "zamba": "one hybrid layer (what 3 layers give) fails tying the shared block: two",
    "xlstm": "the cache rounds hidden x qk_dim_factor up to a multiple of 64 and the layers do not: hidden 128",
}


def tiny_config(model_type: str, dropout: bool = False) -> PretrainedConfig:
    """The family's own config class, shrunk. dropout=False zeroes every dropout-like attribute; dropout=True keeps
    the family's defaults."""
    default = _quietly(AutoConfig.for_model, model_type)
    changes = _shrink(default, dropout)
    for key, v in OVERRIDES.get(model_type, {}).items():
        # An override of a sub-config adds to its shrunk values.
        changes[key] = {**changes[key], **v} if isinstance(v, dict) and isinstance(changes.get(key), dict) else v
    if "tie_word_embeddings" in _fields(default):
        changes["tie_word_embeddings"] = default.tie_word_embeddings
    return _quietly(AutoConfig.for_model, model_type, **changes)


def default_dropout(model_type: str) -> dict[str, float]:
    """The dropout-like attributes the family defaults to above zero (sub-configs as 'sub.attr')."""

    def walk(d, prefix):
        for key, v in d.items():
            if isinstance(v, dict) and "model_type" in v:
                yield from walk(v, f"{prefix}{key}.")
            elif _is_dropout(key, v) and v > 0:
                yield f"{prefix}{key}", v

    return dict(walk(_quietly(AutoConfig.for_model, model_type).to_dict(), ""))


# ---------------------------------------------------------------------------------------------------------------------
# What transformers itself does with the tiny config


@dataclasses.dataclass
class Check:
    model_type: str
    reason: str | None = None  # None: built, saved, loaded and ran
    model_class: str = ""
    parameters: int = 0
    stage: str = ""  # the step under way (or last done)
    attn_implementation: str = ""
    seconds: float = 0.0
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)


def _first_line(error: BaseException) -> str:
    text = [line.strip() for line in str(error).strip().splitlines()]
    # Config validation errors name the validator on their first line and say what is wrong on the next.
    line = " ".join(text[:2]) if text and text[0].endswith(":") else text[0] if text else ""
    if "does not support an attention implementation through torch.nn.functional.scaled_dot_product_attention" in line:
        return "not supported"
    return f"{type(error).__name__}: {line}".strip()


class _Failed(Exception):
    """What differed, in a line."""


def _layerless(name: str) -> str:
    # model.layers.3.mlp.gate.e_score_correction_bias -> model.layers.*.mlp.gate.e_score_correction_bias
    return re.sub(r"\.\d+\.", ".*.", name)


def _tied(model: torch.nn.Module) -> bool | None:
    # Whether the LM head really is the input embedding (not merely what the config says).
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(outputs, torch.nn.Module) or not hasattr(inputs, "weight"):
        return None
    return getattr(outputs, "weight", None) is inputs.weight


# Router biases: DeepSeek-style e_score_correction_bias, aux-loss-free expert_bias, or a bias of the router itself.
_ROUTER_BIAS = re.compile(r"e_score_correction_bias|expert_bias|(^|\.)(gate|router)\.bias$")


def _notes(model: torch.nn.Module) -> dict[str, Any]:
    """What a sharding framework wants to know about the family, read off its model."""
    cls = type(model)
    modules = dict(model.named_modules())
    # An MoE block is whatever holds the experts: "Block/Experts" class names.
    moe = sorted(
        {
            f"{type(modules[name.rpartition('.')[0]]).__name__}/{type(m).__name__}"
            for name, m in modules.items()
            if name.rpartition(".")[2] == "experts" or type(m).__name__.endswith("Experts")
        }
    )
    router_bias = sorted(
        {f"{_layerless(n)} (buffer)" for n, _ in model.named_buffers() if _ROUTER_BIAS.search(n)}
        | {f"{_layerless(n)} (param)" for n, _ in model.named_parameters() if _ROUTER_BIAS.search(n)}
    )
    return {
        "moe": moe,
        "router_bias": router_bias,
        "keep_in_fp32": getattr(cls, "_keep_in_fp32_modules", None),
        "keep_in_fp32_strict": getattr(cls, "_keep_in_fp32_modules_strict", None),
        "no_split_modules": getattr(cls, "_no_split_modules", None),
        "tied": _tied(model),
    }


def _run(config: PretrainedConfig, attn: str, result: Check) -> None:
    """Build, save, load and run; raise _Failed (or whatever transformers raised) on the first difference."""
    result.stage = "from_config"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    result.model_class = type(model).__name__
    result.parameters = sum(p.numel() for p in model.parameters())
    result.notes.update(_notes(model))

    with tempfile.TemporaryDirectory() as tmp:
        result.stage = "save_pretrained"
        model.save_pretrained(tmp)
        if not any(name.endswith(".safetensors") for name in os.listdir(tmp)):
            raise _Failed(f"save_pretrained wrote no safetensors: {sorted(os.listdir(tmp))}")
        result.stage = "from_pretrained"
        loaded, info = AutoModelForCausalLM.from_pretrained(
            tmp, output_loading_info=True, attn_implementation=attn, dtype=torch.float32
        )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise _Failed(f"loading: {'; '.join(f'{k} {sorted(map(str, v))[:3]}' for k, v in bad.items())}")
    saved, back = model.state_dict(), loaded.state_dict()
    if saved.keys() != back.keys():
        raise _Failed(f"state_dict keys differ after loading: {sorted(saved.keys() ^ back.keys())[:3]}")
    differ = [k for k in saved if saved[k].dtype != back[k].dtype or not torch.equal(saved[k], back[k])]
    if differ:
        raise _Failed(f"state_dict differs after loading: {differ[:3]}")

    vocab = config.vocab_size
    ids = torch.randint(0, min(vocab, VOCAB), (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    result.stage = "eval forward"
    model.eval(), loaded.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        again = loaded(input_ids=ids).logits
    if tuple(logits.shape) != (BATCH, SEQ, vocab):
        raise _Failed(f"logits of shape {tuple(logits.shape)}, not {(BATCH, SEQ, vocab)}")
    if not torch.isfinite(logits).all():
        raise _Failed("logits not finite")
    if not torch.equal(logits, again):
        raise _Failed(f"logits differ after loading (max {(logits - again).abs().max().item():.2e})")

    result.stage = "train backward"
    model.train()
    model(input_ids=ids).logits.mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    if not any(g is not None for g in grads.values()):
        raise _Failed("no gradients")
    infinite = [n for n, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    if infinite:
        raise _Failed(f"gradients not finite: {infinite[:3]}")
    # Parameters the loss does not reach (unused branches: indexers, MTP heads, XLNet's segment embeddings).
    result.notes["no_grad"] = sorted({_layerless(n) for n, g in grads.items() if g is None})


transformers.utils.logging.disable_progress_bar()


@functools.cache
def check(model_type: str) -> Check:
    """Build AutoModelForCausalLM.from_config(tiny_config(...)) in fp32 on CPU (seed 0), save_pretrained
    (safetensors), from_pretrained back, and run both (eval forward, train backward): sdpa, else eager."""
    start = time.perf_counter()
    result = Check(model_type, model_class=MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    result.notes["default_dropout"] = default_dropout(model_type)
    try:
        config = tiny_config(model_type)
    except Exception as error:
        result.reason = f"tiny_config: {_first_line(error)}"
        result.seconds = time.perf_counter() - start
        return result
    failures = {}
    for attn in ("sdpa", "eager"):
        try:
            _quietly(_run, config, attn, result)
        except Exception as error:
            # What differed says where; an exception is told by the step it came from.
            failures[attn] = str(error) if isinstance(error, _Failed) else f"{result.stage}: {_first_line(error)}"
            continue
        result.attn_implementation = attn
        break
    else:
        # eager is the reference implementation: its failure is the family's.
        result.reason = failures["eager"]
    if failures.get("sdpa") and failures["sdpa"] != result.reason:
        result.notes["sdpa"] = failures["sdpa"]
    result.seconds = time.perf_counter() - start
    return result


def transformers_itself(model_type: str) -> str | None:
    """None when transformers itself builds, saves, loads and runs the family's tiny model; otherwise why not."""
    return check(model_type).reason


def not_buildable() -> dict[str, str]:
    """The decoder-only text families transformers itself fails on, with why (checks every family: ~15 s)."""
    return {t: reason for t in FAMILIES if (reason := transformers_itself(t)) is not None}
