"""What the fine-tuning benchmarks (sft.py, dpo.py) share: our whole runs on make_data.py's model (8 windows a step
in one micro-batch, no eval, no checkpoints), their steps after the first few, and a clock of TRL's steps."""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_research.metrics.sinks import read_records  # noqa: E402

WARMUP = 4


def train_run(
    tmp: str, run_dir: str, name: str, steps: int, seq_len: int, overrides: list[str], batch: int = 8
) -> tuple[list, dict]:
    """`python train.py` on tmp's model, `batch` samples a step in one micro-batch: (the metrics of its steps after
    WARMUP, its summary)."""
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), "model=pretrained", f"model.name_or_path={tmp}/model",
        f"data.seq_len={seq_len}", "logger=none", "trainer.log_interval=1", "trainer.eval_interval=0",
        f"trainer.max_steps={steps}", f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={batch}",
        "checkpoint.interval=0", "checkpoint.export=false", f"hydra.run.dir={run_dir}", *overrides,
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    if run.returncode:
        raise SystemExit(f"{name}: exit {run.returncode}\n{run.stderr[-3000:]}")
    records = read_records(run_dir)
    return [r for r in records if "loss" in r and r["step"] > WARMUP], next(
        r["summary"] for r in records if "summary" in r
    )


def step_clock(seconds: list[float]):
    """A transformers TrainerCallback that appends each step's seconds to `seconds`."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - self.started)

    return Clock()


def trl_run(trainer_class, config, tmp: str, data: str, **kwargs) -> tuple:
    """TRL's trainer_class(config) on tmp's model (fp32) and tmp/<data>.jsonl, kwargs to it as models (a path: the
    model loaded) or as they are, trained: (the trainer, each step's seconds)."""
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path: str):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    seconds: list[float] = []
    trainer = trainer_class(
        model=load(f"{tmp}/model"),
        args=config,
        train_dataset=load_dataset("json", data_files=f"{tmp}/{data}.jsonl", split="train"),
        processing_class=AutoTokenizer.from_pretrained(f"{tmp}/model"),
        callbacks=[step_clock(seconds)],
        **{k: load(v) if isinstance(v, str) else v for k, v in kwargs.items()},
    )
    trainer.train()
    return trainer, seconds


def arguments(parser, steps: int, trl_help: str):
    """The benchmarks' options: steps, repeats, the model's size, the window; --trl (internal: TRL's case)."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--trl", metavar="DIR", help=trl_help)


def make_data(tmp: str, args) -> None:
    """examples/fine_tune/make_data.py into tmp: chats, pairs, tokenizer, a llama of the asked size."""
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "fine_tune", "make_data.py"), tmp,
         "--hidden", str(args.hidden), "--layers", str(args.layers)],
        check=True, capture_output=True,
    )  # fmt: skip
