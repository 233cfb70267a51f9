"""The losses: a training batch's loss (loss=cross_entropy with its z-loss and label smoothing, or the user's
loss._target_; plus a mixture of experts' load-balancing loss where its config asks for it), and the
token-weighted mean cross-entropy over the held-out set."""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .data.pipeline import Data
from .errors import ConfigError
from .targets import check_call, kwargs_of, named_in, resolve

# loss's own keys: with loss._target_ the others are its keyword arguments.
_OWN = ("name", "z_loss", "label_smoothing")
# (logits [tokens, vocab], labels [tokens]) -> (loss, parts to log apart)
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _target_kwargs(cfg, target) -> dict:
    """The group's other keys; z_loss and label_smoothing too where the target's signature names them."""
    own = named_in(target, {"z_loss": cfg.z_loss, "label_smoothing": cfg.label_smoothing})
    return {**own, **kwargs_of(cfg, _OWN)}


def check_loss(cfg) -> None:
    if cfg.get("_target_"):
        target = resolve(cfg._target_, "loss._target_")
        check_call(target, _target_kwargs(cfg, target), "loss._target_", "logits", "labels")
        unused = [k for k in ("z_loss", "label_smoothing") if cfg[k] and k not in named_in(target, {k: 0})]
        if unused:
            raise ConfigError(
                f"loss.{unused[0]}", f"{cfg._target_} does not take it", f"set loss.{unused[0]}=0, or take it"
            )
        return
    if cfg.name != "cross_entropy":
        raise ConfigError("loss.name", f"unknown loss {cfg.name!r}", "use loss=cross_entropy, or loss._target_")
    unknown = sorted(set(cfg.keys()) - {*_OWN, "_target_"})
    if unknown:
        raise ConfigError(f"loss.{unknown[0]}", f"cross_entropy has no key {unknown[0]!r}", "remove it")
    if cfg.z_loss < 0:
        raise ConfigError("loss.z_loss", f"{cfg.z_loss} is negative", "use 0 (off) or e.g. 1e-4")
    if not 0 <= cfg.label_smoothing < 1:
        raise ConfigError("loss.label_smoothing", f"{cfg.label_smoothing} is not in [0, 1)", "use e.g. 0.1")


def _cross_entropy(logits, labels, z_loss: float, label_smoothing: float):
    loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    if not z_loss:
        return loss, {}
    z = z_loss * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
    return loss + z, {"z_loss": z.detach()}


def _user_loss(fn: Callable, logits, labels):
    return fn(logits, labels), {}


_plain = functools.partial(_cross_entropy, z_loss=0.0, label_smoothing=0.0)


def build_loss(cfg) -> LossFn:
    if cfg.get("_target_"):
        target = resolve(cfg._target_, "loss._target_")
        return functools.partial(_user_loss, functools.partial(target, **_target_kwargs(cfg, target)))
    return functools.partial(_cross_entropy, z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing)


@dataclass(frozen=True)
class Router:
    """A mixture of experts' routing, as the family's config sets it."""

    experts: int
    top_k: int
    # The load-balancing loss's weight in the training loss: 0 unless the config asks for it (output_router_logits).
    aux_coef: float


def router_of(hf_config, experts: int, top_k: int) -> Router | None:
    if not experts:
        return None
    asks = getattr(hf_config, "output_router_logits", False)
    coef = getattr(hf_config, "router_aux_loss_coef", None)
    return Router(experts, top_k, float(coef or 0.0) if asks else 0.0)


def _expert_tokens(router_logits, router: Router) -> torch.Tensor | None:
    """The tokens routed to each expert (top-k of each MoE layer's router logits, summed over layers), where the
    family returns its router logits as one tensor per layer; None where it returns none (or something else)."""
    if isinstance(router_logits, torch.Tensor):
        router_logits = [router_logits]
    layers = [t for t in router_logits or () if isinstance(t, torch.Tensor) and t.shape[-1] == router.experts]
    if not layers:
        return None
    chosen = torch.cat([t.detach().topk(router.top_k, dim=-1).indices.flatten() for t in layers])
    return torch.bincount(chosen, minlength=router.experts).float()


def train_loss(model: nn.Module, batch: torch.Tensor, amp, loss_fn: LossFn | None = None, router: Router | None = None):
    """(loss, to log) of a batch of seq_len + 1 tokens: the configured next-token loss (and its parts to log), plus
    the router's weighted load-balancing loss; for a mixture of experts, its aux loss and the tokens routed to each
    expert (summed over its MoE layers) to log, where the family computes them (a router trained without an aux
    loss has none)."""
    with amp:
        out = model(input_ids=batch[:, :-1], **({"output_router_logits": True} if router else {}))
    logits = getattr(out, "logits", None)
    if logits is None:
        raise ConfigError(
            "model._target_",
            f"the model's forward returned a {type(out).__name__} without .logits",
            "return an object with .logits (e.g. transformers' CausalLMOutput)",
        )
    loss, stats = (loss_fn or _plain)(logits.flatten(0, 1), batch[:, 1:].flatten())
    if router is None:
        return loss, stats
    aux = getattr(out, "aux_loss", None)
    if isinstance(aux, torch.Tensor):
        stats["aux_loss"] = aux.detach().float()
        if router.aux_coef:
            loss = loss + router.aux_coef * aux
    counts = _expert_tokens(getattr(out, "router_logits", None), router)
    if counts is not None:
        stats["expert_tokens"] = counts
    return loss, stats


def token_losses(model: nn.Module, batch: torch.Tensor, amp) -> torch.Tensor:
    """Each target token's cross-entropy, [batch, seq_len]."""
    with amp:
        logits = model(input_ids=batch[:, :-1]).logits
    losses = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="none")
    return losses.view(len(batch), -1)


@torch.no_grad()
def held_out_loss(
    model: nn.Module, data: Data, samples: int, micro_batch: int, device: torch.device, amp
) -> dict[str, float]:
    """The token-weighted mean loss over held-out samples 0 .. samples - 1: the same eval set at any world size,
    rank r taking r, r + world, ... Every rank runs as many forwards (one with fewer samples pads with a sample
    weighted 0): FSDP's collectives need them all. A collective: every rank calls it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    index = rank + world * np.arange(-(-samples // world))
    weight = torch.from_numpy(index < samples).float().to(device)
    index = np.minimum(index, samples - 1)
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # loss summed over tokens, tokens
    model.eval()
    for a in range(0, len(index), micro_batch):
        batch = data.batch(index[a : a + micro_batch], held_out=True).to(device)
        w = weight[a : a + micro_batch]
        per_sample = token_losses(model, batch, amp).sum(1)
        sums += torch.stack([(per_sample * w).sum(), w.sum() * (batch.shape[1] - 1)]).double()
    model.train()
    dist.all_reduce(sums)
    return {"eval_loss": (sums[0] / sums[1]).item(), "eval_tokens": int(sums[1].item())}
