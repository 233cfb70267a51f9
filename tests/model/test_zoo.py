"""The Hugging Face zoo: for every family of tests/helpers/zoo.py, on 2 real ranks, from initial weights
that transformers made and save_pretrained wrote:
- weights in: the sharded model's logits are from_pretrained's;
- 5 steps: losses and weights are those of the independent single-process reference (tests/helpers/reference.py);
- weights out: after a run with optim.lr=0 the export equals the input checkpoint tensor for tensor, and
  from_pretrained of a trained export gives the trained sharded model's logits;
- DCP resume from step 3 of 5 ends bitwise where the uninterrupted run ended;
- initialisation from the config alone: deterministic parts (norm scales, biases, zero rows) as from_config makes
  them, random parts of the same mean and spread, the same at 1 and 2 ranks.
All families run one after another in one pair of processes; a family that fails is named by its own tests."""

import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from fsdp_research.jobs.compose import compose
from tests.conftest import FAST
from tests.helpers.checkpointing import with_overrides
from tests.helpers.dist import each_family, full_state, ok, run_distributed, train_distributed
from tests.helpers.reference import reference_run, save_initial
from tests.helpers.zoo import FAMILIES, assert_initialised_alike, from_config, hf_config, initial_weights, pretrained

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS = 5
TRAIN = with_overrides(
    FAST,
    f"trainer.max_steps={STEPS}",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "checkpoint.interval=3",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
)
BATCH = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(0))


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch).logits
    model.train()
    return out


def _family(family: str, initial: str, out: str, batch: torch.Tensor) -> dict:
    import torch.distributed as dist

    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model
    from fsdp_research.train.trainer import train

    world = dist.get_world_size()
    loaded_cfg = compose(FAST + pretrained(initial))
    loaded, _ = build_sharded_model(loaded_cfg, build_hf_config(loaded_cfg.model), torch.device("cpu"), world)
    run_dir = f"{out}/{family}/train"
    trained = train(compose(TRAIN + pretrained(initial)), run_dir)
    step_3 = f"checkpoint.resume={run_dir}/checkpoints/step_3"
    resumed = train(compose(TRAIN + pretrained(initial) + [step_3]), run_dir)
    train(
        compose(
            with_overrides(TRAIN, "optim.lr=0", "model.moe.bias_update_rate=0", "trainer.max_steps=2")
            + pretrained(initial)
        ),
        f"{out}/{family}/lr0",
    )
    init_cfg = compose(FAST + from_config(family))
    initialised, _ = build_sharded_model(init_cfg, build_hf_config(init_cfg.model), torch.device("cpu"), world)
    return {
        "logits": _logits(loaded, batch),
        "losses": trained.losses,
        "weights": full_state(trained.model),
        "trained_logits": _logits(trained.model, batch),
        "resumed_losses": resumed.losses,
        "resumed_weights": full_state(resumed.model),
        "init": full_state(initialised),
    }


def _init_only(families: list) -> dict:
    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model

    init_distributed(typed(compose([])).distributed, torch.device("cpu"))
    built = {}
    for family in families:
        cfg = compose(FAST + from_config(family))
        built[family] = full_state(build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), 1)[0])
    return built


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo")
    initials = {family: initial_weights(family, str(out / "initial" / family)) for family in FAMILIES}
    return initials, out, run_distributed(each_family, 2, _family, initials, str(out), BATCH)


@pytest.fixture(scope="module")
def one_rank_init():
    return run_distributed(_init_only, 1, list(FAMILIES))


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_load_as_from_pretrained(zoo, family):
    from transformers import AutoModelForCausalLM

    initials, _, records = zoo
    expected = _logits(AutoModelForCausalLM.from_pretrained(initials[family]), BATCH)
    torch.testing.assert_close(ok(records, family)["logits"], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_trains_as_the_reference(zoo, family):
    initials, _, records = zoo
    record = ok(records, family)
    ref_losses, ref_weights = reference_run(compose(TRAIN + pretrained(initials[family])), initials[family])
    torch.testing.assert_close(torch.tensor(record["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert record["weights"].keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(record["weights"][key], ref, rtol=1e-4, atol=2e-5, msg=lambda m: f"{key}: {m}")


def _tensors(directory: str) -> dict:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    return {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_what_save_pretrained_writes(zoo, family):
    from transformers import AutoModelForCausalLM

    initials, out, records = zoo
    record = ok(records, family)
    unchanged, initial = _tensors(f"{out}/{family}/lr0/export"), _tensors(initials[family])
    assert unchanged.keys() == initial.keys()  # the family's own on-disk names (experts one by one, embed_out, ...)
    assert all(torch.equal(unchanged[k], initial[k]) for k in initial)
    exported = AutoModelForCausalLM.from_pretrained(f"{out}/{family}/train/export")
    torch.testing.assert_close(_logits(exported, BATCH), record["trained_logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_from_a_checkpoint_is_exact(zoo, family):
    _, _, records = zoo
    record = ok(records, family)
    assert record["resumed_losses"] == record["losses"][3:]
    assert all(torch.equal(record["resumed_weights"][k], v) for k, v in record["weights"].items())


@pytest.mark.parametrize("family", FAMILIES)
def test_initialised_as_the_family_initialises(zoo, one_rank_init, family):
    from transformers import AutoModelForCausalLM

    _, _, records = zoo
    ours = ok(records, family)["init"]
    assert all(torch.equal(ours[k], v) for k, v in one_rank_init[family].items()), "1 and 2 ranks differ"
    torch.manual_seed(1)
    assert_initialised_alike(ours, AutoModelForCausalLM.from_config(hf_config(family)))


def _no_weights(model) -> dict:
    return {}


def test_dropout_repeats_at_one_world_size_and_says_so(tmp_path):
    """gpt2 with its default dropout (0.1): the same command twice at 2 ranks gives the same losses (the global RNG
    is seeded per rank from trainer.seed); the log says the losses depend on the world size."""
    initial = save_initial(
        AutoConfig.for_model("gpt2", vocab_size=512, n_embd=64, n_layer=2, n_head=4), str(tmp_path / "i")
    )
    steps = with_overrides(FAST, "trainer.max_steps=3", "trainer.global_batch_size=4", "trainer.micro_batch_size=2")
    cfg = compose(steps + pretrained(initial))
    records = train_distributed({"a": cfg, "b": cfg}, 2, str(tmp_path), _no_weights)
    assert ok(records, "a")["losses"] == ok(records, "b")["losses"]
    with open(tmp_path / "a" / "train.log") as f:
        log = f.read()
    assert "dropout is on (attn_pdrop=0.1" in log and "not at another" in log


def _corrupted_load(initial: str) -> str:
    """Loads with shard-on-read giving rank 1 wrong rows for one tensor (a loader bug); returns the error."""
    import torch.distributed as dist
    from transformers.distributed import sharding_utils

    from fsdp_research.config.schema import typed
    from fsdp_research.distributed.processes import init_distributed
    from fsdp_research.errors import ConfigError
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model

    cfg = compose(FAST + pretrained(initial))
    init_distributed(typed(cfg).distributed, torch.device("cpu"))
    read = sharding_utils.DtensorShardOperation.shard_tensor

    def wrong_rows(self, source, *args, **kwargs):
        local = read(self, source, *args, **kwargs)
        if dist.get_rank() == 1 and tuple(source.get_shape()) == (128, 64):  # the MLPs' gate_proj and up_proj
            local = local.flip(0)
        return local

    sharding_utils.DtensorShardOperation.shard_tensor = wrong_rows
    try:
        build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), 2)
    except ConfigError as err:
        return str(err)
    return "loaded without a word"


def test_a_wrongly_read_slice_is_refused_by_name(tmp_path):
    initial = initial_weights("llama", str(tmp_path / "llama"), intermediate_size=128)
    error = run_distributed(_corrupted_load, 2, initial)
    assert error.startswith("model.name_or_path: model.layers.0.mlp.gate_proj.weight as loaded differs from"), error
