"""Trainer overhead, two ways.

The floor: the trainer as a user runs it (`python train.py ...`, log every step) against the seed's loop
(bench/seed_loop.py under torchrun: from_pretrained, per-block fully_shard, AdamW, nothing else), whole processes
alternated, on the issue's case (2 ranks, fp32, a 6-block llama of hidden 256 / vocab 4096 written with
save_pretrained, 4 x 256 tokens per rank) and on the default job (`python train.py`); each run's median step
time after FLOOR_WARMUP steps (a step the machine's neighbours slow down moves it little); each repeat runs the two
back to back, and the figure is the median of the repeats' ratios.

Then in one set of worker processes: the trainer's steady-state step time against a bare loop of per-block
fully_shard + AdamW (+ torch's clip_grad_norm_ where the config clips) and nothing else, same model, batch,
sharding and data, on the same ranks, alternated in one run; and the trainer with trainer.compile=true (each
block's forward compiled; compile time is in the warm-up steps). Then what the trainer adds around a step, item
by item, each timed alone on the same ranks, as a share of the trainer's step at log_interval 1 and 10.

    .venv/bin/python bench/overhead.py [--nproc 2] [--steps 60] [--repeats 3] [--floor-steps 40]
        [--floor-repeats 3] [--skip-floor | --floor-only] [overrides ...]
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from fsdp_research.config.schema import typed  # noqa: E402
from fsdp_research.data.pipeline import build_data  # noqa: E402
from fsdp_research.distributed.precision import dtypes  # noqa: E402
from fsdp_research.distributed.processes import device_for, init_distributed, spawn  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402
from fsdp_research.metrics.meters import PeakMemory  # noqa: E402
from fsdp_research.metrics.sinks import JsonlSink, step_metrics  # noqa: E402
from fsdp_research.model.architecture import block_class_name, build_hf_config, build_model, find_blocks  # noqa: E402
from fsdp_research.model.assembly import build_sharded_model  # noqa: E402
from fsdp_research.model.initialization import init_weights, materialize  # noqa: E402
from fsdp_research.optim import build_optimizer  # noqa: E402
from fsdp_research.optim.clipping import clip_grad_norm  # noqa: E402
from fsdp_research.train.preemption import Signals, agree  # noqa: E402
from fsdp_research.train.trainer import mean_over_ranks, train  # noqa: E402

WARMUP = 10
FLOOR_WARMUP = 4  # steps left out of the floor's medians (the issue's "steps 4+")
# The issue's case: the trainer's overrides beside the model the seed loop loads.
ISSUE_MODEL = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=4096,
    max_position_embeddings=512,
)
ISSUE_CASE = [
    "precision=fp32",
    "sharding=blockwise",
    "data=synthetic",
    "data.seq_len=256",
    "logger=none",
    "trainer.global_batch_size=8",
    "trainer.micro_batch_size=4",
    "distributed.nproc_per_node=2",
    "checkpoint.interval=0",
    "checkpoint.export=false",
]


def write_model(hf_config: dict, out: str) -> str:
    """A randomly initialised model of these shapes, written with save_pretrained (what both sides load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**hf_config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def trainer_run(overrides: list[str], steps: int, run_dir: str) -> float:
    """`python train.py <overrides>` logging every step: the median step_time_s of its steps after FLOOR_WARMUP."""
    command = [sys.executable, "train.py", *overrides, f"trainer.max_steps={steps}", "trainer.log_interval=1"]
    subprocess.run([*command, f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
    return statistics.median(r["step_time_s"] for r in step_metrics(run_dir) if r["step"] > FLOOR_WARMUP)


def seed_run(model_dir: str, cfg, steps: int) -> float:
    """bench/seed_loop.py under torchrun on the trainer's batch: the median of its steps after FLOOR_WARMUP."""
    t, nproc = cfg.trainer, cfg.distributed.nproc_per_node
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, f"--nproc_per_node={nproc}", os.path.join(ROOT, "bench", "seed_loop.py"), model_dir]
    command += [f"--batch={t.global_batch_size // nproc}", f"--micro-batch={t.micro_batch_size}"]
    command += [f"--seq-len={cfg.data.seq_len}", f"--steps={steps}", f"--precision={cfg.precision.name}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    times = json.loads(out.strip().splitlines()[-1])["step_time_s"]
    return statistics.median(times[FLOOR_WARMUP:])


def floor(name: str, overrides: list[str], issue_model: bool, steps: int, repeats: int, out: str) -> None:
    """The trainer against the seed's loop on one case, whole processes alternated; prints the medians and the
    median of the repeats' ratios. The issue's case trains the model both load; the default job builds its own, and
    the seed loop loads one of its shapes."""
    model_dir = os.path.join(out, f"{name}_model")
    if issue_model:
        write_model(ISSUE_MODEL, model_dir)
        overrides = ["model=pretrained", f"model.name_or_path={model_dir}", *overrides]
    cfg = compose(overrides)
    if not issue_model:
        write_model({"model_type": cfg.model.model_type, **cfg.model.config}, model_dir)
    trainer, seed = [], []
    for r in range(repeats):
        trainer.append(trainer_run(overrides, steps, os.path.join(out, f"{name}_run{r}")))
        seed.append(seed_run(model_dir, cfg, steps))
    # Each repeat's pair runs back to back: its ratio cancels what the machine does on a longer time scale, and the
    # median of the pairs' ratios is the figure (the ratio of the two medians beside it).
    ratios = [t / s for t, s in zip(trainer, seed)]
    print(
        f"{name}: trainer {statistics.median(trainer) * 1e3:.1f} ms/step | seed loop "
        f"{statistics.median(seed) * 1e3:.1f} ms/step | trainer / seed loop {statistics.median(ratios):.3f} "
        f"(median of the repeats' ratios: {', '.join(f'{r:.3f}' for r in ratios)}; ratio of the medians "
        f"{statistics.median(trainer) / statistics.median(seed):.3f})",
        flush=True,
    )


def bare_loop(cfg, steps: int) -> float:
    """Seconds per step after warmup: fully_shard each block then the root, AdamW, torch's clip_grad_norm_ where
    the config clips (optim.grad_clip > 0, as the trainer does), nothing else."""
    t = cfg.trainer
    rank, world = dist.get_rank(), dist.get_world_size()
    hf_config = build_hf_config(cfg.model)
    data = build_data(cfg.data, hf_config.vocab_size, t.seed)
    model = build_model(hf_config)
    param_dtype, reduce_dtype = dtypes(cfg.precision)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = find_blocks(model, block_class_name(model, None))
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=mp)
    device = device_for(t.device, int(os.environ.get("LOCAL_RANK", 0)))
    materialize(model, device, device)
    init_weights(model, [], t.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)

    def step(s: int) -> None:
        batch = data.rank_batch(s * t.global_batch_size, t.global_batch_size, rank, world).to(device)
        logits = model(input_ids=batch[:, :-1]).logits
        F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten()).backward()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad()

    return seconds_per_step(step, steps)


def seconds_per_step(step: Callable[[int], None], steps: int) -> float:
    """Mean wall time of step(s) over the steps after warm-up, all ranks in lockstep."""
    for s in range(steps):
        if s == WARMUP:
            _sync()
            start = time.perf_counter()
        step(s)
    _sync()
    return (time.perf_counter() - start) / (steps - WARMUP)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def trainer_step_time(cfg, run_dir: str) -> float:
    """Seconds per step after warmup, from the trainer's own metrics (logging and clipping included)."""
    train(cfg, run_dir)
    if dist.get_rank() != 0:
        return 0.0
    return statistics.mean(r["step_time_s"] for r in step_metrics(run_dir) if r["step"] > WARMUP)


def alternate(runs: dict[str, Callable[[int], float]], repeats: int, out: str) -> None:
    """In every worker: each run once per repeat, in turn, so slow phases of the machine hit all alike;
    rank 0 writes the times."""
    times = {name: [] for name in runs}
    for r in range(repeats):
        for name, run in runs.items():
            times[name].append(run(r))
    if dist.get_rank() == 0:
        with open(os.path.join(out, "times.json"), "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def bench_main(worker: Callable, default_steps: int) -> tuple[argparse.Namespace, DictConfig, dict[str, float]]:
    """Parse the command line, compose the config, run worker(container, steps, repeats, out) on --nproc
    processes; returns each run's seconds per step, one per repeat."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = compose(
        [
            "logger=none",
            "data=synthetic",
            "trainer.log_interval=10",
            "trainer.eval_interval=0",
            "checkpoint.interval=0",
            "checkpoint.export=false",
            f"trainer.max_steps={args.steps}",
            *args.overrides,
        ]
    )
    with tempfile.TemporaryDirectory() as out:
        spawn(worker, args.nproc, OmegaConf.to_container(cfg, resolve=True), args.steps, args.repeats, out)
        with open(os.path.join(out, "times.json")) as f:
            times = json.load(f)
        if os.path.exists(os.path.join(out, "items.json")):
            with open(os.path.join(out, "items.json")) as f:
                times["items"] = json.load(f)
        return args, cfg, times


# What the trainer does around a step, and how often: every step, or every log.
EVERY_STEP, EVERY_LOG = "every step", "every log"


def itemize(cfg, out: str, calls: int = 300) -> None:
    """Seconds per call of each thing the trainer adds around a step, timed alone on these ranks (in lockstep);
    rank 0 writes items.json."""
    device = device_for(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
    init_distributed(cfg.distributed, device)
    signals, peak, loss = Signals([]), PeakMemory(device), torch.tensor(1.0, device=device)
    os.makedirs(os.path.join(out, f"items_rank{dist.get_rank()}"), exist_ok=True)
    sink = JsonlSink(os.path.join(out, f"items_rank{dist.get_rank()}"), 0)
    row = {"step": 1, "time": 0.0, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0}
    # A sharded model with gradients, as after backward (the bare loop clips with torch's clip_grad_norm_).
    hf_config = build_hf_config(cfg.model)
    model, _ = build_sharded_model(cfg, hf_config, device, dist.get_world_size())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    # The schedule is stepped alone here, without its optimizer's steps: torch's warning about that order is moot.
    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
    _, scheduler = build_optimizer(model, cfg)
    t, rank, world = cfg.trainer, dist.get_rank(), dist.get_world_size()
    data = build_data(cfg.data, hf_config.vocab_size, t.seed)
    batch = itertools.count()
    items = {
        (EVERY_STEP, "the next batch (read ahead on a thread: cores and the interpreter lock)"): lambda: (
            data.rank_batch(next(batch) * t.global_batch_size, t.global_batch_size, rank, world)
        ),
        (EVERY_STEP, "the learning-rate schedule's step"): lambda: scheduler.step(),
        (EVERY_STEP, f"the gradient norm and clipping (optim.grad_clip={cfg.optim.grad_clip:g})"): lambda: (
            clip_grad_norm(model, cfg.optim.grad_clip)
        ),
        (EVERY_STEP, "the step-boundary agreement (4 integers, control group)"): lambda: agree(signals, 0, 0.0),
        (EVERY_LOG, "the mean loss (an all-reduce)"): lambda: mean_over_ranks(loss),
        (EVERY_LOG, "peak memory (read, reset, a max all-reduce)"): lambda: (peak.window(), peak.reset()),
        (EVERY_LOG, "the metrics.jsonl line"): lambda: sink.log(row),
    }
    seconds = {}
    for (when, name), call in items.items():
        _sync()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        _sync()
        seconds[f"{when}: {name}"] = (time.perf_counter() - start) / calls
    sink.finish()
    if dist.get_rank() == 0:
        with open(os.path.join(out, "items.json"), "w") as f:
            json.dump(seconds, f)


def _bench(container, steps: int, repeats: int, out: str) -> None:
    cfg = typed(container)
    itemize(cfg, out)
    compiled = typed({**container, "trainer": {**container["trainer"], "compile": True}})
    alternate(
        {
            "trainer": lambda r: trainer_step_time(cfg, os.path.join(out, f"run{r}")),
            "bare": lambda r: bare_loop(cfg, steps),
            "compiled": lambda r: trainer_step_time(compiled, os.path.join(out, f"compiled{r}")),
        },
        repeats,
        out,
    )


def floors(argv: list[str]) -> list[str]:
    """Runs the floor's cases unless --skip-floor; returns the rest of the command line (exits after them with
    --floor-only)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--floor-steps", type=int, default=40)
    parser.add_argument("--floor-repeats", type=int, default=3)
    parser.add_argument("--skip-floor", action="store_true")
    parser.add_argument("--floor-only", action="store_true")
    parser.add_argument("--floor-cases", default="issue,default", help="issue,default or one of them")
    args, rest = parser.parse_known_args(argv)
    if not args.skip_floor:
        print(f"the seed's loop as the floor: {args.floor_steps} steps x {args.floor_repeats} alternated repeats")
        with tempfile.TemporaryDirectory() as out:
            cases = {"issue": ("issue case", ISSUE_CASE, True), "default": ("default job", [], False)}
            for case in args.floor_cases.split(","):
                floor(*cases[case], args.floor_steps, args.floor_repeats, out)
    if args.floor_only:
        sys.exit(0)
    return rest


def main() -> None:
    sys.argv[1:] = floors(sys.argv[1:])
    args, _, times = bench_main(_bench, default_steps=60)
    trainer, bare, compiled = (statistics.median(times[k]) for k in ("trainer", "bare", "compiled"))
    # Each repeat's pair ran back to back: their ratios show the machine's noise.
    ratios = sorted(100 * (t / b - 1) for t, b in zip(times["trainer"], times["bare"]))
    print(
        f"config: {' '.join(args.overrides) or 'defaults'} | {args.nproc} ranks | {args.steps} steps x "
        f"{args.repeats} alternated repeats"
    )
    print(
        f"trainer {trainer * 1e3:.1f} ms/step | bare loop {bare * 1e3:.1f} ms/step | "
        f"overhead {100 * (trainer / bare - 1):+.1f}% (per repeat: {', '.join(f'{r:+.1f}%' for r in ratios)})"
    )
    print(f"trainer.compile=true {compiled * 1e3:.1f} ms/step | compiled / eager = {compiled / trainer:.2f}x")
    print("what the trainer adds, each timed alone: per call | share of the trainer's step at log_interval 1, 10")
    for name, seconds in times["items"].items():
        every = 1 if name.startswith(EVERY_STEP) else None
        shares = [seconds / (trainer * (every or interval)) for interval in (1, 10)]
        print(f"  {name}: {seconds * 1e6:7.1f} us | {shares[0]:6.2%}, {shares[1]:6.2%}")


if __name__ == "__main__":
    main()
