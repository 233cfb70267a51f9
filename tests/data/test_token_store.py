"""The token store: every format a researcher has, read as documents (the text field, not the JSON
syntax) and tokenized as the tokenizer itself tokenizes them; one store per source, tokenizer and end-of-document
handling, reused at another sequence length; the same store however many workers or ranks built it; and a build
that is killed publishes nothing and resumes where it stopped."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from fsdp_research.data import parts, store_builder
from fsdp_research.data.pipeline import Build, build_data, open_stores, store_specs
from fsdp_research.data.store import MANIFEST
from fsdp_research.data.store_builder import ensure_store
from fsdp_research.errors import DataError
from fsdp_research.jobs.compose import compose
from tests.conftest import ROOT
from tests.helpers.corpora import DOCS, bpe_tokenizer, write

pytestmark = pytest.mark.distributed

FORMATS = ["txt", "md", "jsonl", "json", "jsonl.gz", "jsonl.zst", "parquet", "csv", "arrow", "saved"]


def _cfg(tmp_path, paths, *overrides):
    return compose([f"data.paths=[{','.join(paths)}]", f"data.store_dir={tmp_path / 'stores'}", *overrides]).data


def _byte_tokens(docs):
    """The byte tokenizer's definition, written out: UTF-8 bytes, then 256, per non-empty document."""
    return np.concatenate([np.array([*d.encode("utf-8"), 256]) for d in docs if d])


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_is_read_as_its_documents(tmp_path, fmt):
    [store] = open_stores(_cfg(tmp_path, [write(fmt, str(tmp_path / "corpus"))]))
    np.testing.assert_array_equal(store.tokens(0, store.n_tokens), _byte_tokens(DOCS))
    assert store.n_documents == sum(1 for d in DOCS if d)
    assert store.dtype == np.uint16  # 257 tokens fit
    ends = store.document_ends()
    assert ends[-1] == store.n_tokens and (store.tokens(0, store.n_tokens)[ends - 1] == 256).all()


def test_text_field_names_the_column(tmp_path):
    path = write("jsonl", str(tmp_path / "corpus"), field="content")
    [store] = open_stores(_cfg(tmp_path, [path], "data.text_field=content"))
    np.testing.assert_array_equal(store.tokens(0, store.n_tokens), _byte_tokens(DOCS))


def test_a_local_hf_tokenizer_tokenizes_as_itself(tmp_path):
    from transformers import AutoTokenizer

    tok_dir = bpe_tokenizer(str(tmp_path / "tok"))
    [store] = open_stores(_cfg(tmp_path, [write("parquet", str(tmp_path / "corpus"))], f"data.tokenizer={tok_dir}"))
    tok = AutoTokenizer.from_pretrained(tok_dir)
    expected = [t for d in DOCS if d for t in tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    np.testing.assert_array_equal(store.tokens(0, store.n_tokens), expected)


def test_windows_cover_every_token_but_the_last_partial_window(tmp_path):
    cfg = _cfg(tmp_path, [write("jsonl", str(tmp_path / "corpus"))], "data.seq_len=31", "data.eval_fraction=0")
    data = build_data(cfg, 512, seed=0)
    [windows] = data.stream.windows
    store, length = windows.store, 32
    assert windows.count == store.n_tokens // length
    got = windows.read(np.arange(windows.count)).reshape(-1)
    np.testing.assert_array_equal(got, store.tokens(0, windows.count * length))


def test_the_key_is_source_tokenizer_and_field_not_seq_len(tmp_path):
    corpus = write("jsonl", str(tmp_path / "corpus"))
    base = _cfg(tmp_path, [corpus])
    path = open_stores(base)[0].path
    assert open_stores(_cfg(tmp_path, [corpus], "data.seq_len=64"))[0].path == path
    assert open_stores(_cfg(tmp_path, [corpus], f"data.tokenizer={bpe_tokenizer(str(tmp_path / 't'))}"))[0].path != path
    os.utime(corpus, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed (its modification time)
    assert open_stores(base)[0].path != path
    with open(corpus, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    assert open_stores(base)[0].path != path


def _many_parts(tmp_path, monkeypatch):
    """A corpus of several files and a big JSON Lines file, cut into many parts (small parts for the test)."""
    monkeypatch.setattr(parts, "MIN_PART_BYTES", 2048)
    monkeypatch.setattr(store_builder, "WORKER_BYTES", {"byte": 1, "other": 1})
    corpus = str(tmp_path / "corpus")
    return [write("txt", corpus), write("jsonl", corpus)]


def test_workers_and_ranks_build_the_same_store(tmp_path, monkeypatch):
    paths = _many_parts(tmp_path, monkeypatch)
    serial = open_stores(_cfg(tmp_path / "serial", paths))[0]
    [spec] = store_specs(_cfg(tmp_path, paths))
    assert len(spec.parts) > 4
    workers = open_stores(_cfg(tmp_path / "workers", paths), Build(workers=2))[0]
    # Two ranks, as two builders that share only the file system.
    root = str(tmp_path / "ranks" / "stores")
    stores = {}
    threads = [
        threading.Thread(target=lambda r=r: stores.setdefault(r, ensure_store(spec, root, r, 2, 1, "b")))
        for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for store in (workers, stores[0], stores[1]):
        assert store.manifest["parts"] == serial.manifest["parts"]
        np.testing.assert_array_equal(store.tokens(0, store.n_tokens), serial.tokens(0, serial.n_tokens))
    assert stores[0].path == stores[1].path


def test_a_lone_builder_takes_the_other_ranks_parts(tmp_path, monkeypatch):
    """Work stealing: rank 0 of two, the other never coming, builds every part itself (its own, then the other's,
    each claimed once) and publishes the store a single builder makes."""
    paths = _many_parts(tmp_path, monkeypatch)
    serial = open_stores(_cfg(tmp_path / "serial", paths))[0]
    [spec] = store_specs(_cfg(tmp_path, paths))
    alone = ensure_store(spec, str(tmp_path / "stores"), 0, 2, 1, "b", timeout_s=60)
    assert alone.manifest["parts"] == serial.manifest["parts"]
    np.testing.assert_array_equal(alone.tokens(0, alone.n_tokens), serial.tokens(0, serial.n_tokens))
    assert not [p for p in os.listdir(alone.path) if p.startswith("claims-")]


def test_a_store_another_job_publishes_while_this_one_builds_is_opened(tmp_path, monkeypatch):
    """Two jobs building the same store at once (a sweep's first jobs): the other one builds every part in the
    shared build dir and publishes it while this one is still at its parts; this one opens the published store."""
    paths = _many_parts(tmp_path, monkeypatch)
    [spec] = store_specs(_cfg(tmp_path, paths))
    root, build_parts = str(tmp_path / "stores"), store_builder._run_workers

    def the_other_job_finishes_first(*args, **kwargs):
        monkeypatch.setattr(store_builder, "_run_workers", build_parts)
        ensure_store(spec, root, 0, 1, 1, "other", timeout_s=60)

    monkeypatch.setattr(store_builder, "_run_workers", the_other_job_finishes_first)
    store = ensure_store(spec, root, 0, 1, 1, "this", timeout_s=60)
    serial = open_stores(_cfg(tmp_path / "serial", paths))[0]
    np.testing.assert_array_equal(store.tokens(0, store.n_tokens), serial.tokens(0, serial.n_tokens))


def test_a_store_published_after_this_job_looked_is_opened_not_replaced(tmp_path, monkeypatch):
    """The other job publishes (renames the build dir) after this one found no store and before it makes the build
    dir: this one opens that store; its files, which the other job reads, are never removed or replaced."""
    paths = _many_parts(tmp_path, monkeypatch)
    [spec] = store_specs(_cfg(tmp_path, paths))
    root, progress, other = str(tmp_path / "stores"), store_builder.Progress, []

    def the_other_job_publishes_now(*args):
        monkeypatch.setattr(store_builder, "Progress", progress)
        other.append(ensure_store(spec, root, 0, 1, 1, "other", timeout_s=60))
        other.append(os.stat(os.path.join(other[0].path, "part_00000.tokens")).st_ino)
        return progress(*args)

    monkeypatch.setattr(store_builder, "Progress", the_other_job_publishes_now)
    store = ensure_store(spec, root, 0, 1, 1, "this", timeout_s=60)
    assert store.path == other[0].path and os.stat(os.path.join(store.path, "part_00000.tokens")).st_ino == other[1]
    np.testing.assert_array_equal(other[0].tokens(0, other[0].n_tokens), store.tokens(0, store.n_tokens))
    assert os.listdir(root) == [spec.fingerprint]


def test_a_rank_0_that_finds_its_build_dir_published_by_another_job_leaves_the_store(tmp_path, monkeypatch):
    """Two jobs' rank 0 saw every part done in the one build dir; the other renamed it first: this one's publish
    finds the markers gone (or the store there) and leaves the published store as it is."""
    [spec] = store_specs(_cfg(tmp_path, _many_parts(tmp_path, monkeypatch)))
    root = str(tmp_path / "stores")
    store = ensure_store(spec, root, 0, 1, 1, "other", timeout_s=60)
    before = os.stat(os.path.join(store.path, "part_00000.tokens")).st_ino
    store_builder._publish(os.path.join(root, f".build-{spec.fingerprint}"), store.path, spec)
    assert os.stat(os.path.join(store.path, "part_00000.tokens")).st_ino == before


@pytest.mark.parametrize("rank", [0, 1])
def test_a_builder_that_died_without_a_word_fails_the_waiters(tmp_path, monkeypatch, rank):
    """A builder took part 1 and died before it could record an error (its claim is all that is left): once no
    part has finished for timeout_s, this one fails with one line, as rank 0 (waiting for the parts) and as
    another rank (waiting for the store)."""
    [spec] = store_specs(_cfg(tmp_path, _many_parts(tmp_path, monkeypatch)))
    claims = tmp_path / "stores" / f".build-{spec.fingerprint}" / "claims-b"
    claims.mkdir(parents=True)
    (claims / "part_00001").touch()
    with pytest.raises(
        DataError, match=r"no part finished, no error recorded and no builder alive for 1 s \(distributed.timeout_s\)"
    ):
        ensure_store(spec, str(tmp_path / "stores"), rank, 2, 1, "b", timeout_s=1)


def test_an_existing_store_opens_with_one_stat_per_file_and_no_read(tmp_path, monkeypatch):
    """Many files of one document each, as code corpora are, and a Parquet file: once the store exists, a start
    stats each source file once and reads none (no footer either)."""
    corpus = write("txt", str(tmp_path / "corpus"))
    paths = [corpus, write("parquet", str(tmp_path / "corpus"))]
    cfg = _cfg(tmp_path, paths)
    built = open_stores(cfg)[0]
    sources = set(parts.resolve_files(paths, "data.paths"))
    stats, real_stat = [], os.stat
    monkeypatch.setattr(os, "stat", lambda path, *a, **k: stats.append(str(path)) or real_stat(path, *a, **k))
    for name in ("read", "row_groups", "dataset_size"):
        monkeypatch.setattr(parts, name, lambda *a, **k: pytest.fail("a source file was read"))
    assert open_stores(cfg)[0].path == built.path
    assert sorted(p for p in stats if p in sources) == sorted(sources)


def test_a_store_that_does_not_match_its_manifest_is_rebuilt(tmp_path, caplog):
    cfg = _cfg(tmp_path, [write("jsonl", str(tmp_path / "corpus"))])
    [store] = open_stores(cfg)
    expected = store.tokens(0, store.n_tokens)
    with open(os.path.join(store.path, "part_00000.tokens"), "r+b") as f:
        f.truncate(10)
    [again] = open_stores(cfg)
    assert "part_00000.tokens has 10 bytes, the manifest says" in caplog.text and "rebuilding it" in caplog.text
    np.testing.assert_array_equal(again.tokens(0, again.n_tokens), expected)
    os.remove(os.path.join(store.path, MANIFEST))
    [again] = open_stores(cfg)
    assert "no valid manifest.json" in caplog.text
    np.testing.assert_array_equal(again.tokens(0, again.n_tokens), expected)


def _tokenize(args, cwd, env):
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_research", "tokenize", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_a_killed_build_publishes_nothing_and_resumes(tmp_path):
    """`fsdp-research tokenize` killed once its first part is done: no store, only the build's parts; run again,
    it finishes from there (the first part kept as it was) and equals an uninterrupted build."""
    corpus = str(tmp_path / "corpus.jsonl")
    line = json.dumps({"text": "x" * 4000}) + "\n"
    with open(corpus, "w") as f:
        # Eight parts of 4 MiB, the last tiny: those after the first (~1.4 s at 18 MB/s) leave a loaded machine's test
        # time to kill.
        f.write(line * (7 * parts.MIN_PART_BYTES // len(line) + 1))
    stores = tmp_path / "stores"
    args = [f"data.paths=[{corpus}]", f"data.store_dir={stores}", "data.build_workers=1"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = _tokenize(args, str(tmp_path), env)
    deadline = time.monotonic() + 120
    while not list(stores.glob(".build-*/part_00000.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    [build] = list(stores.glob(".build-*"))
    assert [p.name for p in stores.iterdir()] == [build.name], "a killed build publishes no store"
    first = (build / "part_00000.tokens").stat().st_mtime_ns
    out, err = _tokenize(args, str(tmp_path), env).communicate(timeout=300)
    assert "token store" in out and "MB/s" in out, out + err
    [store_dir] = [p for p in stores.iterdir() if not p.name.startswith(".")]
    assert (store_dir / "part_00000.tokens").stat().st_mtime_ns == first
    fresh = open_stores(compose(args[:1] + [f"data.store_dir={tmp_path / 'fresh'}"]).data)[0]
    assert json.loads((store_dir / MANIFEST).read_text())["files"] == fresh.manifest["files"]
