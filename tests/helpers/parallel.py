"""What the tests of the parallel axes (tp, ep, cp) share: the families trained and their references, the losses,
gradient norms and export against the reference, a setting's refusal, one simulated rank's phases."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.refusals import checked_plan
from tests.conftest import FAST
from tests.helpers.cli import subprocess_env

# 4 steps of 4 sequences, a checkpoint at step 2 (to resume from), the export at the end.
BASE = FAST + [
    "trainer.max_steps=4",
    "trainer.global_batch_size=4",
    "trainer.micro_batch_size=2",
    "checkpoint.export=true",
    "checkpoint.interval=2",
]


def assert_export_matches(export_dir, ref_weights: dict) -> None:
    """The export read back by from_pretrained holds the reference's tensors (1e-4, 2e-5)."""
    exported = AutoModelForCausalLM.from_pretrained(str(export_dir)).state_dict()
    assert exported.keys() == ref_weights.keys()
    for key, ref in ref_weights.items():
        torch.testing.assert_close(exported[key], ref, rtol=1e-4, atol=2e-5, msg=lambda m: f"{key}: {m}")


def refused(world: int, *overrides: str) -> str:
    """The ConfigError's line for FAST + overrides on world ranks, raised before anything is allocated."""
    cfg = compose(FAST + list(overrides))
    with pytest.raises(ConfigError) as err:
        checked_plan(cfg, world, build_hf_config(cfg.model), torch.device("cpu"))
    return str(err.value)


def simulated_phases(args: list[str], report) -> dict:
    """`fsdp-research simulate <args> --json <report>`: its phases by name."""
    done = subprocess.run(
        [sys.executable, "-m", "fsdp_research", "simulate", *args, "--json", str(report)],
        env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return {p["name"]: p for p in json.loads(report.read_text())["phases"]}


def assert_simulated_as_planned(phases: dict) -> None:
    for name in ("init", "optimizer"):  # AdamW's step counters beside its moments: a few bytes a tensor
        assert phases[name]["tensors"] == pytest.approx(phases[name]["predicted"], rel=1e-3), name


def loading(base: list[str], initial: str) -> list[str]:
    """base, training from the weights save_pretrained wrote in `initial`."""
    return base + ["model=pretrained", f"model.name_or_path={initial}"]


def train_families(
    out, families, base: list[str], runs: dict, knobs: dict, knob_family: str, **changes
) -> tuple[dict, dict]:
    """Each family's initial weights (transformers' from_config with `changes` to its config, save_pretrained),
    then on each world size (one group of processes) every family with each of runs[world]'s overrides and
    knob_family with knobs[world]'s; returns ({family: its initial dir}, {"<family>/<name>": losses and final
    weights}), run dirs <out>/w<world>/<family>/<name>."""
    from tests.helpers.dist import train_distributed
    from tests.helpers.reference import save_initial
    from tests.helpers.zoo import hf_config

    initials = {f: save_initial(hf_config(f, **changes), str(out / "initial" / f)) for f in families}
    done = {}
    for world in sorted({*runs, *knobs}):
        named = {
            f"{f}/{n}": compose(loading(base, initials[f]) + extra)
            for f in families
            for n, extra in runs.get(world, {}).items()
        }
        named.update(
            {
                f"{knob_family}/{n}": compose(loading(base, initials[knob_family]) + extra)
                for n, extra in knobs.get(world, {}).items()
            }
        )
        done.update(train_distributed(named, world, str(out / f"w{world}")))
    return initials, done


def trained_with_references(out, families, base: list[str], runs: dict, knobs: dict, knob_family: str, **changes):
    """train_families, then each family's single-process reference (losses, final weights, gradient norms): returns
    (out, initials, runs, {family: (losses, weights, norms)})."""
    from tests.helpers.reference import reference_run

    initials, done = train_families(out, families, base, runs, knobs, knob_family, **changes)
    norms = {f: [] for f in families}
    references = {
        f: (*reference_run(compose(loading(base, initials[f])), initials[f], norms=norms[f]), norms[f])
        for f in families
    }
    return out, initials, done, references


def assert_matches_reference(results, family: str, name: str, world: int) -> None:
    """A run of trained_with_references against its family's reference: per-step losses and gradient norms (1e-5;
    AdamW would hide a gradient's wrong scale from the weights), the export read back by from_pretrained."""
    from fsdp_research.metrics.sinks import read_records
    from tests.helpers.dist import ok

    out, _, runs, references = results
    ref_losses, ref_weights, ref_norms = references[family]
    run = ok(runs, f"{family}/{name}")
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    norms = [r["grad_norm"] for r in read_records(str(out / f"w{world}" / family / name)) if "grad_norm" in r]
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0)
    assert_export_matches(out / f"w{world}" / family / name / "export", ref_weights)


def cases(families, runs: dict, knobs: dict, knob_family: str) -> list[tuple[str, str, int]]:
    """(family, run name, world) of every run train_families makes."""
    return [(f, n, w) for w in sorted(runs) for f in families for n in runs[w]] + [
        (knob_family, n, w) for w in sorted(knobs) for n in knobs[w]
    ]


def assert_resumes_at_one_rank_group(results, base: list[str], family: str, name: str, tmp_path) -> None:
    """The step-2 checkpoint of a 4-rank run, resumed on 2 ranks with `base` (the axis at 1): the run's last losses."""
    from tests.helpers.dist import ok, train_distributed

    out, initials, runs, _ = results
    step_2 = out / "w4" / family / name / "checkpoints" / "step_2"
    cfg = compose(loading(base, initials[family]) + [f"checkpoint.resume={step_2}", "checkpoint.export=false"])
    resumed = train_distributed({"resumed": cfg}, 2, str(tmp_path))
    assert ok(resumed, "resumed")["losses"] == pytest.approx(ok(runs, f"{family}/{name}")["losses"][2:], rel=1e-5)
