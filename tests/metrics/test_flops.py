"""MFU's numerator and denominator. FLOPs per token against torch's FlopCounterMode over a real forward and backward
of transformers' own model (eager attention and experts, whose matmuls the counter sees), on a large vocabulary
(where counting the embedding lookup as a matmul inflated MFU 1.6x), a tied one, mixtures of experts, and PEFT's
LoRA (a frozen base takes no weight gradient), and DPO's reference forward beside it. The peak
table on the device names torch.cuda.get_device_name() returns."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from fsdp_research.metrics.hardware import peak_for
from fsdp_research.metrics.meters import flops_per_token, forward_flops_per_token, matmul_parameters
from fsdp_research.model.dimensions import dims
from tests.helpers.zoo import MOE, hf_config

BATCH, SEQ = 2, 64


@pytest.mark.parametrize(
    "family, changes",
    [
        ("llama", dict(vocab_size=8192)),
        ("gpt2", dict(vocab_size=8192)),
        ("mixtral", {}),
        ("qwen3_moe", {}),
        ("deepseek_v3", {}),  # latent attention: qk and v head sizes differ; shared experts; a dense layer
    ],
)
def test_flops_per_token_match_the_flop_counter(family, changes):
    torch.manual_seed(0)
    config = hf_config(family, **changes)
    eager = dict(experts_implementation="eager") if family in MOE else {}
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", **eager)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / (BATCH * SEQ)
    d = dims(model)
    claimed = flops_per_token(d, matmul_parameters(model, d), SEQ)
    assert claimed == pytest.approx(counted, rel=0.02)  # the issue asks for 10%; measured: 0.5% or better


def test_lora_s_frozen_base_takes_no_weight_gradient():
    """PEFT's adapters on every Linear of a llama: the frozen base's matmuls cost 4 FLOPs a parameter, not 6
    (6 counted them 1.48x over)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = hf_config("llama", vocab_size=8192)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    d = dims(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear")).base_model.model
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
    counted = counter.get_total_flops() / (BATCH * SEQ)
    claimed = flops_per_token(d, matmul_parameters(model, d), SEQ, matmul_parameters(model, d, frozen=True))
    assert claimed == pytest.approx(counted, rel=0.02)  # measured: 0.8% over (block 0's inputs take no gradient)


def test_dpo_s_reference_forward_is_counted():
    """A DPO step with LoRA: the policy's forward and backward, and the reference's forward with no gradient (the
    adapters off: the frozen base alone), as objective=dpo runs it and MFU counts it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = hf_config("llama", vocab_size=8192)
    base = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    d = dims(base)
    peft = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    model = peft.base_model.model
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids).loss.backward()
        with torch.no_grad(), peft.disable_adapter():
            model(ids)
    counted = counter.get_total_flops() / (BATCH * SEQ)
    params, frozen = matmul_parameters(model, d), matmul_parameters(model, d, frozen=True)
    claimed = flops_per_token(d, params, SEQ, frozen) + forward_flops_per_token(d, frozen, SEQ)
    assert claimed == pytest.approx(counted, rel=0.02)


def test_embedding_lookups_are_not_matmuls():
    untied = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=8192, tie_word_embeddings=False))
    tied = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=8192, tie_word_embeddings=True))
    table = 8192 * 64
    for model in (untied, tied):
        everything = sum(p.numel() for p in model.parameters())
        assert matmul_parameters(model, dims(model)) == everything - (table if model is untied else 0)


@pytest.mark.parametrize(
    "name, bf16, fp32",
    [
        ("NVIDIA H100 80GB HBM3", 989.0, 67.0),
        ("NVIDIA H100 PCIe", 756.0, 51.0),
        ("NVIDIA H100 NVL", 835.0, 60.0),
        ("NVIDIA H200", 989.0, 67.0),
        ("NVIDIA H200 NVL", 835.0, 60.0),
        ("NVIDIA H800 PCIe", 756.0, 51.0),
        ("NVIDIA GB200", 2500.0, 80.0),
        ("NVIDIA B200", 2250.0, 75.0),
        ("NVIDIA GH200 480GB", 989.0, 67.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, 19.5),
        ("NVIDIA A100 80GB PCIe", 312.0, 19.5),
        ("NVIDIA A10G", 125.0, 31.2),
        ("NVIDIA L4", 121.0, 30.3),
        ("NVIDIA L40", 181.0, 90.5),
        ("NVIDIA L40S", 362.0, 91.6),
        ("Tesla V100-SXM2-32GB", 125.0, 15.7),
        ("Tesla T4", 65.0, 8.1),
        ("NVIDIA GeForce RTX 4090", 165.0, 82.6),
        ("NVIDIA RTX A6000", 154.8, 38.7),
        ("AMD Instinct MI300X", 1307.0, 163.4),
    ],
)
def test_peaks_by_exact_device_and_dtype(name, bf16, fp32):
    assert peak_for(name, torch.bfloat16) == bf16
    assert peak_for(name, torch.float16) == bf16
    assert peak_for(name, torch.float32) == fp32


def test_an_unknown_device_has_no_peak():
    assert peak_for("NVIDIA Quadro P1000", torch.bfloat16) is None
