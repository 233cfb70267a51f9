"""The tokenizer a run trains with (data.tokenizer=auto, the default): a pretrained model's own, from its directory,
named at start and written into the export; byte where the model has none (said so); a tokenizer of another
vocabulary for pretrained weights refused in one line before any compute. Through the CLI as a user types it."""

import os
import shutil

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_research.jobs.compose import compose
from tests.conftest import FAST, ROOT
from tests.helpers.cli import finish, start
from tests.helpers.corpora import DOCS, bpe_tokenizer, write
from tests.helpers.zoo import hf_config, pretrained

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny llama written with save_pretrained beside its BPE tokenizer (300 tokens), the same weights without
    it, and a JSON Lines corpus."""
    tmp = tmp_path_factory.mktemp("tokenizer")
    own = str(tmp / "with_tokenizer")
    bpe_tokenizer(own)
    AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=300)).save_pretrained(own)
    bare = str(tmp / "bare")
    shutil.copytree(own, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    return own, bare, write("jsonl", str(tmp), docs=DOCS * 5)


def test_auto_is_the_models_own_tokenizer_or_byte(model_dirs):
    own, bare, _ = model_dirs
    assert compose(pretrained(own)).data.tokenizer == own
    assert compose(pretrained(bare)).data.tokenizer == "byte"
    assert compose([]).data.tokenizer == "byte"  # a model built from its config
    assert compose([*pretrained(own), "data.tokenizer=byte", "model.load_weights=false"]).data.tokenizer == "byte"


@pytest.mark.slow
def test_a_pretrained_model_trains_and_exports_with_its_own_tokenizer(model_dirs, tmp_path):
    own, bare, corpus = model_dirs
    common = [*FAST, f"data.paths=[{corpus}]", "trainer.max_steps=2", "distributed.nproc_per_node=1"]
    runs = {
        "own": start([*common, *pretrained(own), "checkpoint.export=true", f"hydra.run.dir={tmp_path / 'own'}"], ROOT),
        # With a warmup past the run's end, warned at start.
        "bare": start(
            [*common, *pretrained(bare), "schedule.warmup_steps=5", f"hydra.run.dir={tmp_path / 'bare'}"], ROOT
        ),
        "other": start([*common, *pretrained(own), "data.tokenizer=byte", f"hydra.run.dir={tmp_path / 'x'}"], ROOT),
    }
    done = {name: finish(proc) for name, proc in runs.items()}
    assert done["own"].returncode == 0, done["own"].stderr[-3000:]
    log = open(tmp_path / "own" / "train.log").read()
    assert f"tokenizer: {own} (the model's own), 300 tokens" in log
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "own" / "export"))
    assert exported.get_vocab() == AutoTokenizer.from_pretrained(own).get_vocab()
    assert done["bare"].returncode == 0, done["bare"].stderr[-3000:]
    bare_log = open(tmp_path / "bare" / "train.log").read()
    assert "tokenizer: byte (model.name_or_path holds no tokenizer: give data.tokenizer the one its weights" in bare_log
    assert "schedule.warmup_steps=5 is at or past trainer.max_steps=2: the whole run warms up" in bare_log
    other = done["other"]
    assert other.returncode == 2 and other.last_error_line() == (
        f"error: data.tokenizer: 'byte' (257 tokens) is not the vocabulary of model.name_or_path's own tokenizer "
        f"({own}, 300 tokens), whose ids the weights learnt; fix: use data.tokenizer=auto (the model's own), or "
        "model.load_weights=false"
    )
    assert not os.path.exists(tmp_path / "x" / "metrics.jsonl")


def test_doubtful_settings_are_warned():
    import torch

    from fsdp_research.train.refusals import doubts

    cpu = torch.device("cpu")
    assert doubts(compose([]), cpu) == []
    [fp16] = doubts(compose(["precision=fp16"]), cpu)
    assert fp16.startswith("precision: fp16 on the CPU runs 6-10x slower than bf16")
    [warmup] = doubts(compose(["schedule.warmup_steps=500", "trainer.max_steps=10"]), cpu)
    assert warmup.startswith("schedule.warmup_steps=500 is at or past trainer.max_steps=10")


CUSTOM = [
    "model=custom",
    "model.model_type=qwen3",
    "model.config.hidden_size=128",
    "model.config.intermediate_size=384",
]
CUSTOM += [
    "model.config.num_hidden_layers=4",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
]
CUSTOM += ["model.config.head_dim=32"]


def test_a_model_from_its_config_takes_the_tokenizers_vocabulary(model_dirs):
    """model=custom (the example of conf/model/custom.yaml) with the byte tokenizer: 257 rows, not Qwen3's 151,936;
    with a BPE tokenizer its 300; model.config.vocab_size given wins."""
    import torch
    from transformers import AutoModelForCausalLM

    from fsdp_research.model.architecture import build_hf_config

    own, _, _ = model_dirs
    assert compose(CUSTOM).model.config.vocab_size == 257
    assert compose([*CUSTOM, f"data.tokenizer={own}"]).model.config.vocab_size == 300
    assert compose([*CUSTOM, "model.config.vocab_size=1024"]).model.config.vocab_size == 1024
    assert "vocab_size" not in compose([*CUSTOM, "data=synthetic"]).model.config  # no tokenizer: the family's
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(compose(CUSTOM).model))
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
