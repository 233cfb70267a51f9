"""The losses: a training batch's loss (loss=cross_entropy with its z-loss and label smoothing, or the user's
loss._target_; plus a mixture of experts' load-balancing loss where its config asks for it), and the
token-weighted mean cross-entropy over the held-out set."""

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from fsdp_research.config.schema import LossConfig
from fsdp_research.config.targets import check_call, kwargs_of, named_in, resolve
from fsdp_research.data.packing import IGNORE, INPUTS, LABELS, POSITIONS
from fsdp_research.distributed.context_parallel import ContextSplit
from fsdp_research.distributed.sharding import reshard
from fsdp_research.distributed.step_layout import Layout
from fsdp_research.errors import ConfigError
from fsdp_research.model.architecture import output_layer

# loss's own keys: with loss._target_ the others are its keyword arguments.
_OWN = ("name", "z_loss", "label_smoothing", "chunks")
# (logits [tokens, vocab], labels [tokens]) -> (loss, parts to log apart)
LossFn = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _target_kwargs(cfg, target) -> dict:
    """The group's other keys; z_loss and label_smoothing too where the target's signature names them."""
    own = named_in(target, {"z_loss": cfg.z_loss, "label_smoothing": cfg.label_smoothing})
    return {**own, **kwargs_of(cfg, _OWN)}


def check_loss(cfg, packed: bool = False) -> None:
    """packed: the data is packed documents (data=chat), whose loss is plain cross_entropy's sum over targets."""
    if packed:
        used = {"_target_": bool(cfg.get("_target_")), "z_loss": cfg.z_loss != 0, "chunks": cfg.chunks != 1}
        given = [key for key, on in used.items() if on]
        if given:
            raise ConfigError(
                f"loss.{given[0]}",
                "is not yet taken with packed documents (data=chat, data.document_masking), whose loss is "
                "cross_entropy's sum over targets",
                f"drop the loss.{given[0]} override",
            )
    if cfg.chunks < 1:
        raise ConfigError("loss.chunks", f"{cfg.chunks} is below 1", "use 1 (whole logits) or n chunks, e.g. 8")
    if cfg.chunks > 1 and cfg.get("_target_"):
        raise ConfigError(
            "loss.chunks", f"{cfg._target_} takes whole logits, never made in chunks", "use loss.chunks=1"
        )
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


class _CrossEntropyAndZ(torch.autograd.Function):
    """(sum of the tokens' cross-entropies, sum of their log Z^2) from one logsumexp of the logits, computed in
    fp32. Backward keeps only the logits (alive anyway: the model's output) and the [tokens] lse, and makes one
    fp32 [tokens, vocab] gradient: cross_entropy plus a separate logsumexp kept two fp32 copies of the logits
    for backward (+1 GiB at 8k tokens x 32k vocab), more than cross_entropy alone keeps."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float):
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1)
        nll = lse - x.gather(-1, labels[:, None]).squeeze(-1)
        if label_smoothing:  # the target mixes the label (1 - e) with the uniform distribution (e), as torch's
            nll = (1 - label_smoothing) * nll + label_smoothing * (lse - x.mean(-1))
        ctx.save_for_backward(logits, labels, lse)
        ctx.label_smoothing = label_smoothing
        return nll.sum(), lse.pow(2).sum()

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, grad_z: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        e = ctx.label_smoothing
        # d/dx of ce: softmax - (1 - e) onehot - e / vocab; of lse^2: 2 lse softmax.
        grad = logits.to(torch.float32, copy=True).sub_(lse[:, None]).exp_().mul_((grad_ce + 2 * grad_z * lse)[:, None])
        grad.scatter_add_(-1, labels[:, None], (-(1 - e) * grad_ce).expand(len(labels), 1).to(grad.dtype))
        if e:
            grad.sub_(grad_ce * e / logits.shape[-1])
        return grad.to(logits.dtype), None, None


def cross_entropy_and_z(logits, labels, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens' summed cross-entropy and summed squared log-partition (z-loss before its weight)."""
    return _CrossEntropyAndZ.apply(logits, labels, label_smoothing)


def _cross_entropy(logits, labels, z_loss: float, label_smoothing: float):
    if not z_loss:  # torch's, whose values the default runs keep
        return F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing), {}
    ce, z = cross_entropy_and_z(logits, labels, label_smoothing)
    z = z_loss * z / labels.numel()
    return ce / labels.numel() + z, {"z_loss": z.detach()}


def _summed_cross_entropy(logits, labels, label_smoothing: float):
    """Packed samples: the sum over the targets (labels other than IGNORE); the trainer divides by the step's
    targets over every micro-batch and rank (transformers' num_items_in_batch)."""
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum", label_smoothing=label_smoothing)
    return ce, {}


def _user_loss(fn: Callable, logits, labels):
    return fn(logits, labels), {}


_plain = functools.partial(_cross_entropy, z_loss=0.0, label_smoothing=0.0)


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """loss.chunks > 1: the output layer and cross_entropy over `chunks` slices of the tokens, each slice's logits
    recomputed in backward (a checkpointed loop): one slice's logits exist at a time, for one more output
    projection. Takes the hidden states the output layer would have taken."""

    chunks: int
    z_loss: float
    label_smoothing: float

    def _sums(self, hidden, weight, bias, labels):
        logits = F.linear(hidden, weight, bias)
        if self.z_loss:
            return cross_entropy_and_z(logits, labels, self.label_smoothing)
        ce = F.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=self.label_smoothing)
        return ce, torch.zeros((), device=ce.device)

    def __call__(self, hidden, labels, head: nn.Linear):
        ce, z = 0.0, 0.0
        for h, y in zip(hidden.chunk(self.chunks), labels.chunk(self.chunks)):
            parts = checkpoint(self._sums, h, head.weight, head.bias, y, use_reentrant=False)
            ce, z = ce + parts[0], z + parts[1]
        if not self.z_loss:
            return ce / labels.numel(), {}
        z = self.z_loss * z / labels.numel()
        return ce / labels.numel() + z, {"z_loss": z.detach()}


def build_loss(cfg, packed: bool = False) -> LossFn | ChunkedCrossEntropy:
    """packed: the samples are packed documents (fsdp_research.data.packing), whose loss is a sum."""
    if packed:
        return functools.partial(_summed_cross_entropy, label_smoothing=cfg.label_smoothing)
    if cfg.get("_target_"):
        target = resolve(cfg._target_, "loss._target_")
        return functools.partial(_user_loss, functools.partial(target, **_target_kwargs(cfg, target)))
    if cfg.chunks > 1:
        return ChunkedCrossEntropy(cfg.chunks, cfg.z_loss, cfg.label_smoothing)
    return functools.partial(_cross_entropy, z_loss=cfg.z_loss, label_smoothing=cfg.label_smoothing)


def _head(model: nn.Module) -> nn.Module | None:
    return output_layer(model.module if isinstance(model, DistributedDataParallel) else model)


@contextlib.contextmanager
def head_bypassed(model: nn.Module) -> Iterator[tuple[nn.Module, dict]]:
    """The model's output layer passes its input through: the model returns its last hidden states as `logits`
    (checked by bypassed_hidden). Yields (the output layer, what it saw)."""
    head = _head(model)
    # Chunks compute F.linear with its weight: a head whose forward does more (muP's readout scaling, a quantized
    # layer, a hook) would train on another loss.
    plain = head is not None and type(head).forward is nn.Linear.forward
    if not plain or head._forward_hooks or head._forward_pre_hooks:
        raise ConfigError(
            "loss.chunks",
            f"{type(model).__name__}'s output layer is not a plain nn.Linear, which chunks compute",
            "use loss.chunks=1",
        )
    seen = {}

    def passthrough(hidden):
        seen["hidden"], seen["version"] = hidden, hidden._version
        return hidden

    head.forward = passthrough
    try:
        with warnings.catch_warnings():
            # The model now returns a view of its hidden states, which FSDP2 warns an in-place op could make wrong
            # ("can produce wrong gradients"); none changes it in place (bypassed_hidden checks its version).
            warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
            yield head, seen
    finally:
        del head.forward


def bypassed_hidden(logits: torch.Tensor, seen: dict) -> torch.Tensor:
    """What the model returned, where it is the hidden states the output layer got, untouched (a view of all of
    them counts: transformers slices by logits_to_keep; the returned tensor carries FSDP's backward hooks). A
    model that scales or soft-caps its logits after the output layer (Gemma 2, Cohere, Granite) would train on a
    different loss in chunks: refused."""
    hidden = seen.get("hidden")
    base = hidden if hidden is None or hidden._base is None else hidden._base
    same = logits is hidden or (logits._base is base and logits._base is not None)
    if not (
        same
        and logits.shape == hidden.shape
        and logits.stride() == hidden.stride()
        and logits.storage_offset() == hidden.storage_offset()
        and hidden._version == seen["version"]
    ):
        raise ConfigError(
            "loss.chunks",
            "the model changes its logits after the output layer (scaling, soft-capping), which chunks would skip",
            "use loss.chunks=1",
        )
    return logits


def check_chunked(model: nn.Module, cfg: LossConfig, device: torch.device) -> None:
    """loss.chunks > 1: check_chunkable on the built model (a collective under FSDP: every rank calls it)."""
    if cfg.chunks <= 1:
        return
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    with torch.no_grad():
        check_chunkable(inner, device)
    reshard(inner)


def check_chunkable(model: nn.Module, device: torch.device) -> None:
    """A two-token forward with the output layer bypassed (a collective under FSDP): the model must return what
    its output layer makes, untouched. Raises ConfigError."""
    # Eager: a compiled block would be compiled for this shape first, and recompiled for the batch's.
    with head_bypassed(model) as (_, seen), torch.compiler.set_stance("force_eager"):
        out = model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    bypassed_hidden(out.logits, seen)


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


def step_weight(
    targets: torch.Tensor | None, micro_steps: int, lay: Layout
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(what each micro-batch's summed loss is weighted by, the step's targets) of this rank's samples' targets (an
    objective's, train.objectives). The step's loss (the trainer divides by micro_steps, FSDP averages the
    gradients over the data-parallel and cp ranks) is then the mean over the step's targets on every micro-batch
    and rank: the weight is (world / tp / pp) x micro_steps / the targets (a collective; the tp and cp ranks of a
    group, and a pipeline's stages, hold the same batch, each cp rank its chunk of each sequence). (None, None) for
    no targets."""
    if targets is None:
        return None, None
    total = targets.sum().float()
    dist.all_reduce(total)
    total = total / (lay.tp * lay.cp * lay.pp)
    # No target in the whole step (all padding): a zero loss, not a division by zero.
    return lay.world_size // (lay.tp * lay.pp) * micro_steps / total.clamp(min=1), total


def train_loss(
    model: nn.Module,
    batch: torch.Tensor,
    amp,
    loss_fn: LossFn | None = None,
    router: Router | None = None,
    weight: torch.Tensor | None = None,
    split: ContextSplit | None = None,
):
    """(loss, to log) of a batch of seq_len + 1 tokens (this rank's chunks of them under context parallel: `split`),
    or of packed samples (their summed loss times `weight`: see step_weight): the configured next-token loss (and
    its parts to log), plus the router's weighted load-balancing loss; for a mixture of experts, its aux loss and the
    tokens routed to each expert (summed over its MoE layers) to log, where the family computes them (a router
    trained without an aux loss has none)."""
    chunked = isinstance(loss_fn, ChunkedCrossEntropy)
    inputs, labels, kwargs = model_inputs(batch, split)
    with amp, head_bypassed(model) if chunked else contextlib.nullcontext((None, None)) as (head, seen):
        out = model(input_ids=inputs, **kwargs, **({"output_router_logits": True} if router else {}))
        logits = getattr(out, "logits", None)
        if logits is None:
            raise ConfigError(
                "model._target_",
                f"the model's forward returned a {type(out).__name__} without .logits",
                "return an object with .logits (e.g. transformers' CausalLMOutput)",
            )
        if chunked:
            loss, stats = loss_fn(bypassed_hidden(logits, seen).flatten(0, 1), labels, head)
    if not chunked:
        loss, stats = (loss_fn or _plain)(logits.flatten(0, 1), labels)
    if weight is not None:
        loss = loss * weight
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


def model_inputs(
    batch: torch.Tensor, split: ContextSplit | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(input ids, flat labels, other forward arguments) of windows of seq_len + 1 tokens (this rank's chunks and
    their positions under context parallel), or of packed samples ([n, 3, seq_len]: their position ids restart at
    each document)."""
    if batch.dim() == 3:
        return batch[:, INPUTS], batch[:, LABELS].flatten(), {"position_ids": batch[:, POSITIONS]}
    if split is not None:
        inputs, labels, positions = split.local(batch[:, :-1], batch[:, 1:])
        return inputs, labels.flatten(), {"position_ids": positions}
    return batch[:, :-1], batch[:, 1:].flatten(), {}


def target_count(batch: torch.Tensor) -> torch.Tensor:
    """The batch's targets, per sample (a window of tokens: all of its seq_len)."""
    if batch.dim() == 3:
        return (batch[:, LABELS] != IGNORE).sum(1)
    return torch.full((len(batch),), batch.shape[1] - 1, device=batch.device)


def token_losses(
    model: nn.Module, batch: torch.Tensor, amp, chunks: int = 1, split: ContextSplit | None = None
) -> torch.Tensor:
    """Each position's cross-entropy, [batch, seq_len] (0 where it is no target; this rank's positions under context
    parallel); with chunks > 1 (no grad: eval) the logits of 1/chunks of the tokens at a time, as loss.chunks
    trains."""
    inputs, labels, kwargs = model_inputs(batch, split)
    if chunks == 1:
        with amp:
            logits = model(input_ids=inputs, **kwargs).logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels, reduction="none").view(len(batch), -1)
    with amp, head_bypassed(model) as (head, seen):
        hidden = bypassed_hidden(model(input_ids=inputs, **kwargs).logits, seen).flatten(0, 1)
        parts = [
            F.cross_entropy(F.linear(h, head.weight, head.bias).float(), y, reduction="none")
            for h, y in zip(hidden.chunk(chunks), labels.chunk(chunks))
        ]
    return torch.cat(parts).view(len(batch), -1)
