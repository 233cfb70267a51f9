"""Corpora in the formats researchers have, written by the libraries that own each format, and a small BPE
tokenizer trained here with `tokenizers` and saved as transformers saves one."""

import csv
import gzip
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

# Unicode, newlines and quotes inside documents, an empty one (skipped), and enough text for a few windows.
DOCS = [
    "def f(x):\n    return x + 1\n",
    'She said "hello, world", then left.',
    "",
    "Größe, naïve café — 東京 🚀",
    *(f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1) for i in range(60)),
]


def write(fmt: str, out_dir: str, docs=DOCS, field: str = "text") -> str:
    """The corpus in one format under out_dir; returns the data.paths entry (a glob, a file or a directory)."""
    os.makedirs(out_dir, exist_ok=True)
    records = [{field: d, "id": i} for i, d in enumerate(docs)]
    path = os.path.join(out_dir, f"corpus.{fmt}")
    if fmt in ("txt", "md"):
        for i, d in enumerate(docs):
            with open(os.path.join(out_dir, f"doc_{i:03d}.{fmt}"), "w", encoding="utf-8") as f:
                f.write(d)
        return os.path.join(out_dir, f"*.{fmt}")
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    elif fmt == "json":
        with open(path, "w", encoding="utf-8") as f:
            json.dump(records, f, ensure_ascii=False, indent=1)
    elif fmt == "jsonl.gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    elif fmt == "jsonl.zst":
        import zstandard

        data = "".join(json.dumps(r) + "\n" for r in records).encode()
        with open(path, "wb") as f:
            f.write(zstandard.ZstdCompressor().compress(data))
    elif fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=7)
    elif fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=[field, "id"])
            writer.writeheader()
            writer.writerows(records)
    elif fmt == "arrow":
        table = pa.Table.from_pylist(records)
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table)
    elif fmt == "saved":
        import datasets

        path = os.path.join(out_dir, "saved")
        datasets.Dataset.from_list(records).save_to_disk(path)
    else:
        raise ValueError(fmt)
    return path


def bpe_tokenizer(out_dir: str, vocab_size: int = 300) -> str:
    """A byte-level BPE trained on DOCS, saved as a PreTrainedTokenizerFast (with an eos token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS * 3, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(out_dir)
    return out_dir
