"""GRPO's arithmetic, as TRL's GRPOTrainer computes it: group-relative advantages from each completion's rewards, and
the clipped policy loss of a micro-batch's completions with its KL to the reference, for each loss type (grpo, bnpo,
dr_grpo, dapo) and importance-sampling level (token; sequence: GSPO). The loss comes as a sum and the count it is a
mean over, which the trainer sums over every rank and micro-batch: one rank's run equals N ranks' (TRL normalises
grpo, bnpo and dr_grpo per process and micro-batch; normalised globally, bnpo is dapo)."""

from dataclasses import dataclass
from typing import NamedTuple

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation over the values that are not NaN (NaN where fewer than two are)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True) * count / (count - 1)
    return torch.where(count > 1, variance, torch.nan).sqrt().squeeze(dims)


def weighted_total(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's weighted sum of the functions that scored it (NaN: a function's None); NaN where none did."""
    return (rewards * weights).nansum(dim=1).masked_fill(torch.isnan(rewards).all(dim=1), torch.nan)


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str) -> torch.Tensor:
    """Each completion's advantage from `rewards` [completions, functions] (NaN: a function's None, not applicable),
    the completions of a prompt `group` consecutive rows: the functions' weighted sum less its group's mean, over the
    group's standard deviation (scale "group"), the batch's ("batch") or none ("none"), plus 1e-4; 0 for a completion
    every function left unscored."""
    total = weighted_total(rewards, weights)
    grouped = total.view(-1, group)
    advantages = total - torch.nanmean(grouped, dim=1).repeat_interleave(group)
    if scale == "group":
        advantages = advantages / (nanstd(grouped, dim=1).repeat_interleave(group) + 1e-4)
    elif scale == "batch":
        advantages = advantages / (nanstd(total) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


class Terms(NamedTuple):
    """A micro-batch's policy loss: summed over what it is a mean of, and that count; for the metrics, the
    importance ratios ([n, T], or [n, 1] a completion at the sequence level) and the KL to the reference token by
    token as the loss weighs it ([n, T]; None without a reference)."""

    total: torch.Tensor
    count: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None


@dataclass(frozen=True)
class PolicyLoss:
    """objective=grpo's loss settings (TRL's GRPOConfig names)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon: float = 0.2
    # The upper clip (DAPO's clip-higher); None: epsilon.
    epsilon_high: float | None = None
    # The weight of the k3 estimate of the KL to the reference; 0: no reference.
    beta: float = 0.0
    # dr_grpo's constant: each completion counts this many tokens.
    max_completion_length: int = 256
    # The KL term times the importance ratio (DeepSeek-V3.2's unbiased reverse-KL gradient; TRL's default).
    use_bias_correction_kl: bool = True

    @property
    def upper(self) -> float:
        """The upper clip's epsilon."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __call__(
        self,
        logps: torch.Tensor,
        old_logps: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logps: torch.Tensor | None = None,
    ) -> Terms:
        """The loss terms of completions whose sampled tokens have log-probabilities `logps` [n, T] under the policy
        (old_logps: when sampled; ref_logps: the reference's), `advantages` [n] and `mask` [n, T] (1: a completion
        token)."""
        mask = mask.to(logps.dtype)
        log_ratio = logps - old_logps
        if self.importance_sampling_level == "sequence":  # GSPO: one ratio a completion, of its mean log-ratio
            log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        ratio = torch.exp(log_ratio)
        a = advantages.unsqueeze(1)
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - self.epsilon, 1 + self.upper) * a)
        kl = None
        if self.beta:  # k3: exp(d) - d - 1 of d = log ref / policy, token by token
            delta = ref_logps - logps
            kl = torch.exp(delta) - delta - 1
            kl = kl * ratio if self.use_bias_correction_kl else kl
            per_token = per_token + self.beta * kl
        per_token = per_token.expand_as(mask)
        n = torch.tensor(float(len(mask)), device=mask.device)
        if self.loss_type == "grpo":  # each completion's mean, averaged over completions
            total = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
        else:
            total = (per_token * mask).sum()
        if self.loss_type == "dr_grpo":  # over a constant length a completion
            n = n * self.max_completion_length
        elif self.loss_type != "grpo":  # bnpo, dapo: over the completion tokens
            n = mask.sum()
        return Terms(total, n, ratio, kl)

    def clipped(self, ratio: torch.Tensor, advantages: torch.Tensor) -> dict[str, torch.Tensor]:
        """TRL's clip flags (low: a ratio under 1 - epsilon with a negative advantage, high: over the upper clip with
        a positive one, region: either), shaped as `ratio`."""
        a = advantages.unsqueeze(1)
        low, up = (ratio < 1 - self.epsilon) & (a < 0), (ratio > 1 + self.upper) & (a > 0)
        return {"low": low, "high": up, "region": low | up}


def policy_stats(
    policy: PolicyLoss, terms: Terms, entropy: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's share of TRL's kl, entropy and clip_ratio metrics: (the sums of the KL and the entropy over
    the completion tokens, of the clip flags over the tokens (over the completions at the sequence level), and those
    two counts; the least share of low-clipped tokens a completion has and the greatest of high-clipped ones)."""
    mask = mask.double()
    kl = (terms.kl.detach() * mask).sum() if terms.kl is not None else mask.new_zeros(())
    flags = {k: f.double() for k, f in policy.clipped(terms.ratio.detach(), advantages).items()}
    if policy.importance_sampling_level == "token":
        each = {k: (f * mask).sum(-1) / mask.sum(-1).clamp(min=1.0) for k, f in flags.items()}
        clips, counted = [(f * mask).sum() for f in flags.values()], mask.sum()
    else:  # one ratio, and flag, a completion
        each = {k: f[:, 0] for k, f in flags.items()}
        clips, counted = [e.sum() for e in each.values()], mask.new_tensor(float(len(mask)))
    sums = torch.stack([kl, (entropy.double() * mask).sum(), *clips, mask.sum(), counted])
    return sums, torch.stack([each["low"].min(), each["high"].max()])


def policy_metrics(sums: torch.Tensor, extremes: torch.Tensor, policy: PolicyLoss) -> dict[str, float]:
    """TRL's names for policy_stats' sums and extremes (over a step: every micro-batch's and rank's)."""
    kl, entropy, low, high, region, tokens, counted = sums.tolist()
    out = {"kl": kl / max(tokens, 1.0)} if policy.beta else {}
    out["entropy"] = entropy / max(tokens, 1.0)
    for name, value in (("low_mean", low), ("high_mean", high), ("region_mean", region)):
        out[f"clip_ratio/{name}"] = value / max(counted, 1.0)
    out["clip_ratio/low_min"], out["clip_ratio/high_max"] = extremes.tolist()
    return out


def reward_metrics(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str, names: list[str]):
    """TRL's (sum_then_normalize): the weighted reward's mean and standard deviation over the step's completions
    (those no function scored left out), each function's, and the share of completions whose group's rewards (the
    batch's, scale_rewards batch) do not vary."""
    total = weighted_total(rewards, weights)
    spread = nanstd(total).expand_as(total) if scale == "batch" else nanstd(total.view(-1, group), 1)
    zero = torch.isclose(spread, torch.zeros_like(spread)).double()
    out = {
        "reward": torch.nanmean(total).item(),
        "reward_std": nanstd(total).item(),
        "frac_reward_zero_std": zero.mean().item(),
    }
    for j, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards[:, j]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards[:, j]).item()
    return out
