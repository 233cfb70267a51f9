"""The data path against its goals, side by side in one run on this machine:

- tokenization rate (MB of text per second) of a token store build, against the floor: the same tokenizer's own
  batch encode of the same text in memory on the same number of processes (byte tokenizer and a BPE);
- per-rank peak RSS of 2-rank training on a small and a large corpus (the stores built first);
- time to open the data (start to first step, beyond the model) with existing stores of both sizes;
- the data share of a profiled step of the default job;
- start-up with a source of --files files of one document each (as code corpora are), its store existing: the
  trainer's own `data: ... ready in <s> s` line.

    .venv/bin/python bench/data.py [--small-mb 20] [--large-mb 2000] [--bpe-mb 40] [--workers 2] [--files 200000]
        [--out DIR]

The corpora are JSON Lines of real text (this Python's standard-library sources, in 4 KB records), written under
--out (default: a temporary directory; the large one needs about 3x --large-mb of disk)."""

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from fsdp_research.data.pipeline import Build, build_data, open_stores  # noqa: E402
from fsdp_research.data.tokenizer import load_tokenizer  # noqa: E402
from fsdp_research.jobs.compose import compose  # noqa: E402

RECORD = 4096


def write_corpus(path: str, megabytes: int) -> str:
    """JSON Lines of `megabytes` MB of text: the standard library's sources cut into RECORD-character records."""
    text = "".join(open(p, encoding="utf-8", errors="ignore").read() for p in sorted(glob_stdlib()))
    records = [text[i : i + RECORD] for i in range(0, len(text) - RECORD, RECORD)]
    target, written = megabytes * 10**6, 0
    with open(path, "w") as f:
        while written < target:
            for r in records:
                line = json.dumps({"text": r}) + "\n"
                f.write(line)
                written += len(r)
                if written >= target:
                    break
    return path


def glob_stdlib():
    import glob

    return glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))


def train_bpe(corpus: str, out_dir: str, vocab_size: int = 8192) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.loads(line)["text"] for _, line in zip(range(2000), open(corpus))]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out_dir)
    return out_dir


def _floor_worker(args) -> float:
    """Seconds this process's share takes in the tokenizer's own batch encode (text already in memory)."""
    corpus, tokenizer, share, shares = args
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    texts = [json.loads(line)["text"] for i, line in enumerate(open(corpus)) if i % shares == share]
    if tokenizer == "byte":
        encode = load_tokenizer("byte").encode
    else:
        from transformers import AutoTokenizer

        backend = AutoTokenizer.from_pretrained(tokenizer).backend_tokenizer
        encode = lambda batch: backend.encode_batch(batch, add_special_tokens=False)  # noqa: E731
    started = time.perf_counter()
    for a in range(0, len(texts), 1000):
        encode(texts[a : a + 1000])
    return time.perf_counter() - started


def rate(corpus: str, tokenizer: str, workers: int, out: str) -> tuple[float, float]:
    """(store build MB/s, floor MB/s) for the corpus."""
    mb = sum(len(json.loads(line)["text"]) for line in open(corpus)) / 1e6
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        floor = mb / max(pool.map(_floor_worker, [(corpus, tokenizer, s, workers) for s in range(workers)]))
    cfg = compose([f"data.paths=[{corpus}]", f"data.tokenizer={tokenizer}", f"data.store_dir={out}"]).data
    started = time.perf_counter()
    open_stores(cfg, Build(workers=workers))
    return mb / (time.perf_counter() - started), floor


def train_rss(corpus: str, store_dir: str, run_dir: str) -> dict:
    """Peak RSS (max over 2 ranks) and data set-up time of a short 2-rank run on the corpus (store built)."""
    cmd = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "logger=none",
        "trainer.max_steps=30",
        "trainer.eval_interval=0",
        "checkpoint.interval=0",
        "checkpoint.export=false",
        "distributed.nproc_per_node=2",
        f"data.paths=[{corpus}]",
        f"data.store_dir={store_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    ready = next(line for line in out.splitlines() if "; ready in " in line)
    summary = next(
        json.loads(line)["summary"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"summary"' in line
    )
    return {"peak_rss_gib": summary["peak_rss_gib"], "ready_s": float(ready.rsplit("ready in ", 1)[1].split()[0])}


def data_share(out: str) -> dict:
    run_dir = os.path.join(out, "profiled")
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "logger=none",
            "trainer.max_steps=12",
            "trainer.profile_steps=10",
            "checkpoint.interval=0",
            "checkpoint.export=false",
            f"data.store_dir={out}/stores",
            f"hydra.run.dir={run_dir}",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return next(
        json.loads(line)["profile"] for line in open(os.path.join(run_dir, "metrics.jsonl")) if '"profile"' in line
    )


def many_files(out: str, count: int) -> tuple[float, float]:
    """A source of `count` files of one document each, in directories of 1,000: the seconds its store takes to
    build, and the trainer's `ready in` with the store existing (1 process, 1 step)."""
    root = os.path.join(out, "many")
    for i in range(count):
        if i % 1000 == 0:
            os.makedirs(os.path.join(root, f"d{i // 1000:04d}"), exist_ok=True)
        with open(os.path.join(root, f"d{i // 1000:04d}", f"f{i:07d}.py"), "w") as f:
            f.write(f"def f{i}(x):\n    return x + {i}\n")
    paths, store_dir = f"{root}/**/*.py", os.path.join(out, "many_stores")
    started = time.perf_counter()
    open_stores(compose([f"data.paths=[{paths}]", f"data.store_dir={store_dir}"]).data)
    built = time.perf_counter() - started
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "logger=none", "trainer.max_steps=1",
           "trainer.eval_interval=0", "checkpoint.interval=0", "checkpoint.export=false", f"data.paths=[{paths}]",
           f"data.store_dir={store_dir}", f"hydra.run.dir={out}/run_many"]  # fmt: skip
    log = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    ready = next(line for line in log.splitlines() if "; ready in " in line)
    return built, float(ready.rsplit("ready in ", 1)[1].split()[0])


def open_time(corpus: str, store_dir: str) -> float:
    cfg = compose([f"data.paths=[{corpus}]", f"data.store_dir={store_dir}"]).data
    started = time.perf_counter()
    build_data(cfg, 512, 0)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small-mb", type=int, default=20)
    parser.add_argument("--large-mb", type=int, default=2000)
    parser.add_argument("--bpe-mb", type=int, default=40)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="bench_data_")
    os.makedirs(out, exist_ok=True)
    try:
        small = write_corpus(os.path.join(out, "small.jsonl"), args.small_mb)
        large = write_corpus(os.path.join(out, "large.jsonl"), args.large_mb)
        bpe_corpus = write_corpus(os.path.join(out, "bpe.jsonl"), args.bpe_mb)
        bpe = train_bpe(bpe_corpus, os.path.join(out, "bpe_tokenizer"))
        print(f"tokenization, {args.workers} processes (store build vs the tokenizer's own batch encode in memory):")
        for name, corpus, tokenizer in (("byte", large, "byte"), ("BPE 8k", bpe_corpus, bpe)):
            ours, floor = rate(corpus, tokenizer, args.workers, os.path.join(out, "stores"))
            print(f"  {name:>7}: {ours:8.1f} MB/s | floor {floor:8.1f} MB/s | {ours / floor:.2f}x the floor")
        open_stores(compose([f"data.paths=[{small}]", f"data.store_dir={out}/stores"]).data, Build(workers=2))
        print("with existing stores (2 ranks, llama_tiny, 30 steps):")
        runs = {}
        for name, corpus, mb in (("small", small, args.small_mb), ("large", large, args.large_mb)):
            runs[name] = train_rss(corpus, os.path.join(out, "stores"), os.path.join(out, f"run_{name}"))
            print(
                f"  {mb:>6} MB corpus: peak RSS per rank {runs[name]['peak_rss_gib'] * 1024:7.1f} MiB; data ready "
                f"in {runs[name]['ready_s']:.2f} s in the trainer, {open_time(corpus, out + '/stores'):.3f} s "
                "opened alone"
            )
        diff = (runs["large"]["peak_rss_gib"] - runs["small"]["peak_rss_gib"]) * 1024
        print(f"  peak RSS difference: {diff:+.1f} MiB")
        profile = data_share(out)
        print(
            f"default job, profiled: data {profile['data_s'] * 1e3:.3f} ms of a {profile['step_time_s'] * 1e3:.1f} "
            f"ms step ({profile['data_s'] / profile['step_time_s']:.2%})"
        )
        built, ready = many_files(out, args.files)
        print(
            f"{args.files:,} files of one document each: store built in {built:.1f} s; with it, the trainer's "
            f"data ready in {ready:.2f} s"
        )
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
