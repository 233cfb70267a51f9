"""The planner's model of step time per rank: compute (FLOPs over the device's matmul rate), the recompute of
activation checkpointing and of the loss in chunks, the communication no compute hides (bytes over the link each
collective crosses, plus a fixed latency per collective), the optimizer step (memory-bound: bytes over memory
bandwidth; with cpu_offload, the CPU's optimizer at its measured rate) and cpu_offload's copies to and from the
host (both through the host's memory, which a node's ranks share). Muon's all-to-alls run inside its step, after
backward: exposed, with its Newton-Schulz FLOPs at the device's matmul rate (fsdp_research.planner.optimizer).
A pure function of a ModelSummary, a Run and a Hardware.

Overlap: on CUDA FSDP2 gathers the next block while this one computes (its implicit prefetch, or
sharding.prefetch_*), and reduce-scatters behind the next block's backward: only the first unit's all-gather and
the last one's reduce-scatter of each micro-batch are exposed, and whatever communication outlasts the compute.
Blocks alike in size and compute gain no time from deeper prefetch here (the model shows its memory, not a
speed-up). On CPU (gloo) the collectives share the cores with compute: nothing overlaps.

Links: a collective within `per_node` devices runs over NVLink; one that spans nodes runs at the InfiniBand rate
(`link=ib`, the default above one node; `link=nvlink`: every rank in one NVLink domain). hsdp's replicas and
reshard_after_forward=k's groups of k stay within a node when they fit in one."""

from dataclasses import dataclass

from fsdp_research.config.schema import Strategy
from fsdp_research.metrics.hardware import (
    COMPUTE_EFFICIENCY,
    HOST_MEMORY_GBS,
    LINK_EFFICIENCY,
    NCCL_COMMUNICATOR_INIT_S,
    Device,
)
from fsdp_research.planner.activations import FP32, LLAMA_LIKE, recompute_share, selective_recompute
from fsdp_research.planner.axes import AXES, link_bps
from fsdp_research.planner.optimizer import muon_flops, muon_rounds
from fsdp_research.planner.resident import extra_groups
from fsdp_research.planner.run import Run
from fsdp_research.planner.summary import ModelSummary
from fsdp_research.planner.traffic import traffic

# NCCL's fixed cost per collective on NVLink/InfiniBand (tens of microseconds; NCCL's own tests).
GPU_LATENCY_S = 30e-6


@dataclass(frozen=True)
class Hardware:
    """Rates the time model runs on: matmul FLOP/s reached, memory bandwidth, bytes/s within a node and across
    nodes and to the host (per rank, the host's share), a collective's fixed latency, devices per node, whether
    collectives overlap compute, and the bytes/s a rank's CPU optimizer step moves (cpu_offload; on a CPU, its
    optimizer)."""

    name: str
    flops: float
    memory_bps: float
    intra_bps: float
    inter_bps: float
    host_bps: float
    latency_s: float
    per_node: int
    overlap: bool
    optimizer_bps: float
    # The device's memory (GiB), where known.
    memory_gib: float | None = None


def gpu_hardware(device: Device, compute_bytes: int, link: str, cpu_optimizer_bps: float) -> Hardware:
    """A GPU of the table at the datasheet peaks x the efficiencies a training step reaches; cpu_optimizer_bps: a
    CPU optimizer step's rate on one core (planner.calibrate.cpu_optimizer_rate), the host's memory shared by the
    node's ranks capping it and the copies over PCIe."""
    tflops = device.fp32_tflops if compute_bytes == FP32 else device.bf16_tflops
    nvlink = device.nvlink_gbs * 1e9 * LINK_EFFICIENCY
    host_share = HOST_MEMORY_GBS * 1e9 / device.per_node
    return Hardware(
        name=f"{device.name} ({link})",
        flops=tflops * 1e12 * COMPUTE_EFFICIENCY,
        memory_bps=device.memory_gbs * 1e9,
        intra_bps=nvlink,
        inter_bps=nvlink if link == "nvlink" else device.ib_gbs * 1e9 * LINK_EFFICIENCY,
        host_bps=min(device.pcie_gbs * 1e9, host_share),
        latency_s=GPU_LATENCY_S,
        per_node=device.per_node,
        overlap=True,
        optimizer_bps=min(cpu_optimizer_bps, host_share),
        memory_gib=device.memory_gib,
    )


@dataclass(frozen=True)
class StepTime:
    """Seconds per step on one rank, by cause."""

    compute: float
    recompute: float
    # All communication, and the part of it that no compute hides.
    communication: float
    exposed: float
    optimizer: float
    offload: float
    # Muon's all-to-alls and Newton-Schulz, inside the optimizer step.
    whole_matrices: float = 0.0
    # Once per run, not per step: creating reshard_after_forward=k's NCCL communicators.
    startup: float = 0.0
    # Pipeline parallel: the schedule's bubble, waiting on the other stages.
    bubble: float = 0.0

    @property
    def total(self) -> float:
        busy = self.compute + self.recompute + self.exposed + self.optimizer + self.whole_matrices + self.offload
        return busy + self.bubble


def step_time(m: ModelSummary, run: Run, hw: Hardware) -> StepTime:
    tokens, logits = run.tokens * run.micro_steps, run.logit_tokens * run.micro_steps
    # Tensor parallel splits the blocks' FLOPs; the output layer runs whole on each tp rank, at the positions the
    # loss takes logits of.
    head = 3 * m.head_flops_per_token
    compute = (tokens * (m.flops_per_token - head) / m.tp + logits * head) / hw.flops
    redone = 1.0
    if m.selective_every:  # a family whose block the planner does not enumerate: half of its forward
        redone = selective_recompute(m, run.seq_len) if m.model_type in LLAMA_LIKE else 0.5
    recompute = compute * recompute_share(m.checkpointed, redone)
    if run.loss_chunks > 1:  # one more forward of the output layer
        recompute += logits * m.head_flops_per_token / hw.flops
    comm = traffic(m, run)
    n, replicas = run.shard_group, run.replicas
    shard_bps = link_bps(hw, n)
    gathers = comm.all_gather - comm.regather_within
    communication = (
        (gathers + comm.reduce_scatter) / shard_bps
        + comm.regather_within / hw.intra_bps
        + comm.all_reduce / link_bps(hw, run.world_size if replicas > 1 else 1)
    )
    units = [*m.units, m.root] if m.strategy is not Strategy.ddp_classic else [m.root]
    collectives = run.micro_steps * 3 * len(units) if n > 1 else 0
    communication += collectives * hw.latency_s
    # The parallel axes' collectives stand between a block's operations: none is hidden.
    blocking = 0.0
    for axis, received in zip(AXES, comm.axes):
        blocking += axis.blocking(m, run, hw, received)
    exposed = communication
    if hw.overlap and n > 1:
        # Each micro-batch's first all-gather and last reduce-scatter wait; the rest hides behind compute.
        ends = run.micro_steps * (run.compute_bytes + run.reduce_bytes) * (n - 1) / n * m.root.numel / shard_bps
        exposed = min(communication, ends + max(0.0, communication - ends - compute - recompute))
    communication, exposed = communication + blocking, exposed + blocking
    local = sum(u.numel for u in (*m.units, m.root))  # one tp rank's parameters
    state = FP32 * local / (n if m.strategy is not Strategy.ddp_classic else 1)
    # AdamW-like: parameters, gradients and state read, parameters and state written.
    touched = state * (3 + 2 * m.optimizer_copies)
    # On a GPU the optimizer steps on the device unless offloaded; a CPU's is the CPU's optimizer.
    optimizer = touched / (hw.optimizer_bps if run.cpu_offload or not hw.overlap else hw.memory_bps)
    whole = comm.all_to_all / shard_bps + 2 * muon_rounds(m, run) * hw.latency_s + muon_flops(m, run) / hw.flops
    # cpu_offload: fp32 shards to the device for every all-gather, gradient shards back once per reduction.
    offload = 0.0
    if run.cpu_offload:
        gathers_per_step = run.micro_steps * (
            1 + sum(u.reshard_after_forward is not False for u in m.units) / max(1, len(m.units))
        )
        offload = state * (gathers_per_step + run.micro_steps) / hw.host_bps
    startup = extra_groups(m, run) * NCCL_COMMUNICATOR_INIT_S if hw.overlap else 0.0
    # The schedule's share of waiting, of the stages' forwards and backwards.
    bubble = (compute + recompute + exposed) * run.bubble / (1 - run.bubble)
    return StepTime(compute, recompute, communication, exposed, optimizer, offload, whole, startup, bubble)


def tokens_per_second(run: Run, time: StepTime) -> float:
    """Tokens a step trains on, over all ranks (a tp group's ranks train on the same, a pipeline's stages on the
    same), per second."""
    return run.tokens * run.micro_steps * run.world_size / run.tp / run.pp / time.total
