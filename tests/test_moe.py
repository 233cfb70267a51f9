"""Mixtures of experts (issue 10, section 4): the router's load-balancing loss enters the training loss when the
config asks for it (output_router_logits, router_aux_loss_coef), by transformers' own aux loss; it is logged with the
share of tokens the least and most loaded expert got; MFU counts active parameters; the planner and the doctor
say how many experts a token passes through."""

import pytest
import torch
import torch.nn.functional as F

from fsdp_research.composition import compose
from fsdp_research.dimensions import dims
from fsdp_research.metrics import active_parameters
from fsdp_research.models import build_hf_config, build_model
from tests.conftest import FAST
from tests.helpers.checkpointing import with_overrides
from tests.helpers.cli import read_metrics
from tests.helpers.dist import ok, train_distributed
from tests.helpers.reference import batches
from tests.helpers.zoo import MOE, from_config, hf_config, initial_weights, pretrained

ONE_STEP = with_overrides(FAST, "trainer.max_steps=1", "trainer.global_batch_size=4", "trainer.micro_batch_size=4")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Mixtral from the same initial weights, with and without the config asking for the aux loss (1 rank, one
    micro-batch: the aux loss is a function of the whole batch's routing)."""
    out = tmp_path_factory.mktemp("moe")
    asks = initial_weights("mixtral", str(out / "asks"), output_router_logits=True, router_aux_loss_coef=0.25)
    plain = initial_weights("mixtral", str(out / "plain"))
    configs = {"asks": compose(ONE_STEP + pretrained(asks)), "plain": compose(ONE_STEP + pretrained(plain))}
    ok(train_distributed(configs, 1, str(out)), "asks")
    return {name: (read_metrics(str(out / name))[0], path) for name, path in (("asks", asks), ("plain", plain))}


def _transformers_loss(path: str, cfg):
    """(cross-entropy, aux loss, tokens per expert) of the first batch, by transformers' Mixtral."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    tokens = batches(cfg, model.config.vocab_size)(0)
    with torch.no_grad():
        out = model(input_ids=tokens[:, :-1], output_router_logits=True)
    ce = F.cross_entropy(out.logits.flatten(0, 1), tokens[:, 1:].flatten())
    top = torch.cat([r.topk(model.config.num_experts_per_tok, -1).indices.flatten() for r in out.router_logits])
    return ce.item(), out.aux_loss.item(), torch.bincount(top, minlength=model.config.num_local_experts)


@pytest.mark.parametrize("name, coef", [("asks", 0.25), ("plain", 0.0)])
def test_aux_loss_enters_the_loss_when_the_config_asks(runs, name, coef):
    metrics, path = runs[name]
    ce, aux, tokens = _transformers_loss(path, compose(ONE_STEP + pretrained(path)))
    assert metrics["loss"] == pytest.approx(ce + coef * aux, rel=1e-5)
    assert metrics["aux_loss"] == pytest.approx(aux, rel=1e-5)
    share = tokens / tokens.sum()
    assert metrics["expert_fraction_min"] == pytest.approx(share.min().item())
    assert metrics["expert_fraction_max"] == pytest.approx(share.max().item())


@pytest.mark.parametrize("family", MOE)
def test_active_parameters_count_top_k_of_the_experts(family):
    from transformers import AutoModelForCausalLM

    config = hf_config(family)
    model = AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() for p in model.parameters())
    d = dims(model)
    assert 0 < experts < total and (d.experts, d.experts_per_token) == (4, 2)
    assert active_parameters(build_model(config), d) == total - experts // 2


def test_planner_and_doctor_speak_of_experts(capsys):
    from fsdp_research.cli.doctor import main as doctor
    from fsdp_research.cli.plan import main as plan

    overrides = from_config("mixtral")
    assert plan(overrides) == 0 and doctor(overrides) == 0
    out = capsys.readouterr().out
    cfg = compose(overrides)
    model = build_model(build_hf_config(cfg.model))
    active = active_parameters(model, dims(model)) / 1e6
    assert f"({active:.2f}M active per token: 2 of 4 experts; all-gathers move every expert)" in out
    assert "a mixture of experts, 2 of 4 per token" in out
