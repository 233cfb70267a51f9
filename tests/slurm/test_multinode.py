"""More than one node on a real SLURM: `bash slurm/local_cluster.sh start --nodes 2` runs two
slurmd daemons on this machine (node1, node2). slurm/train.sbatch trains one rank per node (rank and master address
from SLURM, the doctor sees 2 nodes); HSDP on 2 nodes x 2 tasks puts the replicas across the nodes and the shards
within each (fp32 parity with one process); and a node lost mid-run (its slurmd and its tasks killed)
has the job requeued, resuming from its last checkpoint once the node is back, ending with an uninterrupted run's
weights."""

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from harness.jobs import lose_node, stop_controller
from tests.conftest import FAST, ROOT
from tests.helpers.checkpointing import complete_steps, with_overrides
from tests.helpers.cli import finish, read_metrics, start
from tests.helpers.plugins import hold_at
from tests.slurm.cluster import states, wait_done, wait_for

SCRIPT = os.path.join(ROOT, "slurm", "train.sbatch")


def _nodes() -> list[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True).stdout
    return sorted(set(out.split()))


@pytest.fixture(autouse=True, scope="module")
def _two_nodes():
    if len(_nodes()) < 2:
        pytest.skip(f"the cluster has {_nodes()}: start it with `bash slurm/local_cluster.sh start --nodes 2`")


def _run(jobs, tmp_path, sbatch_args, overrides, steps):
    job = jobs.sbatch([*sbatch_args, SCRIPT, *overrides], str(tmp_path))
    run_dir = str(tmp_path / "outputs" / "slurm" / job)
    jobs.logs.append(f"{run_dir}/slurm.out")
    return job, run_dir


def _status(run_dir):
    with open(os.path.join(run_dir, "status.json")) as f:
        return json.load(f)


HSDP = with_overrides(
    FAST,
    "trainer.max_steps=6",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=2",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
)


def test_hsdp_replicas_across_nodes_shards_within(jobs, tmp_path):
    job, run_dir = _run(
        jobs, tmp_path, ["--nodes=2", "--ntasks-per-node=2"], [*HSDP, "sharding=hsdp", "sharding.replicate=2"], 6
    )
    single = start([*HSDP, f"hydra.run.dir={tmp_path}/single", "trainer.micro_batch_size=8"], str(tmp_path))
    assert wait_done(job, tasks=1, timeout=300) == {job: "COMPLETED"}
    assert finish(single, timeout=300).returncode == 0
    # (replicate, shard) mesh: ranks 0-1 and 2-3 are the shard groups, one on each node.
    assert [node for node, _ in _status(run_dir)["ranks"]] == ["node1", "node1", "node2", "node2"]
    with open(os.path.join(run_dir, "train.log")) as f:
        log = f.read()
    assert "hsdp on 4 rank(s)" in log and "doctor: no findings" in log
    got, want = read_metrics(run_dir), read_metrics(f"{tmp_path}/single")
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in got]), torch.tensor([m["loss"] for m in want]), rtol=1e-5, atol=0
    )
    ours, theirs = (
        load_file(f"{run_dir}/export/model.safetensors"),
        load_file(f"{tmp_path}/single/export/model.safetensors"),
    )
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=1e-4, atol=2e-5, msg=key)


LOST = with_overrides(
    FAST,
    "trainer.max_steps=40",
    "checkpoint.interval=5",
    "checkpoint.export=true",
    "checkpoint.export_dtype=float32",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
)


def test_a_lost_node_requeues_and_the_run_resumes(jobs, tmp_path):
    """One rank on each of 2 nodes (their ranks and master address from SLURM); node2 lost after the first
    checkpoint: the job requeues itself, resumes, and ends with the uninterrupted run's weights, to the bit."""
    release = tmp_path / "release"
    job, run_dir = _run(jobs, tmp_path, ["--nodes=2", "--ntasks-per-node=1"], [*LOST, *hold_at(7, release)], 40)
    baseline = start([*LOST, "distributed.nproc_per_node=2", f"hydra.run.dir={tmp_path}/baseline"], str(tmp_path))
    # Held after step 7 (a checkpoint at 5): lost mid-run however late this process looks.
    wait_for("the run held after its first checkpoint", lambda: os.path.exists(f"{run_dir}/held"), timeout=240)
    assert complete_steps(run_dir)
    lose_node("node2")
    release.touch()
    try:
        wait_for("the job to be requeued", lambda: states(job).get(job, [""])[0] == "REQUEUED", timeout=180)
    finally:
        # The node comes back, with slurmctld started again: the requests to end the job's first run that it sent the
        # dead node would be retried about 60 s on, reach the returned node and end the resumed run there (the same
        # job id; SLURM 22.05); a machine that comes back takes longer than that, a test does not.
        stop_controller()
        subprocess.run(
            ["bash", os.path.join(ROOT, "slurm", "local_cluster.sh"), "start", "--nodes", "2"],
            check=True,
            capture_output=True,
        )
    assert wait_done(job, tasks=1, timeout=300) == {job: "COMPLETED"}
    assert finish(baseline, timeout=300).returncode == 0
    with open(os.path.join(run_dir, "slurm.out")) as f:
        assert "a node of the allocation is lost" in f.read()
    with open(os.path.join(run_dir, "train.log")) as f:
        log = f.read()
    assert f"resumed from checkpoint {run_dir}/checkpoints/step_" in log
    # One rank per node: the doctor sees the two nodes (full sharding across them is its slow-interconnect finding).
    assert "blockwise on 2 rank(s)" in log
    assert "full sharding on a slow interconnect → parameters are fully sharded over 2 ranks on 2 nodes" in log
    assert [node for node, _ in _status(run_dir)["ranks"]] == ["node1", "node2"]
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 41))
    ours, theirs = (
        load_file(f"{run_dir}/export/model.safetensors"),
        load_file(f"{tmp_path}/baseline/export/model.safetensors"),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
