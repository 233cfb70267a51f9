"""Every bad input fails fast: one line on stderr naming the key and the fix, exit 2, no compute, and nothing written
into the run dir. Composition errors (an unknown key or option, a `+` for a key no schema has, a list without
brackets, a wrong type) are caught at the entry, before Hydra makes a run dir, with the nearest key."""

import functools
import json
import os
import shutil

import pytest

from tests.helpers.cli import finish, start
from tests.helpers.corpora import bpe_tokenizer, write
from tests.helpers.zoo import hf_config, initial_weights

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SMALL = ["logger=none", "trainer.max_steps=2"]
APP_ERRORS = {
    "batch": (
        "trainer.global_batch_size",
        ["distributed.nproc_per_node=2", "trainer.global_batch_size=6", "trainer.micro_batch_size=2"],
    ),
    "seq_len": ("data.seq_len", ["data.seq_len=4096"]),
    "block_class": ("model.block_class", ["model.block_class=NoSuchBlock"]),
    "hsdp": ("sharding.replicate", ["distributed.nproc_per_node=2", "sharding=hsdp", "sharding.replicate=3"]),
    "paths": ("data.paths", ["data.paths=[/no/such/dir/*.txt]"]),
    "dtype": ("precision.param_dtype", ["precision.param_dtype=float8"]),
    "device": ("trainer.device", ["distributed.nproc_per_node=2", "trainer.device=gpu"]),
    "no_eval_data": ("trainer.eval_interval", ["data.eval_fraction=0", "trainer.eval_interval=1"]),
    # CORPUS: a JSON Lines corpus the fixture writes, whose records hold "text" and "id".
    "text_field": ("data.text_field", ["data.paths=[CORPUS]", "data.text_field=body"]),
    "weights": ("data.sources", ["data.sources=[{paths:[CORPUS],weight:0}]"]),
    "tokenizer_vocab": (
        "data.tokenizer",
        ["data.paths=[CORPUS]", "data.tokenizer=TOKENIZER", "model.config.vocab_size=260"],
    ),
    # LLAMA: a save_pretrained llama; MIXED: its config with a gpt2's weights; SHARDED: a llama whose index lists a
    # shard that is not there.
    "other_architecture": ("model.name_or_path", ["model=pretrained", "model.name_or_path=MIXED"]),
    "missing_shard": ("model.name_or_path", ["model=pretrained", "model.name_or_path=SHARDED"]),
    "reshaped": ("model.config", ["model=pretrained", "model.name_or_path=LLAMA", "model.config.intermediate_size=96"]),
    "unknown_family": ("model.model_type", ["model=custom", "model.model_type=nope"]),
    "not_a_causal_lm": ("model.config", ["model=custom", "model.model_type=t5"]),
    "no_decay": ("optim.no_decay", ["optim.no_decay=[norms]"]),
    "optim_lr": ("optim.lr", ["optim.lr=-1"]),
    "no_model_dir": ("model.name_or_path", ["model=pretrained", "model.name_or_path=/no/such/model"]),
    "optim_target": ("optim._target_", ["optim._target_=mypkg.opt.Lion"]),
    "param_group": ("optim.param_groups[0].match", ["optim.param_groups=[{match: nothing_here}]"]),
    "no_processes": ("distributed.nproc_per_node", ["distributed.nproc_per_node=0"]),
    "nccl_on_cpu": ("distributed.backend", ["distributed.backend=nccl", "trainer.device=cpu"]),
    "nccl_spawned": ("distributed.backend", ["distributed.nproc_per_node=2", "distributed.backend=nccl"]),
    "reshard_int": (
        "sharding.reshard_after_forward",
        ["distributed.nproc_per_node=2", "sharding.reshard_after_forward=3"],
    ),
    "prefetch_depth": ("sharding.prefetch_backward", ["sharding.prefetch_backward=4"]),
    "loss_chunks": ("loss.chunks", ["loss.chunks=0"]),
    "objective_target": ("objective._target_", ["objective._target_=torch.optim.AdamW"]),
    # The base class reads no loss group (objective=lm does): a z-loss would change nothing.
    "objective_loss": ("loss", ["objective._target_=fsdp_research.objectives.Objective", "loss.z_loss=1e-4"]),
    "objective_packed": (
        "data.document_masking",
        ["objective._target_=fsdp_research.objectives.Objective", "data.document_masking=true"],
    ),
    "selective_per_linear": ("activation_checkpointing", ["activation_checkpointing=selective", "sharding=per_linear"]),
    "tp_world": ("parallel.tp", ["parallel.tp=2"]),
    "save_ops": (
        "activation_checkpointing.save_ops",
        ["activation_checkpointing=selective", "activation_checkpointing.save_ops=[aten.no_such_op]"],
    ),
    # Gemma 2 soft-caps its logits after the output layer: chunks would train on another loss.
    "chunks_softcap": (
        "loss.chunks",
        [
            "loss.chunks=4",
            "model=custom",
            "model.model_type=gemma2",
            "model.config.hidden_size=64",
            "model.config.intermediate_size=128",
            "model.config.num_hidden_layers=2",
            "model.config.head_dim=16",
            "model.config.num_attention_heads=4",
            "model.config.num_key_value_heads=2",
            "model.config.vocab_size=512",
        ],
    ),
}
MESSAGES = {
    "optim_target": "cannot import 'mypkg.opt.Lion'",
    "optim_lr": "-1.0: AdamW refuses it (Invalid learning rate: -1.0)",
    "no_model_dir": "/no/such/model does not exist",
    "param_group": "'nothing_here' matches no parameter",
    "other_architecture": "does not fit LlamaForCausalLM: missing lm_head.weight, model.embed_tokens.weight",
    "missing_shard": "index lists model-00002-of-",
    "reshaped": "model.layers.0.mlp.down_proj.weight is [64, 96] in the model, [64, 128] in the checkpoint",
    "unknown_family": "transformers has no config for it",
    "not_a_causal_lm": "transformers cannot build a causal LM of type 't5'",
    "reshard_int": "3 is not true, false or a group size dividing the shard group of 2 rank(s)",
    "prefetch_depth": "4 blocks ahead, but the model has 4 blocks",
    "save_ops": "torch has no operator 'aten.no_such_op'",
    "chunks_softcap": "the model changes its logits after the output layer",
    "objective_target": "torch.optim.AdamW is not a subclass of fsdp_research.objectives.Objective",
    "objective_loss": "objective Objective does not read it (objective=lm does)",
    "objective_packed": "makes packed samples, which objective Objective does not take",
}
COMPOSITION_ERRORS = {
    "unknown_key": (
        "trainer.max_stepz: no such key (did you mean trainer.max_steps?); fix: use trainer.max_steps",
        ["trainer.max_stepz=3"],
    ),
    # Hydra's own hint for the above: a + adds the key, which the trainer's schema has no room for.
    "plus_key": (
        "trainer.max_stepz: no such key (did you mean trainer.max_steps?); fix: use trainer.max_steps",
        ["+trainer.max_stepz=3"],
    ),
    "unknown_option": (
        "sharding: no option 'blockwize' (did you mean blockwise?); fix: use one of blockwise, ddp, ddp_classic, "
        "hsdp, no_reshard, per_linear, reshard_all, root_only",
        ["sharding=blockwize"],
    ),
    "wrong_type": (
        "trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer; fix: give a value of the "
        "key's type",
        ["trainer.max_steps=abc"],
    ),
    "list_without_brackets": (
        "data.paths: '/x.jsonl' is not a list; fix: write data.paths=[/x.jsonl] (brackets; commas between items)",
        ["data.paths=/x.jsonl"],
    ),
}
# A run dir that already holds a run: a bad relaunch into it must leave it as it was. One case of each path:
# checked in the parent before workers start (batch), and inside train() (seq_len).
EXISTING = {
    "train.log": "[00:00:00][INFO] step 1/2 | loss 6\n",
    "metrics.jsonl": '{"step": 1, "loss": 6.0}\n',
    "status.json": '{"status": "completed", "error": null}',
}
INTO_EXISTING = {"batch", "seq_len"}
# Real interpreter starts, as a user's shell makes them: the exit code and the one line of each kind of refusal (the
# others are forked from the suite's forkserver: the same train.py, without the start-up).
REAL = {"unknown_key", "batch", "seq_len"}
# Found by a forward of two tokens on the sharded model, once the run has begun its log.
AFTER_BUILD = {"chunks_softcap"}


def _contents(run_dir):
    # Hydra rewrites its config snapshot before the app starts: the one record a refused command changes.
    return {name: (run_dir / name).read_text() for name in os.listdir(run_dir) if name != ".hydra"}


@pytest.fixture(scope="module")
def failed(tmp_path_factory):
    """Every case at once."""
    cwd = tmp_path_factory.mktemp("bad_input")
    files = {
        "CORPUS": write("jsonl", str(cwd / "corpus")),
        "TOKENIZER": bpe_tokenizer(str(cwd / "tokenizer")),
        **_checkpoints(cwd),
    }
    procs = {}
    for name, (_, overrides) in {**APP_ERRORS, **COMPOSITION_ERRORS}.items():
        overrides = [functools.reduce(lambda o, kv: o.replace(*kv), files.items(), o) for o in overrides]
        if name in INTO_EXISTING:
            (cwd / name).mkdir()
            for file, text in EXISTING.items():
                (cwd / name / file).write_text(text)
        procs[name] = start(SMALL + overrides + [f"hydra.run.dir={cwd / name}"], str(cwd), real=name in REAL)
    return cwd, {name: finish(proc, timeout=300) for name, proc in procs.items()}


def _checkpoints(cwd) -> dict:
    llama = initial_weights("llama", str(cwd / "llama"))
    mixed = str(cwd / "mixed")
    shutil.copytree(llama, mixed)
    shutil.copy(os.path.join(initial_weights("gpt2", str(cwd / "gpt2")), "model.safetensors"), mixed)
    sharded = str(cwd / "sharded")
    hf_config("llama").save_pretrained(sharded)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(sharded, max_shard_size="100KB")
    os.remove(os.path.join(sharded, sorted(f for f in os.listdir(sharded) if f.startswith("model-0"))[1]))
    return {"LLAMA": llama, "MIXED": mixed, "SHARDED": sharded}


@pytest.mark.parametrize("name", list(APP_ERRORS))
def test_app_error_is_one_line_naming_key_and_fix(failed, name):
    cwd, results = failed
    result = results[name]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.last_error_line()
    assert line.startswith(f"error: {APP_ERRORS[name][0]}: ") and "; fix: " in line, result.stderr[-3000:]
    assert MESSAGES.get(name, "") in line, line
    assert "step 1/" not in result.stdout  # no step ran
    # An existing run is left as it was, its status too; a fresh dir holds only the failed status.
    if name in INTO_EXISTING:
        assert _contents(cwd / name) == EXISTING
        return
    status = cwd / name / "status.json"
    assert _contents(cwd / name).keys() <= {"status.json", *(["train.log"] if name in AFTER_BUILD else [])}
    if status.exists():
        record = json.loads(status.read_text())
        assert record["status"] == "failed" and f"{APP_ERRORS[name][0]}: " in record["error"]


@pytest.mark.parametrize("name", list(COMPOSITION_ERRORS))
def test_composition_error_is_one_line_with_the_nearest_key(failed, name):
    cwd, results = failed
    result = results[name]
    assert result.returncode == 2 and result.stderr.strip() == f"error: {COMPOSITION_ERRORS[name][0]}", result.stderr
    assert not (cwd / name).exists()  # fails before Hydra makes the run dir
