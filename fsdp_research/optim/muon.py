"""Muon (torch.optim.Muon's algorithm: momentum, Newton-Schulz orthogonalization of the update, decoupled weight
decay, the shape's lr adjustment), exact on FSDP2's shards, on each tensor's logical matrices (muon_params.Layout:
a fused projection's q/k/v or gate/up each alone, Conv1D's weight transposed, an expert tensor one per expert).

Newton-Schulz needs the whole matrix, and FSDP2 holds row slices of it: orthogonalizing the local slice is a
different update. So, as Dion and torchtitan's DistMuon do, the 2-D matrices of a step are dealt out over the ranks
of the shard group: each rank receives every slice of the matrices it owns (one all-to-all, in ns_dtype: the values
Newton-Schulz reads first), orthogonalizes them whole, and sends each rank its slice of the result back (a second
all-to-all, in ns_dtype: its output). Every element is computed as on one process; each rank does 1 /
shard-group-size of the work. An expert tensor [E, out, in] is sharded on dim 0, its experts: each rank
orthogonalizes the whole experts it holds, with no exchange. Plain tensors (one process, torch's DDP) are
orthogonalized where they are.

Replicas (HSDP's, ddp's) hold the same shards and each runs the same Newton-Schulz itself (not computed once and
shared): the same inputs (gradients all-reduced over the replicas) through the same kernels give the same bits, on
CPU and on GPUs of one architecture and SM count under one CUDA version (cuBLAS's reproducibility); replicas on
mixed GPUs could drift apart."""

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fsdp_research.distributed.sharding import local_shard
from fsdp_research.optim.muon_params import Layout, assembled, matrix_shapes, pieces

# Keller Jordan's quintic coefficients, torch.optim.Muon's defaults.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    matrix: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7, dtype=torch.bfloat16
) -> torch.Tensor:
    """The orthogonalized matrix, as torch.optim.Muon computes it (in bfloat16 by default: the same values); of a
    batch [n, rows, cols], each matrix alone (2-D: torch's ops exactly, bitwise)."""
    a, b, c = coefficients
    x = matrix.to(dtype, copy=True)  # a copy: the iterations work in place
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    batched = x.ndim == 3
    x.div_((x.norm(dim=(-2, -1), keepdim=True) if batched else x.norm()).clamp(min=eps))
    mm = torch.baddbmm if batched else torch.addmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
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
    """torch.optim.Muon's arguments, plus ns_dtype (bfloat16 as torch's, or float32) and layouts: each parameter's
    logical matrices (muon_params.Layout; without one, a 2-D tensor is one matrix, a 3-D one a batch of them)."""

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
        layouts: Mapping[torch.Tensor, Layout] | None = None,
    ):
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr_fn {adjust_lr_fn!r}: use original or match_rms_adamw")
        for name, value in (("lr", lr), ("weight_decay", weight_decay), ("momentum", momentum)):
            if value < 0:  # as torch.optim.Muon checks them
                raise ValueError(f"Invalid {name} value: {value}")
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
        # By identity: a layout is not state (the checkpoint's), it is the model's.
        self.layouts = {id(p): layout for p, layout in (layouts or {}).items()}
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(
                        f"Muon takes matrices and batches of them, not a parameter of shape {list(p.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            layouts = [self.layouts.get(id(p), Layout()) for p in params]
            updates = []
            for p in params:
                grad = local_shard(p.grad)
                buf = self.state[p].get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
                local_buf = local_shard(buf)
                local_buf.lerp_(grad, 1 - group["momentum"])
                updates.append(grad.lerp(local_buf, group["momentum"]) if group["nesterov"] else local_buf)
            orthogonal = _orthogonalize(params, updates, layouts, group)
            for p, layout, update in zip(params, layouts, orthogonal):
                local = local_shard(p)
                local.mul_(1 - group["lr"] * group["weight_decay"])
                lr = _lrs(p, layout, group, update)
                if isinstance(lr, float):
                    local.add_(update, alpha=-lr)
                else:
                    local.addcmul_(update, lr, value=-1)
        return loss


def _lrs(p: torch.Tensor, layout: Layout, group: dict, update: torch.Tensor) -> float | torch.Tensor:
    """The adjusted lr of p's logical matrices (by each one's shape); where they differ, one per out row of p's
    local shard, shaped to broadcast over it."""
    lrs = [adjusted_lr(group["lr"], group["adjust_lr_fn"], shape) for shape in matrix_shapes(p.shape, layout)]
    if len(set(lrs)) == 1:
        return lrs[0]
    rows = torch.tensor(lrs, dtype=update.dtype, device=update.device)
    rows = rows.repeat_interleave(torch.tensor(layout.sizes, device=update.device)).repeat(layout.groups)
    if layout.transposed:  # out is the last dim, never sharded (FSDP2 shards dim 0)
        return rows
    if p.ndim == 2:  # out is dim 0: this rank's rows
        rows = rows[_first_row(p) :][: update.size(0)]
    return rows[:, None]


def _first_row(p: torch.Tensor) -> int:
    if not isinstance(p, DTensor):
        return 0
    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)[1][0]


# A matrix split over more than one mesh dimension (tensor parallel's columns or rows within FSDP's): gathered whole.
GATHERED = "gathered"


def _shard_group(p: torch.Tensor):
    """The process group over which p's rows are split, GATHERED for a matrix split more ways, or None where this
    rank holds it whole."""
    if not isinstance(p, DTensor):
        return None
    # FSDP's rows of a tp shard are a _StridedShard, no Shard: every placement that is not Replicate splits.
    dims = [i for i, placement in enumerate(p.placements) if not placement.is_replicate()]
    if not dims:
        return None
    if len(dims) > 1 or not isinstance(p.placements[dims[0]], Shard) or p.placements[dims[0]].dim != 0:
        # Experts split on their own dimension only (parallel.ep, then FSDP's rows of it): whole experts here.
        by_expert = p.ndim == 3 and all(getattr(p.placements[d], "dim", None) == 0 for d in dims)
        return None if by_expert else GATHERED
    group = p.device_mesh.get_group(dims[0])
    return group if dist.get_world_size(group) > 1 else None


def _gathered(p: DTensor, update: torch.Tensor, orthogonal) -> torch.Tensor:
    """This rank's part of the orthogonalized whole matrix, gathered over every dimension it is split on (each rank
    orthogonalizes every such matrix: exact, not the all-to-all's division of the work)."""
    whole = DTensor.from_local(update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
    return distribute_tensor(orthogonal(whole), p.device_mesh, p.placements, src_data_rank=None).to_local()


def _orthogonalize(params: list, updates: list, layouts: list[Layout], group: dict) -> list[torch.Tensor]:
    """Each update's slice of its orthogonalized whole tensor, in the update's dtype."""
    dtype = getattr(torch, group["ns_dtype"])

    def orthogonal(i: int, whole: torch.Tensor) -> torch.Tensor:
        """Newton-Schulz of each logical matrix, in ns_dtype, laid out as stored."""
        ns = [
            newton_schulz(m, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
            for m in pieces(whole, layouts[i])
        ]
        return assembled(ns, layouts[i])

    out: list[torch.Tensor | None] = [None] * len(params)
    sharded: dict = {}
    for i, p in enumerate(params):
        pg = _shard_group(p)
        if pg is GATHERED:
            out[i] = _gathered(p, updates[i], lambda whole, i=i: orthogonal(i, whole)).to(updates[i].dtype)
        elif pg is None or p.ndim == 3:  # an expert tensor's shard (dim 0) holds whole experts
            out[i] = orthogonal(i, updates[i]).to(updates[i].dtype)
        else:
            sharded.setdefault(pg, []).append(i)
    for pg, indices in sharded.items():
        ranks = dist.get_world_size(pg)
        # Rounds of one matrix per rank: rank j owns the round's j-th matrix.
        for start in range(0, len(indices), ranks):
            _round(params, updates, indices[start : start + ranks], pg, orthogonal, dtype, out)
    return out


def _round(params, updates, indices: list[int], pg, orthogonal, dtype: torch.dtype, out: list) -> None:
    """One all-to-all brings each owner its matrix's slices, one sends the orthogonalized slices back; both in
    dtype (ns_dtype: what Newton-Schulz reads and returns, so bfloat16 halves the bytes and changes no value)."""
    ranks, me = dist.get_world_size(pg), dist.get_rank(pg)
    device = updates[indices[0]].device
    splits = [_row_splits(params[i].shape[0], ranks) for i in indices]
    cols = [params[i].shape[1] for i in indices]
    # What this rank sends owner j: its slice of matrix j; what it receives from rank r: r's slice of its own.
    send = [updates[i].to(dtype).reshape(-1) for i in indices] + [torch.empty(0, dtype=dtype, device=device)] * (
        ranks - len(indices)
    )
    send_sizes = [splits[j][me] * cols[j] for j in range(len(indices))] + [0] * (ranks - len(indices))
    mine = me < len(indices)
    recv_sizes = [splits[me][r] * cols[me] for r in range(ranks)] if mine else [0] * ranks
    received = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(received, torch.cat(send), recv_sizes, send_sizes, group=pg)
    if mine:
        whole = orthogonal(indices[me], received.view(params[indices[me]].shape[0], cols[me])).reshape(-1)
    else:
        whole = torch.empty(0, dtype=dtype, device=device)
    back = torch.empty(sum(send_sizes), dtype=dtype, device=device)
    dist.all_to_all_single(back, whole.contiguous(), send_sizes, recv_sizes, group=pg)
    for j, piece in enumerate(back.split(send_sizes[: len(indices)])):
        out[indices[j]] = piece.view(splits[j][me], cols[j]).to(updates[indices[j]].dtype)
