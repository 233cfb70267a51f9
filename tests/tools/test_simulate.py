"""At scale without the scale: initialisation that costs a shard, and `fsdp-research simulate`.

One real 8-rank gloo run and one 1-rank run of a llama whose embedding and head span two initialisation chunks
(split inside rank 6's rows) give: the full initial weights equal bitwise at 1 and 8 ranks, alike transformers'
from_config; no tensor of an embedding's size made on any rank while the model is built and initialised; and each
rank's shard sizes, shard values (checksum), optimizer state and DCP file, against which `fsdp-research simulate
world_size=8 rank=R` (one process, torch's fake backend) is checked rank by rank."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.cli import subprocess_env
from tests.helpers.dist import full_state, run_distributed
from tests.helpers.parallel import simulated_phases
from tests.helpers.zoo import assert_initialised_alike

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

VOCAB, HIDDEN = 5000, 64  # 320,000 elements: two chunks of recipes.CHUNK (262,144) rows
MODEL = [
    "model=llama_tiny",
    f"model.config.vocab_size={VOCAB}",
    f"model.config.hidden_size={HIDDEN}",
    "model.config.intermediate_size=160",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.config.tie_word_embeddings=false",
]
OVERRIDES = [*FAST, *MODEL, "trainer.global_batch_size=8", "trainer.micro_batch_size=1"]
SIMULATED = (0, 6)


class _Largest(TorchDispatchMode):
    """The most elements of any real tensor an op made (a DTensor's own are its local shard's)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and not isinstance(t, DTensor):
                self.largest = max(self.largest, t.numel())
        return out


def _real(out_dir: str) -> dict:
    """Every rank: build and initialise as the trainer does, its figures; then the optimizer's first step's state
    and a DCP save of model and optimizer (the files DCP writes per rank)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model
    from fsdp_research.optim.factory import build_optimizer

    cfg = compose(OVERRIDES)
    init_distributed(typed(cfg).distributed, torch.device("cpu"))
    with _Largest() as made:
        model, plan = build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), dist.get_world_size())
    shards = [p.to_local() for p in model.parameters()]
    figures = {
        "largest": made.largest,
        "checksum": sum(float(s.double().sum()) for s in shards),
        "params": sum(s.numel() * s.element_size() for s in shards),
    }
    optimizer, _ = build_optimizer(model, cfg, plan.blocks)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values()]
    figures["optimizer"] = sum(
        (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size() for v in state
    )
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=out_dir)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, figures)
    return {"ranks": every, "weights": full_state(model)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("simulate")
    eight = run_distributed(_real, 8, str(out / "dcp8"))
    one = run_distributed(_real, 1, str(out / "dcp1"))
    simulated = {}
    for rank in SIMULATED:
        report = out / f"rank{rank}.json"
        done = subprocess.run(
            [sys.executable, "-m", "fsdp_research", "simulate", *OVERRIDES, "world_size=8", f"rank={rank}"]
            + ["--json", str(report)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        simulated[rank] = (json.loads(report.read_text()), done.stdout)
    return out, eight, one, simulated


def test_initialisation_is_the_same_at_any_world_size_and_alike_transformers(runs):
    from transformers import AutoModelForCausalLM

    from fsdp_research.model.architecture import build_hf_config

    _, eight, one, _ = runs
    assert eight["weights"].keys() == one["weights"].keys()
    assert all(torch.equal(eight["weights"][k], one["weights"][k]) for k in one["weights"]), "1 and 8 ranks differ"
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(build_hf_config(compose(OVERRIDES).model))
    assert_initialised_alike(eight["weights"], hf)


def test_no_rank_makes_a_full_size_table(runs):
    _, eight, one, _ = runs
    assert one["ranks"][0]["largest"] >= VOCAB * HIDDEN  # the one rank holds the whole table: the measure sees it
    assert max(r["largest"] for r in eight["ranks"]) < VOCAB * HIDDEN


def test_a_simulated_rank_is_the_real_rank(runs):
    out, eight, _, simulated = runs
    for rank, (report, stdout) in simulated.items():
        real = eight["ranks"][rank]
        phases = {p["name"]: p for p in report["phases"]}
        assert report["checksum"] == pytest.approx(real["checksum"], rel=1e-12, abs=1e-9)
        assert phases["init"]["tensors"]["params"] == real["params"] == phases["init"]["predicted"]["params"]
        assert phases["optimizer"]["tensors"]["optimizer"] == real["optimizer"]
        # The planner leaves out AdamW's step counters (a scalar per parameter).
        assert 0 <= real["optimizer"] - phases["optimizer"]["predicted"]["optimizer"] <= 8 * len(eight["weights"])
        # The save plan's bytes are what DCP wrote for this rank, less its framing of each item (torch.save's),
        # the items counted in the checkpoint's own metadata.
        path = glob.glob(str(out / "dcp8" / f"__{rank}_*.distcp"))[0]
        stored = FileSystemReader(str(out / "dcp8")).read_metadata().storage_data.values()
        items = sum(1 for s in stored if s.relative_path == os.path.basename(path))
        assert 0 <= os.path.getsize(path) - phases["save plan"]["tensors"]["saved"] < 2048 * items
        assert phases["optimizer"]["tensors"]["grads"] == real["params"] == phases["optimizer"]["predicted"]["grads"]
        assert 0 < phases["export"]["tensors"]["written"] or "no group" in phases["export"]["note"]
        assert "TFLOP, embedding and head included" in phases["forward/backward (first block)"]["note"]
        assert f"rank {rank} of 8" in stdout and "shard checksum" in stdout


@pytest.mark.parametrize(
    "args, error",
    [
        (["world_size=4", "rank=4"], "error: rank: 4 is not a rank of world_size=4"),
        (["rank=1"], "error: world_size: is not given"),
        (["world_size=2", "model.load_weights=true"], "error: model.load_weights: simulate initialises"),
    ],
    ids=["rank", "world_size", "load_weights"],
)
def test_bad_input_is_one_line_before_anything_runs(args, error):
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_research", "simulate", *MODEL, "trainer.micro_batch_size=2", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(error)


def test_a_rank_the_host_cannot_hold_is_refused_before_it_is_built(capsys):
    """Llama-3-70B's shards, gradients and AdamW state over 2 ranks (525 GiB a rank) on this host: one line naming
    world_size, where the kernel's OOM killer would have ended the process without one."""
    from fsdp_research.cli.simulate import main

    assert main(["model=llama_70b", "world_size=2", "trainer.global_batch_size=2", "trainer.micro_batch_size=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: world_size: this rank's parameter shards, gradients")


@pytest.mark.slow
def test_a_pipeline_rank_is_simulated_with_its_stages_and_schedule(tmp_path):
    """pp 2 by 1F1B on 4 ranks, rank 3 (the last stage's): its own layers' shards, gradients, optimizer state and
    save plan as the planner's for that stage, and the schedule's line (1F1B's last rank holds one micro-batch;
    bubble (pp - 1) / (m + pp - 1) of 4 micro-batches: 20%)."""
    phases = simulated_phases([*OVERRIDES, "world_size=4", "rank=3", "parallel.pp=2"], tmp_path / "rank3.json")
    for name in ("init", "optimizer", "save plan"):  # AdamW's step counters aside (bytes)
        assert phases[name]["tensors"] == pytest.approx(phases[name]["predicted"], abs=1024), name
    assert phases["pipeline schedule"]["note"] == (
        "1F1B, 4 micro-batches over 2 pipeline ranks: this one holds 1 micro-batches' activations at most; "
        "bubble 20.0% of the step"
    )
