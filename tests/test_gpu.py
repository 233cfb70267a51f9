"""The CUDA path, on one GPU; skipped where there is none (bench/gpu_check.sh runs it on a lent GPU). fp32 on the
GPU against the CPU reference (from_pretrained + torch AdamW); bf16 with MFU and the planner's peak against
torch.cuda.max_memory_allocated; cpu_offload (gradients reduced over gloo, buffers kept on the GPU); compile."""

import os

import pytest
import torch
from transformers import AutoConfig

from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.hardware import peak_for
from fsdp_research.metrics.sinks import step_metrics
from fsdp_research.planner.memory import memory
from fsdp_research.planner.run import run_settings
from fsdp_research.planner.summary import summary_for
from fsdp_research.train.trainer import train
from tests.conftest import FAST
from tests.helpers.reference import reference_run, save_initial

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
BASE = FAST + [
    "trainer.max_steps=10",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "trainer.device=cuda",
]


@pytest.fixture(scope="module")
def initial(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    path = save_initial(AutoConfig.for_model("llama", **compose(BASE).model.config), str(out / "initial"))
    return BASE + ["model=pretrained", f"model.name_or_path={path}"], path


def test_one_gpu_matches_the_cpu_reference(initial, tmp_path):
    overrides, path = initial
    result = train(compose(overrides), str(tmp_path / "run"))
    ref_losses, _ = reference_run(compose(overrides), path)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)


def test_bf16_mfu_and_the_planned_peak(tmp_path):
    overrides = FAST + ["precision=bf16", "model=llama_1b", "data=synthetic", "data.seq_len=512",
                        "trainer.max_steps=6", "trainer.global_batch_size=8", "trainer.micro_batch_size=8",
                        "trainer.device=cuda", "trainer.log_interval=3"]  # fmt: skip
    cfg = compose(overrides)
    train(cfg, str(tmp_path / "run"))
    last = step_metrics(str(tmp_path / "run"))[-1]
    # MFU from the measured step time, the FLOPs formula (held to torch's FlopCounterMode in test_flops.py) and the
    # datasheet peak of this GPU: the logged figure is that, and a plausible share of the peak.
    summary = summary_for(cfg)
    assert last["tokens_per_s"] == pytest.approx(8 * 512 / last["step_time_s"], rel=1e-3)
    peak = peak_for(torch.cuda.get_device_name(), torch.bfloat16)
    expected = last["tokens_per_s"] * summary.flops_per_token / (peak * 1e12)
    assert last["mfu"] == pytest.approx(expected, rel=1e-3) and 0.05 < last["mfu"] < 0.9
    planned = memory(summary, run_settings(cfg, 1, "cuda")).peak / 2**30
    assert planned == pytest.approx(last["peak_mem_allocated_gib"], rel=0.15)


def test_cpu_offload_trains(initial, tmp_path):
    overrides, _ = initial
    result = train(compose(overrides + ["sharding.cpu_offload=true", "trainer.max_steps=3"]), str(tmp_path / "run"))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert all(b.device.type == "cuda" for b in result.model.buffers())
    assert all(p.device.type == "cpu" for p in result.model.parameters())


def test_compiled_matches_eager(initial, tmp_path):
    overrides, _ = initial
    eager = train(compose(overrides), str(tmp_path / "eager")).losses
    compiled = train(compose(overrides + ["trainer.compile=true"]), str(tmp_path / "compiled")).losses
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=0)
    assert os.path.exists(tmp_path / "compiled" / "metrics.jsonl")


def _dropout_on_a_dtensor() -> bool:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.distributed.tensor_parallel import keep_rank_streams
    from fsdp_research.train.randomness import seed_step, step_seed

    init_distributed(compose(FAST).distributed, torch.device("cuda"))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("tp",))
    keep_rank_streams(mesh)
    x = distribute_tensor(torch.ones(64, 64, device="cuda"), mesh, [Replicate()])
    seed_step(7, 3, 1)
    ours = torch.nn.functional.dropout(x, 0.5).to_local()
    torch.manual_seed(step_seed(7, 3, 0))
    return torch.equal(ours, torch.nn.functional.dropout(torch.ones(64, 64, device="cuda"), 0.5))


def test_dtensor_dropout_draws_from_the_rank_s_own_stream():
    """DTensor's RNG tracker made by keep_rank_streams (no copy of rank 0's generator): a dropout on a DTensor draws
    from the stream the step's seed gave this rank."""
    from tests.helpers.dist import run_distributed

    assert run_distributed(_dropout_on_a_dtensor, 1)
