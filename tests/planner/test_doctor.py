"""The doctor: every check of the "when it is slow" table fires on a config (or measurement) that has the
problem and stays quiet on one that does not; pure functions over a composed config and the plan built on
the meta device. Then the CLI as a user runs it."""

import pytest
import torch

from fsdp_research.distributed.processes import planned_nodes
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.assembly import planned_model
from fsdp_research.planner import summary
from fsdp_research.planner.doctor import CHECKS, diagnose
from fsdp_research.planner.fit import doctor_fit
from fsdp_research.train.refusals import check_doctor
from tests.helpers.cli import command_started
from tests.helpers.fsdp_units import plan_for

pytestmark = pytest.mark.distributed

MULTI_NODE = ["trainer.global_batch_size=128"]  # divisible by micro batch 8 x 16 ranks
FIT_7B = ["model=llama_7b", "trainer.global_batch_size=64", "data.seq_len=4096", "doctor.fit_gpu=h100"]
FIT_7B_PICK = ["sharding=reshard_all", "activation_checkpointing=none", "trainer.micro_batch_size=2"]
SLOW_SAVE = {"checkpoint_save_s": 30.0, "step_time_s": 1.0}  # 30 s per 100 steps of 1 s: 30%
# (check, a case that has the problem, a near miss that does not); each (overrides, world_size, nodes, measured).
CASES = [
    ("root_only", (["sharding=root_only"], 2, 1, None), (["sharding=blockwise"], 2, 1, None)),
    ("per_linear", (["sharding=per_linear"], 2, 1, None), (["sharding=blockwise"], 2, 1, None)),
    # HSDP with one replica group per node shards only within a node.
    (
        "slow_interconnect",
        (MULTI_NODE, 16, 2, None),
        (MULTI_NODE + ["sharding=hsdp", "sharding.replicate=2"], 16, 2, None),
    ),
    # ... but with fewer groups than nodes its shard groups span nodes; no_reshard (no all-gather in backward)
    # is one of the fixes.
    (
        "slow_interconnect",
        (MULTI_NODE + ["sharding=hsdp", "sharding.replicate=2"], 16, 4, None),
        (MULTI_NODE + ["sharding=no_reshard"], 16, 2, None),
    ),
    (
        "slow_interconnect",
        ([], 2, 1, {"exposed_comm_share": 0.5}),
        (["doctor.exposed_comm_share=0.6"], 2, 1, {"exposed_comm_share": 0.5}),
    ),
    ("reshard_all", (["sharding=reshard_all"], 2, 1, None), (["sharding=blockwise"], 2, 1, None)),
    (
        "reshard_all",
        (["sharding.reshard_override={3:true}"], 2, 1, None),
        (["sharding=reshard_all", "sharding.reshard_override={3:false}"], 2, 1, None),
    ),
    ("checkpoint_save", ([], 2, 1, SLOW_SAVE), (["checkpoint.interval=1000"], 2, 1, SLOW_SAVE)),
    ("cpu_offload", (["sharding.cpu_offload=true"], 2, 1, None), (["sharding.cpu_offload=false"], 2, 1, None)),
    (
        "grad_sync",
        (["trainer.micro_batch_size=2", "trainer.defer_grad_sync=true"], 2, 1, None),
        (["trainer.micro_batch_size=2", "trainer.defer_grad_sync=false"], 2, 1, None),
    ),
    # llama_7b on 8 H100s: micro-batches of 8 x 4096 tokens do not fit 80 GiB; what plan --fit picks does.
    ("fit", (FIT_7B + ["trainer.micro_batch_size=8"], 8, 1, None), (FIT_7B + FIT_7B_PICK, 8, 1, None)),
    # The pick for 80 GiB peaks at 61.8 GiB: over 80 x (1 - 0.3) less the CUDA context, under the default 10%.
    ("fit", (FIT_7B + FIT_7B_PICK + ["doctor.fit_headroom=0.3"], 8, 1, None), (FIT_7B + FIT_7B_PICK, 8, 1, None)),
]


def _checks(overrides, world_size, nodes, measured):
    cfg = compose(overrides)
    fit = doctor_fit(cfg, world_size, torch.device("cpu"))
    return [f.check for f in diagnose(cfg, plan_for(cfg), world_size, nodes, measured, fit)]


@pytest.mark.parametrize(
    "check,fires,near_miss",
    # The fit check plans the whole search (seconds each): slow.
    [pytest.param(*c, marks=pytest.mark.slow if c[0] == "fit" else ()) for c in CASES],
    ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)],
)
def test_check_fires_and_near_miss_does_not(check, fires, near_miss):
    assert check in _checks(*fires)
    assert check not in _checks(*near_miss)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "every_block", "selective"])
def test_the_fit_check_reads_the_model_the_trainer_planned(ac, monkeypatch):
    """At start the trainer hands the doctor its model as planned (before sharding): the advice is the one a model
    built for the purpose gives, and no model is built again."""
    cfg = compose([*FIT_7B, "trainer.micro_batch_size=8", f"activation_checkpointing={ac}"])
    built = doctor_fit(cfg, 8, torch.device("cpu"))
    planned = planned_model(cfg, build_hf_config(cfg.model), values=False)

    def no_build(*args, **kwargs):
        raise AssertionError("the fit check built the model again")

    monkeypatch.setattr(summary, "planned_model", no_build)
    assert built is not None and doctor_fit(cfg, 8, torch.device("cpu"), planned) == built


def test_every_check_is_tested():
    assert [name for name, *_ in CHECKS] == list(dict.fromkeys(check for check, *_ in CASES))


@pytest.mark.parametrize(
    "overrides,world_size,nodes",
    [([], 1, 1), ([], 2, 1), (["sharding=ddp"], 2, 1), (MULTI_NODE + ["sharding=hsdp", "sharding.replicate=2"], 16, 2)],
)
def test_healthy_configs_have_no_findings(overrides, world_size, nodes):
    measured = {"exposed_comm_share": 0.05, "checkpoint_save_s": 1.0, "step_time_s": 1.0}
    assert _checks(overrides, world_size, nodes, measured) == []


def test_bad_fit_headroom_is_refused():
    cfg = compose(["doctor.fit_headroom=1.5"])
    with pytest.raises(ConfigError, match=r"^doctor.fit_headroom: 1.5 is not a share of the cap in \[0, 1\); fix: "):
        check_doctor(cfg.doctor)


def test_findings_in_table_order_one_line_each():
    cfg = compose(
        [
            "sharding=root_only",
            "sharding.cpu_offload=true",
            "trainer.micro_batch_size=2",
            "trainer.defer_grad_sync=true",
        ]
    )
    findings = diagnose(cfg, plan_for(cfg), 2, 1)
    assert [f.check for f in findings] == ["root_only", "cpu_offload", "grad_sync"]
    for finding in findings:
        line = str(finding)
        assert "\n" not in line and line.split(" → ") == [finding.symptom, finding.cause, finding.fix]
    assert str(findings[0]).startswith("wrapped only the root → ")


@pytest.mark.parametrize(
    "env,nodes",
    [
        ({}, 1),
        ({"RANK": "0", "WORLD_SIZE": "2"}, 1),  # this app's own workers: one node
        ({"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),  # torchrun
        ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "4", "SLURM_JOB_NUM_NODES": "8"}, 4),  # srun step
        ({"SLURM_JOB_NUM_NODES": "8"}, 1),  # inside an allocation, not in a step: this process runs on one node
    ],
)
def test_planned_nodes_from_the_launcher(monkeypatch, env, nodes):
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "SLURM_STEP_ID",
        "SLURM_STEP_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_JOB_NUM_NODES",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert planned_nodes() == nodes


@pytest.mark.slow
def test_cli_prints_findings_or_why_none():
    """Both commands at once: they are mostly start-up."""
    args = {"root_only": ["sharding=root_only"], "default": []}
    procs = {name: command_started(["doctor", *a]) for name, a in args.items()}
    out = {name: proc.communicate(timeout=120) + (proc.returncode,) for name, proc in procs.items()}
    stdout, stderr, code = out["root_only"]
    assert code == 0, stderr
    assert stdout.splitlines() == [
        "wrapped only the root → the root is the only FSDP unit: all 4 blocks' parameters are gathered at once, so "
        "peak memory holds the whole model and no gather overlaps compute → wrap each repeating block: "
        "sharding=blockwise"
    ]
    stdout, stderr, code = out["default"]
    assert code == 0, stderr
    assert len(stdout.splitlines()) == 1 and stdout.startswith("no findings: blockwise on 1 rank(s), 1 node(s): ")
