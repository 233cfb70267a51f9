"""What the tests of the parallel axes (tp, ep) share: the export against the reference, a setting's refusal, one
simulated rank's phases."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.validation import checked_plan
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


def train_families(out, families, base: list[str], runs: dict, knobs: dict, knob_family: str) -> tuple[dict, dict]:
    """Each family's initial weights (transformers' from_config, save_pretrained), then on each world size (one group
    of processes) every family with each of runs[world]'s overrides and knob_family with knobs[world]'s; returns
    ({family: its initial dir}, {"<family>/<name>": losses and final weights}), run dirs
    <out>/w<world>/<family>/<name>."""
    from tests.helpers.dist import train_distributed
    from tests.helpers.reference import save_initial
    from tests.helpers.zoo import hf_config

    initials = {f: save_initial(hf_config(f), str(out / "initial" / f)) for f in families}
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
