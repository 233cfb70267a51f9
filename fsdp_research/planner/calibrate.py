"""The CPU's rates, measured, for the step-time model on this machine: matmul FLOP/s in the compute dtype at a
block's shapes, memory bandwidth, torch's AdamW step on the CPU, and gloo's all-gather bandwidth and latency, each
with every rank measuring at once (the ranks share the cores and the memory bus, as in training); and, for a GPU
plan's cpu_offload, the CPU AdamW step's rate on one core (torchrun gives each rank OMP_NUM_THREADS=1)."""

import functools
import os
import tempfile
import time

import torch
import torch.distributed as dist

from fsdp_research.config.schema import DistributedConfig
from fsdp_research.distributed.processes import init_distributed, spawn
from fsdp_research.planner.timing import Hardware


def _seconds(fn, repeats: int) -> float:
    """The best of `repeats` timed calls (after one warm-up), agreed as the slowest rank's."""
    fn()
    best = min(_timed(fn) for _ in range(repeats))
    slowest = torch.tensor(best, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _timed(fn) -> float:
    if dist.is_initialized():  # every rank starts together
        dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# A parameter's bytes an AdamW step moves: parameter, gradient and two moments read, parameter and moments written.
ADAMW_BYTES = 7 * 4


def _adamw_step(numel: int):
    """An AdamW step over numel fp32 parameters, as torch runs it on a CPU (the per-tensor loop)."""
    param = torch.zeros(numel, requires_grad=True)
    param.grad = torch.randn(numel)
    optimizer = torch.optim.AdamW([param], foreach=False)
    optimizer.step()  # its state made
    return optimizer.step


@functools.cache
def cpu_optimizer_rate(numel: int = 2**22) -> float:
    """Bytes/s of torch's AdamW step on one of this machine's cores (in this process, once: about 0.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = _adamw_step(numel)
        step()  # warm: the state's pages touched
        seconds = min(_timed(step) for _ in range(5))
    finally:
        torch.set_num_threads(threads)
    return ADAMW_BYTES * numel / seconds


def measure_rates(rows: int, inner: int, cols: int, dtype: torch.dtype) -> dict[str, float]:
    """In a process group (gloo, CPU): the rates of this machine's ranks, all measuring together."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    matmul = _seconds(lambda: torch.mm(a, b), 5)
    big = torch.empty(64 * 2**20 // 4)
    memory = _seconds(lambda: big.clone(), 5)
    world = dist.get_world_size()
    shard = torch.empty(4 * 2**20 // 4)
    gathered = torch.empty(world * shard.numel())
    tiny, tiny_out = torch.empty(1), torch.empty(world)
    latency = _seconds(lambda: dist.all_gather_into_tensor(tiny_out, tiny), 20)
    adamw = _seconds(_adamw_step(2**22), 3)
    gather = _seconds(lambda: dist.all_gather_into_tensor(gathered, shard), 5)
    received = shard.numel() * shard.element_size() * (world - 1)
    return {
        "flops": 2 * rows * inner * cols / matmul,
        "memory_bps": 2 * big.numel() * big.element_size() / memory,
        # One rank receives nothing: no link to time (the plans it times move nothing over one either).
        "link_bps": received / max(gather - latency, 1e-9) if world > 1 else float("inf"),
        "latency_s": latency,
        "optimizer_bps": ADAMW_BYTES * 2**22 / adamw,
    }


def cpu_hardware(rates: dict[str, float]) -> Hardware:
    return Hardware(
        name="cpu (measured)",
        flops=rates["flops"],
        memory_bps=rates["memory_bps"],
        intra_bps=rates["link_bps"],
        inter_bps=rates["link_bps"],
        host_bps=rates["memory_bps"],
        latency_s=rates["latency_s"],
        per_node=2**31,
        overlap=False,
        optimizer_bps=rates["optimizer_bps"],
    )


def _measure_and_keep(rows: int, inner: int, cols: int, dtype: torch.dtype, path: str) -> None:
    init_distributed(DistributedConfig(), torch.device("cpu"))
    rates = measure_rates(rows, inner, cols, dtype)
    if dist.get_rank() == 0:
        torch.save(rates, path)
    dist.destroy_process_group()


def calibrate_cpu(world_size: int, rows: int, inner: int, cols: int, dtype: torch.dtype) -> Hardware:
    """This machine's rates with world_size ranks on it (fresh processes, a few seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rates.pt")
        spawn(_measure_and_keep, world_size, rows, inner, cols, dtype, path)
        return cpu_hardware(torch.load(path))
