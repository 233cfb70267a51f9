"""A researcher's own project (examples/my_project: a GPT written from scratch, Lion, a schedule function, a loss
and a callback, with configs of its own) run exactly as its user would: copied into a directory of its own, run
from there with `python <framework>/train.py hydra.searchpath=[file://<its conf>] ...`, the framework untouched.
Its model is any nn.Module: initialised as its own constructor does at any world size, 1 = 2 ranks, activation
checkpointing, resume bitwise, the export read back by safetensors into the model class, the planner, MFU's
FLOPs against torch's FlopCounterMode."""

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.conftest import FAST, ROOT
from tests.helpers.checkpointing import assert_bitwise_equal, checkpoint_tensors, with_overrides
from tests.helpers.cli import read_metrics, subprocess_env

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

EXAMPLE = os.path.join(ROOT, "examples", "my_project")
OWN = ["model=tiny_gpt", "optim=lion", "schedule=step_decay"]
BASE = with_overrides(FAST, "trainer.global_batch_size=8", "trainer.micro_batch_size=4", "checkpoint.interval=4")
# Its objective (no loss group: objective=lm's), at 2 ranks and at 1 (two micro-batches a step there).
OBJECTIVE = ["objective=tail_tokens", "trainer.max_steps=4", "checkpoint.save=false"]
RUNS = {
    "one_rank": ["trainer.max_steps=8"],
    "two_ranks": [
        "trainer.max_steps=8",
        "distributed.nproc_per_node=2",
        "checkpoint.export=true",
        "checkpoint.export_dtype=float32",
    ],  # fmt: skip
    "two_ranks_ac": ["trainer.max_steps=8", "distributed.nproc_per_node=2", "activation_checkpointing=every_block"],
    # Stops once the mean loss is below 6 (it starts at ln 512 = 6.2).
    "stop": [
        "trainer.max_steps=30",
        "distributed.nproc_per_node=2",
        "callbacks=stop_at_loss",
        "callbacks.stop_at_loss.target=6.0",
    ],  # fmt: skip
    "tail_one": OBJECTIVE,
    "tail_two": [*OBJECTIVE, "distributed.nproc_per_node=2"],
}


def _user_dir(tmp) -> str:
    project = os.path.join(tmp, "my_project")
    shutil.copytree(EXAMPLE, project)
    return project


def _run(project: str, args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**subprocess_env(), "PYTHONPATH": project}
    return subprocess.run(
        [sys.executable, *args], cwd=project, env=env, text=True, capture_output=True, timeout=timeout
    )


def _train(project: str, name: str, extra: list[str]) -> subprocess.CompletedProcess:
    search = f"hydra.searchpath=[file://{project}/conf]"
    own = OWN if "objective=tail_tokens" in extra else [*OWN, "loss=capped"]
    args = [os.path.join(ROOT, "train.py"), search, *own, *BASE, *extra, f"hydra.run.dir={project}/runs/{name}"]
    return _run(project, args)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = _user_dir(str(tmp_path_factory.mktemp("user")))
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(_train, project, name, extra) for name, extra in RUNS.items()}
        done = {name: f.result() for name, f in futures.items()}
    # The 2-rank run resumed from its step 4.
    resumed = os.path.join(project, "runs", "resumed")
    shutil.copytree(os.path.join(project, "runs", "two_ranks"), resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step_8"))
    shutil.rmtree(os.path.join(resumed, "export"))
    done["resumed"] = _train(project, "resumed", RUNS["two_ranks"])
    return project, done


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def _losses(project, name):
    return torch.tensor([r["loss"] for r in read_metrics(os.path.join(project, "runs", name))])


def test_own_model_at_one_and_two_ranks_and_with_checkpointing(project):
    project, done = project
    for name in ("one_rank", "two_ranks", "two_ranks_ac"):
        _ok(done[name])
    one = _losses(project, "one_rank")
    assert len(one) == 8 and one[-1] < one[0]
    torch.testing.assert_close(_losses(project, "two_ranks"), one, rtol=1e-5, atol=0)
    torch.testing.assert_close(_losses(project, "two_ranks_ac"), one, rtol=1e-5, atol=0)


def test_own_objective_at_one_and_two_ranks(project):
    """Its loss sums weighted by the step's targets (summed over ranks and micro-batches): the same losses at 1 rank
    (two micro-batches a step) and at 2 (one each)."""
    project, done = project
    for name in ("tail_one", "tail_two"):
        _ok(done[name])
    one = _losses(project, "tail_one")
    assert len(one) == 4
    torch.testing.assert_close(_losses(project, "tail_two"), one, rtol=1e-5, atol=0)


def test_own_model_resumes_bitwise(project):
    project, done = project
    _ok(done["resumed"])
    a = checkpoint_tensors(os.path.join(project, "runs", "two_ranks", "checkpoints", "step_8"))
    b = checkpoint_tensors(os.path.join(project, "runs", "resumed", "checkpoints", "step_8"))
    assert any(k.startswith("optim.state.h.0.attn.qkv.weight.exp_avg") for k in a)  # Lion's state
    assert_bitwise_equal(a, b)
    assert torch.equal(_losses(project, "resumed"), _losses(project, "two_ranks"))


def test_export_loads_into_the_model_class(project):
    project, _ = project
    sys.path.insert(0, project)
    try:
        from my_project.model import TinyGPT
        from safetensors.torch import load_file
    finally:
        sys.path.remove(project)
    model = TinyGPT()
    model.load_state_dict(load_file(os.path.join(project, "runs", "two_ranks", "export", "model.safetensors")))
    trained = checkpoint_tensors(os.path.join(project, "runs", "two_ranks", "checkpoints", "step_8"))
    for name, param in model.named_parameters():
        assert torch.equal(param, trained[f"model.{name}"]), name
    assert model.wte.weight is model.lm_head.weight


def test_a_callback_of_ones_own_stops_the_run(project):
    project, done = project
    _ok(done["stop"])
    run = os.path.join(project, "runs", "stop")
    step = int(open(os.path.join(run, "stopped_at.txt")).read())
    losses = read_metrics(run)
    assert 1 < step < 30 and losses[-1]["step"] == step and losses[-1]["loss"] < 6.0 <= losses[-2]["loss"]
    assert os.path.isdir(os.path.join(run, "checkpoints", f"step_{step}"))
    assert json.load(open(os.path.join(run, "status.json")))["status"] == "completed"


def _initial_weights(project: str, world_size: int) -> dict:
    from omegaconf import OmegaConf

    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.jobs.compose import compose
    from fsdp_research.model.assembly import build_sharded_model
    from tests.helpers.dist import full_state

    cfg = compose([f"hydra.searchpath=[file://{project}/conf]", "model=tiny_gpt"])
    del OmegaConf
    init_distributed(cfg.distributed, torch.device("cpu"))
    model, _ = build_sharded_model(cfg, None, torch.device("cpu"), world_size)
    return full_state(model)


def test_initialised_as_its_own_constructor_does_at_any_world_size(project, monkeypatch):
    project, _ = project
    monkeypatch.syspath_prepend(project)
    from my_project.model import TinyGPT

    from tests.helpers.dist import run_distributed

    torch.manual_seed(0)  # trainer.seed
    expected = TinyGPT().state_dict()
    for world_size in (1, 2):
        got = run_distributed(_initial_weights, world_size, project, world_size)
        assert got.keys() <= expected.keys() and {"lm_head.weight", "h.3.mlp.2.weight"} <= got.keys()
        for name, value in got.items():
            assert torch.equal(value, expected[name]), (world_size, name)


def test_planner_and_flops_of_an_own_model(project):
    project, _ = project
    result = _run(project, ["-m", "fsdp_research", "plan", f"hydra.searchpath=[file://{project}/conf]",
                            "model=tiny_gpt", "world_size=2"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("tiny_gpt: 0.89M parameters, 4 blocks; blockwise on 2 rank(s)")


def test_mfu_flops_of_an_own_model_match_torchs_counter(project, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fsdp_research.jobs.compose import compose
    from fsdp_research.metrics.meters import flops_per_token, matmul_parameters
    from fsdp_research.model.assembly import planned_model
    from fsdp_research.model.dimensions import dims

    project, _ = project
    monkeypatch.syspath_prepend(project)
    from my_project.model import TinyGPT

    cfg = compose([f"hydra.searchpath=[file://{project}/conf]", "model=tiny_gpt", "data.seq_len=64"])
    meta, plan = planned_model(cfg, None)
    d = dims(meta, plan.blocks)
    assert (d.hidden, d.vocab, d.layers, d.heads, d.head_dim) == (128, 512, 4, 4, 32)
    predicted = flops_per_token(d, matmul_parameters(meta, d), 64)
    model, tokens = TinyGPT(), torch.randint(0, 512, (2, 64))
    # SDPA's math kernel: its matmuls are counted (CPU's fused kernel is not), over the whole T x T, as MFU counts.
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).logits.sum().backward()
    counted = counter.get_total_flops() / tokens.numel()
    assert predicted == pytest.approx(counted, rel=0.02)


def test_an_own_model_without_its_block_class_is_refused(project, monkeypatch):
    from fsdp_research.errors import ConfigError
    from fsdp_research.jobs.compose import compose
    from fsdp_research.model.assembly import planned_model

    project, _ = project
    monkeypatch.syspath_prepend(project)
    cfg = compose([f"hydra.searchpath=[file://{project}/conf]", "model=tiny_gpt", "model.block_class=Layer"])
    with pytest.raises(ConfigError, match=r"^model.block_class: TinyGPT has no module of class Layer; fix: use one"):
        planned_model(cfg, None)
    cfg = compose([f"hydra.searchpath=[file://{project}/conf]", "model=tiny_gpt", "model.n_layers=2"])
    with pytest.raises(ConfigError, match=r"^model.n_layers: TinyGPT takes no argument 'n_layers'"):
        planned_model(cfg, None)


def test_the_docs_show_the_objective_as_the_example_has_it():
    with open(os.path.join(ROOT, "docs", "extending.md")) as f:
        shown = f.read().split("## Objectives", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    with open(os.path.join(EXAMPLE, "my_project", "objectives.py")) as f:
        assert shown == f.read()
