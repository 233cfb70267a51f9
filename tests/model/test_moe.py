"""Mixtures of experts: the router's load-balancing loss enters the training loss when the
config asks for it (output_router_logits, router_aux_loss_coef), by transformers' own aux loss; it is logged with the
share of tokens the least and most loaded expert got; MFU counts active parameters; the planner and the doctor
say how many experts a token passes through."""

import pytest
import torch
import torch.nn.functional as F

from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.meters import active_parameters
from fsdp_research.model.architecture import build_hf_config, build_model
from fsdp_research.model.dimensions import dims
from tests.conftest import FAST
from tests.helpers.checkpointing import with_overrides
from tests.helpers.cli import read_metrics
from tests.helpers.dist import ok, train_distributed
from tests.helpers.reference import batches
from tests.helpers.zoo import MOE, from_config, hf_config, initial_weights, pretrained

pytestmark = pytest.mark.distributed

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


@pytest.mark.slow
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


def _biases(model) -> dict:
    from tests.helpers.dist import full_state

    return {"biases": {k: v for k, v in full_state(model).items() if k.endswith("e_score_correction_bias")}}


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """DeepSeek-V3 (aux-loss-free routers) for 5 steps at 1 and 4 ranks, one micro-batch per rank, exported."""
    out = tmp_path_factory.mktemp("balance")
    initial = initial_weights("deepseek_v3", str(out / "initial"))
    cfg = compose(
        with_overrides(
            FAST,
            "trainer.max_steps=5",
            "trainer.global_batch_size=4",
            "trainer.micro_batch_size=1",
            "model.moe.bias_update_rate=0.01",
            "checkpoint.export=true",
            "checkpoint.export_dtype=float32",
        )
        + pretrained(initial)
    )
    runs = {
        world: ok(train_distributed({"run": cfg}, world, str(out / str(world)), _biases), "run") for world in (1, 4)
    }
    return cfg, initial, runs, out


@pytest.mark.slow
def test_expert_bias_moves_towards_balance_identically_at_any_world_size(balanced):
    from safetensors.torch import load_file

    from tests.helpers.reference import reference_run

    cfg, initial, runs, out = balanced
    _, ref_weights = reference_run(cfg, initial)
    expected = {k: v for k, v in ref_weights.items() if k.endswith("e_score_correction_bias")}
    assert expected and all(v.abs().sum() > 0 for v in expected.values())  # it moved
    for world, run in runs.items():
        assert run["biases"].keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(run["biases"][key], value, rtol=0, atol=1e-7, msg=lambda m: f"{world}: {m}")
    exported = load_file(str(out / "4" / "run" / "export" / "model.safetensors"))
    for key, value in expected.items():
        torch.testing.assert_close(exported[key], value, rtol=0, atol=1e-7)


BATCH = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))


def _router_logits(model, batch) -> list:
    """What each router returns first (its logits), on one forward."""
    seen = []
    routers = [m for m in model.modules() if "e_score_correction_bias" in m._buffers]
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append(out[0].detach().float().cpu())) for m in routers]
    with torch.no_grad():
        model(input_ids=batch)
    for hook in hooks:
        hook.remove()
    return seen


def _bf16_routers(initial: str, out: str) -> dict:
    import torch.distributed as dist

    from fsdp_research.checkpoint.hf_export import export_model
    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.model.assembly import build_sharded_model

    cfg = compose(FAST + pretrained(initial) + ["precision=bf16"])
    init_distributed(typed(cfg).distributed, torch.device("cpu"))
    model, plan = build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), dist.get_world_size())
    logits = _router_logits(model, BATCH)
    export_model(model, model.config, out, torch.bfloat16, 10**9, None)
    return {"logits": logits, "fp32_units": [u.path for u in plan.units if u.fp32]}


def test_modules_kept_in_fp32_compute_in_fp32_under_bf16(tmp_path):
    """DeepSeek-V3 keeps its router gate (and bias) in fp32 whatever the dtype: sharded under bf16 its router
    logits are from_pretrained(dtype=bfloat16)'s, and the bf16 export keeps the gate fp32 as save_pretrained does."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tests.helpers.dist import run_distributed

    initial = initial_weights("deepseek_v3", str(tmp_path / "initial"))
    record = run_distributed(_bf16_routers, 2, initial, str(tmp_path / "export"))
    assert record["fp32_units"] == ["model.layers.1.mlp.gate"]
    theirs = AutoModelForCausalLM.from_pretrained(initial, dtype=torch.bfloat16)
    assert theirs.model.layers[1].mlp.gate.weight.dtype is torch.float32
    expected = _router_logits(theirs, BATCH)
    assert len(record["logits"]) == len(expected) == 1
    torch.testing.assert_close(record["logits"][0], expected[0], rtol=0, atol=0)
    theirs.save_pretrained(tmp_path / "theirs")
    saved, ours = (
        load_file(str(tmp_path / "theirs" / "model.safetensors")),
        load_file(str(tmp_path / "export" / "model.safetensors")),
    )
    assert {k: v.dtype for k, v in ours.items()} == {k: v.dtype for k, v in saved.items()}
