"""LoRA on FSDP2 (model.lora) through the CLI at 1, 2 and 4 ranks, against a single-process PEFT model
(get_peft_model on transformers' from_pretrained) trained with torch's AdamW on the same batches: the same losses,
the same adapters (the export, read back by PeftModel.from_pretrained), the merged export equal to PEFT's
merge_and_unload; resume checkpoints hold the adapters and their optimizer state only, a resume ends where the
uninterrupted run ends, and `fsdp-research export` of one writes the run's own export; bad settings are one line
before any compute."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fsdp_research.checkpoint.hf_export import export_adapted
from fsdp_research.cli.export import main as export
from fsdp_research.data.packing import IGNORE, INPUTS, LABELS, POSITIONS
from fsdp_research.data.pipeline import build_data
from fsdp_research.errors import CheckpointError, ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.lora import apply_lora, base_identity, initial_a
from fsdp_research.train.refusals import checked_plan
from fsdp_research.train.state import TrainState
from tests.conftest import FAST, ROOT
from tests.helpers.chats import CONVERSATIONS, chat_llama, write_chats
from tests.helpers.cli import command, finish, read_metrics, start
from tests.helpers.reference import decay_groups, factor_at
from tests.helpers.zoo import hf_config, initial_weights, pretrained

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 4
# The head trained whole beside the adapters (PEFT's modules_to_save: a trained copy of it).
LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.modules_to_save=[lm_head]"]
PROMPT = "What is x + 1?"
SAMPLES = [f"trainer.eval_interval={STEPS}", f"trainer.sample_prompts=[{PROMPT}]", "trainer.sample_tokens=6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    model = chat_llama(str(tmp / "model"))
    train = write_chats(str(tmp / "data" / "train.jsonl"), CONVERSATIONS * 8)
    common = [
        *pretrained(model),
        *LORA,
        "data=chat",
        f"data.paths=[{train}]",
        "data.seq_len=192",
        "precision=fp32",
        "logger=none",
        "trainer.log_interval=1",
        "trainer.eval_interval=0",
        "trainer.global_batch_size=4",
        "trainer.micro_batch_size=1",
        "checkpoint.interval=2",
    ]
    steps = f"trainer.max_steps={STEPS}"
    procs = {
        1: start([*common, steps, *SAMPLES, f"hydra.run.dir={tmp / 'one'}"], ROOT),
        2: start(
            # No saves: the export follows the last eval, which left the last block and the root gathered.
            [*common, steps, *SAMPLES, "checkpoint.save=false", f"hydra.run.dir={tmp / 'two'}"],
            ROOT,
            torchrun_nproc=2,
        ),  # fmt: skip
        "half": start(
            [*common, "trainer.max_steps=2", "checkpoint.export=false", f"hydra.run.dir={tmp / 'half'}"], ROOT
        ),  # fmt: skip
    }
    done = {name: finish(proc) for name, proc in procs.items()}
    procs = {
        4: start(
            [
                *common,
                steps,
                "distributed.nproc_per_node=4",
                "checkpoint.export=false",
                f"hydra.run.dir={tmp / 'four'}",
            ],
            ROOT,
        ),
        "resumed": start(
            [
                *common,
                steps,
                "checkpoint.export=false",
                f"checkpoint.resume={tmp / 'half'}",
                f"hydra.run.dir={tmp / 'half'}",
            ],
            ROOT,
        ),  # fmt: skip
    }
    done.update({name: finish(proc) for name, proc in procs.items()})
    for name, result in done.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])
    return common, model, tmp


def _reference(cfg, model_dir: str):
    """Per-step losses and the trained PEFT model: transformers' loss of each step's global batch (its packed
    samples' positions, num_items_in_batch), clipping and AdamW as the config has them."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base.config.use_cache = False
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"])
    model = get_peft_model(base, lora)
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):  # the run's initial A (B starts at zero, as PEFT's)
            a = module.lora_A["default"].weight
            a.data = initial_a(cfg.trainer.seed, name.removeprefix("base_model.model."), a.shape)
    o = cfg.optim
    optimizer = torch.optim.AdamW(decay_groups(model, o), lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    data = build_data(cfg.data, 0, cfg.trainer.seed)
    losses = []
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = o.lr * factor_at(cfg, step)
        batch = data.global_batch(step, cfg.trainer.global_batch_size)
        labels = torch.cat([torch.full_like(batch[:, LABELS, :1], IGNORE), batch[:, LABELS, :-1]], dim=1)
        out = model(
            input_ids=batch[:, INPUTS],
            position_ids=batch[:, POSITIONS],
            labels=labels,
            num_items_in_batch=int((labels != IGNORE).sum()),
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses, model


def test_lora_trains_as_peft_and_torch_adamw_at_any_world_size(runs):
    common, model_dir, tmp = runs
    losses, reference = _reference(compose([*common, f"trainer.max_steps={STEPS}"]), model_dir)
    for name in ("one", "two", "four"):
        ours = [row["loss"] for row in read_metrics(str(tmp / name))]
        assert ours == pytest.approx(losses, rel=1e-5), name
    # The exported adapter, read by PEFT onto the base: the reference's adapters.
    exported = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir), str(tmp / "one" / "export" / "adapter")
    )
    theirs = {k: v for k, v in reference.state_dict().items() if "lora_" in k or "modules_to_save" in k}
    loaded = {k: v for k, v in exported.state_dict().items() if "lora_" in k or "modules_to_save" in k}
    assert loaded.keys() == theirs.keys() and len(loaded) == 2 * 7 * 2 + 1
    for key, value in theirs.items():
        torch.testing.assert_close(loaded[key], value, rtol=1e-5, atol=1e-6)
    # The merged export: PEFT's merge of that adapter (at 2 ranks too, exported right after an eval).
    merged = exported.merge_and_unload().state_dict()
    for name in ("one", "two"):
        ours = AutoModelForCausalLM.from_pretrained(str(tmp / name / "export")).state_dict()
        assert ours.keys() == merged.keys()
        for key, value in merged.items():
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-6)


def test_checkpoints_hold_the_adapters_and_a_resume_is_exact(runs):
    _, model_dir, tmp = runs
    saved = dcp.FileSystemReader(str(tmp / "one" / "checkpoints" / "step_2")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert [k for k in model_keys if ".lora_A." not in k and ".lora_B." not in k] == [
        "model.lm_head.modules_to_save.default.weight"
    ]
    assert not any("base_layer" in k or "embed_tokens" in k or "original_module" in k for k in saved)
    one = [row["loss"] for row in read_metrics(str(tmp / "one"))]
    resumed = [row["loss"] for row in read_metrics(str(tmp / "half"))]
    assert resumed == one  # bitwise: steps 1-2, then 3-4 after the resume
    # Other base weights at the same path are refused on resume: their identity differs.
    other = tmp / "other"
    shutil.copytree(model_dir, other)
    before = base_identity(compose(pretrained(str(other)) + LORA).model)
    changed = AutoModelForCausalLM.from_pretrained(str(other))
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1
    changed.save_pretrained(str(other))
    state = TrainState(None, None, base_weights=base_identity(compose(pretrained(str(other)) + LORA).model))
    with pytest.raises(ConfigError, match="model.name_or_path: is not the base the checkpoint's adapters trained on"):
        state.load_state_dict({"base_weights": before}, 64)
    assert base_identity(compose(pretrained(model_dir)).model) is None


def test_a_checkpoint_exports_offline_as_the_run_ends(runs, tmp_path):
    """`fsdp-research export <run dir>` of a LoRA run (its newest checkpoint: the adapters alone, on the base it
    names), in this process: the run's own export, file for file (it was refused); the adapter, read by
    PeftModel.from_pretrained onto the base, has the merged model's logits."""
    _, model_dir, tmp = runs
    own, offline = tmp / "one" / "export", tmp_path / "export"
    assert export([str(tmp / "one"), str(offline)]) == 0
    assert sorted(os.listdir(offline)) == sorted(os.listdir(own))
    assert sorted(os.listdir(offline / "adapter")) == sorted(os.listdir(own / "adapter"))
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        ours, theirs = load_file(str(offline / name)), load_file(str(own / name))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), name
    merged = AutoModelForCausalLM.from_pretrained(str(own))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(offline / "adapter"))
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


def test_an_offline_export_onto_another_base_is_refused(runs, tmp_path):
    _, model_dir, tmp = runs
    step_dir = str(tmp / "one" / "checkpoints" / "step_4")
    cfg = OmegaConf.load(os.path.join(step_dir, "train_config.yaml"))
    cfg.model.name_or_path = str(tmp_path / "other")
    changed = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        changed.lm_head.weight[0, 0] += 1
    changed.save_pretrained(cfg.model.name_or_path)
    with pytest.raises(CheckpointError, match="is not the base its adapters trained on .*; fix: "):
        export_adapted(step_dir, cfg, changed.config, str(tmp_path / "export"))
    assert not (tmp_path / "export").exists()


def test_the_samples_are_transformers_generate_of_the_export(runs):
    """The last eval's sample: what `fsdp-research generate` makes of the export with transformers' generate, from
    the merged model and from the base with the adapter (PEFT)."""
    _, _, tmp = runs
    samples = {}
    for name in ("one", "two"):
        with open(tmp / name / "metrics.jsonl") as f:
            [samples[name]] = [row["samples"] for row in map(json.loads, f) if isinstance(row.get("samples"), list)][-1]
    sample = samples["one"]
    assert sample["prompt"] == PROMPT and samples["two"] == sample  # every rank extends alike
    for extra in ([], ["--adapter"]):
        out = command(["generate", str(tmp / "one"), "--prompt", PROMPT, "--max-new-tokens", "6", *extra])
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.endswith(f"{PROMPT} -> {sample['completion']}\n")


def test_bad_lora_settings_are_one_line(runs):
    common, model_dir, _ = runs

    def refused(*overrides) -> str:
        cfg = compose([*common, *overrides])
        with pytest.raises(ConfigError) as err:
            checked_plan(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))
        return str(err.value)

    assert refused("model.lora.r=0").startswith("model.lora.r: 0 is below 1")
    assert refused("model.lora.target_modules=[nothing_here]").startswith("model.lora.target_modules: PEFT cannot")
    assert refused("model.load_weights=false").startswith("model.lora: adapts pretrained weights")
    assert os.path.isdir(model_dir)
    # A tied head cannot train a copy of its own.
    tied = AutoModelForCausalLM.from_config(hf_config("llama", tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="model.lora.modules_to_save: lm_head shares its weights"):
        apply_lora(tied, compose(LORA).model.lora)


def test_the_frozen_base_is_stored_in_the_compute_dtype(runs):
    common, _, _ = runs
    cfg = compose([*common, "precision=bf16"])
    model, _ = planned_model(cfg, build_hf_config(cfg.model), values=False)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {dtypes[n] for n, p in model.named_parameters() if p.requires_grad} == {torch.float32}
    assert {dtypes[n] for n, p in model.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    assert dtypes["lm_head.modules_to_save.default.weight"] == torch.float32


def test_an_adapted_tied_head_is_exported_untied(tmp_path):
    """Llama-3.2's head, tied to the input embedding, among LoRA's targets at 2 ranks: the merged export unties it
    (the head with its adapter merged, the embedding as it was), so its logits are those of the adapted model as
    PEFT loads the exported adapter onto the base; merged into the shared weight, they differed by ~0.8."""
    base = initial_weights("llama", str(tmp_path / "base"), tie_word_embeddings=True)
    run = tmp_path / "run"
    overrides = [*pretrained(base), "model.lora.r=4", "model.lora.target_modules=[q_proj,v_proj,lm_head]"]
    train = [o for o in FAST if not o.startswith(("data.paths=", "checkpoint.export="))] + ["data=synthetic"]
    settings = [
        "optim.lr=0.01",
        "schedule.warmup_steps=0",
        "trainer.max_steps=2",
        "distributed.nproc_per_node=2",
        "checkpoint.save=false",
    ]
    done = finish(
        start([*train, *overrides, *settings, "checkpoint.export_dtype=float32", f"hydra.run.dir={run}"], str(tmp_path))
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(run / "export" / "adapter"))
    exported = AutoModelForCausalLM.from_pretrained(str(run / "export"))
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, adapted(ids).logits, rtol=1e-6, atol=1e-5)
    assert not exported.config.tie_word_embeddings
    assert "lm_head.weight: adapted and tied to another module; the merged export unties them" in done.stdout
