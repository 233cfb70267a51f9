"""Tokenizers: `byte` (UTF-8 bytes and an end-of-document token, no download) or a Hugging Face tokenizer (a local
directory, or a name in the local cache). Each encodes a batch of documents, every one ending with the
end-of-document token, and has a fingerprint of what it does (its vocabulary, merges, normalization and special
tokens, not only its name), so that a token store is never read with another tokenizer's ids."""

import hashlib
import itertools
import os
from functools import cache

import numpy as np

from fsdp_research.config.data_schema import DataKind
from fsdp_research.errors import ConfigError

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

    def prompt_ids(self, text: str) -> list[int]:
        """A prompt's token ids: no end-of-document token (the model continues it)."""
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(ids, skip_special_tokens=True)

    @property
    def hf(self):
        """The Hugging Face tokenizer (None for `byte`)."""
        return self._hf

    @property
    def dtype(self) -> np.dtype:
        """The token store's dtype: uint16 while the vocabulary fits, else uint32."""
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    def encode(self, texts) -> tuple[np.ndarray, np.ndarray]:
        """The documents' token ids concatenated (in the store's dtype), each document ending with the
        end-of-document token; and each document's length in tokens. texts: a list of str, or an Arrow string
        array without nulls."""
        if not isinstance(texts, list):
            if self._hf is None:
                return self._with_eos(*_utf8_buffers(texts))
            texts = texts.to_pylist()
        if self._hf is None:
            encoded = [t.encode("utf-8") for t in texts]
            pieces = np.frombuffer(b"".join(encoded), np.uint8)
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        else:
            backend = getattr(self._hf, "backend_tokenizer", None)
            if backend is not None:
                ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
            else:
                ids = self._hf(texts, add_special_tokens=False)["input_ids"]
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            pieces = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return self._with_eos(pieces, lengths)

    def _with_eos(self, pieces: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Documents whose tokens are `pieces`, `lengths` each, with the end-of-document token after each."""
        ends = np.cumsum(lengths + 1)
        tokens = np.empty(int(ends[-1]) if len(ends) else 0, self.dtype)
        if len(lengths) and len(pieces) > 256 * len(lengths):
            # Long documents: one copy each is faster than a mask over every token.
            for start, src, n in zip(
                (ends - lengths - 1).tolist(), (np.cumsum(lengths) - lengths).tolist(), lengths.tolist()
            ):
                tokens[start : start + n] = pieces[src : src + n]
        else:
            text = np.ones(len(tokens), bool)
            text[ends - 1] = False
            tokens[text] = pieces
        tokens[ends - 1] = self.eos_id
        return tokens, lengths + 1

    def special_ids(self) -> dict[str, int | None]:
        """The ids a model's config names (bos/eos/pad_token_id), as this tokenizer has them."""
        hf = self._hf
        return {
            "bos_token_id": hf.bos_token_id if hf is not None else None,
            "eos_token_id": self.eos_id,
            "pad_token_id": hf.pad_token_id if hf is not None else None,
        }

    def save(self, out_dir: str) -> None:
        """Into an export: the Hugging Face tokenizer's files (the byte tokenizer has none)."""
        if self._hf is not None:
            self._hf.save_pretrained(out_dir)


def _utf8_buffers(array) -> tuple[np.ndarray, np.ndarray]:
    """An Arrow string array's UTF-8 bytes and each string's length in bytes, without a copy."""
    import pyarrow as pa

    width = np.int64 if pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(array.buffers()[1], width)[array.offset : array.offset + len(array) + 1]
    data = np.frombuffer(array.buffers()[2], np.uint8) if len(array) else np.zeros(0, np.uint8)
    return data[offsets[0] : offsets[-1]], np.diff(offsets).astype(np.int64)


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


AUTO = "auto"
# What a directory written by a tokenizer's save_pretrained holds (one of them at least).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_tokenizer(name_or_path: str | None) -> str | None:
    """The tokenizer a pretrained model comes with: its directory (or hub id, from the local cache) where it holds
    a tokenizer's files; else None."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        found = any(os.path.exists(os.path.join(name_or_path, f)) for f in _TOKENIZER_FILES)
        return name_or_path if found else None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = [try_to_load_from_cache(name_or_path, f) for f in _TOKENIZER_FILES]
    except ValueError:  # not a hub id either: the model's own checks say so
        return None
    # A hub model whose weights are not fetched yet: its tokenizer comes with them (one it lacks is said on load).
    return name_or_path if any(isinstance(c, str) for c in cached) or not os.path.exists(name_or_path) else None


def _from_config_alone(model) -> bool:
    return bool(model.get("model_type")) and not model.get("name_or_path") and not model.get("_target_")


def resolve_tokenizer(cfg) -> None:
    """A run's config, in place: data.tokenizer=auto is the pretrained model's own tokenizer, else byte; a model
    built from its family's config alone, without model.config.vocab_size, takes the tokenizer's vocabulary (not the
    family's default: Qwen3's 151,936 rows beside a 257-token byte tokenizer), and its special tokens' ids where
    those are not given either (the family's would lie outside the vocabulary: Phi-3's padding row 32,000)."""
    if cfg.data.tokenizer == AUTO:
        cfg.data.tokenizer = model_tokenizer(cfg.model.get("name_or_path")) or "byte"
    model = cfg.model
    if _from_config_alone(model) and "vocab_size" not in model.config and cfg.data.kind != DataKind.synthetic:
        tok = load_tokenizer(cfg.data.tokenizer)
        model.config.vocab_size = tok.vocab_size
        for key, value in tok.special_ids().items():
            model.config.setdefault(key, value)


def check_model_tokenizer(tokenizer: str, model) -> None:
    """Pretrained weights learnt one vocabulary: a data tokenizer of another one would train them on the wrong
    ids."""
    own = model_tokenizer(model.get("name_or_path")) if model.get("load_weights") else None
    if own is None or os.path.abspath(own) == os.path.abspath(tokenizer):
        return
    theirs, ours = load_tokenizer(own), load_tokenizer(tokenizer)
    if ours._hf is None or ours._hf.get_vocab() != theirs._hf.get_vocab():
        raise ConfigError(
            "data.tokenizer",
            f"{tokenizer!r} ({ours.vocab_size} tokens) is not the vocabulary of model.name_or_path's own tokenizer "
            f"({own}, {theirs.vocab_size} tokens), whose ids the weights learnt",
            "use data.tokenizer=auto (the model's own), or model.load_weights=false",
        )


def describe(name: str, model) -> str:
    """The start-up line's words for the tokenizer of a run."""
    tok = load_tokenizer(name)
    own = model_tokenizer(model.get("name_or_path"))
    whose = " (the model's own)" if own and os.path.abspath(own) == os.path.abspath(name) else ""
    if model.get("load_weights") and own is None:
        whose = " (model.name_or_path holds no tokenizer: give data.tokenizer the one its weights learnt)"
    follows = _from_config_alone(model) and model.config.get("vocab_size") == tok.vocab_size
    return f"tokenizer: {name}{whose}, {tok.vocab_size} tokens" + (", the model's vocab_size" if follows else "")
