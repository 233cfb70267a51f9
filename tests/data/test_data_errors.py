"""Bad data input: each a ConfigError naming the key, the file and the line or row, and the fix;
a full disk while building leaves no store and every earlier store as it was; an error one rank meets is raised on
the ranks that wait for its part. (The same errors through the command line: tests/config/test_bad_input.py.)"""

import json
import os
import shutil
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fsdp_research.data.pipeline import build_data, open_stores, store_specs
from fsdp_research.data.store_builder import ensure_store
from fsdp_research.errors import ConfigError, DataError
from fsdp_research.jobs.compose import compose
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.train.refusals import check_config, check_sources
from tests.helpers.corpora import bpe_tokenizer, write
from tests.helpers.disk import small_disk


def _data_cfg(tmp_path, paths, *overrides):
    return compose([f"data.paths=[{','.join(map(str, paths))}]", f"data.store_dir={tmp_path / 'stores'}", *overrides])


def _build(tmp_path, paths, *overrides):
    cfg = _data_cfg(tmp_path, paths, *overrides)
    return build_data(cfg.data, 512, seed=0)


def _check(tmp_path, paths, *overrides):
    cfg = _data_cfg(tmp_path, paths, *overrides)
    check_config(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))


def _lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_line_that_is_not_json_is_named(tmp_path):
    path = _lines(tmp_path / "a.jsonl", ['{"text": "one"}', '{"text": "two"}', '{"text": "thr'])
    with pytest.raises(ConfigError, match=rf"^data.paths: {path} line 3: not JSON .*; fix: fix or remove that file$"):
        _build(tmp_path, [path])


def test_a_missing_text_field_names_the_fields_there(tmp_path):
    path = _lines(tmp_path / "a.jsonl", [json.dumps({"body": "x", "id": 1})])
    message = rf"^data.text_field: {path} line 1 has no field 'text' \(its fields: body, id\); fix: set it to one"
    with pytest.raises(ConfigError, match=message):
        _check(tmp_path, [path])  # before anything is tokenized
    table = tmp_path / "a.parquet"
    pq.write_table(pa.table({"content": ["x"]}), table)
    with pytest.raises(ConfigError, match=rf"^data.text_field: {table} has no column 'text' \(its columns: content\)"):
        _check(tmp_path, [table])
    sheet = tmp_path / "a.csv"
    sheet.write_text("title,body\nx,y\n")
    with pytest.raises(
        ConfigError, match=rf"^data.text_field: {sheet} has no column 'text' \(its columns: title, body"
    ):
        _check(tmp_path, [sheet])


def test_a_later_record_without_the_field_is_named_by_its_line(tmp_path):
    path = _lines(tmp_path / "a.jsonl", [json.dumps({"text": "ok"})] * 4 + [json.dumps({"txt": "typo"})])
    with pytest.raises(ConfigError, match=rf"^data.text_field: {path} line 5 has no field 'text' \(its fields: txt\)"):
        _build(tmp_path, [path])


def test_text_that_is_not_utf8_is_named_by_its_line(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"fine\nstill fine\n\xff\xfe broken\n")
    with pytest.raises(ConfigError, match=rf"^data.paths: {path} line 3: not UTF-8 text"):
        _build(tmp_path, [path])


def test_a_text_field_that_is_not_text(tmp_path):
    path = _lines(tmp_path / "a.jsonl", [json.dumps({"text": "ok"}), json.dumps({"text": 7})])
    with pytest.raises(ConfigError, match=rf"^data.paths: {path} line 2: field 'text' holds a int, not text"):
        _build(tmp_path, [path])


def test_a_directory_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match=r"^data.paths: .*/d is a directory but not one written by datasets"):
        _check(tmp_path, [tmp_path / "d"])


@pytest.mark.parametrize("docs", [["", ""], ["short"]], ids=["empty", "too_small"])
def test_a_corpus_too_small_for_one_window(tmp_path, docs):
    path = write("jsonl", str(tmp_path), docs=docs)
    with pytest.raises(
        ConfigError,
        match=r"^data.paths: \d+ window\(s\) of data.seq_len \+ 1 = 129 tokens, .* none "
        r"left to train on; fix: add text, or lower data.seq_len",
    ):
        _build(tmp_path, [path])


@pytest.mark.parametrize("weights", [(1.0, -0.5), (0.0, 0.0)], ids=["negative", "all_zero"])
def test_mixture_weights(tmp_path, weights):
    path = write("jsonl", str(tmp_path))
    sources = ",".join(f"{{paths:[{path}],weight:{w}}}" for w in weights)
    cfg = compose([f"data.sources=[{sources}]", f"data.store_dir={tmp_path / 'stores'}"])
    with pytest.raises(ConfigError, match=r"^data.sources: weights \[.*\]: each must be 0 or more, one at least"):
        check_sources(cfg.data)


def test_a_mixture_and_paths_together(tmp_path):
    path = write("jsonl", str(tmp_path))
    cfg = compose([f"data.sources=[{{paths:[{path}]}}]", f"data.paths=[{path}]"])
    with pytest.raises(ConfigError, match=r"^data.sources: a mixture is given and data.paths too"):
        check_sources(cfg.data)


def test_a_tokenizer_larger_than_the_model(tmp_path):
    tok = bpe_tokenizer(str(tmp_path / "tok"))
    with pytest.raises(ConfigError, match=rf"^data.tokenizer: '{tok}' has \d+ tokens, the model only 260; fix: use a"):
        _check(tmp_path, [write("jsonl", str(tmp_path))], f"data.tokenizer={tok}", "model.config.vocab_size=260")


def test_a_tokenizer_that_is_not_one(tmp_path):
    with pytest.raises(ConfigError, match=r"^data.tokenizer: cannot load '/no/such/tok': not a tokenizer"):
        _check(tmp_path, [write("jsonl", str(tmp_path))], "data.tokenizer=/no/such/tok")


def test_an_error_one_rank_meets_is_raised_on_the_rank_that_waits(tmp_path):
    """Rank 1's part holds a bad line; rank 0, which has nothing wrong, stops with rank 1's error."""
    good = write("jsonl", str(tmp_path / "good"))
    bad = _lines(tmp_path / "bad.jsonl", ['{"text": "x"}', "not json"])
    cfg = _data_cfg(tmp_path, [good, bad]).data
    [spec] = store_specs(cfg)
    assert len(spec.parts) == 2
    errors = {}

    def rank(r):
        try:
            ensure_store(spec, str(tmp_path / "stores"), r, 2, 1, "build-1")
        except ConfigError as err:
            errors[r] = str(err)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors[0] == errors[1] and errors[0].startswith(f"data.paths: {bad} line 2: not JSON")


TMPFS_MIB = 3


def _fill_up(tmp_path, disk):
    small = write("jsonl", str(tmp_path / "small_corpus"))
    big = tmp_path / "big.jsonl"
    big.write_text((json.dumps({"text": "z" * 2**20}) + "\n") * 4)  # 8 MB of uint16 tokens
    [earlier] = open_stores(compose([f"data.paths=[{small}]", f"data.store_dir={disk}"]).data)
    before = {p: os.path.getsize(os.path.join(earlier.path, p)) for p in os.listdir(earlier.path)}
    tokens = earlier.tokens(0, earlier.n_tokens)
    with pytest.raises(
        DataError,
        match=r"^writing token store part 0 in .* failed \(OSError: .*No space left on "
        r"device.* MiB free there\); no store was published, earlier stores are "
        r"intact$",
    ):
        open_stores(compose([f"data.paths=[{big}]", f"data.store_dir={disk}"]).data)
    assert [p for p in os.listdir(disk) if not p.startswith(".")] == [os.path.basename(earlier.path)]
    assert {p: os.path.getsize(os.path.join(earlier.path, p)) for p in os.listdir(earlier.path)} == before
    [again] = open_stores(compose([f"data.paths=[{small}]", f"data.store_dir={disk}"]).data)
    np.testing.assert_array_equal(again.tokens(0, again.n_tokens), tokens)


def test_a_full_disk_while_building_publishes_nothing_and_keeps_earlier_stores(tmp_path):
    disk = tmp_path / "small"
    with small_disk(str(disk), TMPFS_MIB):
        _fill_up(tmp_path, disk)
    shutil.rmtree(disk, ignore_errors=True)
