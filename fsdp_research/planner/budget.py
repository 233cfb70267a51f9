"""What plan --fit and the doctor's fit check may fill of a device: the cap less a headroom (default 10% of it:
fragmentation, the allocator's rounding, NCCL's and the CUDA libraries' buffers, what the planner does not count)
and, on a GPU, the CUDA context (fsdp_research.metrics.hardware.CUDA_CONTEXT_GIB)."""

from dataclasses import dataclass

from fsdp_research.errors import ConfigError
from fsdp_research.metrics.hardware import CUDA_CONTEXT_GIB

GIB = 2**30
DEFAULT_HEADROOM = 0.1


@dataclass(frozen=True)
class Budget:
    cap_gib: float
    # The share of the cap kept free.
    headroom: float
    # The CUDA context's GiB (0 on a CPU).
    context_gib: float = 0.0

    @property
    def usable(self) -> int:
        """Bytes a config's predicted peak may reach."""
        return int((self.cap_gib * (1 - self.headroom) - self.context_gib) * GIB)

    def __str__(self) -> str:
        context = f" and {self.context_gib:g} GiB of CUDA context" if self.context_gib else ""
        return f"{self.cap_gib:g} GiB less {self.headroom:.0%} headroom{context} ({self.usable / GIB:.2f} GiB)"


def budget(cap_gib: float, headroom: float, gpu: bool) -> Budget:
    return Budget(cap_gib, headroom, CUDA_CONTEXT_GIB if gpu else 0.0)


def parse_headroom(value, key: str) -> float:
    """A share of the cap: 0.1 or 10%, in [0, 1)."""
    text = str(value).strip()
    try:
        share = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        share = -1.0
    if not 0 <= share < 1:
        given = f"{key} " if key.startswith("--") else f"{key}="
        raise ConfigError(key, f"{value!r} is not a share of the cap in [0, 1)", f"use e.g. {given}0.1 (or 10%)")
    return share
