"""Muon on the matrices it is meant for: expert tensors one matrix per expert, routers to AdamW, fused
projections (q/k/v by the config's head counts, gate/up by halves, DeepSeek's latent kv) each orthogonalized alone,
GPT-2's Conv1D weights (in, out) transposed, each logical matrix's lr adjusted by its own shape. The reference is
written here from those rules (row indices from the config, torch's Newton-Schulz patched to float32 as in
tests/optim/test_muon.py), not from fsdp_research.optim.muon_params: one process stepping synthetic gradients, and
2 ranks training each family through the trainer (one launch), to 1e-5 in fp32."""

import copy
import itertools
import math
import os
import re
import traceback
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.optim import build_optimizer, check_optim
from fsdp_research.planner.summary import summary_for
from fsdp_research.train.trainer import train
from tests.conftest import FAST
from tests.helpers.dist import full_state, ok, run_distributed
from tests.helpers.reference import decay_groups, factor_at, reference_run
from tests.helpers.zoo import from_config, hf_config, initial_weights, pretrained
from tests.optim.test_muon import _ns_float32

pytestmark = pytest.mark.distributed

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt2", "phi3")
MUON = ["optim=muon", "optim.ns_dtype=float32"]


def _runs(*sizes: int) -> list[list[int]]:
    edges = [0, *itertools.accumulate(sizes)]
    return [list(range(a, b)) for a, b in zip(edges, edges[1:])]


def _logical(name: str, p: torch.Tensor, c) -> tuple[bool, list[list[int]]]:
    """(stored as (in, out): GPT-2's Conv1D, the out rows of each logical matrix), written out per family."""
    transposed = c.model_type == "gpt2"
    out = p.shape[-1] if transposed else p.shape[-2]
    module = name.split(".")[-2] if name.endswith(".weight") else name.split(".")[-1]
    head = c.hidden_size // c.num_attention_heads
    if module in ("qkv_proj", "c_attn"):  # q, k, v consecutive; k and v of the key-value heads
        kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return transposed, _runs(c.num_attention_heads * head, kv * head, kv * head)
    if module == "gate_up_proj":
        return transposed, _runs(out // 2, out // 2)
    if module == "kv_a_proj_with_mqa":  # the kv latent, then the shared rope key
        return transposed, _runs(c.kv_lora_rank, c.qk_rope_head_dim)
    if module == "kv_b_proj":  # per head: k's nope part, then v
        width = c.qk_nope_head_dim + c.v_head_dim
        k = [h * width + j for h in range(c.num_attention_heads) for j in range(c.qk_nope_head_dim)]
        return transposed, [k, [r for r in range(out) if r not in set(k)]]
    return transposed, [list(range(out))]


def _muon_names(model) -> list[str]:
    """The blocks' weights of 2 or more dims but the routers (one row per expert)."""
    return [
        n
        for n, p in model.named_parameters()
        if re.search(r"\.(layers|h)\.\d+\.", n) and p.ndim >= 2 and not n.endswith("mlp.gate.weight")
    ]


class _FormulaMuon(torch.optim.Optimizer):
    """Muon from its formulas on each logical matrix alone (each expert's own): momentum, Nesterov, torch's
    Newton-Schulz, decoupled weight decay, lr x sqrt(max(1, rows / cols)) of that matrix."""

    def __init__(self, params: dict, lr: float, weight_decay: float, momentum: float, ns_steps: int):
        super().__init__(list(params), dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps))
        self.logical = {id(p): spec for p, spec in params.items()}

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - g["momentum"])
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(self._update(p.grad.lerp(buf, g["momentum"]), p, g), alpha=-g["lr"])

    def _update(self, grad: torch.Tensor, p: torch.Tensor, g: dict) -> torch.Tensor:
        transposed, rows_of = self.logical[id(p)]
        m = grad.mT if transposed else grad
        out = torch.empty_like(m)
        for e in range(m.shape[0]) if m.ndim == 3 else [...]:
            for rows in rows_of:
                piece = m[e][rows]
                ns = torch.optim._muon._zeropower_via_newtonschulz(
                    piece, (3.4445, -4.7750, 2.0315), g["ns_steps"], 1e-7
                )
                out[e][rows] = ns * math.sqrt(max(1, piece.shape[0] / piece.shape[1]))
        return out.mT if transposed else out


def _formula_optimizers(model, cfg):
    """_FormulaMuon on the blocks' matrices but the routers, torch's AdamW on the rest (reference_run's form)."""
    o, others = cfg.optim, cfg.optim.others
    params = dict(model.named_parameters())
    matrices = {params[n]: _logical(n, params[n], model.config) for n in _muon_names(model)}
    muon = _FormulaMuon(matrices, o.lr, o.weight_decay, o.momentum, o.ns_steps)
    rest = [{**g, "params": [p for p in g["params"] if p not in matrices]} for g in decay_groups(model, _others(o))]
    adamw = torch.optim.AdamW([g for g in rest if g["params"]], lr=others.lr, betas=tuple(others.betas), eps=others.eps)
    return [(muon, o.lr), (adamw, others.lr)]


def _others(o):
    return type("O", (), {"no_decay": o.no_decay, "weight_decay": o.others.weight_decay})


@pytest.fixture
def float32_ns(monkeypatch):
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _ns_float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_logical_matrix_is_orthogonalized_alone(family, float32_ns):
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(hf_config(family))
    theirs = copy.deepcopy(ours)
    cfg = compose(MUON)
    blocks = [n for n, _ in ours.named_modules() if re.fullmatch(r".*\.(layers|h)\.\d+", n)]
    optimizer, _ = build_optimizer(ours, cfg, blocks)
    names = {id(p): n for n, p in ours.named_parameters()}
    assert sorted(names[id(p)] for g in optimizer.parts[0].param_groups for p in g["params"]) == sorted(
        _muon_names(ours)
    )
    [(reference, _), _] = _formula_optimizers(theirs, cfg)
    for group in reference.param_groups:
        group["lr"] = cfg.optim.lr * factor_at(cfg, 0)  # the schedule's first step, where ours stays
    for step in range(3):
        for model in (ours, theirs):
            for i, p in enumerate(model.parameters()):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        optimizer.step()
        reference.step()
    for n in _muon_names(ours):
        torch.testing.assert_close(ours.get_parameter(n), theirs.get_parameter(n), rtol=1e-5, atol=1e-6, msg=n)


def test_the_split_in_the_plan_and_muon_without_others():
    cfg = compose(["optim=muon", *from_config("qwen3_moe")])
    line = summary_for(cfg).optimizer_split
    # 2 blocks: q, k, v, o, and the experts' gate_up (gate, up) and down, 4 experts each.
    assert line.startswith("Muon: 12 tensors (73,728 params, 0.281 MiB) as 32 matrices")
    assert line.endswith("; others (AdamW): embeddings, norms, routers, lm_head")
    bad = compose(["optim=muon", "optim.others=null"])
    with pytest.raises(ConfigError, match="optim.others: is not set: Muon takes matrices only"):
        check_optim(bad.optim, bad.schedule)


def _train_recording(containers: dict, out_dir: str) -> dict:
    """Each config trained in turn on these ranks: its losses, final weights, and the dtypes of what the
    all-to-alls sent."""
    sent, exchange = [], dist.all_to_all_single

    def recording(output, input, *args, **kwargs):
        sent.append(str(input.dtype))
        return exchange(output, input, *args, **kwargs)

    records = {}
    with mock.patch.object(dist, "all_to_all_single", recording):
        for name, container in containers.items():
            sent.clear()
            try:
                result = train(container, os.path.join(out_dir, name))
                weights = full_state(result.model)
                records[name] = {"losses": result.losses, "weights": weights, "sent": sorted(set(sent))}
            except Exception:  # the other configs still run; the test of this one names it
                records[name] = {"error": traceback.format_exc()}
    return records


STEPS = ["trainer.max_steps=4", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
# 3 experts on 2 ranks: 2 and 1 whole experts per shard.
CHANGES = {"qwen3_moe": dict(num_experts=3)}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The four families on 2 ranks (one launch), and qwen3_moe with bfloat16 Newton-Schulz (the exchange's dtype);
    each family's overrides and initial weights."""
    out = tmp_path_factory.mktemp("muon_params")
    initial = {f: initial_weights(f, str(out / f), **CHANGES.get(f, {})) for f in FAMILIES}
    bases = {f: FAST + MUON + STEPS + pretrained(path) for f, path in initial.items()}
    configs = {f: compose(base) for f, base in bases.items()}
    configs["bf16"] = compose(bases["qwen3_moe"] + ["optim.ns_dtype=bfloat16", "trainer.max_steps=1"])
    # Expert parallel: each rank's experts whole on it, orthogonalized there.
    configs["deepseek_v3/ep2"] = compose(bases["deepseek_v3"] + ["parallel.ep=2"])
    containers = {n: OmegaConf.to_container(c, resolve=True) for n, c in configs.items()}
    return out, bases, initial, run_distributed(_train_recording, 2, containers, str(out / "runs"))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "family"), [(f, f) for f in FAMILIES] + [("deepseek_v3/ep2", "deepseek_v3")])
def test_sharded_muon_matches_the_formulas(sharded, name, family, float32_ns):
    out, bases, initial, runs = sharded
    run = ok(runs, name)
    losses, weights = reference_run(compose(bases[family]), initial[family], _formula_optimizers)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
    for key, ours in run["weights"].items():
        torch.testing.assert_close(ours, weights[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    # (expert parallel's dispatch sends its counts and expert ids as int64)
    assert [dtype for dtype in run["sent"] if dtype != "torch.int64"] == ["torch.float32"]
    with open(out / "runs" / name / "train.log") as f:
        assert re.search(r"Muon: \d+ tensors .* as \d+ matrices .*; others \(AdamW\): embeddings, ", f.read())


@pytest.mark.slow  # the module's 2-rank trainings of every family, for this alone in the quick subset
def test_the_exchange_is_in_bfloat16_under_bfloat16_newton_schulz(sharded):
    assert ok(sharded[3], "bf16")["sent"] == ["torch.bfloat16"]
