"""Gradient clipping by the true global norm."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def _split_over_tp(g: DTensor) -> bool:
    names = g.device_mesh.mesh_dim_names or ()
    return "tp" in names and g.placements[names.index("tp")].is_shard()


def local_squares(grads: list[DTensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """([sum of squares of the local shards that the tp ranks hold alike, of those split over tp], the local
    shards): one foreach kernel per kind, not op by op through DTensor dispatch (a few percent of a small model's
    step)."""
    local = [g.to_local() for g in grads]
    split = [_split_over_tp(g) for g in grads]
    sums = []
    for kind in (False, True):
        chosen = [t for t, s in zip(local, split) if s is kind]
        norms = torch._foreach_norm(chosen) if chosen else [torch.zeros((), device=local[0].device)]
        sums.append(torch.stack(norms).float().pow(2).sum())
    return torch.stack(sums), local


def reduce_squares(squares: torch.Tensor, mesh) -> torch.Tensor:
    """Local squares ([..., 2] as local_squares gives them) summed over every shard: over the shard group (replicas
    hold the same shards), the tp-split ones over the tp group too, and over a pipeline's stages (each holds its
    layers); the whole sums, [...]."""
    dist.all_reduce(squares, group=mesh.get_group("shard"))
    if "tp" in (mesh.mesh_dim_names or ()):
        tp = squares[..., 1].contiguous()
        dist.all_reduce(tp, group=mesh.get_group("tp"))
        whole = squares[..., 0] + tp
    else:
        whole = squares.sum(-1)
    root = mesh._get_root_mesh()
    if "pp" in (root.mesh_dim_names or ()):
        dist.all_reduce(whole, group=root.get_group("pp"))
    return whole


def grad_norm(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the true global gradient norm over every shard of every rank, the local gradients). A parameter marked
    `counted_elsewhere` (a tied embedding's copy on a pipeline's last stage) is clipped, not counted again."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if grads and isinstance(grads[0], DTensor):
        squares, _ = local_squares([p.grad for p in params if not getattr(p, "counted_elsewhere", False)])
        return reduce_squares(squares, widest_mesh(grads)).sqrt(), [g.to_local() for g in grads]
    return torch.nn.utils.get_total_norm(grads), grads


def widest_mesh(grads: list[DTensor]):
    """The mesh with the most dimensions among the gradients' that has the shard dimension (with tp, the 2-D one;
    the experts' mesh splits it in two, over the same ranks)."""
    meshes = [g.device_mesh for g in grads if "shard" in (g.device_mesh.mesh_dim_names or ())]
    return max(meshes, key=lambda mesh: mesh.ndim)


def clip_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale by min(1, max_norm / norm) without a host sync, as torch's clip_grad_norm_ does (0: no clipping)."""
    if max_norm > 0:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0: measure only) by the true global norm; returns the norm before clipping."""
    norm, local = grad_norm(model)
    clip_(local, norm, max_norm)
    return norm
