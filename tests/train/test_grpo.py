"""GRPO's arithmetic (fsdp_research.objectives.grpo_loss) against TRL's: the advantages as its GRPOTrainer computes
them from the same rewards (None: not applicable), and for fixed completions, masks, advantages and old and
reference log-probabilities, each loss type at each importance-sampling level equal to GRPOTrainer._compute_loss in
one process and one micro-batch (1e-6, fp32), its gradients and its metrics (kl, entropy, clip_ratio/*) too; the
reward functions' values checked (None: not applicable; a wrong count or a non-number named with the prompt) and
the functions themselves before any compute."""

import pytest
import torch
from trl.trainer.utils import nanstd

from fsdp_research.errors import ConfigError
from fsdp_research.objectives.grpo_loss import (
    LEVELS,
    LOSS_TYPES,
    PolicyLoss,
    group_advantages,
    policy_metrics,
    policy_stats,
    reward_metrics,
)
from fsdp_research.objectives.rewards import build_rewards, score
from tests.helpers.chats import chat_llama

N, T, GROUP = 6, 7, 3


def _rewards() -> torch.Tensor:
    """Two functions over two groups of three: a function's None (NaN) for some, both for one completion."""
    nan = float("nan")
    return torch.tensor([[1.0, 0.5], [0.0, nan], [2.0, 1.0], [nan, nan], [1.0, 0.0], [3.0, nan]])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trl_s(scale):
    """TRL's sum_then_normalize: the weighted sum of the applicable functions, a completion no function scored
    left out of its group's mean and given 0; its std (Bessel's, NaN-aware: TRL's nanstd) plus 1e-4."""
    rewards, weights = _rewards(), torch.tensor([1.0, 0.5])
    total = (rewards * weights).nansum(1)
    total[3] = float("nan")
    grouped = total.view(-1, GROUP)
    mean = torch.nanmean(grouped, 1).repeat_interleave(GROUP)
    std = {"group": nanstd(grouped, dim=1).repeat_interleave(GROUP), "batch": nanstd(total), "none": None}[scale]
    expected = torch.nan_to_num((total - mean) / (std + 1e-4) if std is not None else total - mean, nan=0.0)
    ours = group_advantages(rewards, weights, GROUP, scale)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    assert ours[3] == 0 and ours[:3].sum().abs() < 1e-5  # the unscored one; a group's advantages sum to zero


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_reward_metrics_are_trl_s(scale):
    """As GRPOTrainer logs them: the unscored completion out of reward and reward_std (nanstd), each function's
    nanmean and nanstd, the share of completions whose group's (or batch's) rewards do not vary."""
    rewards, weights = _rewards(), torch.tensor([1.0, 0.5])
    rewards[:3, 0] = 1.0  # the first group's rewards all equal: its std 0
    rewards[:3, 1] = 0.0
    total = (rewards * weights).nansum(1)
    total[3] = float("nan")
    spread = nanstd(total.view(-1, GROUP), dim=1).repeat_interleave(GROUP) if scale == "group" else nanstd(total)
    got = reward_metrics(rewards, weights, GROUP, scale, ["a", "b"])
    assert got["reward"] == pytest.approx(torch.nanmean(total).item())
    assert got["reward_std"] == pytest.approx(nanstd(total).item())
    zero = torch.isclose(spread, torch.zeros_like(spread)).float().mean().item()
    assert got["frac_reward_zero_std"] == pytest.approx(zero) and (zero == 0.5) == (scale == "group")
    for j, name in enumerate("ab"):
        assert got[f"rewards/{name}/mean"] == pytest.approx(torch.nanmean(rewards[:, j]).item())
        assert got[f"rewards/{name}/std"] == pytest.approx(nanstd(rewards[:, j]).item())


def test_a_group_of_equal_rewards_has_no_advantage():
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    assert group_advantages(rewards, torch.ones(1), 3, "group").abs().max() == 0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_llama(str(tmp_path_factory.mktemp("grpo") / "model"))


def _inputs():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(N, T, generator=g) * 3
    old = logps + (torch.rand(N, T, generator=g) - 0.5) * 0.8  # ratios beyond 1 +- 0.2 and 0.28: clipped
    ref = logps + (torch.rand(N, T, generator=g) - 0.5)
    lengths = torch.tensor([7, 3, 1, 5, 7, 2])
    mask = (torch.arange(T) < lengths[:, None]).long()
    advantages = torch.randn(N, generator=g)
    return logps, old, ref, mask, advantages


ENTROPY = torch.rand(N, T, generator=torch.Generator().manual_seed(1)) * 4


def _trl_loss(model_dir: str, tmp_path, logps: torch.Tensor, **settings) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPOTrainer._compute_loss of one micro-batch and the metrics it logged, the policy's log-probabilities (and
    entropies) handed in."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=N,
        num_generations=GROUP,
        max_completion_length=T,
        disable_tqdm=True,
        **settings,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * N),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer.current_gradient_accumulation_steps = 1  # one micro-batch a step (the Trainer sets it when training)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logps, ENTROPY, None)
    _, old, ref, mask, advantages = _inputs()
    inputs = {
        "prompt_ids": torch.ones(N, 2, dtype=torch.long),
        "prompt_mask": torch.ones(N, 2, dtype=torch.long),
        "completion_ids": torch.ones(N, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    return loss, {k: v[-1] for k, v in trainer._metrics["train"].items()}


@pytest.mark.slow  # a GRPOTrainer built for each case (~1.5 s each)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_is_trl_s_and_so_are_its_gradients(model_dir, tmp_path, loss_type, level):
    """With the KL to the reference (beta 0.04, times the importance ratio as TRL's default) and DAPO's higher upper
    clip (0.28); dapo without either too, and with the KL unweighted."""
    cases = [dict(beta=0.04, epsilon_high=0.28)]
    if loss_type == "dapo":  # neither; the KL without its importance weight
        cases += [dict(beta=0.0), dict(beta=0.04, use_bias_correction_kl=False)]
    for settings in cases:
        logps, old, ref, mask, advantages = _inputs()
        theirs_in = logps.clone().requires_grad_()
        theirs, their_metrics = _trl_loss(
            model_dir, tmp_path, theirs_in, loss_type=loss_type, importance_sampling_level=level, **settings
        )
        theirs.backward()
        ours_in = logps.clone().requires_grad_()
        loss = PolicyLoss(loss_type, level, max_completion_length=T, **settings)
        terms = loss(ours_in, old, advantages, mask, ref if settings["beta"] else None)
        (terms.total / terms.count).backward()
        torch.testing.assert_close(terms.total / terms.count, theirs.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=1e-6, atol=1e-7)
        metrics = policy_metrics(*policy_stats(loss, terms, ENTROPY, advantages, mask), loss)
        assert metrics.keys() == {k for k in their_metrics if k == "entropy" or k.startswith(("kl", "clip_ratio"))}
        assert metrics == pytest.approx({k: their_metrics[k] for k in metrics}, rel=1e-6)
        assert metrics["clip_ratio/region_mean"] > 0 or level == "sequence"  # a completion's mean ratio: in the clip
        assert metrics.get("kl", 1) > 0


def test_a_reward_that_is_none_a_wrong_count_or_no_number_is_said_so():
    names, funcs, weights = build_rewards(
        ["tests.helpers.rewards.matches_answer", "tests.helpers.rewards.digits"], None
    )
    columns = {
        "prompts": ["a", "b"],
        "completions": ["it is 4", "x"],
        "completion_ids": [[1], [2]],
        "answer": ["4", None],
    }
    rewards, error = score(names, funcs, columns, [7, 9])
    assert error is None and rewards[0].tolist() == [1.0, 1 / 7] and rewards[1, 0].isnan() and rewards[1, 1] == 0
    assert weights.tolist() == [1.0, 1.0]
    _, error = score(*build_rewards(["tests.helpers.rewards.too_few"], None)[:2], columns, [7, 9])
    want = "reward function too_few returned 1 values for 2 completions (prompt 7 first): return one float or None"
    assert error == f"{want} per completion"
    _, error = score(["text"], [lambda **kw: [1.0, "1"]], columns, [7, 9])
    assert error == "reward function text returned '1' for a completion of prompt 9: not a number"


def test_reward_functions_are_checked_before_any_compute():
    with pytest.raises(ConfigError, match=r"^objective.reward_funcs: is empty: GRPO learns from rewards; fix: "):
        build_rewards([], None)
    with pytest.raises(
        ConfigError, match=r"^objective.reward_funcs\[0\]: module 'tests.helpers.rewards' has no attribute 'nope'"
    ):
        build_rewards(["tests.helpers.rewards.nope"], None)
    with pytest.raises(ConfigError, match=r"^objective.reward_weights: 2 weights for 1 functions; fix: give one each$"):
        build_rewards(["tests.helpers.rewards.digits"], [1.0, 2.0])
    with pytest.raises(ConfigError, match=r"^objective.reward_funcs\[0\]: 3 names no function; fix: "):
        build_rewards([3], None)
