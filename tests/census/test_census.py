"""The census: every decoder-only text family transformers lists as a causal LM, built tiny from its own
config (tests/census/families.py), as a new user would use it. A family transformers itself cannot build, save,
load and run is listed with the reason and not counted. For every other one, from the initial weights transformers
made and save_pretrained wrote:
- weights in: the 2-rank sharded model's logits are from_pretrained's (1e-5), every tensor verified by the loader;
- weights out: the 2-rank export of the loaded model is the input checkpoint, tensor for tensor, bitwise;
- training: 3 steps at 1 and 2 ranks give the same losses (fp32, dropout off; 1e-4);
- initialisation from the config alone: deterministic parts as from_config makes them, random parts alike.
All families run in one 2-rank and one 1-rank pool of processes; the census table in docs/models.md is this test's
output (`CENSUS_WRITE=1 pytest tests/census` rewrites it; CENSUS_README=1, its former name, too)."""

import os
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers
from omegaconf import OmegaConf, open_dict
from safetensors.torch import load_file

from fsdp_research.jobs.compose import compose
from tests.census.families import EXCLUDED, FAMILIES, check, tiny_config
from tests.conftest import FAST, ROOT
from tests.helpers.checkpointing import with_overrides
from tests.helpers.dist import each_family, full_state, run_distributed
from tests.helpers.zoo import assert_initialised_alike, pretrained

STEPS = 3
# Random tokens (no token store to build): the losses compare 1 with 2 ranks.
SYNTHETIC = [o for o in FAST if not o.startswith("data.paths=")] + ["data=synthetic", "data.num_sequences=64"]
TRAIN = with_overrides(
    SYNTHETIC,
    f"trainer.max_steps={STEPS}",
    "trainer.global_batch_size=2",
    "trainer.micro_batch_size=1",
    "checkpoint.save=false",  # nothing reads a census run's checkpoint
    "distributed.timeout_s=180",  # a collective that waits longer is one the other rank never joins: fail, not hang
)
BATCH = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
# CENSUS_FAMILIES=a,b runs those only (the docs/models.md table is then not checked).
CHOSEN = [f for f in os.environ.get("CENSUS_FAMILIES", "").split(",") if f] or FAMILIES


def _logits(model, batch):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=batch).logits
    model.train()
    return out.float()


def _one(family: str, initial: str, out: str, base) -> dict:
    """Everything one family is checked for, on this pool's ranks; `base`: the composed config, each family's its
    model.name_or_path (the one override that differs: Hydra's compose took a third of a family's time)."""
    import torch.distributed as dist

    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model
    from fsdp_research.train.trainer import train

    world = dist.get_world_size()
    cfg = base.copy()
    cfg.model.name_or_path = initial
    if world == 1:
        return {"losses": train(cfg, f"{out}/{family}/train1").losses}
    with open_dict(cfg):  # the loaded model as the trainer loaded it, before its first step
        cfg.callbacks["loaded"] = {"_target_": f"{__name__}.AsLoaded", "out": f"{out}/{family}"}
    record = {"losses": train(cfg, f"{out}/{family}/train{world}").losses}
    record |= torch.load(f"{out}/{family}/loaded.pt")
    made = OmegaConf.merge(cfg, {"model": {"load_weights": False}})
    record["init"] = full_state(build_sharded_model(made, build_hf_config(made.model), torch.device("cpu"), world)[0])
    return record


class AsLoaded:
    """A callback: at the start of training, before any step, the loaded model's logits on BATCH and its export
    (the weights-in and weights-out checks), of the trainer's own load (a family's model built once fewer)."""

    def __init__(self, out: str):
        self.out = out

    def on_train_start(self, run) -> None:
        from fsdp_research.checkpoint.hf_export import export_model

        logits = _logits(run.model, BATCH)
        block = ", ".join(sorted({type(run.model.get_submodule(b)).__name__[4:] for b in run.blocks}))
        if run.rank == 0:
            torch.save({"logits": logits, "block": block}, f"{self.out}/loaded.pt")
        export_model(run.model, run.model.config, f"{self.out}/export", torch.float32, 10**10, None)


def _one_rank(initials: dict, out: str, base) -> tuple[dict, dict]:
    """The 1-rank pool's work: each family's training, then its initialisation taken as a large model's (after the
    training, which it would change): beside the 2-rank pool, it keeps the second core busy."""
    return each_family(_one, initials, out, base), _initialised_as_large(initials)


def _initial(family: str, out_dir: str) -> str:
    """The family's initial weights as transformers makes them (seed 0), written by save_pretrained."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    out = tmp_path_factory.mktemp("census")
    built = [f for f in CHOSEN if check(f).reason is None]
    initials = {f: _initial(f, str(out / "initial" / f)) for f in built}
    # Both pools at once: the 1-rank one fills the 2-rank one's waits on the two cores.
    # Each family sets its own model.name_or_path; data.tokenizer=auto is byte for all (no tokenizer was saved).
    base = compose(TRAIN + pretrained(str(out / "initial")))
    with ThreadPoolExecutor(1) as pool:
        two = pool.submit(run_distributed, each_family, 2, _one, initials, str(out), base)
        one, large = run_distributed(_one_rank, 1, initials, str(out), base)
        return out, initials, two.result(), one, {}, large


def _failure(census, family: str) -> str | None:
    """Why the family fails here (None: it passes), checked as the module docstring lists; found once."""
    found = census[4]
    if family not in found:
        found[family] = _first_failure(census, family)
    return found[family]


def _first_failure(census, family: str) -> str | None:
    from transformers import AutoModelForCausalLM

    out, initials, two, one, *_ = census
    for record in (two[family], one[family]):
        if "error" in record:
            return record["error"].strip().splitlines()[-1]
    theirs = AutoModelForCausalLM.from_pretrained(initials[family])
    if not torch.allclose(two[family]["logits"], _logits(theirs, BATCH), rtol=1e-5, atol=1e-5):
        return "2-rank logits differ from from_pretrained's"
    exported, initial = _tensors(f"{out}/{family}/export"), _tensors(initials[family])
    if exported.keys() != initial.keys():
        return f"export keys differ: {sorted(exported.keys() ^ initial.keys())[:3]}"
    changed = [k for k in initial if not torch.equal(exported[k], initial[k])]
    if changed:
        return f"export differs from the input in {changed[:3]}"
    if not torch.allclose(torch.tensor(two[family]["losses"]), torch.tensor(one[family]["losses"]), rtol=1e-4):
        return f"losses at 2 ranks {two[family]['losses']} vs 1 rank {one[family]['losses']}"
    made = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        made.append(AutoModelForCausalLM.from_config(tiny_config(family)))
    try:
        assert_initialised_alike(two[family]["init"], *made)
    except AssertionError as err:
        return f"initialisation: {str(err).splitlines()[0]}"
    return None


def _tensors(directory: str) -> dict:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    return {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}


@pytest.mark.parametrize("family", CHOSEN)
def test_family(census, family):
    reason = check(family).reason
    if reason is not None:
        pytest.skip(f"transformers itself cannot: {reason}")
    failure = _failure(census, family)
    assert failure is None, f"{family}: {failure}"


def _special(family: str) -> str:
    notes = check(family).notes
    special = []
    if notes.get("moe"):
        special.append("MoE")
    if notes.get("router_bias"):
        special.append("expert bias")
    if notes.get("keep_in_fp32_strict") or notes.get("keep_in_fp32"):
        special.append("fp32 " + ", ".join(sorted(notes.get("keep_in_fp32_strict") or notes["keep_in_fp32"])))
    if notes.get("tied"):
        special.append("tied")
    if notes.get("default_dropout"):
        special.append("dropout by default")
    if not notes.get("no_split_modules"):
        special.append("block from structure")
    return "; ".join(special)


def census_table(census) -> str:
    rows = []
    for family in FAMILIES:
        reason = check(family).reason
        if reason is not None:
            result, block = f"not counted: transformers itself fails ({reason})", ""
        else:
            failure = _failure(census, family)
            result = "pass" if failure is None else f"FAIL: {failure}"
            block = census[2][family].get("block", "")
        rows.append(f"| {family} | {check(family).model_class} | {block} | {_special(family)} | {result} |")
    built = [f for f in FAMILIES if check(f).reason is None]
    passing = [f for f in built if _failure(census, f) is None]
    counts = (
        f"{len(FAMILIES) + len(EXCLUDED)} causal-LM model types in transformers; {len(EXCLUDED)} not decoder-only "
        f"text (listed in tests/census/families.py); {len(FAMILIES)} decoder-only text families; "
        f"{len(built)} built, saved, loaded and run by transformers itself; {len(passing)} of those pass here."
    )
    header = "| family | model class | block | special | census |\n|---|---|---|---|---|"
    return "\n".join([counts, "", header, *rows])


# The census table's page, and the marked section of it this test checks (and rewrites under CENSUS_WRITE=1).
CENSUS_PAGE = os.path.join(ROOT, "docs", "models.md")
CENSUS_SECTION = re.compile(r"(<!-- census -->\n)(.*?)(\n<!-- /census -->)", re.S)


def test_docs_have_the_census_table(census):
    if CHOSEN != FAMILIES:
        pytest.skip("CENSUS_FAMILIES chooses some families only")
    table = census_table(census)
    with open(CENSUS_PAGE) as f:
        page = f.read()
    found = CENSUS_SECTION.search(page)
    assert found, "docs/models.md has no <!-- census --> ... <!-- /census --> section"
    if os.environ.get("CENSUS_WRITE") or os.environ.get("CENSUS_README"):
        with open(CENSUS_PAGE, "w") as f:
            f.write(CENSUS_SECTION.sub(lambda m: m.group(1) + table + m.group(3), page))
        return
    assert found.group(2) == table, (
        f"docs/models.md's census table is stale for transformers {transformers.__version__} (scripts/constraints.txt "
        "pins the tested one): run CENSUS_WRITE=1 pytest tests/census"
    )


def _initialised_as_large(initials: dict) -> dict:
    """Every family's initialisation from its config on 1 rank with every parameter taken as a large one (only
    its mean and spread noted at construction, then torch's reset): the path real-size models take."""
    import fsdp_research.model.architecture
    from fsdp_research.model.architecture import build_hf_config
    from fsdp_research.model.assembly import build_sharded_model

    fsdp_research.model.architecture._KEPT_AS_BUILT = 0
    base = compose(FAST + pretrained(next(iter(initials.values()), "")) + ["model.load_weights=false"])

    def init(family: str, initial: str) -> dict:
        cfg = base.copy()
        cfg.model.name_or_path = initial  # the one key that differs: composed once
        return full_state(build_sharded_model(cfg, build_hf_config(cfg.model), torch.device("cpu"), 1)[0])

    return each_family(init, initials)


def test_initialised_alike_at_real_size(census):
    from transformers import AutoModelForCausalLM

    _, initials, *_, records = census
    failures = {}
    for family, ours in records.items():
        made = []
        for seed in (1, 2):
            torch.manual_seed(seed)
            made.append(AutoModelForCausalLM.from_config(tiny_config(family)))
        try:
            assert "error" not in ours, ours.get("error", "").strip().splitlines()[-1:]
            assert_initialised_alike(ours, *made)
        except AssertionError as err:
            failures[family] = str(err).splitlines()[0]
    assert not failures, failures
