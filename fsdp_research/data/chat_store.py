"""Conversations (and prompt/completion pairs; preference pairs, two documents each; prompts alone) tokenized once,
into a token store (fsdp_research.data.store): the documents' token ids in the store's dtype, a byte a token saying
which are targets, and per document its target count (prompts: their records too, a line of JSON each), built by
one rank and read by every rank and every later start at the positions it packs (fsdp_research.data.packing's
ChatWindows, PairWindows; fsdp_research.data.prompts.PromptWindows). Its fingerprint is of the files (or hub
dataset), the tokenizer, the chat template's text, the fields and data.loss_on: what decides the ids and targets.
Sequence length, packing and truncation are not in it: they apply when it is read."""

import functools
import json
import os
from typing import Any

import numpy as np

from fsdp_research.config.data_schema import DataConfig, DataKind
from fsdp_research.data.chat import chat_tokenizer, documents
from fsdp_research.data.parts import Part, identity, scan
from fsdp_research.data.store import VERSION, StoreSpec, part_name
from fsdp_research.data.store_builder import finish_part, write_atomic
from fsdp_research.data.tokenizer import load_tokenizer


def chat_spec(cfg: DataConfig, paths: list[str] | None, key: str) -> StoreSpec:
    """The store of the conversations of `paths` (None: of the hub dataset data.hub_name) as data.* renders them."""
    tok = load_tokenizer(cfg.tokenizer)
    if paths is None:
        source: Any = {"hub": cfg.hub_name, "config": cfg.hub_config, "split": cfg.split}
    else:
        source = identity(scan(paths, key))
    spec = {
        "version": VERSION,
        "kind": cfg.kind.value,
        "source": source,
        "tokenizer": tok.fingerprint,
        "template": chat_tokenizer(cfg).chat_template,
        "fields": [cfg.messages_field, cfg.prompt_field, cfg.completion_field],
        "loss_on": cfg.loss_on.value,
        "dtype": tok.dtype.name,
    }
    if cfg.kind is DataKind.preference:
        # Text completions end with the end-of-sequence token's text, which tokenizer.json alone does not say.
        hf = chat_tokenizer(cfg)
        fields = [cfg.chosen_field, cfg.rejected_field, cfg.completion_field, cfg.label_field]
        spec["pairs"] = {"fields": fields, "kl_chunk": cfg.kl_chunk, "eos": hf.eos_token, "bos": hf.bos_token}
    part = Part(tuple(paths or [cfg.hub_name]), "chat", "")
    build = functools.partial(_build, cfg, paths, key, tok.dtype)
    return StoreSpec(lambda: [part], json.dumps(spec, sort_keys=True), cfg.tokenizer, build)


def _build(cfg: DataConfig, paths: list[str] | None, key: str, dtype: np.dtype, _part, index: int, build_dir: str):
    """Every document written as it is tokenized (nothing held but its end and target count)."""
    prefix = os.path.join(build_dir, part_name(index))
    ends: list[int] = []
    targets: list[int] = []
    labels: list[int] = []
    record_ends: list[int] = []
    fields: dict[str, None] = {}  # every record's fields, in the order they first come (a set that keeps it)
    counts = {"tokens": 0, "documents": 0, "text_bytes": 0}

    def write(tokens_file, targets_file, records_file) -> None:
        for doc in documents(cfg, paths, key):
            tokens_file.write(doc.ids.astype(dtype).tobytes())
            targets_file.write(doc.targets.astype(np.uint8).tobytes())
            if records_file:
                record_ends.append(records_file.tell() + records_file.write(doc.record.encode() + b"\n"))
                fields.update(dict.fromkeys(json.loads(doc.record)))
            counts["tokens"] += len(doc.ids)
            counts["documents"] += 1
            ends.append(counts["tokens"])
            targets.append(int(doc.targets[1:].sum()))
            labels.append(doc.label)

    def write_tokens(f, g) -> None:
        if cfg.kind is DataKind.prompts:  # each prompt's record, for the reward functions
            write_atomic(prefix + ".records", lambda r: write(f, g, r), "wb")
            write_atomic(prefix + ".records.npy", lambda r: np.save(r, np.asarray(record_ends, np.int64)), "wb")
            # JSON, but no .json name: a part's one .json file is its completion marker.
            write_atomic(prefix + ".fields", lambda r: json.dump(list(fields), r))
        else:
            write(f, g, None)

    write_atomic(
        prefix + ".tokens", lambda f: write_atomic(prefix + ".targets", lambda g: write_tokens(f, g), "wb"), "wb"
    )
    write_atomic(prefix + ".counts.npy", lambda f: np.save(f, np.asarray(targets, np.int64)), "wb")
    written = (".tokens", ".targets", ".counts.npy")
    if cfg.kind is DataKind.prompts:
        written += (".records", ".records.npy", ".fields")
    if cfg.kind is DataKind.preference:  # which document is preferred (fsdp_research.data.chat.Document.label)
        write_atomic(prefix + ".labels.npy", lambda f: np.save(f, np.asarray(labels, np.int8)), "wb")
        written += (".labels.npy",)
    return finish_part(prefix, np.asarray(ends, np.int64), counts, written)
