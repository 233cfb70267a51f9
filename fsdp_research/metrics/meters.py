"""Throughput, MFU and peak memory, computed in one place and handed to whichever sinks are on."""

import contextlib
import resource
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fsdp_research.data.packing import IGNORE, INPUTS, LABELS, POSITIONS
from fsdp_research.metrics.hardware import peak_for
from fsdp_research.model.dimensions import ModelDims, expert_modules


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    return peak_for(torch.cuda.get_device_name(device), dtype)


def flops_per_token(model: ModelDims, matmul_params: int, seq_len: int, frozen: int = 0) -> float:
    """Training FLOPs per token (forward and backward): 6 per parameter a token is multiplied with (2 forward, 2
    for the input's gradient, 2 for the weight's), 4 for the `frozen` ones among them (no weight gradient: LoRA's
    base), plus each attention's scores and weighted sum, 6 * T * heads * (qk head size + v head size) per block
    (12 * L * d * T where the two sizes are equal; unmasked, as torch's FlopCounterMode counts them)."""
    return 6.0 * matmul_params - 2.0 * frozen + 3.0 * _attention_forward(model, seq_len)


def forward_flops_per_token(model: ModelDims, matmul_params: int, seq_len: int) -> float:
    """A forward's FLOPs per token with no gradient (a reference model's): 2 per parameter a token is multiplied
    with, and the attentions' scores and weighted sums."""
    return 2.0 * matmul_params + _attention_forward(model, seq_len)


def _attention_forward(model: ModelDims, seq_len: int) -> float:
    return 2.0 * seq_len * sum(a.heads * (a.qk_dim + a.v_dim) for a in model.attention if a)


def matmul_parameters(model: torch.nn.Module, d: ModelDims, frozen: bool = False) -> int:
    """The parameters a token is multiplied with: the active ones less the embedding tables, which are looked up
    (a tied output embedding is a matmul, and stays); `frozen`: only those that take no gradient."""
    counted = (lambda p: not p.requires_grad) if frozen else (lambda p: True)
    kept = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    lookups = {
        id(p): p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
        if id(p) not in kept and counted(p)
    }
    return active_parameters(model, d, counted) - sum(lookups.values())


def active_parameters(model: torch.nn.Module, d: ModelDims, counted=lambda p: True) -> int:
    """The parameters a token passes through (those `counted`): all of a dense model's; of a mixture of experts,
    its routed experts' in the proportion top-k / experts."""
    total = sum(p.numel() for p in model.parameters() if counted(p))
    if not d.experts:
        return total
    experts = sum(p.numel() for m in expert_modules(model) for p in m.parameters() if counted(p))
    return total - experts + experts * d.experts_per_token // d.experts


# Per-step losses besides the training loss, logged as their mean over ranks.
MEAN_LOSSES = ("aux_loss", "z_loss")


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def loss_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """The loss's parts logged apart (a mixture of experts' load-balancing loss, the z-loss: means over ranks) and
    the share of the routed tokens that the least and the most loaded expert got (1 / experts when balanced), each
    where the run computes it. A collective (every rank has the same keys: they depend on the config and the
    family only); nothing for a dense model with the plain loss."""
    # Packed documents: the step's targets, already summed over ranks.
    out = {"targets": round(stats["targets"].item())} if "targets" in stats else {}
    means = [k for k in MEAN_LOSSES if k in stats]
    parts = [stats[k].reshape(-1).float() for k in (*means, "expert_tokens") if k in stats]
    if not parts:
        return out
    values = torch.cat(parts)
    dist.all_reduce(values)
    for key in means:
        out[key], values = values[0].item() / dist.get_world_size(), values[1:]
    if "expert_tokens" in stats:
        share = values / values.sum()
        out.update(expert_fraction_min=share.min().item(), expert_fraction_max=share.max().item())
    return out


def _status_bytes(field: str) -> float:
    """A VmRSS/VmHWM figure of this process in bytes; the lifetime peak where /proc cannot tell (KiB on Linux)."""
    try:
        with open("/proc/self/status") as status:
            return next(float(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


def rss() -> float:
    """This process's resident memory now, in bytes."""
    return _status_bytes("VmRSS")


def rss_peak() -> float:
    """This process's peak resident memory in bytes since it started or since reset_rss_peak."""
    return _status_bytes("VmHWM")


def reset_rss_peak() -> None:
    """Linux resets VmHWM to the current RSS on "5" written to clear_refs."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


class PeakMemory:
    """Peak memory per logging window in GiB, the maximum over ranks (allocated and reserved by torch on CUDA, the
    resident set on CPU), and over the run: set-up and every window (kept, so the run's end needs no collective;
    what comes after the last window, the final save and the export, is not in it)."""

    def __init__(self, device: torch.device):
        """Made where training starts (a collective): the run's peak starts from the set-up's."""
        self.device = device
        self.run: dict[str, float] = {}
        self.window()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            reset_rss_peak()

    def window(self) -> dict[str, float]:
        """The peak since the last reset (a collective)."""
        if self.device.type == "cuda":
            peaks = [torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)]
            keys = ("peak_mem_allocated_gib", "peak_mem_reserved_gib")
        else:
            peaks, keys = [rss_peak()], ("peak_rss_gib",)
        values = torch.tensor(peaks, dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        window = {k: round(v / 2**30, 4) for k, v in zip(keys, values.tolist())}
        self.run = {k: max(v, self.run.get(k, 0.0)) for k, v in window.items()}
        return window


def packed_tokens(batch: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """The tokens of packed samples ([n, 3, seq_len], fsdp_research.data.packing), summed: the positions before the
    padding that follows the last document. With document masking (pad_id None) the padding is a document of its
    own, positions from 0, with no target (every document holds one): the last one where it has none. Without, the
    positions run on through it: the trailing run of pad_id inputs with no target (a last document's own trailing
    pad tokens with no target go with it)."""
    untargeted = batch[:, LABELS] == IGNORE
    if pad_id is None:
        last = batch[:, POSITIONS, -1] + 1
        padding = torch.where(_trailing(untargeted) >= last, last, 0)
    else:
        padding = _trailing(untargeted & (batch[:, INPUTS] == pad_id))
    return (batch.shape[-1] - padding).sum()


def _trailing(flags: torch.Tensor) -> torch.Tensor:
    """Per row, how many of its last positions are all set."""
    return flags.flip(1).cumprod(1).sum(1)


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
        group: int = 1,
    ):
        """group: the neighbouring ranks that read the same batch (tp x cp), whose added tokens count once."""
        self.tokens_per_step, self.samples_per_step, self.world_size = tokens_per_step, samples_per_step, world_size
        self.flops_per_token, self.peak_tflops, self.device, self.group = flops_per_token, peak_tflops, device, group
        self._start = self._paused = 0.0
        self._tokens: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        model,
        d: ModelDims,
        batch: int,
        seq_len: int,
        world: int,
        dtype,
        device,
        peak: float | None,
        group: int,
        reference_forwards: float = 0,
    ):
        """The rates of a model's steps of `batch` sequences of seq_len tokens over `world` devices (`group` of them
        reading the same batch), MFU against the device's peak in dtype (or `peak` TFLOP/s); each step also runs
        `reference_forwards` forwards with no gradient of the model (LoRA's: its frozen base alone)."""
        params, frozen = matmul_parameters(model, d), matmul_parameters(model, d, frozen=True)
        reference = reference_forwards * forward_flops_per_token(d, frozen or params, seq_len)
        return cls(
            batch * seq_len,
            batch,
            world,
            flops_per_token(d, params, seq_len, frozen) + reference,
            peak_tflops(device, dtype, peak),
            device,
            group,
        )

    def start(self) -> None:
        self._start = time.perf_counter()
        self._paused = 0.0
        self._tokens = None

    def add(self, tokens: torch.Tensor) -> None:
        """This rank's tokens of a step, where they are fewer than its positions (packed samples: packed_tokens);
        kept on the device until the window closes. A window with none added: tokens_per_step a step."""
        self._tokens = tokens if self._tokens is None else self._tokens + tokens

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
        """The window's rates; a collective where tokens were added (every rank adds them) in a process group."""
        self._sync()
        dt, closed = (time.perf_counter() - self._start - self._paused) / steps, time.time()
        tokens = self.tokens_per_step * steps
        if self._tokens is not None:
            added = self._tokens.clone()
            if dist.is_initialized():
                dist.all_reduce(added)
            tokens = added.item() / self.group
        tokens_per_s = tokens / steps / dt
        out = {
            # Wall clock (Unix seconds) when the window closed, after the device's queue: a reader holds step
            # times against it.
            "time": closed,
            "step_time_s": dt,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.world_size,
            "samples_per_s": self.samples_per_step / dt,
            "samples_per_s_per_device": self.samples_per_step / dt / self.world_size,
        }
        # Of the tokens counted: padding that packed samples also compute is no model FLOP.
        if self.peak_tflops:
            out["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_tflops * 1e12 * self.world_size)
        return out
