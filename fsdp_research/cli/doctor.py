"""fsdp-research doctor <overrides...> [world_size=N] [nodes=N] [--measure]: the config and its sharding plan
checked against the causes of FSDP running correctly but slowly, one line per finding; --measure adds the
measured checks from a short profiled run on world_size local processes, kept in outputs/doctor/<date>/<time>/."""

import argparse
import datetime
import os
from collections.abc import Sequence
from typing import Any

from torch.multiprocessing import ProcessExitedException

from fsdp_research.cli.common import checked_config, fail, split_launch
from fsdp_research.distributed.processes import device_for, planned_nodes
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.jobs.launch import run_spawned
from fsdp_research.metrics.profiling import format_breakdown
from fsdp_research.metrics.sinks import read_records
from fsdp_research.model.assembly import planned_model
from fsdp_research.model.dimensions import dims
from fsdp_research.planner.doctor import CHECKS, diagnose, explain
from fsdp_research.planner.fit import doctor_fit
from fsdp_research.train.refusals import check_planned

MEASURE_STEPS = 3


def measure(overrides: Sequence[str], world_size: int, steps: int, run_dir: str) -> dict[str, Any]:
    """A short profiled run on world_size spawned processes: one warm-up step, `steps` profiled steps, then the
    final resume checkpoint. Returns the profile breakdown plus checkpoint_save_s."""
    cfg = compose(
        [
            *overrides,
            "logger=none",
            "trainer.eval_interval=0",
            "checkpoint.export=false",
            "checkpoint.resume=never",
            f"trainer.profile_steps={steps}",
            f"trainer.max_steps={steps + 1}",
        ]
    )
    run_spawned(cfg, world_size, run_dir)
    records = read_records(run_dir)
    profile = next(r["profile"] for r in records if "profile" in r)
    summary = next(r["summary"] for r in reversed(records) if "summary" in r)
    return {**profile, "checkpoint_save_s": summary.get("checkpoint_save_s")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research doctor", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides as for train.py, plus world_size=N "
        "(default: as the launch would have) and nodes=N (default: from the launcher's environment)",
    )
    parser.add_argument("--measure", action="store_true", help="add findings from a short profiled run")
    args = parser.parse_intermixed_args(argv)
    try:
        launch, overrides = split_launch(args.overrides)
        cfg, hf_config, world_size = checked_config(overrides, launch.get("world_size", 0))
        nodes = launch.get("nodes") or planned_nodes()
        model, plan = planned_model(cfg, hf_config, values=False)
        check_planned(cfg, model, plan, hf_config)
    except ConfigError as err:
        return fail(err)
    measured = None
    if args.measure:
        run_dir = os.path.join("outputs", "doctor", datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S-%f"))
        try:
            measured = measure(overrides, world_size, cfg.trainer.profile_steps or MEASURE_STEPS, run_dir)
        except ProcessExitedException as err:  # the run has said why on stderr
            return err.exit_code or 1
        saved = measured["checkpoint_save_s"]
        print(
            f"measured on {world_size} rank(s): {format_breakdown(measured)}"
            + (f"; checkpoint save {saved:.2f} s" if saved is not None else "")
            + f"\nrun dir: {run_dir}"
        )
    fit = doctor_fit(cfg, world_size, device_for(cfg.trainer.device, 0))
    findings = diagnose(cfg, plan, world_size, nodes, measured, fit)
    for finding in findings:
        print(finding)
    if not findings:
        summary = explain(cfg, plan, world_size, nodes, dims(model, plan.blocks))
        print(f"no findings: {summary}; all {len(CHECKS)} checks pass")
    return 0
