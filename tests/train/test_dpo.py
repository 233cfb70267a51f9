"""objective=dpo on data=preference through the CLI, against TRL's DPOTrainer.evaluate in one process
(per_device_eval_batch_size=1: means over the pairs) on the same pairs, in each of TRL's formats (text with its
prompt, messages, and the implicit prompt): the eval loss of every loss type at once (weighted, as TRL combines
them) and TRL's metrics, at 1 and 2 ranks, with a reference model that differs from the policy. With LoRA and
objective.reference=auto, step 1's loss is log 2 (the adapters start at zero: policy = reference), the losses and the
eval on held-out windows of pairs are the same at 1, 2 and 4 ranks; a resumed run ends where the uninterrupted one
ends. Bad settings: one line, before any compute."""

import json
import math

import pytest
import torch

from fsdp_research.data.chat import prompt_rendering
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.refusals import check_config
from tests.conftest import ROOT
from tests.helpers.chats import chat_llama
from tests.helpers.cli import finish, read_metrics, start
from tests.helpers.zoo import hf_config, pretrained

pytestmark = pytest.mark.distributed

PAIRS = [
    ("What is x + 1 when x is 2?", " It is 3.", " It is 4, or so."),
    ("Name a colour.", " Blue", " A dog"),
    ("def f(x): return", " x + 1", " what?"),
    ("The sky is", " blue today", " green"),
    ("import", " os", " nothing at all here"),
    ("Say hi.", " Hi!", " No."),
]
LOSSES = ["sigmoid", "ipo", "hinge", "robust", "sft"]
WEIGHTS = [1.0, 0.5, 0.25, 0.125, 0.0625]
METRICS = ["loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
METRICS += ["logps/chosen", "logps/rejected"]


def _records(form: str) -> list[dict]:
    if form == "text":
        return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    if form == "implicit":
        return [{"chosen": p + c, "rejected": p + r} for p, c, r in PAIRS]
    return [
        {
            "prompt": [{"role": "user", "content": p}],
            "chosen": [{"role": "assistant", "content": c.strip()}],
            "rejected": [{"role": "assistant", "content": r.strip()}],
        }
        for p, c, r in PAIRS
    ]


def _write(path, records: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = tmp_path_factory.mktemp("dpo")
    model = chat_llama(str(tmp / "model"))
    torch.manual_seed(1)  # the reference: another model of the same vocabulary
    tok = AutoTokenizer.from_pretrained(model)
    AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=len(tok))).save_pretrained(tmp / "ref")
    tok.save_pretrained(tmp / "ref")
    files = {form: _write(tmp / f"{form}.jsonl", _records(form)) for form in ("text", "chat", "implicit")}
    return tmp, model, str(tmp / "ref"), files


def _common(tmp, model, files, *more):
    return [
        *pretrained(model),
        "data=preference",
        f"data.paths=[{files['text']},{files['chat']}]",
        f"data.store_dir={tmp / 'stores'}",
        "data.seq_len=128",
        "objective=dpo",
        "precision=fp32",
        "logger=none",
        "trainer.log_interval=1",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1",
        *more,
    ]


# TRL's trainers evaluating in this process: fp32, a pair at a time (its metrics then means over pairs), uncut.
TRL_EVAL = dict(
    report_to="none",
    use_cpu=True,
    bf16=False,
    per_device_eval_batch_size=1,
    gradient_checkpointing=False,
    max_length=None,
    disable_tqdm=True,
)


def _trl_eval(model: str, ref: str, records: list[dict], out: str, **settings) -> dict:
    """DPOTrainer.evaluate (every loss type weighted, unless settings say otherwise), and the pairs it kept."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    settings = {**TRL_EVAL, **(settings or dict(loss_type=LOSSES, loss_weights=WEIGHTS, label_smoothing=0.1))}
    args = DPOConfig(out, **settings)
    data = Dataset.from_list(records)
    policy, reference = (AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32) for m in (model, ref))
    tok = AutoTokenizer.from_pretrained(model)
    trainer = DPOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=data, eval_dataset=data, processing_class=tok
    )
    return {**trainer.evaluate(), "pairs": len(trainer.eval_dataset)}


@pytest.fixture(scope="module")
def evaluated(work):
    """Runs at lr 0 evaluating each format as an eval set of its own (data.eval_sources), at 1 and 2 ranks."""
    tmp, model, ref, files = work
    sources = ",".join(f"{form}:[{path}]" for form, path in files.items())
    common = _common(
        tmp,
        model,
        files,
        f"data.eval_sources={{{sources}}}",
        f"objective.loss_type=[{','.join(LOSSES)}]",
        f"objective.loss_weights=[{','.join(map(str, WEIGHTS))}]",
        "objective.label_smoothing=0.1",
        f"objective.reference={ref}",
        "optim.lr=0",
        "trainer.max_steps=2",
        "trainer.eval_interval=2",
        "checkpoint.save=false",
        "checkpoint.export=false",
    )
    procs = {
        n: start([*common, f"distributed.nproc_per_node={n}", f"hydra.run.dir={tmp / f'eval{n}'}"], ROOT)
        for n in (1, 2)
    }
    runs = {}
    for n, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, result.stderr[-3000:]
        with open(tmp / f"eval{n}" / "metrics.jsonl") as f:
            runs[n] = [row for row in map(json.loads, f) if "eval_loss" in row][-1], read_metrics(tmp / f"eval{n}")
    return runs


@pytest.mark.parametrize("form", ["text", "chat", "implicit"])
def test_eval_equals_trl_dpo_trainer_at_1_and_2_ranks(work, evaluated, form):
    tmp, model, ref, _ = work
    trl = _trl_eval(model, ref, _records(form), str(tmp / f"trl_{form}"))
    for n, (ours, _) in evaluated.items():
        assert ours[f"eval_pairs/{form}"] == len(PAIRS)
        for key in METRICS:
            assert ours[f"eval_{key}/{form}"] == pytest.approx(trl[f"eval_{key}"], rel=2e-3, abs=1e-6), (n, key)


def test_truncate_cuts_each_sequence_as_trl_s_max_length(work):
    """data.truncation=truncate at data.seq_len 24: each sequence cut to its first 12 tokens, as TRL's max_length=12
    (keep_start) cuts it, a pair whose prompt fills them dropped by both: the eval equals DPOTrainer's."""
    tmp, model, ref, files = work
    overrides = ["data.seq_len=24", "data.truncation=truncate", f"objective.reference={ref}", "optim.lr=0"]
    overrides += ["trainer.max_steps=1", "trainer.eval_interval=1", "trainer.global_batch_size=2"]
    overrides += [f"data.paths=[{files['text']}]", f"data.eval_paths=[{files['text']}]", "checkpoint.save=false"]
    run = finish(start([*_common(tmp, model, files, *overrides), f"hydra.run.dir={tmp / 'cut'}"], ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp / "cut" / "metrics.jsonl") as f:
        ours = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    trl = _trl_eval(model, ref, _records("text"), str(tmp / "trl_cut"), loss_type="sigmoid", max_length=12)
    assert ours["eval_pairs"] == trl["pairs"] and 0 < ours["eval_pairs"]
    for key in METRICS:
        assert ours[f"eval_{key}"] == pytest.approx(trl[f"eval_{key}"], rel=2e-3, abs=1e-6), key


def test_training_metrics_are_the_same_at_1_and_2_ranks(evaluated):
    (_, one), (_, two) = evaluated[1], evaluated[2]
    # Each step's pairs: 4 samples of packed pairs, as many at any world size.
    assert [r["targets"] for r in one] == [r["targets"] for r in two] and min(r["targets"] for r in one) > 4
    for key in ["loss", *METRICS[1:]]:
        assert [r[key] for r in one] == pytest.approx([r[key] for r in two], rel=1e-5), key


# Eval on the held-out windows of pairs (no eval files) at the last step.
@pytest.mark.slow
def test_full_dpo_composes_with_tp_hsdp_and_activation_checkpointing(work):
    """DPO with its reference a frozen copy, sharded as the policy is: the losses of 3 steps under tensor parallel
    (2 ranks), hsdp (2 x 2) and activation checkpointing are the 1-rank run's (1e-5)."""
    tmp, model, ref, files = work
    common = _common(tmp, model, files, "optim.lr=1e-3", "trainer.max_steps=3", "trainer.eval_interval=0")
    common += ["checkpoint.save=false", "checkpoint.export=false"]
    cases = {
        "one": ["distributed.nproc_per_node=1"],
        "tp2": ["distributed.nproc_per_node=2", "parallel.tp=2"],
        "hsdp": ["distributed.nproc_per_node=4", "sharding=hsdp"],
        "ac": ["distributed.nproc_per_node=1", "activation_checkpointing=every_block"],
    }
    procs = {name: start([*common, *more, f"hydra.run.dir={tmp / name}"], ROOT) for name, more in cases.items()}
    for proc in procs.values():
        result = finish(proc)
        assert result.returncode == 0, result.stderr[-3000:]
    losses = {name: [r["loss"] for r in read_metrics(tmp / name)] for name in cases}
    assert losses["one"][-1] != losses["one"][0]
    for name in ("tp2", "hsdp", "ac"):
        assert losses[name] == pytest.approx(losses["one"], abs=1e-5), name


@pytest.mark.slow
def test_precomputed_reference_trains_as_the_reference_it_replaces(work):
    """objective.reference=precompute: the losses and eval of 3 steps are those of the reference it stands for (the
    frozen copy; with LoRA the adapters off), at 1 and 2 ranks; a later start reads the kept tables."""
    tmp, model, _, files = work
    common = _common(tmp, model, files, "optim.lr=1e-3", "trainer.max_steps=3", "trainer.eval_interval=3")
    common += [f"data.eval_paths=[{files['text']}]", "checkpoint.save=false", "checkpoint.export=false"]
    lora = ["model.lora.r=4", "model.lora.alpha=8", "optim.lr=1e-2"]
    cases = {
        "copy": [],
        "pre": ["objective.reference=precompute"],
        "lora": lora,
        "lora_pre": [*lora, "objective.reference=precompute"],
        "pre2": ["objective.reference=precompute", "distributed.nproc_per_node=2"],
    }
    runs = {}
    for group in (["copy", "pre", "lora", "lora_pre"], ["pre2"]):  # pre2 after the tables exist
        procs = {name: start([*common, *cases[name], f"hydra.run.dir={tmp / name}"], ROOT) for name in group}
        for name, proc in procs.items():
            runs[name] = finish(proc)
            assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    assert "objective.reference=precompute: read" in runs["pre2"].stdout + runs["pre2"].stderr
    rows = {}
    for name in cases:
        with open(tmp / name / "metrics.jsonl") as f:
            rows[name] = [json.loads(line) for line in f if '"loss"' in line or '"eval_loss"' in line]
    for name, like in (("pre", "copy"), ("pre2", "copy"), ("lora_pre", "lora")):
        for ours, theirs in zip(rows[name], rows[like], strict=True):
            for key in ("loss", "eval_loss", "rewards/chosen", "eval_rewards/margins"):
                if key in theirs:
                    assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (name, key)


def test_simpo_eval_equals_trl_cpo_trainer(work):
    """objective=simpo at lr 0 against TRL's CPOTrainer(loss_type="simpo", cpo_alpha=0).evaluate on the same pairs of
    text (where CPO's tokenization, the end-of-sequence token appended, is DPO's)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    tmp, model, _, files = work
    overrides = ["objective=simpo", "objective.beta=2.0", "objective.gamma=1.0", "optim.lr=0", "trainer.max_steps=1"]
    overrides += ["trainer.eval_interval=1", f"data.paths=[{files['text']}]", f"data.eval_paths=[{files['text']}]"]
    run = finish(start([*_common(tmp, model, files, *overrides), f"hydra.run.dir={tmp / 'simpo'}"], ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp / "simpo" / "metrics.jsonl") as f:
        ours = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    tok = AutoTokenizer.from_pretrained(model)
    tok.pad_token = tok.eos_token  # CPO's collator reads it before the trainer would set it
    args = CPOConfig(str(tmp / "trl_simpo"), loss_type="simpo", cpo_alpha=0.0, beta=2.0, simpo_gamma=1.0, **TRL_EVAL)
    data = Dataset.from_list(_records("text"))
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    trl = CPOTrainer(model=policy, args=args, train_dataset=data, eval_dataset=data, processing_class=tok).evaluate()
    assert ours["eval_pairs"] == len(PAIRS)
    for key in METRICS:
        assert ours[f"eval_{key}"] == pytest.approx(trl[f"eval_{key}"], rel=2e-3, abs=1e-6), key


def _unpaired() -> list[dict]:
    """The pairs as KTO's unpaired examples: each prompt with its chosen completion (desirable), then its rejected."""
    return [
        {"prompt": p, "completion": c, "label": label} for p, *both in PAIRS for c, label in zip(both, (True, False))
    ]


def test_kto_eval_equals_trl_kto_trainer(work):
    """objective=kto at lr 0 with a reference model that differs, against TRL's KTOTrainer.evaluate on the same 12
    examples as one eval batch (its KL estimate over them, as ours over the eval set), each example's KL completion
    the one before it within chunks of 4 (its per_device_train_batch_size, our data.kl_chunk), desirable and
    undesirable examples weighted apart."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tmp, model, ref, files = work
    examples = _write(tmp / "unpaired.jsonl", _unpaired())
    overrides = ["objective=kto", "objective.desirable_weight=1.5", "objective.undesirable_weight=0.5"]
    # The seed-1 model as the policy, the seed-0 one its reference: their KL estimate here is above 0.
    overrides += [*pretrained(ref), f"objective.reference={model}", "optim.lr=0", "trainer.max_steps=1"]
    overrides += ["trainer.eval_interval=1"]
    overrides += [f"data.paths=[{examples}]", f"data.eval_paths=[{examples}]", "data.kl_chunk=4"]
    overrides += ["trainer.global_batch_size=2", "checkpoint.save=false"]
    run = finish(start([*_common(tmp, model, files, *overrides), f"hydra.run.dir={tmp / 'kto'}"], ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp / "kto" / "metrics.jsonl") as f:
        ours = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    args = KTOConfig(
        str(tmp / "trl_kto"), per_device_train_batch_size=4, desirable_weight=1.5, undesirable_weight=0.5, **TRL_EVAL
    )
    args.per_device_eval_batch_size = len(_unpaired())
    data = Dataset.from_list(_unpaired())
    policy, reference = (AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32) for m in (ref, model))
    tok = AutoTokenizer.from_pretrained(model)
    trl = KTOTrainer(
        model=policy, ref_model=reference, args=args, train_dataset=data, eval_dataset=data, processing_class=tok
    ).evaluate()
    assert ours["eval_pairs"] == len(_unpaired()) and ours["eval_kl"] > 0.01  # not the clamp's 0 on both sides
    for key in ("loss", "kl", *METRICS[1:3], "rewards/margins", *METRICS[-2:]):
        assert ours[f"eval_{key}"] == pytest.approx(trl[f"eval_{key}"], rel=2e-3, abs=1e-6), key


@pytest.mark.slow
def test_kto_s_kl_estimate_and_losses_are_the_same_at_1_and_2_ranks(work):
    """The KL estimate is over the step's examples on every rank (not each rank's own): 3 steps of KTO with LoRA
    (reference auto) give the same losses and kl at 1 and 2 ranks (1e-5)."""
    tmp, model, _, files = work
    examples = _write(tmp / "unpaired_train.jsonl", _unpaired() * 2)
    common = _common(tmp, model, files, "objective=kto", "model.lora.r=4", "model.lora.alpha=8", "optim.lr=1e-2")
    common += [f"data.paths=[{examples}]", "data.kl_chunk=4", "data.seq_len=64", "trainer.max_steps=3"]
    common += ["trainer.eval_interval=0", "checkpoint.save=false", "checkpoint.export=false"]
    procs = {
        n: start([*common, f"distributed.nproc_per_node={n}", f"hydra.run.dir={tmp / f'kto{n}'}"], ROOT) for n in (1, 2)
    }
    rows = {}
    for n, proc in procs.items():
        result = finish(proc)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[n] = read_metrics(tmp / f"kto{n}")
    assert rows[1][-1]["loss"] != rows[1][0]["loss"]
    # The kl (~0.01) is a difference of log-probabilities of ~-50, summed in another order at 2 ranks: fp32's
    # rounding of those (~6e-6) is its tolerance (seen: 1.5e-6 after 3 steps at lr 1e-2), not 1e-5 of its own size.
    for key, tolerance in (("loss", 1e-7), ("kl", 1e-5), ("rewards/chosen", 1e-7)):
        assert [r.get(key) for r in rows[2]] == pytest.approx([r.get(key) for r in rows[1]], rel=1e-5, abs=tolerance), (
            key
        )


# The head trained whole beside the adapters (a copy, which the reference switches off with them); LoRA's dropout
# (switched off, as TRL's disable_dropout).
LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.modules_to_save=[lm_head]", "model.lora.dropout=0.1"]
LORA += ["optim.lr=1e-2", "trainer.eval_interval=4"]


@pytest.mark.slow
def test_lora_reference_auto_starts_at_log_2_and_is_the_same_at_1_2_4_ranks_and_on_resume(work):
    tmp, model, _, files = work
    common = _common(tmp, model, files, *LORA, "checkpoint.export=false")
    run = {n: tmp / f"lora{n}" for n in (1, 2, 4)}
    procs = [
        start(
            [
                *common,
                "trainer.max_steps=4",
                "checkpoint.save=false",
                f"distributed.nproc_per_node={n}",
                f"hydra.run.dir={run[n]}",
            ],
            ROOT,
        )  # fmt: skip
        for n in (1, 2, 4)
    ]
    procs.append(
        start([*common, "trainer.max_steps=2", "checkpoint.interval=2", f"hydra.run.dir={tmp / 'half'}"], ROOT)
    )
    base = [*common, "trainer.max_steps=4", "optim.lr=0", "checkpoint.save=false", f"hydra.run.dir={tmp / 'base'}"]
    procs.append(start(base, ROOT))
    for proc in procs:
        result = finish(proc)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "objective=dpo: dropout off in" in result.stdout + result.stderr
    resumed = finish(
        start(
            [*common, "trainer.max_steps=4", f"checkpoint.resume={tmp / 'half'}", f"hydra.run.dir={tmp / 'half'}"], ROOT
        )
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = {n: [r["loss"] for r in read_metrics(path)] for n, path in run.items()}
    assert losses[1][0] == pytest.approx(math.log(2), abs=1e-7)  # policy = reference: the sigmoid of 0
    assert losses[1][-1] < losses[1][0]
    for n in (2, 4):
        assert losses[n] == pytest.approx(losses[1], abs=1e-5), n
    assert [r["loss"] for r in read_metrics(tmp / "half")] == losses[1]  # bitwise: steps 1-2, then 3-4 resumed
    evals = {}
    for n, path in {**run, "base": tmp / "base"}.items():
        with open(path / "metrics.jsonl") as f:
            evals[n] = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    assert evals[1]["eval_pairs"] > 0 and evals[1]["eval_rewards/accuracies"] > 0
    # The reference is the base model however far the adapters and the head's copy have moved: the policy's logps
    # less its rewards / beta are the untrained run's logps.
    for side in ("chosen", "rejected"):
        reference = evals[1][f"eval_logps/{side}"] - evals[1][f"eval_rewards/{side}"] / 0.1
        assert reference == pytest.approx(evals["base"][f"eval_logps/{side}"], rel=1e-5)
    for n in (2, 4):
        assert evals[n]["eval_pairs"] == evals[1]["eval_pairs"]
        for key in METRICS:
            assert evals[n][f"eval_{key}"] == pytest.approx(evals[1][f"eval_{key}"], rel=1e-5, abs=1e-7), (n, key)


@pytest.mark.parametrize("form, rendering", [("chat", "chat"), ("text", "pair"), ("implicit", "pair")])
def test_samples_and_generate_render_prompts_as_the_pairs_are(work, form, rendering):
    """A run's samples (and `generate` on its export) take a prompt as the pairs' prompts are tokenized: a user's
    message in the chat template where the pairs are messages, else the text as TRL tokenizes it."""
    tmp, model, _, files = work
    cfg = compose(_common(tmp, model, files, f"data.paths=[{files[form]}]"))
    assert prompt_rendering(cfg.data) == rendering


def test_the_store_of_text_pairs_is_of_the_end_of_sequence_text_too(work, tmp_path):
    """Text completions end with the tokenizer's end-of-sequence text: two tokenizers alike but for it (a base and
    an instruct model's) make two stores."""
    from transformers import AutoTokenizer

    from fsdp_research.data.chat_store import chat_spec

    tmp, model, _, files = work
    other = AutoTokenizer.from_pretrained(model)
    other.add_special_tokens({"eos_token": "<|im_end|>"})
    other.save_pretrained(tmp_path / "other")
    specs = [
        chat_spec(compose(_common(tmp, model, files, f"data.tokenizer={tok}")).data, [files["text"]], "data.paths")
        for tok in (model, tmp_path / "other")
    ]
    assert specs[0].fingerprint != specs[1].fingerprint


def test_the_planner_counts_the_reference_copy_and_none_with_lora(work):
    """The frozen reference is a copy of each rank's parameters (fp32 shards, as the policy's), in the peak and on
    the plan's row of declared state; with LoRA the reference is the policy itself: nothing."""
    from transformers import AutoModelForCausalLM

    from fsdp_research.planner.memory import memory
    from fsdp_research.planner.run import run_settings
    from fsdp_research.planner.summary import summary_for

    tmp, model, _, files = work
    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    copy, lora = (compose(_common(tmp, model, files, *more)) for more in ([], ["model.lora.r=4"]))
    summary = summary_for(copy)
    planned = memory(summary, run_settings(copy, 2, "cpu"))
    assert planned.callbacks == pytest.approx(4 * params / 2, rel=0.01)
    assert memory(summary_for(lora), run_settings(lora, 2, "cpu")).callbacks == 0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["objective=lm"], "data"),
        (["objective=kto"], "data.paths"),
        (["objective.loss_type=[sigmoid,kto]"], "objective.loss_type"),
        (["objective.loss_type=[sigmoid,sft]", "objective.loss_weights=[1.0]"], "objective.loss_weights"),
        (["objective.reference=/nonexistent"], "objective.reference"),
        (["objective.beta=0"], "objective.beta"),
        (["model=llama_tiny", "objective.reference=precompute"], "objective.reference"),
        (["objective.label_smoothing=0.1"], "objective.label_smoothing"),
        (["objective=simpo", "objective.label_smoothing=0.5"], "objective.label_smoothing"),
        (["data.document_masking=false"], "data.document_masking"),
        (["trainer.eval_interval=1", "data.eval_fraction=0"], "trainer.eval_interval"),
    ],
)
def test_bad_settings_are_one_line_before_any_compute(work, overrides, key):
    tmp, model, _, files = work
    cfg = compose(_common(tmp, model, files, "trainer.eval_interval=0", *overrides))
    with pytest.raises(ConfigError) as err:
        check_config(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))
    assert err.value.key == key
