"""Throughput, MFU and peak memory, computed in one place and handed to whichever sinks are on."""

import contextlib
import resource
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .models import ModelDims

# Peak dense bf16 TFLOP/s per device, by a substring of torch.cuda.get_device_name().
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "A10G": 125.0,
    "L40S": 362.0,
    "L4": 121.0,
    "V100": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "MI300X": 1307.0,
    "MI250X": 383.0,
}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def flops_per_token(model: ModelDims, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls with parameters, plus attention's 12 * L * d * T."""
    return 6.0 * n_params + 12.0 * model.layers * model.hidden * seq_len


def active_parameters(model: torch.nn.Module, d: ModelDims) -> int:
    """The parameters a token passes through: all of a dense model's; of a mixture of experts, its experts' in
    the proportion top-k / experts (the fused experts modules: MixtralExperts, Qwen3MoeExperts, ...)."""
    total = sum(p.numel() for p in model.parameters())
    if not d.experts:
        return total
    experts = sum(
        p.numel() for m in model.modules() if type(m).__name__.endswith("Experts") for p in m.parameters(recurse=False)
    )
    return total - experts + experts * d.experts_per_token // d.experts


def router_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """A mixture of experts' load-balancing loss (mean over ranks) and the share of the routed tokens that the least
    and the most loaded expert got (1 / experts when balanced). A collective; nothing for a dense model."""
    if not stats:
        return {}
    values = torch.cat([stats["aux_loss"].reshape(1), stats["expert_tokens"]])
    dist.all_reduce(values)
    share = values[1:] / values[1:].sum()
    return {
        "aux_loss": values[0].item() / dist.get_world_size(),
        "expert_fraction_min": share.min().item(),
        "expert_fraction_max": share.max().item(),
    }


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory of this process in GiB, the maximum over ranks."""
    if device.type == "cuda":
        values = torch.tensor(
            [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
            dtype=torch.float64,
            device=device,
        )
        keys = ("peak_mem_allocated_gib", "peak_mem_reserved_gib")
    else:
        # ru_maxrss is in KiB on Linux.
        values = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0], dtype=torch.float64)
        keys = ("peak_rss_gib",)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: round(v / 2**30, 4) for k, v in zip(keys, values.tolist())}


class Throughput:
    """Timing of the steps since the last report, and the rates derived from it."""

    def __init__(
        self,
        tokens_per_step: int,
        samples_per_step: int,
        world_size: int,
        flops_per_token: float,
        peak_tflops: float | None,
        device: torch.device,
    ):
        self.tokens_per_step, self.samples_per_step, self.world_size = tokens_per_step, samples_per_step, world_size
        self.flops_per_token, self.peak_tflops, self.device = flops_per_token, peak_tflops, device
        self._start = self._paused = 0.0

    def start(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time that is not training (eval, a checkpoint save) is left out of the window."""
        self._sync()
        started = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._paused += time.perf_counter() - started

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stop(self, steps: int) -> dict[str, float]:
        self._sync()
        dt = (time.perf_counter() - self._start - self._paused) / steps
        tokens_per_s = self.tokens_per_step / dt
        out = {
            "step_time_s": dt,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "samples_per_s": self.samples_per_step / dt,
            "samples_per_s_per_device": self.samples_per_step / dt / self.world_size,
        }
        if self.peak_tflops:
            out["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_tflops * 1e12 * self.world_size)
        return out
