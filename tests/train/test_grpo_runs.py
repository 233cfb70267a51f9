"""objective=grpo end to end, by train.py's processes, on a tiny chat llama and a toy task with a user's reward
function outside the package (tests/helpers/rewards.py), with the KL to the reference (beta 0.04): the reward rises;
4 ranks (tp 2 x dp 2) log the losses, rewards and KL of 1; a run resumed mid-way logs the uninterrupted run's, to
the bit (the rollouts' noise is keyed by the step and the prompt; the reference is the initial weights again); with
LoRA and a trained copy of the head (the reference: the policy with both switched off) the reward rises too and the
first step's KL is 0; num_iterations 2 trains each rollout batch twice and resumes within one (refused with another
num_iterations); a reward function that raises at the second step stops the run in one line naming it, the first
step's checkpoint kept."""

import json

import pytest

from tests.conftest import ROOT
from tests.helpers.chats import chat_llama
from tests.helpers.cli import finish, read_metrics, start

pytestmark = pytest.mark.distributed  # train.py launches

QUESTIONS = [f"What is {i} + {i % 7}?" for i in range(48)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_runs")
    model = chat_llama(str(tmp / "model"))
    with open(tmp / "prompts.jsonl", "w") as f:
        for i, q in enumerate(QUESTIONS):
            f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": str(i + i % 7)}) + "\n")
    common = [
        "model=pretrained",
        f"model.name_or_path={model}",
        "data=prompts",
        f"data.paths=[{tmp / 'prompts.jsonl'}]",
        "data.seq_len=40",
        "objective=grpo",
        "objective.reward_funcs=[tests.helpers.rewards.digits]",
        "objective.num_generations=4",
        "objective.max_completion_length=12",
        "objective.beta=0.04",
        "trainer.global_batch_size=16",
        "trainer.micro_batch_size=8",
        "trainer.eval_interval=0",
        "trainer.log_interval=1",
        "precision=fp32",
        "logger=none",
        "schedule=constant",
        "optim.lr=1e-2",
        "checkpoint.export=false",
    ]
    # 6 held-out prompts evaluated every 6 steps (the runs compared with one another), by digits and (weighted 0: the
    # training is digits' alone) mean_token, which any token sampled otherwise would move. 6: 3 generations of 2
    # prompts on 1 rank, 2 (one of a single prompt) on each of 2 data-parallel ranks (a random model's completions
    # are the noise's, whatever the prompt: noise keyed by the place in a generation would sum alike otherwise).
    evals = ["data.eval_fraction=0.25", "trainer.eval_interval=6", "trainer.eval_batches=3"]
    evals += ["objective.reward_funcs=[tests.helpers.rewards.digits,tests.helpers.rewards.mean_token]"]
    evals += ["objective.reward_weights=[1.0,0.0]"]
    dirs = {name: tmp / name for name in ("one", "tp_dp", "half", "broken", "lora", "iter", "iter_half")}
    iterations = [*common, "objective.num_iterations=2", "trainer.max_steps=8"]
    procs = {
        "one": start(
            [*common, *evals, "trainer.max_steps=12", "checkpoint.save=false", f"hydra.run.dir={dirs['one']}"], ROOT
        ),
        # 4 ranks: tp 2 x dp 2 (a tp group's ranks generate the same completions, as its data-parallel rank's).
        "tp_dp": start(
            [
                *common,
                *evals,
                "trainer.max_steps=12",
                "checkpoint.save=false",
                "distributed.nproc_per_node=4",
                "parallel.tp=2",
                f"hydra.run.dir={dirs['tp_dp']}",
            ],
            ROOT,
        ),  # fmt: skip
        "lora": start(
            [
                *common,
                "trainer.max_steps=12",
                "checkpoint.save=false",
                "model.lora.r=8",
                "model.lora.alpha=16",
                "model.lora.modules_to_save=[lm_head]",
                f"hydra.run.dir={dirs['lora']}",
            ],
            ROOT,
        ),  # fmt: skip
        "half": start(
            [*common, *evals, "trainer.max_steps=6", "checkpoint.interval=6", f"hydra.run.dir={dirs['half']}"], ROOT
        ),
        "iter": start([*iterations, "checkpoint.save=false", f"hydra.run.dir={dirs['iter']}"], ROOT),
        # Stopped at step 5, within the rollouts of step 4 (num_iterations 2), on 2 ranks; resumed on 1.
        "iter_half": start(
            [
                *iterations,
                "trainer.max_steps=5",
                "checkpoint.interval=5",
                "distributed.nproc_per_node=2",
                f"hydra.run.dir={dirs['iter_half']}",
            ],
            ROOT,
        ),  # fmt: skip
        "broken": start(
            [
                *common,
                "objective.reward_funcs=[tests.helpers.rewards.raises_second_time]",
                "trainer.max_steps=3",
                "checkpoint.interval=1",
                f"hydra.run.dir={dirs['broken']}",
            ],
            ROOT,
        ),  # fmt: skip
    }
    done = {name: finish(proc) for name, proc in procs.items()}
    for name in ("one", "tp_dp", "half", "lora", "iter", "iter_half"):
        assert done[name].returncode == 0, done[name].stderr[-3000:]
    resume = [*common, *evals, "trainer.max_steps=12", f"checkpoint.resume={dirs['half']}"]
    resume.append(f"hydra.run.dir={dirs['half']}")
    iter_resume = [*iterations, f"checkpoint.resume={dirs['iter_half']}", f"hydra.run.dir={dirs['iter_half']}"]
    other = [*iterations, "objective.num_iterations=3", f"hydra.run.dir={tmp / 'iter_other'}"]
    step_5 = dirs["iter_half"] / "checkpoints" / "step_5"  # a step's dir: this config, not the run's own
    done["iter_other"] = finish(start([*other, f"checkpoint.resume={step_5}"], ROOT))
    resumed = {"resumed": start(resume, ROOT), "iter_resumed": start(iter_resume, ROOT)}
    for name, proc in resumed.items():
        done[name] = finish(proc)
        assert done[name].returncode == 0, done[name].stderr[-3000:]
    return dirs, done


def _series(run_dir, key: str) -> list[float]:
    """The key's values in metrics.jsonl's per-step rows, or its eval records' for an eval_ key."""
    rows = read_metrics(run_dir) if not key.startswith("eval_") else map(json.loads, open(run_dir / "metrics.jsonl"))
    return [m[key] for m in rows if key in m]


@pytest.mark.slow
def test_the_reward_rises_and_tp_x_dp_ranks_and_a_resume_log_one_rank_s(runs):
    dirs, _ = runs
    reward = _series(dirs["one"], "reward")
    shown = [json.loads(line) for line in open(dirs["one"] / "metrics.jsonl") if '"samples": [' in line]
    assert [r["step"] for r in shown] == list(range(1, 13))  # some completions with each logged step
    assert all(len(r["samples"]) == 2 and r["samples"][0]["prompt"] in QUESTIONS for r in shown), shown[0]
    assert len(reward) == 12 and sum(reward[-4:]) > 1.5 * sum(reward[:4]), reward
    evaluated = _series(dirs["one"], "eval_reward")
    assert len(evaluated) == 2 and all(0 <= r <= 1 for r in evaluated), evaluated  # steps 6 and 12
    kl = _series(dirs["one"], "kl")
    assert kl[0] == 0 and min(kl[1:]) > 0, kl  # the reference: the initial weights
    for key in (
        "loss",
        "reward",
        "reward_std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "kl",
        "entropy",
        "eval_reward",
        "eval_rewards/digits/mean",
        "eval_rewards/mean_token/mean",
        "eval_completions/mean_length",
    ):
        assert _series(dirs["tp_dp"], key) == pytest.approx(_series(dirs["one"], key), abs=1e-4), key
        assert _series(dirs["half"], key) == _series(dirs["one"], key), key  # bitwise: steps 1-6, then 7-12 resumed


@pytest.mark.slow
def test_num_iterations_trains_each_rollout_again_and_resumes_within_one(runs):
    """num_iterations 2 (TRL's): each rollout batch trains two steps (the second against the first's log-probs:
    ratios off 1, some clipped), the data moving on every other step; 2 ranks stopped at step 5, within the rollouts of
    step 4, resumed on 1 rank (the rollouts from the checkpoint): the uninterrupted run's metrics."""
    dirs, done = runs
    rows = read_metrics(dirs["iter"])
    assert [r["samples"] for r in rows] == [4, 4, 8, 8, 12, 12, 16, 16]  # prompts read: 4 every other step
    assert [r["reward"] for r in rows[::2]] == [r["reward"] for r in rows[1::2]]  # one rollout batch, two steps
    # Against the log-probabilities as sampled: ratios of 1 at the step that generated, clipped ones after an update.
    clipped = [r["clip_ratio/region_mean"] for r in rows]
    assert max(clipped[::2]) == 0 and min(clipped[1::2]) > 0, clipped
    for key in ("loss", "reward", "kl", "entropy", "samples", "clip_ratio/region_mean", "completions/mean_length"):
        assert _series(dirs["iter_half"], key) == pytest.approx(_series(dirs["iter"], key), abs=1e-4), key
    other = done["iter_other"]  # num_iterations 3 at step 5: the rollouts of step 3, which the checkpoint lacks
    said = "error: objective.num_iterations: step 5 trains on the rollouts step 3 generated, which the checkpoint"
    assert other.returncode == 2 and any(line.startswith(said) for line in other.stderr.splitlines()), other.stderr


@pytest.mark.slow
def test_with_lora_the_reference_is_the_policy_with_its_adapters_off(runs):
    dirs, _ = runs
    reward, kl = _series(dirs["lora"], "reward"), _series(dirs["lora"], "kl")
    assert sum(reward[-4:]) > 1.5 * sum(reward[:4]), reward
    assert kl[0] == 0 and min(kl[1:]) > 0, kl  # LoRA's B starts at 0: the adapted policy is the base at first


@pytest.mark.slow
def test_a_reward_function_that_raises_stops_the_run_in_one_line(runs):
    dirs, done = runs
    broken = done["broken"]
    assert broken.returncode == 1
    line = broken.last_error_line()
    start = "error: RewardError: reward function raises_second_time raised ValueError: this reward function fails"
    assert line.startswith(f"{start} (its first prompt: data index "), broken.stderr[-3000:]
    assert (dirs["broken"] / "checkpoints" / "step_1").is_dir()  # the step before it, kept
    assert [m["step"] for m in read_metrics(dirs["broken"]) if "loss" in m] == [1]
