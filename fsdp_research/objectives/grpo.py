"""objective=grpo: GRPO and its variants (Dr. GRPO, DAPO, GSPO) on data=prompts, as TRL's GRPOTrainer runs them.
Each step: every prompt of this data-parallel rank's share num_generations times, completed by the policy as it is
(fsdp_research.objectives.rollouts: the same completions at any world size and after a resume), scored by the
reward functions (fsdp_research.objectives.rewards), their group-relative advantages taken over the whole step's
completions; then the clipped policy loss (fsdp_research.objectives.grpo_loss) of the completions, normalised over
the step's (every rank's and micro-batch's) as the loss type says. trainer.global_batch_size counts completions, as
TRL's. With objective.beta > 0, the k3 estimate of the KL to the reference (objectives.reference: the policy with its
adapters off under LoRA, else a frozen copy of the initial weights or of objective.reference's directory) joins the
loss. Metrics with TRL's names: reward, reward_std, frac_reward_zero_std, rewards/<function>/mean and /std,
completions/mean_length, completions/clipped_ratio, kl, entropy, clip_ratio/low_mean, low_min, high_mean, high_max
and region_mean (means over the step's completion tokens, every rank's and micro-batch's)."""

import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig

from fsdp_research.callbacks.footprint import PlannedGeneration, PlannedRank
from fsdp_research.config.data_schema import DataKind
from fsdp_research.data.chat import chat_tokenizer, prompt_rendering
from fsdp_research.data.pipeline import Data
from fsdp_research.data.prompts import DOCUMENT, TOKENS
from fsdp_research.distributed.mesh import data_parallel, one_per_data_rank
from fsdp_research.distributed.precision import forward_autocast
from fsdp_research.distributed.sharding import reshard
from fsdp_research.errors import ConfigError
from fsdp_research.model.lora import enabled
from fsdp_research.objectives.base import Objective, StepContext
from fsdp_research.objectives.grpo_loss import (
    LEVELS,
    LOSS_TYPES,
    SCALES,
    PolicyLoss,
    group_advantages,
    policy_metrics,
    policy_stats,
    reward_metrics,
    weighted_total,
)
from fsdp_research.objectives.reference import check_directory, frozen_copy, reference_model
from fsdp_research.objectives.rewards import agree_on_errors, build_rewards, reward_columns, score, text_of
from fsdp_research.objectives.rollouts import Rollout, Sampling, first_column, generate, length_metrics, noise_keys
from fsdp_research.train.evaluation import held_out_sums

# The purposes a rollout's keys are drawn for (fsdp_research.data.sampling.key's parts): a step's, an eval's.
_ROLLOUT, _EVAL = 7, 8


class GRPO(Objective):
    reads = (DataKind.prompts,)

    def __init__(
        self,
        reward_funcs: list | None = None,
        reward_weights: list | None = None,
        num_generations: int = 8,
        max_completion_length: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        loss_type: str = "dapo",
        importance_sampling_level: str = "token",
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        num_iterations: int = 1,
        scale_rewards: str = "group",
        reference: str = "auto",
        gather_for_generation: bool = True,
    ):
        self.reward_funcs, self.reward_weights = list(reward_funcs or []), reward_weights
        self.reference, self.directory = reference, None if reference == "auto" else reference
        self.group, self.scale = num_generations, scale_rewards
        self.sampling = Sampling(max_completion_length, temperature, top_p)
        self.iterations, self.gather = num_iterations, gather_for_generation
        self.policy = PolicyLoss(
            loss_type, importance_sampling_level, epsilon, epsilon_high, beta, max_completion_length
        )

    def check(self, cfg: DictConfig) -> None:
        for name, value, allowed in [
            ("loss_type", self.policy.loss_type, LOSS_TYPES),
            ("importance_sampling_level", self.policy.importance_sampling_level, LEVELS),
            ("scale_rewards", self.scale, SCALES),
        ]:
            if value not in allowed:
                raise ConfigError(f"objective.{name}", f"{value!r} is not one of {', '.join(allowed)}", "pick one")
        s, t = self.sampling, cfg.trainer
        if self.group < 2:
            raise ConfigError("objective.num_generations", f"{self.group}: a group of one has no advantage", "use 2+")
        if s.max_tokens < 1:
            raise ConfigError("objective.max_completion_length", f"{s.max_tokens} is below 1", "use e.g. 256")
        if s.temperature <= 0 or not 0 < s.top_p <= 1:
            raise ConfigError(
                "objective.temperature", f"{s.temperature} (top_p {s.top_p})", "temperature > 0 and top_p in (0, 1]"
            )
        if self.policy.beta < 0:
            raise ConfigError("objective.beta", f"{self.policy.beta} is below 0", "use 0 (no reference) or e.g. 0.04")
        if self.directory and not self.policy.beta:
            raise ConfigError("objective.reference", "is read only for the KL, and objective.beta is 0", "set beta > 0")
        check_directory(self.reference, ("auto",), cfg)
        if not isinstance(self.iterations, int) or self.iterations < 1:
            raise ConfigError(
                "objective.num_iterations", f"{self.iterations} is not a whole number of 1 or more", "use e.g. 1 or 2"
            )
        if cfg.data.eval_paths or cfg.data.eval_sources:
            given = "data.eval_paths" if cfg.data.eval_paths else "data.eval_sources"
            raise ConfigError(given, "objective=grpo evaluates held-out prompts only", "use data.eval_fraction")
        if t.global_batch_size % self.group:
            raise ConfigError(
                "trainer.global_batch_size",
                f"{t.global_batch_size} completions are not whole groups of objective.num_generations={self.group}",
                f"use a multiple of {self.group}",
            )
        build_rewards(self.reward_funcs, self.reward_weights)

    @classmethod
    def planned_bytes(cls, rank: PlannedRank, beta: float = 0.0, reference: str = "auto", **_) -> int:
        """What the planner counts (as a callback's state): the reference's copy of the rank's parameters, if any."""
        return 0 if not beta or (reference == "auto" and rank.adapters) else rank.param_bytes

    @classmethod
    def planned_sequence(cls, seq_len: int, max_completion_length: int = 256, **_) -> tuple[int, int, int]:
        """A prompt (data.seq_len at most) and its completion; the loss takes the completion's logits alone, and
        holds two fp32 tensors of them besides: their log-probabilities and the entropy's p log p."""
        return seq_len + max_completion_length, max_completion_length + 1, 2

    @classmethod
    def planned_generation(
        cls, max_completion_length: int = 256, gather_for_generation: bool = True, **_
    ) -> PlannedGeneration:
        return PlannedGeneration(max_completion_length, gather_for_generation)

    def setup(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.names, self.funcs, self.weights = build_rewards(self.reward_funcs, self.reward_weights)
        # A step's share of the no-grad forwards each rollout batch runs once: the reference's, the old policy's.
        self.reference_forwards = ((1 if self.policy.beta else 0) + (self.iterations > 1)) / self.iterations
        self.tok = chat_tokenizer(cfg.data)
        self.conversational = prompt_rendering(cfg.data) == "chat"

    def prepare(self, model: nn.Module, device: torch.device, data: Data) -> None:
        self.windows, self.device = data.stream.windows[0], device
        self.amp = forward_autocast(self.cfg, device)
        self.model = None  # the policy, its adapters off: the reference
        self.rows: list[dict[str, str]] = []
        if self.policy.beta and (self.directory or not enabled(self.cfg.model.lora)):
            self.model = frozen_copy(self.cfg, device, self.directory)
        # TRL's: the tokenizer's end of sequence and every one the model's generation config names.
        ends = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.stop = {self.tok.eos_token_id, *([ends] if isinstance(ends, int) else ends or [])} - {None}
        # The ranks of a tp group read the same prompts and generate the same completions.
        self.rank, self.ranks = data_parallel(self.cfg.parallel.tp)
        ranks, completions = self.ranks, self.cfg.trainer.global_batch_size
        if self.samples_per_step(completions) % ranks:
            raise ConfigError(
                "trainer.global_batch_size",
                f"{completions} completions: {self.samples_per_step(completions)} prompts do not split over {ranks} "
                "data-parallel ranks",
                f"use a multiple of {self.group * ranks}",
            )

    def samples_per_step(self, global_batch_size: int) -> int:
        return global_batch_size // self.group

    def _step_keys(self, completions: int, step: int) -> torch.Tensor:
        """The noise keys of this rank's completions at `step`: by the prompt's place in the step's global batch, not
        its index in the data (a prompt twice in a step, as an epoch ends, gets two groups of completions): the same
        at any world size."""
        first = self.rank * (completions // self.group)
        places = [(first + k // self.group, k % self.group) for k in range(completions)]
        return noise_keys([(self.cfg.trainer.seed, _ROLLOUT, step, j, g) for j, g in places])

    def _rollout(self, model: nn.Module, prompts: torch.Tensor, keys: torch.Tensor) -> Rollout:
        """The completions of `prompts` (sequence i's noise from keys[i]), generated a micro-batch at a time (the same
        shapes at any world size)."""
        parts = []
        for rows in torch.arange(len(prompts)).split(self.cfg.trainer.micro_batch_size):
            p = prompts[rows]
            p = p[..., first_column(p[:, DOCUMENT] >= 0) :]  # no column of padding alone
            real, row_keys = p[:, DOCUMENT] >= 0, keys[rows].to(p.device)
            with self.amp:  # as the training forward computes (torch DDP's autocast; a null context under FSDP)
                parts.append(
                    generate(
                        model, p[:, TOKENS], real, row_keys, self.sampling, self.stop, self.windows.pad_id, self.gather
                    )
                )
        return Rollout(*(torch.cat([getattr(r, f) for r in parts]) for f in ("ids", "mask", "logps")))

    def _columns(self, docs: list[int], rollout: Rollout) -> dict[str, list]:
        """The reward functions' arguments (TRL's): prompts as given, completions (text, or an assistant message for
        conversational prompts), completion_ids, and every other field of the records."""
        records = [self.windows.record(d) for d in docs]
        ids = [row[m].tolist() for row, m in zip(rollout.ids, rollout.mask)]
        texts = self.tok.batch_decode(ids, skip_special_tokens=True)
        return reward_columns(records, self.cfg.data.prompt_field, self.windows.fields, ids, texts, self.conversational)

    def step_batch(self, model: nn.Module, batch: torch.Tensor, step: int) -> torch.Tensor:
        """The step's completions (a collective): generated, scored, their advantages over the whole step's; what
        the micro-batches get is their indices in this rank's rollout, which the objective holds. With
        num_iterations > 1, the steps after one that generated train on its rollouts again (TRL's), their old
        log-probabilities the policy's before the first of them."""
        # clip_ratio/low_min and high_max so far, the step's micro-batches' extremes.
        self.extremes = torch.tensor([1.0, 0.0], dtype=torch.float64, device=self.device)
        rows = torch.arange(len(batch) * self.group, device=batch.device)[:, None]
        if step % self.iterations:
            return rows
        self.generated_at = step
        prompts = batch.repeat_interleave(self.group, 0)
        rollout = self._rollout(model, prompts, self._step_keys(len(prompts), step))
        docs = prompts[:, DOCUMENT].max(1).values.tolist()
        columns = self._columns(docs, rollout)
        # Shown with the logged step: the first completion of each of this rank's first two prompts.
        self.rows = [
            {"prompt": text_of(columns["prompts"][k]), "completion": text_of(columns["completions"][k])}
            for k in range(0, min(len(docs), 2 * self.group), self.group)
        ]
        rewards, error = score(self.names, self.funcs, columns, docs)
        agree_on_errors(error)
        everyone = self._gathered(rewards.to(self.device))
        advantages = group_advantages(everyone, self.weights.to(everyone), self.group, self.scale)
        mine = slice(self.rank * len(rewards), (self.rank + 1) * len(rewards))
        self.logged = reward_metrics(everyone, self.weights.to(everyone), self.group, self.scale, self.names)
        self.logged.update(length_metrics(rollout, self.stop))
        self.step = {
            "tokens": torch.cat([prompts[:, TOKENS], rollout.ids], 1),
            "attention": torch.cat([prompts[:, DOCUMENT] >= 0, rollout.mask], 1).long(),
            "ids": rollout.ids,
            "mask": rollout.mask,
            "advantages": advantages[mine].float(),
        }
        micro = rows.split(self.cfg.trainer.micro_batch_size)
        with torch.no_grad():
            if self.policy.beta:
                with reference_model(self.model, model) as reference:
                    self.step["reference"] = torch.cat([self._logps(reference, r, self.amp)[0] for r in micro])
                if self.model is not None:  # the copy's root keeps its parameters gathered after a forward
                    reshard(self.model)
            if self.iterations > 1:  # TRL's old_per_token_logps: the policy's as it sampled them
                self.step["old"] = torch.cat([self._logps(model, r, self.amp)[0] for r in micro])
        return rows

    def state_dict(self) -> dict[str, torch.Tensor]:
        """With num_iterations > 1: the rollouts the next steps train on again, every data-parallel rank's (a
        collective when they exist; zeros shaped as they will be before), their metrics and the step that generated
        them."""
        if self.iterations == 1:
            return {}
        if not hasattr(self, "step"):
            completions, width = self.cfg.trainer.global_batch_size, self.sampling.max_tokens
            tokens = torch.zeros(completions, self.cfg.data.seq_len + width, dtype=torch.long)
            shapes = {"tokens": tokens, "attention": tokens, "ids": tokens[:, :width], "mask": tokens[:, :width]}
            shapes.update(advantages=torch.zeros(completions), old=torch.zeros(completions, width))
            if self.policy.beta:
                shapes["reference"] = shapes["old"]
            logged = torch.zeros(len(self._logged_names()), dtype=torch.float64)
            return {**{k: v.clone() for k, v in shapes.items()}, "logged": logged, "generated_at": torch.tensor(-1)}
        state = {k: self._gathered(v.long() if v.dtype == torch.bool else v).cpu() for k, v in self.step.items()}
        logged = torch.tensor([self.logged[k] for k in self._logged_names()], dtype=torch.float64)
        return {**state, "logged": logged, "generated_at": torch.tensor(self.generated_at)}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None, step: int) -> None:
        """A resume within a rollout batch's num_iterations takes its rollouts (this rank's rows of them) from the
        checkpoint; one at a step that generates needs none."""
        first = step - step % self.iterations
        if first == step:
            return
        if state is None or int(state["generated_at"]) != first:
            raise ConfigError(
                "objective.num_iterations",
                f"step {step} trains on the rollouts step {first} generated, which the checkpoint does not hold "
                "(saved with other settings: num_iterations, beta, reward_funcs, the batch, data.seq_len, "
                "max_completion_length)",
                "resume with the settings it was saved with",
            )
        n = self.cfg.trainer.global_batch_size // self.ranks
        mine = slice(self.rank * n, (self.rank + 1) * n)
        self.step = {k: v[mine].to(self.device) for k, v in state.items() if k not in ("logged", "generated_at")}
        self.step["mask"] = self.step["mask"].bool()
        self.logged = dict(zip(self._logged_names(), state["logged"].tolist()))
        self.generated_at = first

    def _logged_names(self) -> list[str]:
        """The rollouts' metrics (reward_metrics' and length_metrics'), in order."""
        each = [f"rewards/{name}/{kind}" for name in self.names for kind in ("mean", "std")]
        return [
            "reward",
            "reward_std",
            "frac_reward_zero_std",
            *each,
            "completions/mean_length",
            "completions/clipped_ratio",
        ]

    def _logps(
        self, model: nn.Module, batch: torch.Tensor, amp, entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The micro-batch's completions' tokens' log-probabilities under `model` (of its temperature-scaled logits,
        as sampled) and, where asked (the training forward's metric), each position's entropy (without gradient):
        [n, max_completion_length] each (0 past the micro-batch's longest completion: its forward leaves out the
        columns no sequence of it fills)."""
        rows = batch[:, 0]
        ids, longest = self.step["ids"][rows], int(self.step["mask"][rows].any(0).sum())
        end = self.step["tokens"].shape[1] - ids.shape[1] + longest
        attention = self.step["attention"][rows, :end]
        attention = attention[:, first_column(attention.bool()) :]
        tokens = self.step["tokens"][rows, end - attention.shape[1] : end]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        with amp:  # the completions' logits only (those of their last token's position too: dropped)
            logits = model(
                input_ids=tokens, attention_mask=attention, position_ids=positions, logits_to_keep=longest + 1
            ).logits
        every = (logits[:, :-1].float() / self.sampling.temperature).log_softmax(-1)
        past = (0, ids.shape[1] - longest)
        logps = F.pad(every.gather(-1, ids[:, :longest, None])[..., 0], past)
        if not entropy:
            return logps, None
        with torch.no_grad():  # one temporary over the vocabulary (the planner counts it: planned_sequence)
            return logps, F.pad(-every.exp().mul_(every).sum(-1), past)

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank's rows of x, in their order (a collective; a tp group's ranks hold the same)."""
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(one_per_data_rank(parts, self.cfg.parallel.tp))

    def evaluate(self, model: nn.Module, data: Data, cfg: DictConfig, device: torch.device, amp) -> dict[str, float]:
        """TRL's eval metrics, eval_-prefixed (eval_reward, eval_rewards/<function>/mean,
        eval_completions/mean_length): the held-out prompts (at most trainer.eval_batches micro-batches of their
        completions), each completed num_generations times by the policy as it is, its noise keyed by the prompt (the
        same completions at any world size); means over the completions each function scored (a collective)."""
        t, group = cfg.trainer, self.group
        each = max(1, t.micro_batch_size // group)  # prompts a generation takes
        prompts = min(sum(s.held_out for s in data.stream.splits), t.eval_batches * each)

        def sums_of(batch: torch.Tensor) -> torch.Tensor:
            """Each prompt's sums over its completions: of their weighted reward, each function's and their
            length; then how many of them each scored."""
            batch = batch.repeat_interleave(group, 0)
            docs = batch[:, DOCUMENT].max(1).values.tolist()
            keys = noise_keys([(t.seed, _EVAL, d, k % group) for k, d in enumerate(docs)])
            rollout = self._rollout(model, batch, keys)
            rewards, error = score(self.names, self.funcs, self._columns(docs, rollout), docs)
            agree_on_errors(error)
            lengths = rollout.mask.sum(1, keepdim=True).cpu().double()
            values = torch.cat([weighted_total(rewards, self.weights.to(rewards))[:, None], rewards, lengths], 1)
            sums = torch.cat([values.nan_to_num(0.0), (~values.isnan()).double()], 1)
            return sums.view(-1, group, sums.shape[1]).sum(1).to(device)

        read = functools.partial(data.batch, held_out=True)
        values, counts = held_out_sums(model, read, prompts, each, device, sums_of, cfg.parallel.tp).chunk(2)
        means = (values / counts.clamp(min=1)).tolist()
        out = {"eval_reward": means[0], "eval_completions/mean_length": means[-1]}
        out.update({f"eval_rewards/{name}/mean": means[1 + j] for j, name in enumerate(self.names)})
        return out

    def shown(self) -> list[dict[str, str]]:
        """The last rollouts' first completions, once (num_iterations > 1: the logged step may train them again)."""
        rows, self.rows = self.rows, []
        return rows

    def trained_tokens(self, batch: torch.Tensor) -> torch.Tensor:
        return self.step["attention"].sum()

    def targets(self, batch: torch.Tensor) -> torch.Tensor:
        """What the loss type averages over: completions (grpo), max_completion_length tokens a completion
        (dr_grpo), or completion tokens (bnpo, dapo)."""
        mask = self.step["mask"][batch[:, 0]]
        if self.policy.loss_type == "grpo":
            return torch.ones(len(mask), device=mask.device)
        if self.policy.loss_type == "dr_grpo":
            return torch.full((len(mask),), float(self.policy.max_completion_length), device=mask.device)
        return mask.sum(1).float()

    def loss(self, model: nn.Module, batch: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, dict]:
        rows = batch[:, 0]
        logps, entropy = self._logps(model, batch, ctx.amp, entropy=True)
        mask, advantages = self.step["mask"][rows], self.step["advantages"][rows]
        reference = self.step["reference"][rows] if self.policy.beta else None
        # num_iterations 1: the old policy is this one (TRL's), the ratio 1.
        old = self.step["old"][rows] if self.iterations > 1 else logps.detach()
        terms = self.policy(logps, old, advantages, mask, reference)
        sums, extremes = policy_stats(self.policy, terms, entropy, advantages, mask)
        self.extremes = torch.stack([self.extremes[0].minimum(extremes[0]), self.extremes[1].maximum(extremes[1])])
        return terms.total * ctx.weight, {"grpo sums": sums}

    def metrics(self, stats: dict[str, torch.Tensor]) -> dict[str, float]:
        sums, extremes = stats["grpo sums"].clone(), self.extremes.clone()
        dist.all_reduce(sums)
        dist.all_reduce(extremes[:1], op=dist.ReduceOp.MIN)
        dist.all_reduce(extremes[1:], op=dist.ReduceOp.MAX)
        return {"targets": round(stats["targets"].item()), **self.logged, **policy_metrics(sums, extremes, self.policy)}
