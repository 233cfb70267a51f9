"""Eval that means the same thing everywhere, on a researcher's corpus (JSON Lines) with a
local BPE tokenizer: fp32 train and eval losses equal at 1, 2 and 4 ranks; eval every trainer.eval_interval
steps as its own record, whether or not the step is a log step; the tokenizer travels into the export. Then a
store built ahead with `fsdp-research tokenize`, and a build that takes longer than distributed.timeout_s."""

import json
import os

import pytest
import torch

from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.checkpointing import snapshot, with_overrides
from tests.helpers.cli import command, finish, start
from tests.helpers.corpora import DOCS, bpe_tokenizer, write
from tests.helpers.dist import ok, train_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORLDS = (1, 2, 4)
STEPS, LOG, EVAL = 6, 3, 2
EVAL_SAMPLES = 3 * 2  # eval_batches x micro_batch_size: not a multiple of 4 ranks, so some ranks pad


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval_corpus")
    return write("jsonl", str(tmp), docs=DOCS * 20), bpe_tokenizer(str(tmp / "tok"))


def _overrides(corpus, *extra):
    path, tok = corpus
    return with_overrides(
        FAST,
        f"data.paths=[{path}]",
        f"data.tokenizer={tok}",
        "data.seq_len=32",
        f"trainer.max_steps={STEPS}",
        f"trainer.log_interval={LOG}",
        f"trainer.eval_interval={EVAL}",
        "trainer.eval_batches=3",
        "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2",
        *extra,
    )


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval_runs")
    results = {}
    for world in WORLDS:
        extra = ["checkpoint.export=true"] if world == 1 else []
        ok(train_distributed({f"w{world}": compose(_overrides(corpus, *extra))}, world, str(out)), f"w{world}")
        results[world] = _records(str(out / f"w{world}"))
    return out, results


def test_eval_has_its_own_records_at_its_own_interval(runs):
    _, results = runs
    records = results[1]
    assert [r["step"] for r in records if "loss" in r] == [3, 6]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 6] and all("loss" not in r for r in evals)
    assert all(r["eval_tokens"] == EVAL_SAMPLES * 32 for r in evals)


@pytest.mark.parametrize("world", WORLDS[1:])
def test_train_and_eval_losses_equal_at_any_world_size(runs, world):
    _, results = runs
    for key in ("loss", "eval_loss"):
        want = [r[key] for r in results[1] if key in r]
        got = [r[key] for r in results[world] if key in r]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0, msg=key)


def test_the_tokenizer_travels_into_the_export(runs, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = runs
    export = str(out / "w1" / "export")
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(export))
    exported, original = AutoTokenizer.from_pretrained(export), AutoTokenizer.from_pretrained(corpus[1])
    assert exported("naïve café 東京")["input_ids"] == original("naïve café 東京")["input_ids"]
    assert exported.eos_token == original.eos_token
    AutoModelForCausalLM.from_pretrained(export)


def test_a_store_built_ahead_is_only_opened(corpus, tmp_path):
    """`fsdp-research tokenize` builds it, with the rate at the end; a training run then opens it, tokenizing
    nothing."""
    stores = f"data.store_dir={tmp_path / 'stores'}"
    data = [o for o in _overrides(corpus) if o.startswith("data.")] + [stores]
    built = command(["tokenize", *data])
    assert built.returncode == 0, built.stderr
    assert "built in" in built.stdout and "MB/s of text" in built.stdout and " tokens (uint16)" in built.stdout
    again = command(["tokenize", *data])
    assert "(already built)" in again.stdout and "built in" not in again.stdout
    before = snapshot(str(tmp_path / "stores"))
    run = finish(
        start([*_overrides(corpus, "trainer.max_steps=1"), stores, f"hydra.run.dir={tmp_path / 'run'}"], str(tmp_path))
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # Not a time (a loaded machine takes seconds to load the tokenizer): the stores' files as they were.
    assert "tokenizing" not in run.stdout and "; ready in " in run.stdout
    assert snapshot(str(tmp_path / "stores")) == before


def test_a_build_longer_than_the_collective_timeout(tmp_path):
    """Rank 0 tokenizes a store of one part for longer than distributed.timeout_s while rank 1 waits: it waits on
    the store's manifest, not in a collective, and the run trains."""
    tok = bpe_tokenizer(str(tmp_path / "tok"))
    text = tmp_path / "one_document.txt"
    text.write_text(" ".join(DOCS[4:]) * 1400)  # ~1 part, twice the timeout of BPE on one core at least
    run = finish(
        start(
            with_overrides(
                FAST,
                f"data.paths=[{text}]",
                f"data.tokenizer={tok}",
                "trainer.max_steps=2",
                "distributed.nproc_per_node=2",
                "distributed.timeout_s=3",
                f"data.store_dir={tmp_path / 'stores'}",
                f"hydra.run.dir={tmp_path / 'run'}",
            ),
            str(tmp_path),
        ),
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ready = [line for line in run.stdout.splitlines() if "; ready in " in line]
    assert ready and float(ready[0].rsplit("ready in ", 1)[1].split()[0]) > 3, ready
