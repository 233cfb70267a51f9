"""Tokenizers: `byte` (UTF-8 bytes and an end-of-document token, no download) or a Hugging Face tokenizer (a local
directory, or a name in the local cache). Each encodes a batch of documents, every one ending with the
end-of-document token, and has a fingerprint of what it does (its vocabulary, merges, normalization and special
tokens, not only its name), so that a token store is never read with another tokenizer's ids."""

import hashlib
import os
from functools import cache

import numpy as np

from ..errors import ConfigError

BYTE_VOCAB = 257  # 256 byte values and an end-of-document token
BYTE_EOS = 256


class Tokenizer:
    def __init__(self, name: str):
        self.name = name
        if name == "byte":
            self._hf = None
            self.vocab_size, self.eos_id = BYTE_VOCAB, BYTE_EOS
            self.fingerprint = "byte-utf8-v1"
            return
        self._hf = _load_hf(name)
        self.vocab_size = len(self._hf)
        if self._hf.eos_token_id is None:
            raise ConfigError(
                "data.tokenizer", f"{name!r} has no end-of-document (eos) token", "use a tokenizer that defines one"
            )
        self.eos_id = self._hf.eos_token_id
        backend = getattr(self._hf, "backend_tokenizer", None)
        text = backend.to_str() if backend is not None else repr(sorted(self._hf.get_vocab().items()))
        self.fingerprint = hashlib.sha256(f"{type(self._hf).__name__}\n{text}".encode()).hexdigest()

    @property
    def dtype(self) -> np.dtype:
        """The token store's dtype: uint16 while the vocabulary fits, else uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Each document's token ids, the end-of-document token last."""
        if self._hf is None:
            return [np.append(np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint32), BYTE_EOS) for t in texts]
        backend = getattr(self._hf, "backend_tokenizer", None)
        if backend is not None:
            ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        else:
            ids = self._hf(texts, add_special_tokens=False)["input_ids"]
        return [np.array([*doc, self.eos_id], dtype=np.uint32) for doc in ids]

    def save(self, out_dir: str) -> None:
        """Into an export: the Hugging Face tokenizer's files (the byte tokenizer has none)."""
        if self._hf is not None:
            self._hf.save_pretrained(out_dir)


def _load_hf(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        where = "directory" if os.path.isdir(name) else "name (or it is not in the local cache)"
        raise ConfigError(
            "data.tokenizer",
            f"cannot load {name!r}: not a tokenizer {where} ({str(err).splitlines()[0]})",
            "use `byte` or a directory written by save_pretrained",
        ) from None


@cache
def load_tokenizer(name: str) -> Tokenizer:
    return Tokenizer(name)
