"""From the data config to batches: the sources (local files, a mixture of them, a hub dataset, or synthetic
tokens) -> their token stores (built once, opened by every rank) -> a Stream of windows by global sample index
-> this rank's slice of each step's global batch, read ahead in a background thread. Conversations (data=chat) have
stores of their own (fsdp_research.data.chat_store), packed as they are opened (fsdp_research.data.packing);
data.eval_paths, evaluated whole, the same way as the training data (text under document masking: each document
whole, packed)."""

import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fsdp_research.config.data_schema import DataConfig, DataKind
from fsdp_research.data.chat import chat_tokenizer
from fsdp_research.data.chat_store import chat_spec
from fsdp_research.data.packing import ChatWindows, DocumentWindows, PackedDocuments, PairWindows, TextDocuments
from fsdp_research.data.parts import default_paths, hub_parts, identity, plan_parts, scan
from fsdp_research.data.prompts import PromptWindows
from fsdp_research.data.sampling import StoreWindows, Stream, SyntheticWindows
from fsdp_research.data.store import StoreSpec, TokenStore, store_spec
from fsdp_research.data.store_builder import ensure_store
from fsdp_research.data.store_wait import Report
from fsdp_research.data.tokenizer import load_tokenizer
from fsdp_research.errors import ConfigError


def packed(cfg: DataConfig) -> bool:
    """Whether the samples are packed documents with targets (fsdp_research.data.packing), not token windows."""
    return (cfg.kind.templated and cfg.kind is not DataKind.prompts) or bool(cfg.document_masking)


def store_root(cfg: DataConfig) -> str:
    """data.store_dir, else $FSDP_RESEARCH_CACHE/token_stores (default ~/.cache/fsdp_research/token_stores): a
    directory every node of a job sees."""
    if cfg.store_dir:
        return os.path.abspath(os.path.expanduser(cfg.store_dir))
    cache = os.environ.get("FSDP_RESEARCH_CACHE") or os.path.join("~", ".cache", "fsdp_research")
    return os.path.join(os.path.abspath(os.path.expanduser(cache)), "token_stores")


@dataclass(frozen=True)
class Source:
    paths: tuple[str, ...]
    text_field: str
    weight: float
    key: str  # the config key that names it, for errors


def sources(cfg: DataConfig) -> list[Source]:
    """The local sources: data.sources (a mixture), else data.paths (empty: the standard library's sources)."""
    if cfg.sources:
        return [
            Source(tuple(s.paths), s.text_field, s.weight, f"data.sources[{i}].paths")
            for i, s in enumerate(cfg.sources)
        ]
    return [Source(tuple(cfg.paths) or tuple(default_paths()), cfg.text_field, 1.0, "data.paths")]


def store_specs(cfg: DataConfig) -> list[StoreSpec]:
    """Each source's store spec (the files are listed and stat'ed; nothing is read); data=chat: the conversations'
    and each eval set's."""
    if cfg.kind.templated:
        evals = [chat_spec(cfg, paths, key) for key, paths in eval_set_paths(cfg).values()]
        return [chat_spec(cfg, None if cfg.hub_name else list(cfg.paths), _chat_key(cfg)), *evals]
    if cfg.kind is DataKind.hub:
        hub = {
            "path": cfg.hub_name,
            "name": cfg.hub_config,
            "split": cfg.split,
            "streaming": cfg.streaming,
            "cache_dir": cfg.cache_dir,
            "max_documents": cfg.max_documents,
        }
        parts = functools.partial(hub_parts, hub, cfg.text_field)
        return [store_spec(parts, {k: v for k, v in hub.items() if k != "cache_dir"}, cfg.text_field, cfg.tokenizer)]
    return [_local_spec(source.paths, source.key, source.text_field, cfg.tokenizer) for source in sources(cfg)]


def _local_spec(paths: Sequence[str], key: str, text_field: str, tokenizer: str) -> StoreSpec:
    files = scan(paths, key)
    parts = functools.partial(plan_parts, files, text_field)  # planned only where the store is built
    return store_spec(parts, identity(files), text_field, tokenizer)


@dataclass(frozen=True)
class Build:
    """How this process takes part in building stores: its rank among the builders, their number, its worker
    processes, the name of the build (the same on every rank), and where progress goes."""

    rank: int = 0
    world: int = 1
    workers: int = 1
    name: str = "local"
    report: Report | None = None
    every_s: float = 10.0
    # A build that shows no progress this long fails (distributed.timeout_s).
    timeout_s: float = 600.0


def open_stores(cfg: DataConfig, build: Build = Build()) -> list[TokenStore]:
    """Every source's store, built first where there is none (see fsdp_research.data.store)."""
    return [_ensure(spec, store_root(cfg), build) for spec in store_specs(cfg)]


def _ensure(spec: StoreSpec, root: str, b: Build) -> TokenStore:
    return ensure_store(spec, root, b.rank, b.world, b.workers, b.name, b.report, b.every_s, b.timeout_s)


def _held_out_fraction(cfg: DataConfig) -> float:
    """Eval files replace the held-out windows: every training window trains."""
    return 0.0 if cfg.eval_paths or cfg.eval_sources else cfg.eval_fraction


def _check_size(windows, cfg: DataConfig, key: str) -> None:
    fraction = _held_out_fraction(cfg)
    held_out = max(1, int(windows.count * fraction)) if fraction > 0 else 0
    if windows.count - held_out < 1:
        capped = cfg.max_windows and windows.count == cfg.max_windows
        raise ConfigError(
            "data.max_windows" if capped else key,
            f"{windows.count} window(s) of data.seq_len + 1 = {windows.length} tokens, {held_out} held out for "
            "eval: none left to train on",
            "raise data.max_windows" if capped else "add text, or lower data.seq_len or data.eval_fraction",
        )


@dataclass
class Data:
    stream: Stream
    seq_len: int
    # data.overfit_batches: >0, the global batches of steps 0 .. N-1 over and over.
    overfit_batches: int = 0
    # The eval sets read whole (instead of held-out windows), by name: data.eval_paths' ("") or data.eval_sources'.
    eval_sets: dict[str, StoreWindows | PackedDocuments] = field(default_factory=dict)

    def batch(self, index: np.ndarray, held_out: bool = False) -> torch.Tensor:
        """Samples by index: [n, seq_len + 1] tokens, or packed [n, 3, seq_len] (fsdp_research.data.packing)."""
        samples = self.stream.held_out(index) if held_out else self.stream.train(index)
        return torch.from_numpy(samples)

    @property
    def pad_id(self) -> int | None:
        """What tells packed samples' padding from their documents without document masking: its token (None:
        masked, the padding is a document of its own, its positions from 0; or no padding)."""
        first = self.stream.windows[0]
        return first.pad_id if isinstance(first, ChatWindows) and not first.masking else None

    def eval_batch(self, name: str, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(self.eval_sets[name].read(index))

    def rank_batch(self, first: int, batch_size: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's slice of the global batch of samples first + [0, batch_size): a run reads on from the samples
        it consumed, whatever batch size each of its steps had."""
        if self.overfit_batches:
            first %= self.overfit_batches * batch_size
        per_rank = batch_size // world_size
        return self.batch(first + rank * per_rank + np.arange(per_rank))

    def global_batch(self, step: int, batch_size: int) -> torch.Tensor:
        """The global batch of `step` (0-based) of a run at one batch size throughout."""
        return self.rank_batch(step * batch_size, batch_size, 0, 1)

    def describe(self) -> str:
        out = []
        for windows, split in zip(self.stream.windows, self.stream.splits):
            out.append(
                f"{split.train:,} training + {split.held_out:,} held-out windows of {windows.length} tokens "
                f"from {_describe(windows)}"
            )
        for name, windows in self.eval_sets.items():
            out.append(f"eval{f' {name}' if name else ''}: {windows.count:,} windows from {_describe(windows)}")
        return "; ".join(out)


def _describe(windows) -> str:
    store = getattr(windows, "store", None)
    if isinstance(windows, (PackedDocuments, PromptWindows)):
        return f"{windows.describe()}, token store {store.path}"
    if store:
        masked = ", documents masked apart" if isinstance(windows, DocumentWindows) else ""
        return f"token store {store.path} ({store.n_tokens:,} tokens, {store.n_documents:,} documents{masked})"
    return "synthetic tokens"


def _chat_key(cfg: DataConfig) -> str:
    return "data.hub_name" if cfg.hub_name else "data.paths"


def chat_windows(
    cfg: DataConfig, paths: list[str] | None, key: str, build: Build
) -> ChatWindows | PairWindows | PromptWindows:
    """The conversations (or preference pairs, or prompts) of `paths` (None: of data.hub_name) from their store
    (built first where there is none), packed (data.packing, data.document_masking: on unless false)."""
    store = _ensure(chat_spec(cfg, paths, key), store_root(cfg), build)
    what = cfg.hub_name if paths is None else list(paths)
    tok = chat_tokenizer(cfg)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if cfg.kind is DataKind.prompts:
        prompts = PromptWindows(store, cfg.seq_len, pad, cfg.truncation, key)
        if not prompts.count:
            raise ConfigError(key, f"{what} holds no prompt of at most data.seq_len tokens", "raise data.seq_len")
        return prompts
    if cfg.kind is DataKind.preference:
        pairs = PairWindows(store, cfg.seq_len, pad, cfg.packing, cfg.truncation, key)
        if not pairs.count:
            raise ConfigError(key, f"{what} holds no pair of at most data.seq_len tokens", "raise data.seq_len")
        return pairs
    windows = ChatWindows(store, cfg.seq_len, pad, cfg.packing, cfg.document_masking is not False, cfg.truncation, key)
    if not windows.count and windows.untargeted:
        raise ConfigError(key, f"{what} holds no target token (data.loss_on={cfg.loss_on.value})", "check it")
    if not windows.count:
        raise ConfigError(key, f"{what} holds no document of at most data.seq_len tokens", "raise data.seq_len")
    return windows


def eval_set_paths(cfg: DataConfig) -> dict[str, tuple[str, list[str]]]:
    """name -> (config key, paths): data.eval_paths as one set (""), or data.eval_sources' sets."""
    named = {"": ("data.eval_paths", list(cfg.eval_paths))} if cfg.eval_paths else {}
    named.update({name: (f"data.eval_sources.{name}", list(paths)) for name, paths in cfg.eval_sources.items()})
    return named


def _eval_sets(cfg: DataConfig, build: Build) -> dict[str, StoreWindows | PackedDocuments]:
    return {
        name: chat_windows(cfg, paths, key, build) if cfg.kind.templated else _eval_text(cfg, paths, key, build)
        for name, (key, paths) in eval_set_paths(cfg).items()
    }


def _eval_text(cfg: DataConfig, paths: list[str], key: str, build: Build) -> StoreWindows | TextDocuments:
    """An eval set of text: its store's windows, or with data.document_masking its documents packed whole (cut at
    no window's edge: each loses what it loses fed alone)."""
    store = _ensure(_local_spec(paths, key, cfg.text_field, cfg.tokenizer), store_root(cfg), build)
    if cfg.document_masking:
        windows = TextDocuments(store, cfg.seq_len, load_tokenizer(cfg.tokenizer).eos_id, key)
        short = "no document of two tokens or more (or data.seq_len is 1)"
    else:
        windows, short = StoreWindows(store, cfg.seq_len + 1), "less than one window of data.seq_len + 1 tokens"
    if not windows.count:
        raise ConfigError(key, f"{paths} holds {short}", "add text")
    return windows


def _masked(cfg: DataConfig, windows: StoreWindows) -> StoreWindows | DocumentWindows:
    """Training windows of text as packed documents where data.document_masking asks for it."""
    return DocumentWindows(windows) if cfg.document_masking else windows


def build_data(cfg: DataConfig, vocab_size: int, seed: int, build: Build = Build()) -> Data:
    """The data of a run: every rank calls it (where a store is missing, all of them build it)."""
    length = cfg.seq_len + 1
    if cfg.kind is DataKind.synthetic:
        count = min(cfg.num_sequences, cfg.max_windows or cfg.num_sequences)
        windows, weights, keys = [SyntheticWindows(count, length, vocab_size, seed)], [1.0], ["data"]
    elif cfg.kind.templated:
        key, paths = _chat_key(cfg), None if cfg.hub_name else list(cfg.paths)
        windows, weights, keys = [chat_windows(cfg, paths, key, build)], [1.0], [key]
    else:
        stores = open_stores(cfg, build)
        windows = [_masked(cfg, StoreWindows(store, length, cfg.max_windows)) for store in stores]
        weights = [s.weight for s in sources(cfg)] if cfg.kind is DataKind.local_text else [1.0]
        keys = [s.key for s in sources(cfg)] if cfg.kind is DataKind.local_text else ["data.hub_name"]
    for w, key, weight in zip(windows, keys, weights):
        if weight > 0:
            _check_size(w, cfg, key)
    stream = Stream(windows, weights, seed, _held_out_fraction(cfg))
    return Data(stream, cfg.seq_len, cfg.overfit_batches, _eval_sets(cfg, build))


def check_tokenizer(cfg: DataConfig, model_vocab: int) -> None:
    if cfg.kind is DataKind.synthetic:
        return
    tok = load_tokenizer(cfg.tokenizer)
    if tok.vocab_size > model_vocab:
        raise ConfigError(
            "data.tokenizer",
            f"{cfg.tokenizer!r} has {tok.vocab_size} tokens, the model only {model_vocab}",
            "use a model with a larger vocab_size or a smaller tokenizer",
        )


class Prefetcher:
    """The batch of each next step read in a background thread while the current step runs (pinned on CUDA, so
    that its copy to the device can overlap): fetch(step) for first, first + 1, ... up to `ahead` steps ahead."""

    def __init__(self, fetch: Callable[[int], torch.Tensor], first: int, last: int, pin: bool, ahead: int = 2):
        self.fetch, self.pin = fetch, pin
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=ahead)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(first, last), daemon=True)
        self._thread.start()

    def _run(self, first: int, last: int) -> None:
        for step in range(first, last):
            try:
                batch = self.fetch(step)
                item = (step, batch.pin_memory() if self.pin else batch, None)
            except Exception as err:  # raised in the training thread, where it is asked for
                item = (step, None, err)
            # Blocks while `ahead` batches wait, without waking: a thread that polls takes the interpreter lock
            # from the step each time it wakes (2.5% of a 2-rank CPU step at ten wake-ups a second).
            self._queue.put(item)
            if self._stop.is_set() or item[2] is not None:
                return

    def get(self, step: int) -> torch.Tensor:
        started = time.perf_counter()
        got, batch, error = self._queue.get()
        self.wait_s += time.perf_counter() - started
        if error is not None:
            raise error
        assert got == step, f"prefetched step {got}, asked for {step}"
        return batch

    def close(self, failed: bool = False) -> None:
        self._stop.set()
        # A put blocked on the full queue returns once a batch is taken; the thread then sees the stop.
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()
