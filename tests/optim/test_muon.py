"""Muon exact under sharding: 2 and 4 ranks (blockwise, hsdp on a (2, 2) mesh, matrices split unevenly over 4
ranks) reproduce a single process running torch.optim.Muon on the blocks' matrices and torch.optim.AdamW on the
rest (tests/helpers/reference.py: from_pretrained, torch's optimizers, the schedule written out, numpy-read
batches), losses and weights to 1e-5 in fp32. Newton-Schulz runs in float32 there (optim.ns_dtype=float32;
torch.optim.Muon's is patched to the same iteration in float32); in its default bfloat16 our iteration is
torch's, bitwise."""

import pytest
import torch

from fsdp_research.jobs.compose import compose
from fsdp_research.optim.muon import Muon, newton_schulz
from tests.conftest import FAST
from tests.helpers.dist import ok
from tests.helpers.reference import decay_groups, reference_run, trained_from_initial

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# 342 rows: 86, 86, 86, 84 on 4 ranks.
BASE = FAST + [
    "optim=muon",
    "optim.ns_dtype=float32",
    "model.config.intermediate_size=342",
    "trainer.max_steps=6",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
]
RUNS_2 = {"blockwise": [], "tp2": ["parallel.tp=2"]}
RUNS_4 = {
    "blockwise_4": ["trainer.micro_batch_size=1"],
    "hsdp_2x2": ["sharding=hsdp", "trainer.micro_batch_size=1"],
    # Tensor parallel's matrices, split over tp and FSDP's rows: gathered whole.
    "tp2xdp2": ["parallel.tp=2", "trainer.micro_batch_size=1"],
}


def _ns_float32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration with its first line (grad.bfloat16()) in float32."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def _torch_muon(model, cfg):
    """torch.optim.Muon on the blocks' 2-D matrices (written out from transformers' model), AdamW on the rest."""
    o, others = cfg.optim, cfg.optim.others
    matrices = [p for layer in model.model.layers for p in layer.parameters() if p.ndim == 2]
    ids = {id(p) for p in matrices}
    muon = torch.optim.Muon(
        matrices, lr=o.lr, weight_decay=o.weight_decay, momentum=o.momentum, nesterov=o.nesterov, ns_steps=o.ns_steps
    )
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in decay_groups(model, others_cfg(o))]
    adamw = torch.optim.AdamW([g for g in rest if g["params"]], lr=others.lr, betas=tuple(others.betas), eps=others.eps)
    return [(muon, o.lr), (adamw, others.lr)]


def others_cfg(o):
    return type("O", (), {"no_decay": o.no_decay, "weight_decay": o.others.weight_decay})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon")
    base, initial, runs = trained_from_initial(out, BASE, {2: RUNS_2, 4: RUNS_4})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _ns_float32)
        reference = reference_run(compose(base), initial, _torch_muon)
    return reference, runs


@pytest.mark.parametrize("name", [*RUNS_2, *RUNS_4])
def test_sharded_muon_matches_single_process_torch_muon(results, name):
    (ref_losses, ref_weights), runs = results
    run = ok(runs, name)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for key, ref in ref_weights.items():
        torch.testing.assert_close(run["weights"][key], ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{key}: {m}")
    assert ref_losses[-1] < ref_losses[0]


def test_bfloat16_iteration_is_torchs_bitwise():
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 96), (96, 64), (32, 32)]:
        matrix = torch.randn(shape, generator=g)
        ours = newton_schulz(matrix.clone())
        theirs = torch.optim._muon._zeropower_via_newtonschulz(matrix.clone(), (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(ours, theirs)


def test_unsharded_steps_are_torch_muons_bitwise():
    """One process, plain tensors: our Muon's steps equal torch.optim.Muon's (bfloat16, nesterov, weight decay)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(48, 80, bias=False), torch.nn.Linear(48, 80, bias=False)
    b.load_state_dict(a.state_dict())
    ours = Muon(a.parameters(), lr=0.02, weight_decay=0.1)
    theirs = torch.optim.Muon(b.parameters(), lr=0.02, weight_decay=0.1)
    for step in range(3):
        x = torch.randn(16, 48, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, ours), (b, theirs)):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert torch.equal(a.weight, b.weight)
