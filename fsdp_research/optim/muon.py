"""Muon (torch.optim.Muon's algorithm: momentum, Newton-Schulz orthogonalization of the update, decoupled weight
decay, the shape's lr adjustment), exact on FSDP2's shards.

Newton-Schulz needs the whole matrix, and FSDP2 holds row slices of it: orthogonalizing the local slice is a
different update. So, as Dion and torchtitan's DistMuon do, the matrices of a step are dealt out over the ranks of
the shard group: each rank receives every slice of the matrices it owns (one all-to-all), orthogonalizes them
whole, and sends each rank its slice of the result back (a second all-to-all). Every element is computed as on
one process; each rank does 1 / shard-group-size of the work. Replicas (HSDP, ddp) hold the same shards and do
the same. Plain tensors (one process, torch's DDP) are orthogonalized where they are."""

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..sharding import local_shard

# Keller Jordan's quintic coefficients, torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    matrix: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7, dtype=torch.bfloat16
) -> torch.Tensor:
    """The orthogonalized matrix, as torch.optim.Muon computes it (in bfloat16 by default: the same values)."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # a copy: the iterations work in place
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def _row_splits(rows: int, ranks: int) -> list[int]:
    """Rows of each rank's slice of a matrix sharded on dim 0 (torch.chunk's split, as FSDP2 makes it)."""
    sizes = [len(c) for c in torch.empty(rows, 0).chunk(ranks)]
    return sizes + [0] * (ranks - len(sizes))


class Muon(torch.optim.Optimizer):
    """torch.optim.Muon's arguments, plus ns_dtype (bfloat16 as torch's, or float32)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: str = "bfloat16",
    ):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: use original or match_rms_adamw")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon takes 2-D matrices only, not a parameter of shape {list(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                grad = local_shard(p.grad)
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                local_buf = local_shard(buf)
                local_buf.lerp_(grad, 1 - group["momentum"])
                updates.append(grad.lerp(local_buf, group["momentum"]) if group["nesterov"] else local_buf)
            orthogonal = _orthogonalize(params, updates, group)
            for p, update in zip(params, orthogonal):
                local = local_shard(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                local.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss


def _shard_group(p: torch.Tensor):
    """The process group over which p's rows are split, or None where this rank holds it whole."""
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, placement in enumerate(p.placements) if isinstance(placement, Shard)]
    if not dims:
        return None
    if len(dims) > 1 or p.placements[dims[0]].dim != 0:
        raise ValueError(f"Muon: cannot orthogonalize a matrix sharded as {p.placements}")
    group = p.device_mesh.get_group(dims[0])
    return group if dist.get_world_size(group) > 1 else None


def _orthogonalize(params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Each update's slice of the orthogonalized whole matrix."""

    def ns(matrix: torch.Tensor) -> torch.Tensor:
        return newton_schulz(
            matrix, group["ns_coefficients"], group["ns_steps"], group["eps"], getattr(torch, group["ns_dtype"])
        )

    out: list[torch.Tensor | None] = [None] * len(params)
    sharded: dict = {}
    for i, p in enumerate(params):
        pg = _shard_group(p)
        if pg is None:
            out[i] = ns(updates[i]).to(updates[i].dtype)
        else:
            sharded.setdefault(pg, []).append(i)
    for pg, indices in sharded.items():
        ranks = dist.get_world_size(pg)
        # Rounds of one matrix per rank: rank j owns the round's j-th matrix.
        for start in range(0, len(indices), ranks):
            _round(params, updates, indices[start : start + ranks], pg, ns, out)
    return out


def _round(params, updates, indices: list[int], pg, ns, out: list) -> None:
    """One all-to-all brings each owner its matrix's slices, one sends the orthogonalized slices back."""
    ranks, me = dist.get_world_size(pg), dist.get_rank(pg)
    dtype, device = updates[indices[0]].dtype, updates[indices[0]].device
    splits = [_row_splits(params[i].shape[0], ranks) for i in indices]
    cols = [params[i].shape[1] for i in indices]
    # What this rank sends owner j: its slice of matrix j; what it receives from rank r: r's slice of its own.
    send = [updates[i].reshape(-1) for i in indices] + [torch.empty(0, dtype=dtype, device=device)] * (
        ranks - len(indices)
    )
    send_sizes = [splits[j][me] * cols[j] for j in range(len(indices))] + [0] * (ranks - len(indices))
    mine = me < len(indices)
    recv_sizes = [splits[me][r] * cols[me] for r in range(ranks)] if mine else [0] * ranks
    received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(received, torch.cat(send), recv_sizes, send_sizes, group=pg)
    if mine:
        whole = ns(received.view(params[indices[me]].shape[0], cols[me])).to(dtype).reshape(-1)
    else:
        whole = torch.empty(0, dtype=dtype, device=device)
    back = torch.empty(sum(send_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(back, whole.contiguous(), send_sizes, recv_sizes, group=pg)
    for j, piece in enumerate(back.split(send_sizes[: len(indices)])):
        out[indices[j]] = piece.view(splits[j][me], cols[j])
