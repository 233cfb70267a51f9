"""The optimizer step's cost: Muon (optim=muon: whole-matrix Newton-Schulz, each rank a share of the block matrices,
two all-to-alls) against AdamW on the same sharded model, measured side by side in one run, alternated, on real
ranks (gloo on CPU, NCCL on GPU). Prints each optimizer's median step time and the ratio to AdamW's, and one
training step (forward + backward + optimizer) for scale.

    .venv/bin/python bench/optimizers.py [--nproc 2] [--steps 10] [--repeats 3] [overrides ...]
"""

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.distributed.processes import device_for, init_distributed, spawn  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402
from fsdp_research.model.architecture import build_hf_config  # noqa: E402
from fsdp_research.model.assembly import build_sharded_model  # noqa: E402
from fsdp_research.optim import build_optimizer  # noqa: E402
from fsdp_research.train.losses import train_loss  # noqa: E402

MID = [
    "model=llama_mid",
    "precision=fp32",
    "logger=none",
    "trainer.micro_batch_size=4",
    "trainer.global_batch_size=8",
]
OPTIMIZERS = {"adamw": [], "muon": ["optim=muon"], "muon_fp32_ns": ["optim=muon", "optim.ns_dtype=float32"]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _measure(configs: dict, steps: int, repeats: int, out: dict) -> None:
    device = device_for("auto", int(os.environ.get("LOCAL_RANK", 0)))
    times = {name: [] for name in configs}
    built = {}
    for name, container in configs.items():
        cfg = typed(container)
        init_distributed(cfg.distributed, device)
        model, plan = build_sharded_model(cfg, build_hf_config(cfg.model), device, dist.get_world_size())
        optimizer, _ = build_optimizer(model, cfg, plan.blocks)
        batch = torch.randint(0, 512, (cfg.trainer.micro_batch_size, cfg.data.seq_len + 1), device=device)
        train_loss(model, batch, contextlib.nullcontext())[0].backward()
        optimizer.step()  # creates the state
        built[name] = (model, optimizer)
    backward = []
    for _ in range(repeats):
        for name, (_, optimizer) in built.items():
            _sync(device)
            started = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            _sync(device)
            times[name].append((time.perf_counter() - started) / steps)
        model, _ = built["adamw"]
        _sync(device)
        started = time.perf_counter()
        train_loss(model, batch, contextlib.nullcontext())[0].backward()
        _sync(device)
        backward.append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        out.update({name: statistics.median(t) for name, t in times.items()})
        out["forward_backward"] = statistics.median(backward)


def _worker(configs: dict, steps: int, repeats: int, path: str) -> None:
    result: dict = {}
    _measure(configs, steps, repeats, result)
    if dist.get_rank() == 0:
        torch.save(result, path)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    configs = {
        name: OmegaConf.to_container(compose([*MID, *extra, *args.overrides]), resolve=True)
        for name, extra in OPTIMIZERS.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.pt")
        spawn(_worker, args.nproc, configs, args.steps, args.repeats, path)
        result = torch.load(path)
    base, backward = result.pop("adamw"), result.pop("forward_backward")
    print(f"optimizer step on {args.nproc} rank(s), mid-size llama (24M parameters), median of {args.repeats}:")
    print(f"  {'forward+backward':<18}{backward * 1e3:8.1f} ms (micro-batch 4 x 128 tokens per rank)")
    for name, seconds in {"adamw": base, **result}.items():
        share = seconds / (backward + seconds)
        print(f"  {name:<18}{seconds * 1e3:8.1f} ms   {seconds / base:5.2f}x AdamW's, {share:.0%} of a training step")


if __name__ == "__main__":
    main()
