"""Prompts alone (data=prompts, TRL's prompt-only format) as samples: each prompt's tokens (rendered by
fsdp_research.data.chat as TRL's GRPOTrainer tokenizes prompts) with its index in the store, where its record (the
prompt as given and the other fields, for the reward functions) is read when a step asks for it: nothing per record
is held in memory but its place."""

import json
from typing import Any

import numpy as np

from fsdp_research.config.data_schema import Truncation
from fsdp_research.data.packing import documents_of, refuse_longer
from fsdp_research.data.store import TokenStore

# A sample's rows: the prompt's tokens, right-aligned (left-padded, as prompts are for generation); its document
# index at each of its positions (-1: padding).
TOKENS, DOCUMENT = 0, 1


class PromptWindows:
    """One prompt a sample, [2, seq_len] (TOKENS, DOCUMENT). A prompt longer than seq_len is dropped (counted),
    refused, or cut to its last seq_len tokens (where its generation prompt is) by data.truncation."""

    def __init__(self, store: TokenStore, seq_len: int, pad: int, truncation: Truncation, what: str):
        self.store, self.length, self.shape, self.pad_id, self.what = store, seq_len, (2, seq_len), pad, what
        first, self.lengths = documents_of(store)
        self.ends = first + self.lengths
        refuse_longer(self.lengths, seq_len, truncation, f"a prompt of {what}")
        keep = self.lengths <= seq_len if truncation is Truncation.drop else np.ones(len(self.lengths), bool)
        self.dropped = int((~keep).sum())
        self.prompts = np.flatnonzero(keep)
        self.count = len(self.prompts)
        # What the reward functions get as columns: every field, None where a record lacks it.
        self.fields = store.record_fields()

    def read(self, index: np.ndarray) -> np.ndarray:
        out = np.full((len(index), *self.shape), -1, np.int64)
        out[:, TOKENS] = self.pad_id
        for row, w in zip(out, index.tolist()):
            d = int(self.prompts[w])
            n, end = min(int(self.lengths[d]), self.length), int(self.ends[d])
            row[TOKENS, -n:] = self.store.tokens(end - n, end)
            row[DOCUMENT, -n:] = d
        return out

    def record(self, document: int) -> dict[str, Any]:
        """The prompt's record as its file held it (the prompt field as given, and every other field)."""
        return json.loads(self.store.record(document))

    def describe(self) -> str:
        dropped = f"; {self.dropped:,} longer than data.seq_len dropped" if self.dropped else ""
        mean = float(self.lengths[self.prompts].mean()) if self.count else 0.0
        return f"{self.count:,} prompts of {self.what} ({mean:.1f} tokens on average{dropped})"
