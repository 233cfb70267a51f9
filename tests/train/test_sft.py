"""Chat SFT through the CLI (data=chat: packed conversations, loss on the assistant's tokens, eval files evaluated
whole) at 1 and 2 ranks, against transformers: the first step's loss is transformers' loss of the step's global
batch with num_items_in_batch (the mean over the step's targets, however they fall into micro-batches and ranks);
the last eval_loss is transformers' loss of each eval conversation fed alone to the exported model, its targets
from transformers' return_assistant_tokens_mask; both world sizes log the same losses."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_research.cli.generate import main as generate
from fsdp_research.data.packing import IGNORE, INPUTS, LABELS, POSITIONS
from fsdp_research.data.pipeline import build_data
from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.sinks import read_records
from tests.conftest import ROOT
from tests.helpers.chats import CHATML_MARKED, CONVERSATIONS, chat_llama, chat_tokenizer, write_chats
from tests.helpers.cli import finish, read_metrics, start
from tests.helpers.zoo import pretrained

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    model = chat_llama(str(tmp / "model"))
    train = write_chats(str(tmp / "data" / "train.jsonl"), CONVERSATIONS * 8)
    evals = write_chats(str(tmp / "data" / "eval.jsonl"), CONVERSATIONS)
    common = [
        *pretrained(model),
        "data=chat",
        f"data.paths=[{train}]",
        f"data.eval_paths=[{evals}]",
        "data.seq_len=192",
        "precision=fp32",
        "logger=none",
        "trainer.log_interval=1",
        f"trainer.max_steps={STEPS}",
        f"trainer.eval_interval={STEPS}",
        "trainer.global_batch_size=4",
        "checkpoint.interval=0",
    ]
    pairs = _write_pairs(str(tmp / "data" / "pairs.jsonl"))
    procs = {
        1: start([*common, "trainer.micro_batch_size=2", f"hydra.run.dir={tmp / 'one'}"], ROOT),
        # Prompt/completion pairs, sampled at the last eval.
        "pairs": start(
            [
                *common,
                f"data.paths=[{pairs}]",
                f"data.eval_paths=[{pairs}]",
                "data.prompt_field=prompt",
                "data.completion_field=completion",
                f"trainer.sample_prompts=[{PAIR_PROMPT}]",
                "trainer.sample_tokens=6",
                "trainer.micro_batch_size=2",
                f"hydra.run.dir={tmp / 'pairs'}",
            ],
            ROOT,
        ),
        2: start(
            [*common, "trainer.micro_batch_size=1", "checkpoint.export=false", f"hydra.run.dir={tmp / 'two'}"],
            ROOT,
            torchrun_nproc=2,
        ),  # fmt: skip
        # The eval file twice as two named sets: each set's loss, and the whole's.
        "sets": start(
            [
                *common,
                "trainer.micro_batch_size=1",
                "checkpoint.export=false",
                "distributed.nproc_per_node=2",
                f"data.eval_sources={{first:[{evals}],again:[{evals}]}}",
                "data.eval_paths=[]",
                f"hydra.run.dir={tmp / 'sets'}",
            ],
            ROOT,
        ),  # fmt: skip
        "bad": start(
            [*common, "trainer.micro_batch_size=2", "data.messages_field=conversation", f"hydra.run.dir={tmp / 'bad'}"],
            ROOT,
        ),
    }
    done = {name: finish(proc) for name, proc in procs.items()}
    for name in (1, 2, "sets", "pairs"):
        assert done[name].returncode == 0, done[name].stderr[-3000:]
    return common, model, tmp, done


PAIR_PROMPT = "What is x + 1 when x is 2?"


def _write_pairs(path: str) -> str:
    """Each conversation's first user message and the answer to it, as prompt/completion records."""
    with open(path, "w") as f:
        for messages in CONVERSATIONS * 8:
            turns = [m for m in messages if m["role"] != "system"]
            f.write(json.dumps({"prompt": turns[0]["content"], "completion": turns[1]["content"]}) + "\n")
    return path


def _hf_labels(labels: torch.Tensor) -> torch.Tensor:
    """Our labels are the next token's; transformers' are each token's own, shifted in its loss."""
    return torch.cat([torch.full_like(labels[:, :1], IGNORE), labels[:, :-1]], dim=1)


def test_the_first_step_is_transformers_mean_over_the_steps_targets(runs):
    common, model_dir, tmp, _ = runs
    [one, two] = [read_metrics(str(tmp / name)) for name in ("one", "two")]
    cfg = compose(common)
    batch = build_data(cfg.data, 0, cfg.trainer.seed).global_batch(0, cfg.trainer.global_batch_size)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.use_cache = False
    targets = int((batch[:, LABELS] != IGNORE).sum())
    with torch.no_grad():
        out = model(
            input_ids=batch[:, INPUTS],
            position_ids=batch[:, POSITIONS],
            labels=_hf_labels(batch[:, LABELS]),
            num_items_in_batch=targets,
        )
    assert one[0]["targets"] == two[0]["targets"] == targets
    assert one[0]["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    for a, b in zip(one, two, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert one[-1]["loss"] < one[0]["loss"]


def test_eval_is_every_eval_conversation_alone_in_transformers(runs):
    _, model_dir, tmp, _ = runs
    evals = {}
    for name in ("one", "two"):
        with open(tmp / name / "metrics.jsonl") as f:
            evals[name] = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    tok = AutoTokenizer.from_pretrained(chat_tokenizer(str(tmp / "marked"), CHATML_MARKED))
    model = AutoModelForCausalLM.from_pretrained(str(tmp / "one" / "export"))
    total, count = 0.0, 0
    with torch.no_grad():
        for messages in CONVERSATIONS:
            enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor([enc["input_ids"]])
            mask = torch.tensor([enc["assistant_masks"]], dtype=torch.bool)
            n = int(mask[0, 1:].sum())
            total += model(input_ids=ids, labels=torch.where(mask, ids, IGNORE)).loss.item() * n
            count += n
    assert evals["one"]["eval_tokens"] == evals["two"]["eval_tokens"] == count
    assert evals["one"]["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert evals["two"]["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    # data.eval_sources: each named set evaluated whole, the overall loss over all their targets.
    with open(tmp / "sets" / "metrics.jsonl") as f:
        sets = [row for row in map(json.loads, f) if "eval_loss" in row][-1]
    assert sets["eval_loss/first"] == sets["eval_loss/again"] == sets["eval_loss"] == evals["two"]["eval_loss"]
    assert sets["eval_tokens/first"] == sets["eval_tokens/again"] == count and sets["eval_tokens"] == 2 * count


def test_a_record_without_the_messages_field_is_one_line(runs):
    bad = runs[3]["bad"]
    assert bad.returncode == 2
    assert bad.last_error_line().startswith("error: data.messages_field: ")
    assert "has no field 'conversation' (its fields: messages)" in bad.last_error_line()
    assert not (runs[2] / "bad" / "metrics.jsonl").exists()


def test_generate_on_a_pair_run_prompts_as_its_samples_did(runs, capsys):
    """Prompt/completion data with a tokenizer that has a chat template: `fsdp-research generate` tokenizes the
    prompt as the pairs were (no template), so its continuation is the run's last sample (wrapped in the template,
    it continued something else)."""
    _, _, tmp, _ = runs
    [sample] = [r["samples"] for r in read_records(str(tmp / "pairs")) if isinstance(r.get("samples"), list)][-1]
    assert sample["prompt"] == PAIR_PROMPT
    assert generate([str(tmp / "pairs"), "--prompt", PAIR_PROMPT, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == f"{PAIR_PROMPT} -> {sample['completion']}\n"
