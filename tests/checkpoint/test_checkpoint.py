"""Checkpoints that never lose a run. Real processes through the real CLI, a real SIGKILL of the whole
job, a real full disk (tmpfs); nothing is mocked. One uninterrupted 2-rank run, the baseline, is shared by most
tests: each test that resumes from it works on a copy of its run dir. The scenarios after the baseline start
together on a few threads (each mostly waits on its subprocesses); a test waits for the one it reads."""

import functools
import json
import os
import re
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from fsdp_research.checkpoint.hf_export import load_checkpoint_weights
from fsdp_research.checkpoint.resume import MANIFEST, TRAINER_STATE, checkpoints_in, verify
from fsdp_research.cli.generate import main as generate
from fsdp_research.data.tokenizer import BYTE_EOS
from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.checkpointing import (
    Job,
    assert_bitwise_equal,
    build_distributed,
    checkpoint_tensors,
    complete_steps,
    newest_complete,
    snapshot,
    train,
    with_overrides,
)
from tests.helpers.cli import command
from tests.helpers.disk import small_disk

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS, INTERVAL, KEEP, BATCH, SEQ_LEN = 16, 4, 3, 8, 64
BASE = with_overrides(
    FAST,
    "distributed.nproc_per_node=2",
    f"trainer.max_steps={STEPS}",
    f"trainer.global_batch_size={BATCH}",
    "trainer.micro_batch_size=4",
    f"checkpoint.interval={INTERVAL}",
    f"checkpoint.keep_last={KEEP}",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
)
LAST = f"checkpoints/step_{STEPS}"
KEPT = list(range(STEPS - (KEEP - 1) * INTERVAL, STEPS + 1, INTERVAL))  # [8, 12, 16]
# Gradient accumulation and activation checkpointing are resumed together, to keep the runs few; that variant
# also logs to W&B, so its kill and resume show the W&B run id carried over.
VARIANTS = {
    "plain": [],
    "accumulation+ac": ["trainer.micro_batch_size=2", "activation_checkpointing=every_block", "logger=wandb"],
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return str(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "hf_datasets")


def _copy_run(run_dir: str, to: str) -> str:
    shutil.copytree(run_dir, to)
    return to


def _watch_pruning(job: Job) -> list:
    """Wait for the job, noting the complete checkpoints at each moment the listing held still while it was
    checked: [(steps published so far, complete steps)]."""
    root, seen, observed = os.path.join(job.run_dir, "checkpoints"), set(), []
    running = True
    while running:
        # The last look comes after the exit: on a busy machine the run can publish its last checkpoint and end
        # between two looks (CI's stop 62 saw [4, 8, 12]).
        running = job.proc.poll() is None
        before = checkpoints_in(root)
        complete = complete_steps(job.run_dir)
        if before and before == checkpoints_in(root):
            seen.update(step for step, _ in before)
            observed.append((sorted(seen), complete))
        if running:
            time.sleep(0.05)
    return observed


@pytest.fixture(scope="module")
def watched_baseline(work, hf_cache):
    """The uninterrupted run, and what _watch_pruning saw while it ran."""
    job = Job(os.path.join(work, "baseline"), BASE, hf_cache)
    observed = _watch_pruning(job)
    run = job.finish()
    assert run.returncode == 0, run.stderr[-3000:]
    return run, observed


@pytest.fixture(scope="module")
def baseline(watched_baseline):
    return watched_baseline[0]


@pytest.fixture(scope="module")
def scenario(work, hf_cache, baseline):
    """Starts every scenario at once, the longest first, on three threads; scenario(name) waits for one."""
    jobs = {
        "exact[accumulation+ac]": functools.partial(_kill_and_resume, work, hf_cache, None, "accumulation+ac"),
        "exact[plain]": functools.partial(_kill_and_resume, work, hf_cache, baseline, "plain"),
        "reshard[4]": functools.partial(_resume_at, work, hf_cache, baseline, 4),
        "disk_full": functools.partial(_fill_the_disk, work, hf_cache),
        "broken": functools.partial(_resume_broken, work, hf_cache, baseline),
        "async": functools.partial(
            train, os.path.join(work, "async"), with_overrides(BASE, "checkpoint.async=true"), hf_cache
        ),
        "gpt2": functools.partial(
            train,
            os.path.join(work, "gpt2"),  # tied embeddings, export in ~1 MB shards
            with_overrides(BASE, "model=gpt2_tiny", "trainer.max_steps=2", "checkpoint.export_shard_size=1MB"),
            hf_cache,
        ),
        "built": functools.partial(_build, work),
        "reshard[1]": functools.partial(_resume_at, work, hf_cache, baseline, 1),
        **{
            f"mismatch[{name}]": functools.partial(_resume_mismatched, work, hf_cache, baseline, name)
            for name in MISMATCHED
        },
        "older": functools.partial(_resume_older, work, hf_cache, baseline),
    }
    pool = ThreadPoolExecutor(3)
    futures = {name: pool.submit(job) for name, job in jobs.items()}
    yield lambda name: futures[name].result()
    pool.shutdown(cancel_futures=True)


def _kill_and_resume(work, hf_cache, baseline, name):
    overrides = with_overrides(BASE, *VARIANTS[name])
    if baseline is None:
        baseline = train(os.path.join(work, f"{name}_baseline"), overrides, hf_cache)
    run_dir = os.path.join(work, name)
    killed = Job(run_dir, overrides, hf_cache).kill_when(os.path.join(run_dir, f"checkpoints/step_{INTERVAL}"))
    killed_steps = [m["step"] for m in killed.metrics()]
    resumed_from = newest_complete(run_dir)
    # A save killed just before its rename: a newer, complete-looking copy under the temporary name.
    leftover = os.path.join(run_dir, f"checkpoints/.tmp_step_{STEPS - INTERVAL}")
    shutil.copytree(os.path.join(run_dir, f"checkpoints/step_{resumed_from}"), leftover)
    resumed = train(run_dir, overrides, hf_cache)
    return baseline, killed, killed_steps, resumed_from, resumed


def _assert_same_metrics(run, reference, keys=("loss", "grad_norm", "lr")):
    got, want = run.metrics(), reference.metrics()
    assert [m["step"] for m in got] == list(range(1, STEPS + 1)), "each step logged exactly once"
    for key in keys:
        assert [m[key] for m in got] == [m[key] for m in want], key


@pytest.mark.parametrize("variant", VARIANTS)
def test_sigkill_then_resume_is_bitwise_exact(scenario, variant):
    baseline, killed, killed_steps, resumed_from, resumed = scenario(f"exact[{variant}]")
    assert baseline.returncode == 0, baseline.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL
    assert resumed_from is not None and max(killed_steps) < STEPS, "the kill must land mid-run"
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {resumed.run_dir}/checkpoints/step_{resumed_from}" in resumed.stdout
    _assert_same_metrics(resumed, baseline)
    # Model and optimizer state of the last checkpoint, and the exported weights.
    assert_bitwise_equal(
        checkpoint_tensors(os.path.join(resumed.run_dir, LAST)),
        checkpoint_tensors(os.path.join(baseline.run_dir, LAST)),
    )
    assert_bitwise_equal(
        load_file(os.path.join(resumed.run_dir, "export/model.safetensors")),
        load_file(os.path.join(baseline.run_dir, "export/model.safetensors")),
    )


def test_keep_last_prunes_only_after_a_newer_checkpoint_is_complete(watched_baseline):
    baseline, observed = watched_baseline
    assert sorted(os.listdir(os.path.join(baseline.run_dir, "checkpoints"))) == sorted(f"step_{s}" for s in KEPT)
    assert complete_steps(baseline.run_dir) == KEPT
    published = max((seen for seen, _ in observed), key=len, default=[])
    assert published == list(range(INTERVAL, STEPS + 1, INTERVAL)), "the watch saw every checkpoint appear"
    for seen, complete in observed:
        assert len(complete) >= min(KEEP, len(seen)), f"after {seen} were published only {complete} were complete"


def test_leftover_temporary_checkpoint_is_ignored(scenario):
    _, _, _, resumed_from, resumed = scenario("exact[plain]")
    # The .tmp_step_12 copy was newer than step_<resumed_from> yet not loaded; the run's own save replaced it.
    assert f"resumed from checkpoint {resumed.run_dir}/checkpoints/step_{resumed_from}" in resumed.stdout
    assert sorted(os.listdir(os.path.join(resumed.run_dir, "checkpoints"))) == sorted(f"step_{s}" for s in KEPT)


def test_wandb_run_id_survives_resume(scenario):
    """The resume continues the killed attempt's W&B run, or forks it where that had logged steps past the
    checkpoint (tests/jobs/test_launch.py): either way the checkpoints carry the id of the run it logs to."""
    baseline, _, _, _, resumed = scenario("exact[accumulation+ac]")
    run_id = torch.load(os.path.join(resumed.run_dir, LAST, TRAINER_STATE), weights_only=False)["wandb_run_id"]
    offline = sorted(os.listdir(os.path.join(resumed.run_dir, "wandb")))
    offline = [name for name in offline if name.startswith("offline-run-")]
    assert len(offline) == 2 and offline[-1].endswith(f"-{run_id}"), (run_id, offline)
    assert not any(name.endswith(f"-{run_id}") for name in os.listdir(os.path.join(baseline.run_dir, "wandb")))


def _resume_at(work, hf_cache, baseline, world):
    run_dir = _copy_run(baseline.run_dir, os.path.join(work, f"reshard_{world}"))
    return train(
        run_dir,
        with_overrides(
            BASE,
            f"distributed.nproc_per_node={world}",
            f"trainer.micro_batch_size={BATCH // world}",
            f"checkpoint.resume={run_dir}/checkpoints/step_{KEPT[0]}",
        ),
        hf_cache,
    )


@pytest.mark.parametrize("world", [1, 4])
def test_resume_at_another_world_size(baseline, scenario, world):
    run, k = scenario(f"reshard[{world}]"), KEPT[0]
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"resumed from checkpoint {run.run_dir}/checkpoints/step_{k}" in run.stdout
    assert f"on {world} rank(s)" in run.stdout and f"starting at step {k}" in run.stdout
    got, want = run.metrics(), baseline.metrics()
    # The data stream is a function of the global step: continuing at k + 1, each step once, neither repeats
    # nor skips a sample.
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert got[:k] == want[:k]
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in got[k:]], dtype=torch.float64),
        torch.tensor([m["loss"] for m in want[k:]], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    state = torch.load(os.path.join(run.run_dir, LAST, TRAINER_STATE), weights_only=False)
    assert state["tokens_seen"] == STEPS * BATCH * SEQ_LEN and state["world_size"] == world
    final, reference = (load_checkpoint_weights(os.path.join(r.run_dir, LAST)) for r in (run, baseline))
    for key, value in reference.items():
        torch.testing.assert_close(final[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def _garble(path):
    with open(path, "r+b") as f:  # same size, so only reading it can tell
        f.write(b"garbled!" * 4)


# The newest checkpoint loses a shard file, the one before it gets garbled metadata: resume=auto must fall back
# to the third newest, naming what is wrong with each.
BROKEN = {
    STEPS: (lambda step_dir: os.remove(os.path.join(step_dir, "__1_0.distcp")), "missing __1_0.distcp"),
    STEPS - INTERVAL: (lambda step_dir: _garble(os.path.join(step_dir, ".metadata")), "unreadable DCP metadata"),
}


def _resume_broken(work, hf_cache, baseline):
    run_dir = _copy_run(baseline.run_dir, os.path.join(work, "broken"))
    for step, (breakage, _) in BROKEN.items():
        breakage(os.path.join(run_dir, f"checkpoints/step_{step}"))
    return train(run_dir, BASE, hf_cache)


@pytest.mark.parametrize("step", BROKEN)
def test_broken_checkpoint_is_skipped_with_a_warning(scenario, step):
    broken = scenario("broken")
    warnings = [line for line in broken.stdout.splitlines() if "[WARNING]" in line]
    assert any(
        f"skipping checkpoint {broken.run_dir}/checkpoints/step_{step}: {BROKEN[step][1]}" in w for w in warnings
    ), warnings


def test_training_continues_from_the_newest_complete_checkpoint(baseline, scenario):
    broken = scenario("broken")
    assert broken.returncode == 0, broken.stderr[-3000:]
    assert f"resumed from checkpoint {broken.run_dir}/checkpoints/step_{KEPT[0]}" in broken.stdout
    _assert_same_metrics(broken, baseline)
    assert complete_steps(broken.run_dir) == KEPT, "the broken checkpoints were replaced"


def _momentum_optimizer(step_dir):
    """Rewrite the checkpoint as if its run's optimizer had kept one momentum buffer per parameter instead of
    Adam's two moments (the manifest too, so that the checkpoint stays complete)."""
    full = step_dir + ".pt"
    dcp_to_torch_save(step_dir, full)
    state = torch.load(full, weights_only=False)
    state["optim"]["state"] = {fqn: {"momentum_buffer": s["exp_avg"]} for fqn, s in state["optim"]["state"].items()}
    torch.save(state, full)
    for name in os.listdir(step_dir):
        if name.endswith(".distcp") or name in (".metadata", MANIFEST):
            os.remove(os.path.join(step_dir, name))
    torch_save_to_dcp(full, step_dir)
    os.remove(full)
    files = {name: os.path.getsize(os.path.join(step_dir, name)) for name in os.listdir(step_dir)}
    with open(os.path.join(step_dir, MANIFEST), "w") as f:
        json.dump({"step": STEPS, "world_size": 2, "files": files}, f)
    assert verify(step_dir) is None


MISMATCHED = {
    "model_shape": (
        None,
        ["model.config.hidden_size=64"],
        ["model.model.embed_tokens.weight is [512, 128] in the checkpoint, [512, 64] here"],
    ),
    # One rank (a cheaper start): the check compares whole tensors, whatever the world size.
    "optimizer": (
        _momentum_optimizer,
        ["distributed.nproc_per_node=1", f"trainer.micro_batch_size={BATCH}"],
        ["missing optim.state.lm_head.weight.exp_avg;", "unexpected optim.state.lm_head.weight.momentum_buffer;"],
    ),
}


def _app_files(files):
    return {k: v for k, v in files.items() if not k.startswith(".hydra" + os.sep)}


def _resume_mismatched(work, hf_cache, baseline, name):
    edit, overrides, _ = MISMATCHED[name]
    run_dir = _copy_run(baseline.run_dir, os.path.join(work, name))
    if edit:
        edit(os.path.join(run_dir, LAST))
    before = snapshot(run_dir)
    # More steps than the checkpoint's run: a resume that went ahead would write.
    run = train(run_dir, with_overrides(BASE, *overrides, f"trainer.max_steps={STEPS + INTERVAL}"), hf_cache)
    return run, before, snapshot(run_dir)


@pytest.mark.parametrize("name", MISMATCHED)
def test_mismatched_resume_names_the_keys_and_writes_nothing(scenario, name):
    run, before, after = scenario(f"mismatch[{name}]")
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(run.error_lines()) == 1, run.stderr[-3000:]
    line = run.error_lines()[0]
    assert line.startswith(f"error: checkpoint {run.run_dir}/{LAST} does not fit this model/optimizer: ")
    assert all(named in line for named in MISMATCHED[name][2]), line
    # Hydra records the command in .hydra/ before the app starts; everything the app owns is untouched.
    assert _app_files(after) == _app_files(before)


OLDER_STEPS = KEPT[0] + 2


def _resume_older(work, hf_cache, baseline):
    run_dir = _copy_run(baseline.run_dir, os.path.join(work, "older"))
    return train(
        run_dir,
        with_overrides(
            BASE,
            "distributed.nproc_per_node=1",
            f"trainer.micro_batch_size={BATCH}",
            f"trainer.max_steps={OLDER_STEPS}",
            "checkpoint.export=false",
            f"checkpoint.resume={run_dir}/checkpoints/step_{KEPT[0]}",
        ),
        hf_cache,
    )


def test_resume_from_an_older_checkpoint_abandons_the_later_ones(scenario):
    """Resumed from step_8 of a run that went on to step_16, a run continues in that run dir: once its own
    checkpoint is complete, the later ones go (else the next resume=auto would pick up the abandoned run)."""
    run, steps = scenario("older"), OLDER_STEPS
    assert run.returncode == 0, run.stderr[-3000:]
    assert complete_steps(run.run_dir) == [KEPT[0], steps]
    assert [m["step"] for m in run.metrics()] == list(range(1, steps + 1))


TMPFS_MIB = 17  # one llama_tiny checkpoint (~11.1 MiB) fits, a second does not


def _fill_the_disk(work, hf_cache):
    """A run on a tmpfs too small for its second checkpoint; then, copied off it, a resume of what it left."""
    with small_disk(os.path.join(work, "small_disk"), TMPFS_MIB) as mount:
        # The job's own output stays off the full disk.
        run = train(os.path.join(mount, "run"), BASE, hf_cache, logs=os.path.join(work, "small_disk_run"))
        saved = _copy_run(run.run_dir, os.path.join(work, "disk_full"))
    complete = verify(os.path.join(saved, f"checkpoints/step_{INTERVAL}"))
    return run, saved, complete, os.listdir(os.path.join(saved, "checkpoints")), train(saved, BASE, hf_cache)


def test_write_failure_during_save_keeps_the_previous_checkpoint(baseline, scenario):
    run, saved, problem, left, resumed = scenario("disk_full")
    assert run.returncode == 2, run.stderr[-3000:]
    assert len(run.error_lines()) == 1, run.stderr[-3000:]
    line = run.error_lines()[0]
    assert line.startswith(f"error: saving checkpoint step_{2 * INTERVAL} in {run.run_dir}/checkpoints failed ("), line
    free = re.search(r"; ([\d.]+) MiB free there\); the previous checkpoint \((.*)\) is intact$", line)
    assert free and float(free.group(1)) < 1 and free.group(2) == f"{run.run_dir}/checkpoints/step_{INTERVAL}", line
    assert left == [f"step_{INTERVAL}"], "the failed save left nothing behind"
    assert problem is None
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from checkpoint {saved}/checkpoints/step_{INTERVAL}" in resumed.stdout
    _assert_same_metrics(resumed, baseline)


def test_async_save_writes_the_same_checkpoints(baseline, scenario):
    async_run = scenario("async")
    assert async_run.returncode == 0, async_run.stderr[-3000:]
    assert complete_steps(async_run.run_dir) == KEPT
    _assert_same_metrics(async_run, baseline)
    # The intermediate checkpoint too: training went on while it was written.
    for step in KEPT:
        assert_bitwise_equal(
            checkpoint_tensors(os.path.join(async_run.run_dir, f"checkpoints/step_{step}")),
            checkpoint_tensors(os.path.join(baseline.run_dir, f"checkpoints/step_{step}")),
        )


def _save_random_llama(out_dir: str, **kwargs) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **compose().model.config))
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def _build(work):
    """Sharded models from build_sharded_model on spawned ranks: seeded initial weights at 1 and 2 ranks, and
    a save_pretrained llama (one file, and sharded with an index) loaded at 2 ranks."""
    single = _save_random_llama(os.path.join(work, "hf_single"))
    sharded = _save_random_llama(os.path.join(work, "hf_sharded"), max_shard_size="200KB")

    def container(*overrides):
        return OmegaConf.to_container(compose(FAST + list(overrides)), resolve=True)

    batch = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    configs = {
        "init": container(),
        "single": container("model=pretrained", f"model.name_or_path={single}"),
        "sharded": container("model=pretrained", f"model.name_or_path={sharded}"),
    }
    return (
        batch,
        {"single": single, "sharded": sharded},
        build_distributed({"init": configs["init"]}, 1, batch),
        build_distributed(configs, 2, batch),
    )


def test_initial_weights_do_not_depend_on_world_size(scenario):
    _, _, one, two = scenario("built")
    assert_bitwise_equal(one["init"]["weights"], two["init"]["weights"])


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_pretrained_weights_load_shard_by_shard(scenario, layout):
    from transformers import AutoModelForCausalLM

    batch, dirs, _, two = scenario("built")
    files = os.listdir(dirs[layout])
    assert ("model.safetensors.index.json" in files) == (layout == "sharded"), files
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(dirs[layout]).eval()(input_ids=batch).logits
    torch.testing.assert_close(two[layout]["logits"], expected, rtol=1e-5, atol=1e-5)


def _logits(model_or_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_or_dir) if isinstance(model_or_dir, str) else model_or_dir
    with torch.no_grad():
        return model.eval()(input_ids=batch).logits


def _trained_model(step_dir):
    """The model as its last checkpoint holds it, built without the exporter."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(step_dir))
    model.load_state_dict(load_checkpoint_weights(step_dir))
    return model


BATCH_IDS = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(1))


def test_export_loads_with_the_trained_weights(baseline):
    from transformers import AutoModelForCausalLM

    export = os.path.join(baseline.run_dir, "export")
    assert sorted(os.listdir(export)) == ["config.json", "generation_config.json", "model.safetensors", "prompts.json"]
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(
        _logits(model, BATCH_IDS),
        _logits(_trained_model(os.path.join(baseline.run_dir, LAST)), BATCH_IDS),
        rtol=0,
        atol=0,
    )


def test_offline_export_equals_the_end_of_training_export(work, baseline):
    out = os.path.join(work, "offline_export")
    result = command(["export", os.path.join(baseline.run_dir, LAST), out])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_bitwise_equal(
        load_file(os.path.join(out, "model.safetensors")),
        load_file(os.path.join(baseline.run_dir, "export/model.safetensors")),
    )
    torch.testing.assert_close(
        _logits(out, BATCH_IDS), _logits(os.path.join(baseline.run_dir, "export"), BATCH_IDS), rtol=0, atol=0
    )


def test_generate_continues_a_byte_tokenizer_run(baseline, capsys):
    """data.tokenizer=byte, which leaves no tokenizer files in the export (transformers' AutoTokenizer failed on it,
    in a cut-off line): `fsdp-research generate` encodes the prompt's UTF-8 bytes and decodes the greedy
    continuation's, stopping at the end-of-document token, as the run's samples do."""
    from transformers import AutoModelForCausalLM

    prompt, tokens = "def ", 8
    assert generate([baseline.run_dir, "--prompt", prompt, "--max-new-tokens", str(tokens)]) == 0
    model = AutoModelForCausalLM.from_pretrained(os.path.join(baseline.run_dir, "export"))
    ids = list(prompt.encode())
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == BYTE_EOS:
                break
    completion = bytes(i for i in ids[len(prompt) :] if i != BYTE_EOS).decode("utf-8", errors="replace")
    assert capsys.readouterr().out == f"{prompt} -> {completion}\n"


def test_sharded_export_of_tied_embeddings_loads(scenario):
    from transformers import AutoModelForCausalLM

    gpt2_run = scenario("gpt2")

    assert gpt2_run.returncode == 0, gpt2_run.stderr[-3000:]
    export = os.path.join(gpt2_run.run_dir, "export")
    shards = sorted(f for f in os.listdir(export) if f.endswith(".safetensors"))
    assert len(shards) > 1 and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors", shards
    with open(os.path.join(export, "model.safetensors.index.json")) as f:
        assert sorted(set(json.load(f)["weight_map"].values())) == shards
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(
        _logits(model, BATCH_IDS),
        _logits(_trained_model(os.path.join(gpt2_run.run_dir, "checkpoints/step_2")), BATCH_IDS),
        rtol=0,
        atol=0,
    )
