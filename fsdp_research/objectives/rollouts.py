"""Rollouts for online RL (objective=grpo): completions sampled from the policy as it is, in this process, by the
sharded model itself (FSDP gathers each block for every forward), batched, with a KV cache. A completion's tokens are
a function of its key (the run's seed, the step, the prompt's index, the generation) and the logits alone: the noise
at each position is a counter-based hash of the key and the position (Gumbel-max over the temperature-scaled,
top-p filtered logits, transformers' TopPLogitsWarper), not a generator's stream that the batch's make-up would
shift; so the same completions come out at any world size and after a resume. Every rank runs the same number of
decode steps: they agree after each whether any sequence is unfinished (FSDP's forwards are collectives)."""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import DynamicCache
from transformers.generation.logits_process import TopPLogitsWarper

from fsdp_research.data.sampling import key
from fsdp_research.distributed.sharding import kept_gathered

_LOW32 = 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32, a bijective hash of 32-bit values held in int64 (a product's wrap keeps its low 32 bits right): the
    same bits on any device."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LOW32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _LOW32
    return x ^ (x >> 16)


def noise_keys(parts: list[tuple[int, ...]]) -> torch.Tensor:
    """The keys gumbel_noise takes (int64 holding 32-bit values) of each sequence's fsdp_research.data.sampling.key
    parts."""
    return torch.tensor([key(*p) & _LOW32 for p in parts])


def gumbel_noise(keys: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """[n, vocab] standard Gumbel noise for the sequences of `keys` (int64, 32-bit values) at `position`."""
    at = _hash32(keys ^ _hash32(torch.full_like(keys, position)))
    bits = _hash32(at[:, None] ^ torch.arange(vocab, device=keys.device))
    uniform = (bits.double() + 0.5) / 2**32
    return -torch.log(-torch.log(uniform))


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Rollout:
    """[n, max_tokens] each: the completions' tokens (pad after the end), which are theirs (up to and including the
    stop token), and each token's log-probability under the temperature-scaled logits (before top-p: what the
    trainer computes of them)."""

    ids: torch.Tensor
    mask: torch.Tensor
    logps: torch.Tensor


def sample_next(
    logits: torch.Tensor, keys: torch.Tensor, position: int, s: Sampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next token of each sequence, its log-probability) from the last position's logits [n, vocab]."""
    scaled = logits.float() / s.temperature
    kept = TopPLogitsWarper(s.top_p)(None, scaled) if s.top_p < 1 else scaled
    token = (kept.double() + gumbel_noise(keys, position, logits.shape[-1])).argmax(-1)
    return token, scaled.log_softmax(-1).gather(-1, token[:, None])[:, 0]


def _any_unfinished(done: torch.Tensor) -> bool:
    """Whether a sequence on any rank is unfinished (a collective: every rank decodes as many steps)."""
    flag = (~done).any().to(torch.int32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: torch.Tensor,
    real: torch.Tensor,
    keys: torch.Tensor,
    s: Sampling,
    stop: set[int],
    pad: int,
    gather: bool = True,
) -> Rollout:
    """Completions of `prompts` [n, P] (left-padded; `real` marks their tokens), sequence i's noise from keys[i]. The
    model in eval mode meanwhile; `gather`: its FSDP units' parameters gathered once, after the prompt's forward,
    and kept so to the end (else gathered for each token's forward). A collective: every rank calls it, with as many
    sequences."""
    n, device = len(prompts), prompts.device
    ids = torch.full((n, s.max_tokens), pad, dtype=torch.long, device=device)
    mask = torch.zeros(n, s.max_tokens, dtype=torch.bool, device=device)
    logps = torch.zeros(n, s.max_tokens, device=device)
    attention = real.long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    stops = torch.tensor(sorted(stop), device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    cache, step_ids = DynamicCache(), prompts
    with contextlib.ExitStack() as stack:
        stack.callback(model.train, model.training)
        model.eval()
        for t in range(s.max_tokens):
            inputs = {"input_ids": step_ids, "attention_mask": attention, "position_ids": positions}
            out = model(**inputs, cache=cache, use_cache=True, logits_to_keep=1)
            if t == 0 and gather:
                stack.enter_context(kept_gathered(model))
            token, logp = sample_next(out.logits[:, -1], keys, t, s)
            ids[:, t] = torch.where(done, pad, token)
            mask[:, t], logps[:, t] = ~done, torch.where(done, 0.0, logp)
            done = done | torch.isin(token, stops)
            if t + 1 == s.max_tokens or not _any_unfinished(done):
                break
            step_ids, positions = ids[:, t : t + 1], positions[:, -1:] + 1
            attention = torch.cat([attention, torch.ones(n, 1, dtype=attention.dtype, device=device)], dim=1)
    return Rollout(ids, mask, logps)


def first_column(real: torch.Tensor) -> int:
    """The first column of left-padded rows [n, T] (True: a token) that holds a token of any row."""
    return int(real.any(0).int().argmax())


def length_metrics(rollout: Rollout, stop: set[int]) -> dict[str, float]:
    """Of every rank's completions (a collective): their mean length, the share that ended without a stop token
    (cut at max_completion_length)."""
    lengths = rollout.mask.sum(1)
    last = rollout.ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    cut = ~torch.isin(last, torch.tensor(sorted(stop), device=last.device))
    sums = torch.stack([lengths.double().sum(), cut.double().sum(), torch.tensor(len(lengths), device=cut.device)])
    dist.all_reduce(sums)
    return {
        "completions/mean_length": (sums[0] / sums[2]).item(),
        "completions/clipped_ratio": (sums[1] / sums[2]).item(),
    }
