"""data=prompts, TRL's prompt-only format, in the formats users have (JSON Lines, Parquet, a saved dataset): each
prompt's tokens are what TRL's GRPOTrainer tokenizes (messages with the generation prompt, text with the special
tokens), left-padded; its record (the prompt as given and every other field, None where it lacks one) is the row
`datasets` reads; too-long prompts are dropped, cut to their end or refused; objective=grpo reads them (objective=lm
refuses them), and what it cannot do yet, or the store cannot keep, is refused in one line."""

import datetime
import json
import re
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fsdp_research.data.pipeline import build_data
from fsdp_research.data.prompts import DOCUMENT, TOKENS
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.refusals import check_config
from tests.helpers.chats import chat_tokenizer

RECORDS = [
    {"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i), "meta": {"i": [i]}}
    for i in range(5)
] + [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7 * 6?"}], "answer": "42"}]
# (the last record without "meta": datasets gives it None)
TEXT = [{"prompt": f"Q: {i} squared is", "answer": str(i * i), "meta": {"i": [i]}} for i in range(6)]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _cfg(tmp_path, tok_dir, path, *overrides):
    return compose(
        [
            "data=prompts",
            f"data.paths=[{path}]",
            f"data.tokenizer={tok_dir}",
            f"data.store_dir={tmp_path / 'stores'}",
            "data.eval_fraction=0",
            *overrides,
        ]
    )


def _check(tmp_path, tok_dir, path, *overrides):
    cfg = _cfg(tmp_path, tok_dir, path, "trainer.eval_interval=0", *overrides)
    check_config(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))


def _trl_ids(tok_dir: str, prompts: list) -> list[list[int]]:
    """TRL's GRPOTrainer._tokenize_prompts, on a stand-in of the trainer's state it reads."""
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    trainer = types.SimpleNamespace(
        processing_class=AutoTokenizer.from_pretrained(tok_dir),
        _is_vlm=False,
        environment_factories=None,
        tools=None,
        chat_template=None,
        chat_template_kwargs={},
    )
    return [list(ids) for ids in GRPOTrainer._tokenize_prompts(trainer, prompts)[0]]


def _write(tmp_path, fmt: str, records: list[dict]) -> str:
    from datasets import Dataset

    path = str(tmp_path / f"prompts.{fmt}")
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    elif fmt == "parquet":
        Dataset.from_list(records).to_parquet(path)
    else:
        path = str(tmp_path / "saved")
        Dataset.from_list(records).save_to_disk(path)
    return path


def _read_back(fmt: str, path: str):
    """The rows as `datasets` reads the file."""
    from datasets import load_dataset, load_from_disk

    if fmt == "saved":
        return load_from_disk(path)
    return load_dataset("json" if fmt == "jsonl" else "parquet", data_files=path, split="train")


@pytest.mark.parametrize("fmt,records", [("jsonl", RECORDS), ("parquet", TEXT), ("saved", RECORDS)])
def test_prompts_are_trl_s_tokens_and_their_records_the_rows(tmp_path, tok_dir, fmt, records):
    path = _write(tmp_path, fmt, records)
    cfg = _cfg(tmp_path, tok_dir, path, "data.seq_len=48")
    data = build_data(cfg.data, 512, seed=0)
    windows = data.stream.windows[0]
    samples = data.batch(np.arange(len(records))).numpy()
    rows = _read_back(fmt, path)
    want = _trl_ids(tok_dir, [r["prompt"] for r in records])
    seen = set()
    for sample in samples:
        real = sample[DOCUMENT] >= 0
        d = int(sample[DOCUMENT][real][0])
        assert (sample[DOCUMENT][real] == d).all() and real[-1] and not real[: (~real).sum()].any()  # left-padded
        assert sample[TOKENS][real].tolist() == want[d]
        assert (sample[TOKENS][~real] == windows.pad_id).all()
        record = windows.record(d)  # as its file holds it; the reward functions get every field, None if missing
        assert {k: record.get(k) for k in windows.fields} == rows[d]
        seen.add(d)
    assert seen == set(range(len(records)))  # every prompt once in an epoch
    assert windows.fields == rows.column_names


def test_too_long_prompts_are_dropped_cut_to_their_end_or_refused(tmp_path, tok_dir):
    path = _write(tmp_path, "jsonl", RECORDS)
    longest = max(map(len, _trl_ids(tok_dir, [r["prompt"] for r in RECORDS])))
    seq_len = longest - 3  # the system prompt's record only is longer
    dropped = build_data(_cfg(tmp_path, tok_dir, path, f"data.seq_len={seq_len}").data, 512, seed=0)
    assert dropped.stream.windows[0].count == len(RECORDS) - 1
    assert "1 longer than data.seq_len dropped" in dropped.describe()
    cut = build_data(_cfg(tmp_path, tok_dir, path, f"data.seq_len={seq_len}", "data.truncation=truncate").data, 512, 0)
    last = cut.stream.windows[0].read(np.asarray([len(RECORDS) - 1]))[0]
    assert last[TOKENS].tolist() == _trl_ids(tok_dir, [RECORDS[-1]["prompt"]])[0][-seq_len:]  # the generation prompt
    message = rf"^data.truncation: a prompt of data.paths has {longest} tokens, more than data.seq_len={seq_len}; "
    with pytest.raises(ConfigError, match=message):
        build_data(_cfg(tmp_path, tok_dir, path, f"data.seq_len={seq_len}", "data.truncation=error").data, 512, 0)


def test_what_prompts_cannot_be_is_refused_in_one_line(tmp_path, tok_dir):
    path = _write(tmp_path, "jsonl", RECORDS)
    with pytest.raises(ConfigError, match=r"^data: prompts is not what objective NextToken reads; fix: use one of "):
        _check(tmp_path, tok_dir, path)  # until an objective generates
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(ConfigError, match=rf"^data.prompt_field: {bad} line 1: a int, not text or messages; fix: "):
        _check(tmp_path, tok_dir, bad)
    with pytest.raises(ConfigError, match=r"^data.prompt_field: data=prompts reads each record's prompt from it"):
        _check(tmp_path, tok_dir, path, "data.prompt_field=null")
    dated = tmp_path / "dated.parquet"
    pq.write_table(pa.table({"prompt": ["a"], "when": [datetime.date(2026, 12, 7)]}), dated)
    with pytest.raises(ConfigError, match=rf"^data.paths: {dated} row 0: a field JSON cannot hold \(.*date.*\); fix: "):
        _check(tmp_path, tok_dir, dated)


def test_objective_grpo_reads_them_and_refuses_what_it_cannot_do_in_one_line(tmp_path, tok_dir):
    from transformers import AutoConfig

    path = _write(tmp_path, "jsonl", RECORDS)
    other = tmp_path / "other_vocab"  # a reference of another vocabulary
    AutoConfig.for_model("llama", vocab_size=7).save_pretrained(other)
    grpo = ["objective=grpo", "objective.reward_funcs=[tests.helpers.rewards.digits]", "objective.num_generations=4"]
    _check(tmp_path, tok_dir, path, *grpo, "trainer.global_batch_size=16", "trainer.micro_batch_size=4")
    refused = {
        "objective.num_generations: 1: a group of one has no advantage": ["objective.num_generations=1"],
        "trainer.global_batch_size: 10 completions are not whole groups of objective.num_generations=4": [
            "trainer.global_batch_size=10",
            "trainer.micro_batch_size=5",
        ],
        "objective.loss_type: 'ppo' is not one of grpo, bnpo, dr_grpo, dapo": ["objective.loss_type=ppo"],
        "objective.beta: -0.1 is below 0": ["objective.beta=-0.1"],
        "objective.num_iterations: 0 is not a whole number of 1 or more": ["objective.num_iterations=0"],
        "objective.num_iterations: 1.5 is not a whole number of 1 or more": ["objective.num_iterations=1.5"],
        "objective.reference: None is neither auto nor a model directory": [
            "objective.beta=0.1",
            "objective.reference=null",
        ],
        f"objective.reference: {other}: a vocabulary of 7 tokens, the policy's": [
            "objective.beta=0.1",
            f"objective.reference={other}",
        ],
        "objective.reference: '/nonexistent' is neither auto nor a model directory": [
            "objective.beta=0.04",
            "objective.reference=/nonexistent",
        ],
        "objective.reference: is read only for the KL, and objective.beta is 0": [f"objective.reference={tok_dir}"],
        "objective.reward_funcs: is empty": ["objective.reward_funcs=[]"],
        "data.eval_paths: objective=grpo evaluates held-out prompts only; fix: use data.eval_fraction": [
            f"data.eval_paths=[{path}]",
            "trainer.eval_interval=10",
        ],
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
            _check(tmp_path, tok_dir, path, *grpo, *overrides)
    # Its eval: the held-out prompts.
    cfg = _cfg(tmp_path, tok_dir, path, *grpo, "trainer.eval_interval=10", "data.eval_fraction=0.2")
    check_config(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))


def test_the_planner_counts_grpo_s_reference_copy_and_none_with_lora_or_without_beta(tmp_path, tok_dir):
    """With objective.beta > 0 the frozen reference is a copy of each rank's parameters (fp32 shards); with LoRA it
    is the policy itself, and without the KL there is none."""
    from transformers import AutoModelForCausalLM

    from fsdp_research.planner.memory import memory
    from fsdp_research.planner.run import run_settings
    from fsdp_research.planner.summary import summary_for

    path = _write(tmp_path, "jsonl", RECORDS)
    grpo = ["objective=grpo", "objective.reward_funcs=[tests.helpers.rewards.digits]", "objective.num_generations=4"]
    planned = {}
    cases = {"copy": ["objective.beta=0.04"], "lora": ["objective.beta=0.04", "model.lora.r=4"], "none": []}
    for name, more in cases.items():
        cfg = _cfg(tmp_path, tok_dir, path, *grpo, *more)
        planned[name] = memory(summary_for(cfg), run_settings(cfg, 2, "cpu")).callbacks
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(build_hf_config(cfg.model)).parameters())
    assert planned["copy"] == pytest.approx(4 * params / 2, rel=0.01)
    assert planned["lora"] == planned["none"] == 0
