"""Chat data (data=chat) against transformers: the assistant's tokens found turn by turn are those transformers'
return_assistant_tokens_mask marks under the same template with {% generation %} marks; a packed document's loss is
transformers' loss of the document fed alone (its own labels, its own positions); packing on or off gives the same
loss over the targets; bad input is one line before any compute."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from fsdp_research.data.chat import documents, end_of_turn
from fsdp_research.data.packing import IGNORE, LABELS, ChatWindows, assign, fill
from fsdp_research.data.pipeline import build_data
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import compose
from fsdp_research.metrics.meters import packed_tokens
from fsdp_research.model.architecture import build_hf_config
from fsdp_research.model.document_masking import check_document_masking
from fsdp_research.train.evaluation import evaluate
from fsdp_research.train.losses import token_losses
from fsdp_research.train.refusals import check_config
from tests.helpers.chats import CHATML, CHATML_MARKED, CONVERSATIONS, chat_llama, chat_tokenizer, write_chats
from tests.helpers.corpora import write
from tests.helpers.zoo import hf_config, pretrained


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    tok = chat_llama(str(tmp / "model"))
    marked = chat_tokenizer(str(tmp / "marked"), CHATML_MARKED)
    model = AutoModelForCausalLM.from_pretrained(tok)
    # As the trainer runs it: transformers' packed-sequence path is taken without a cache.
    model.config.use_cache = False
    return tok, marked, write_chats(str(tmp / "chats.jsonl")), model.eval()


def _cfg(setup, *overrides):
    tok, _, path, _ = setup
    return compose([*pretrained(tok), "data=chat", f"data.paths=[{path}]", *overrides])


@pytest.mark.parametrize("loss_on", ["assistant", "last_assistant", "all"])
def test_targets_are_transformers_assistant_masks(setup, loss_on):
    _, marked, path, _ = setup
    docs = list(documents(_cfg(setup, f"data.loss_on={loss_on}").data, [path], "data.paths"))
    tok = AutoTokenizer.from_pretrained(marked)
    for doc, messages in zip(docs, CONVERSATIONS, strict=True):
        ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        mask = np.asarray(ref["assistant_masks"], bool)
        if loss_on == "last_assistant":  # the last assistant message: its content starts after the last header
            last = tok.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=True)["input_ids"]
            mask[: len(last)] = False
        assert doc.ids.tolist() == ref["input_ids"]
        assert doc.targets.tolist() == (mask.tolist() if loss_on != "all" else [True] * len(mask))
        decoded = tok.decode(doc.ids[doc.targets])
        assert messages[-1]["content"] in decoded and ("assistant\n" in decoded) == (loss_on == "all")


def test_parquet_and_saved_datasets_hold_the_same_conversations(setup, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": messages} for messages in CONVERSATIONS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    cfg = _cfg(setup).data
    expected = list(documents(cfg, [setup[2]], "data.paths"))
    for path in (tmp_path / "chats.parquet", tmp_path / "saved"):
        got = list(documents(cfg, [str(path)], "data.paths"))
        assert [d.ids.tolist() for d in got] == [d.ids.tolist() for d in expected]
        assert [d.targets.tolist() for d in got] == [d.targets.tolist() for d in expected]
    # data.hub_name: what load_dataset reads (a hub name; here a directory of JSON Lines, as no hub is reachable).
    (tmp_path / "hub").mkdir()
    shutil.copy(setup[2], tmp_path / "hub" / "train.jsonl")
    hub = [*pretrained(setup[0]), "data=chat", f"data.hub_name={tmp_path / 'hub'}", f"data.cache_dir={tmp_path}/c"]
    got = list(documents(compose(hub).data, None, "data.hub_name"))
    assert [d.ids.tolist() for d in got] == [d.ids.tolist() for d in expected]
    assert [d.targets.tolist() for d in got] == [d.targets.tolist() for d in expected]
    assert f"{len(expected)} conversations of data.hub_name" in build_data(compose(hub).data, 0, 0).describe()


def test_the_end_of_a_turn_is_the_templates_special_token(setup):
    tok = AutoTokenizer.from_pretrained(setup[0])
    assert tok.convert_ids_to_tokens([end_of_turn(tok)]) == ["<|im_end|>"]


def test_prompt_completion_pairs_train_on_the_completion(setup, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "What is x + 1?", "completion": " It is 3."}) + "\n")
    cfg = _cfg(setup, "data.prompt_field=prompt", "data.completion_field=completion")
    [doc] = list(documents(cfg.data, [str(path)], "data.paths"))
    tok = AutoTokenizer.from_pretrained(setup[0])
    assert tok.decode(doc.ids[doc.targets]) == " It is 3." + tok.eos_token
    assert tok.decode(doc.ids[~doc.targets]) == "What is x + 1?"


def _alone(model, doc) -> float:
    """transformers' summed loss of one document fed alone (labels: the targets, shifted by the model)."""
    labels = torch.where(torch.from_numpy(doc.targets), torch.from_numpy(doc.ids), IGNORE)
    out = model(input_ids=torch.from_numpy(doc.ids)[None], labels=labels[None])
    return out.loss.item() * int(doc.targets[1:].sum())


def _pack(docs, seq_len: int, packing: bool, masking: bool) -> torch.Tensor:
    order, starts = assign(np.array([len(d.ids) for d in docs]), seq_len, packing)
    out = np.empty((len(starts) - 1, 3, seq_len), np.int64)
    for row, a, b in zip(out, starts, starts[1:]):
        fill(row, [(docs[d].ids, docs[d].targets) for d in order[a:b]], 0, masking)
    return torch.from_numpy(out)


@pytest.mark.parametrize("packing", [True, False])
def test_a_packed_document_loses_what_it_loses_alone(setup, packing):
    model = setup[3]
    docs = list(documents(_cfg(setup).data, [setup[2]], "data.paths")) * 2
    samples = _pack(docs, 256, packing, masking=True)
    assert len(samples) == (2 if packing else len(docs))
    with torch.no_grad():
        ours = token_losses(model, samples, torch.autocast("cpu", enabled=False)).sum().item()
        reference = sum(_alone(model, doc) for doc in docs)
        assert (samples[:, LABELS] != IGNORE).sum() == sum(int(d.targets[1:].sum()) for d in docs)
        assert ours == pytest.approx(reference, rel=1e-5)
        # Without document masking the later documents see the earlier ones: another loss.
        unmasked = _pack(docs, 256, packing=True, masking=False)
        seen = token_losses(model, unmasked, torch.autocast("cpu", enabled=False)).sum().item()
        assert abs(seen - reference) > 100 * max(abs(ours - reference), 1e-7 * reference)


def test_a_model_that_keeps_documents_apart_passes_the_start_check(setup):
    check_document_masking(setup[3], torch.device("cpu"))


def _windows(setup, *overrides) -> ChatWindows:
    [windows] = build_data(_cfg(setup, *overrides).data, 0, 0).stream.windows
    return windows


def test_long_conversations_are_dropped_cut_or_refused(setup):
    docs = list(documents(_cfg(setup).data, [setup[2]], "data.paths"))
    limit = max(len(d.ids) for d in docs) - 1
    assert len(_windows(setup, f"data.seq_len={limit}").docs) == len(docs) - 1
    cut = _windows(setup, f"data.seq_len={limit}", "data.truncation=truncate")
    assert len(cut.docs) == len(docs) and cut.lengths.max() == limit
    longest = max(range(len(docs)), key=lambda d: len(docs[d].ids))
    w = next(w for w in range(cut.count) if longest in cut.docs[cut.starts[w] : cut.starts[w + 1]])
    members = cut.docs[cut.starts[w] : cut.starts[w + 1]].tolist()
    at = sum(int(cut.lengths[d]) for d in members[: members.index(longest)])
    [row] = cut.read(np.array([w]))
    assert row[0, at : at + limit].tolist() == docs[longest].ids[:limit].tolist()
    with pytest.raises(ConfigError, match="data.truncation"):
        _windows(setup, f"data.seq_len={limit}", "data.truncation=error")


def _refused(cfg) -> str:
    with pytest.raises(ConfigError) as err:
        check_config(cfg, 1, build_hf_config(cfg.model), torch.device("cpu"))
    return str(err.value)


def test_bad_chat_input_is_one_line(setup, tmp_path):
    no_field = tmp_path / "x.jsonl"
    no_field.write_text(json.dumps({"conversation": []}) + "\n")
    assert "data.messages_field" in _refused(
        compose(["data=chat", f"data.paths=[{no_field}]", f"data.tokenizer={setup[0]}"])
    )
    rejects = tmp_path / "rejects.jinja"
    rejects.write_text("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                       "{% endif %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    assert re.search(
        "line 1: the chat template rejects it .*no system", _refused(_cfg(setup, f"data.chat_template={rejects}"))
    )
    assert "data.tokenizer" in _refused(compose(["data=chat", f"data.paths=[{setup[2]}]"]))  # byte
    bare = tmp_path / "bare"
    tok = AutoTokenizer.from_pretrained(setup[0])
    tok.chat_template = None
    tok.save_pretrained(bare)
    assert "no chat template" in _refused(compose(["data=chat", f"data.paths=[{setup[2]}]", f"data.tokenizer={bare}"]))
    assert "loss.z_loss" in _refused(_cfg(setup, "loss.z_loss=1e-4"))
    assert "data.paths: data=chat reads files or a hub dataset: neither" in _refused(_cfg(setup, "data.paths=[]"))
    assert "both given" in _refused(_cfg(setup, "data.hub_name=x/y"))
    # An eval set without a target: refused as the data is built, before the first step.
    prompts_only = write_chats(str(tmp_path / "prompts.jsonl"), [[{"role": "user", "content": "hi"}]])
    with pytest.raises(ConfigError, match="data.eval_paths: .* holds no target token"):
        build_data(_cfg(setup, f"data.eval_paths=[{prompts_only}]").data, 0, 0)


def test_text_documents_masked_apart_lose_what_each_piece_loses_alone(tmp_path):
    """data.document_masking on text (a token store's windows): each piece of a document in a window, fed alone to
    transformers (its positions from 0), loses what it loses in the window."""
    from fsdp_research.data.packing import DocumentWindows
    from tests.helpers.corpora import write

    corpus = write("jsonl", str(tmp_path))
    cfg = compose(["data.document_masking=true", f"data.paths=[{corpus}]", "data.seq_len=96", "data.eval_fraction=0"])
    [windows] = build_data(cfg.data, 257, 0).stream.windows
    assert isinstance(windows, DocumentWindows)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=257)).eval()
    model.config.use_cache = False
    span, n = windows.windows.length, windows.length
    for i in (0, 1, 2, 30):
        [sample] = torch.from_numpy(windows.read(np.array([i])))
        tokens = torch.from_numpy(windows.store.tokens(i * span, (i + 1) * span))
        starts = [0, *(j for j in range(1, n) if sample[2, j] == 0), n]
        assert len(starts) > 2 or i == 30  # the first windows hold several short documents
        with torch.no_grad():
            ours = token_losses(model, sample[None], torch.autocast("cpu", enabled=False))[0]
            for a, b in zip(starts, starts[1:]):
                # A piece ending at the window's end predicts the window's last token too (the same document).
                end = b + 1 if b == n and sample[1, n - 1] != IGNORE else b
                ids = tokens[a:end][None]
                alone = model(input_ids=ids, labels=ids).loss.item() * (end - a - 1)
                assert ours[a:b].sum().item() == pytest.approx(alone, rel=1e-5, abs=1e-5)


# A template that opens with a default system message where a conversation has none (Qwen2.5's way).
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
)


def test_an_assistant_first_turn_is_a_target_and_the_default_system_message_is_not(setup, tmp_path):
    """A conversation that opens with the assistant, under a template that puts a default system message first:
    the targets are transformers' assistant masks of the same template marked with {% generation %}."""
    messages = [
        {"role": "assistant", "content": "Hello, ask me."},
        {"role": "user", "content": "What is x + 1 when x is 2?"},
        {"role": "assistant", "content": "It is 3."},
    ]
    template = tmp_path / "template.jinja"
    template.write_text(DEFAULT_SYSTEM + CHATML)
    path = write_chats(str(tmp_path / "first.jsonl"), [messages])
    [doc] = list(documents(_cfg(setup, f"data.paths=[{path}]", f"data.chat_template={template}").data, [path], "x"))
    tok = AutoTokenizer.from_pretrained(setup[1])
    tok.chat_template = DEFAULT_SYSTEM + CHATML_MARKED
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert doc.ids.tolist() == ref["input_ids"]
    assert doc.targets.tolist() == [bool(m) for m in ref["assistant_masks"]]
    assert "helpful" not in tok.decode(doc.ids[doc.targets])


def _many(n: int) -> list[list[dict]]:
    """n conversations of different lengths (one with no assistant turn in every 100)."""
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": f"what is {i} + {i % 7}?" + " and" * (i % 13)}]
        if i % 100:
            turns.append({"role": "assistant", "content": f"It is {i + i % 7}." + " so" * (i % 29)})
        out.append(turns)
    return out


def test_conversations_are_tokenized_once_into_a_store(setup, tmp_path, monkeypatch):
    """2,000 conversations: the first start builds the store, the second reads it (nothing tokenized) and packs the
    same windows; the ids in the store's dtype; the ones with no assistant turn left out and counted."""
    import fsdp_research.data.chat_store as chat_store

    path = write_chats(str(tmp_path / "many.jsonl"), _many(2000))
    cfg = _cfg(setup, f"data.paths=[{path}]", f"data.store_dir={tmp_path}/stores", "data.seq_len=256").data
    first = build_data(cfg, 0, 0)
    [windows] = first.stream.windows
    assert windows.store.dtype == np.uint16 and windows.untargeted == 20 and len(windows.docs) == 1980
    assert "20 with no target token left out" in first.describe()

    def tokenize(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(chat_store, "documents", tokenize)
    again = build_data(cfg, 0, 0)
    index = np.arange(windows.count)
    assert np.array_equal(again.stream.windows[0].read(index), windows.read(index))
    # Every kept document once, as the tokenizer renders it.
    docs = [d for d in documents(cfg, [path], "data.paths") if d.targets[1:].any()]
    rows = windows.read(index)
    assert sorted(len(d.ids) for d in docs) == sorted(windows.lengths[windows.docs].tolist())
    assert (rows[:, LABELS] != IGNORE).sum() == sum(int(d.targets[1:].sum()) for d in docs)


def test_packing_fills_windows_as_trls_best_fit_decreasing_does(setup, tmp_path):
    """The same conversations packed by TRL's pack_dataset (strategy bfd, SFTTrainer's): no more windows than
    TRL's, so at least its share of target positions."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    path = write_chats(str(tmp_path / "many.jsonl"), _many(300))
    cfg = _cfg(setup, f"data.paths=[{path}]", f"data.store_dir={tmp_path}/stores", "data.seq_len=256").data
    [windows] = build_data(cfg, 0, 0).stream.windows
    docs = [d for d in documents(cfg, [path], "data.paths") if d.targets[1:].any()]
    trl = pack_dataset(Dataset.from_dict({"input_ids": [d.ids.tolist() for d in docs]}), 256, strategy="bfd")
    assert windows.count <= len(trl) < len(docs) // 2


def test_sharegpt_records_are_read_as_conversations(setup, tmp_path):
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [[{"from": roles[m["role"]], "value": m["content"]} for m in c] for c in CONVERSATIONS]
    path = write_chats(str(tmp_path / "sharegpt.jsonl"), sharegpt, field="conversations")
    cfg = _cfg(setup, "data.messages_field=conversations").data
    got = list(documents(cfg, [path], "data.paths"))
    expected = list(documents(_cfg(setup).data, [setup[2]], "data.paths"))
    assert [d.ids.tolist() for d in got] == [d.ids.tolist() for d in expected]
    assert [d.targets.tolist() for d in got] == [d.targets.tolist() for d in expected]


def test_a_prompt_completion_file_given_as_conversations_names_the_pair_fields(setup, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "What is x + 1?", "completion": " It is 3."}) + "\n")
    assert "set data.prompt_field=prompt data.completion_field=completion" in _refused(
        _cfg(setup, f"data.paths=[{path}]")
    )


@pytest.fixture
def one_rank(tmp_path):
    """A process group of this process alone, for the eval's all-reduce."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "group"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_text_eval_documents_lose_what_each_loses_alone(tmp_path, one_rank):
    """data.document_masking with data.eval_paths (text): every eval document once and whole, packed. The eval loss
    over its targets is transformers' loss summed over the documents fed alone (one longer than data.seq_len in
    pieces of seq_len tokens, each fed alone, each after the first from the previous one's last token), and its
    targets are every token after a document's first."""
    corpus, seq_len = write("jsonl", str(tmp_path)), 96
    paths = f"data.paths=[{corpus}]", f"data.eval_paths=[{corpus}]", f"data.store_dir={tmp_path}/stores"
    cfg = compose(["data.document_masking=true", *paths, f"data.seq_len={seq_len}", "trainer.micro_batch_size=2"])
    data = build_data(cfg.data, 257, 0)
    windows = data.eval_sets[""]
    store, ends = windows.store, windows.store.document_ends()
    firsts = np.concatenate([[0], ends[:-1]])
    assert (ends - firsts).min() < seq_len < (ends - firsts).max()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=257)).eval()
    model.config.use_cache = False
    out = evaluate(model, data, cfg, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    alone = 0.0
    with torch.no_grad():
        for first, end in zip(firsts.tolist(), ends.tolist()):
            for start in range(first, end - 1, seq_len - 1):
                ids = torch.from_numpy(store.tokens(start, min(start + seq_len, end)))[None]
                alone += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
    assert out["eval_tokens"] == store.n_tokens - store.n_documents
    assert out["eval_loss"] * out["eval_tokens"] == pytest.approx(alone, rel=1e-5)
    # Its windows' tokens (throughput's count) are the documents' positions, the padding left out.
    assert packed_tokens(torch.from_numpy(windows.read(np.arange(windows.count))), None) == windows.lengths.sum()


def _flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_func's contract ([batch, positions, heads, head size]) in torch."""
    out = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, **kwargs):
    """flash_attn_varlen_func's ([tokens, heads, head size], the sequences at cu_seqlens) in torch."""
    cuts = cu_seqlens_q.tolist()
    return torch.cat([_flash(q[None, a:b], k[None, a:b], v[None, a:b], **kwargs)[0] for a, b in zip(cuts, cuts[1:])])


def test_flash_attention_keeps_documents_apart_at_micro_batch_1_only(monkeypatch):
    """transformers' flash-attention path (its kernels in torch: no flash-attn here) reads restarting positions as
    varlen sequences at batch size 1 only: the start check passes it at trainer.micro_batch_size=1 and refuses it
    above, naming the fix."""
    import transformers.modeling_flash_attention_utils as fa

    loaded = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_process_flash_kwargs_fn")
    for name in loaded:  # left as they were
        monkeypatch.setattr(fa, name, getattr(fa, name))
    monkeypatch.setattr(fa, "_loaded_implementation", None)
    monkeypatch.setattr(
        fa, "_lazy_imports", lambda *a, **k: (_flash, _flash_varlen, None, fa._pad_input, fa._unpad_input)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama", vocab_size=64)).eval()
    model.config.use_cache = False
    model.config._attn_implementation = "flash_attention_2"
    check_document_masking(model, torch.device("cpu"), micro_batch=1)
    with pytest.raises(ConfigError, match=r"set trainer.micro_batch_size=1, or"):
        check_document_masking(model, torch.device("cpu"), micro_batch=2)


# A generation prompt that ends in a space: a byte-level BPE joins it to the reply's first digits (" 42").
SPACED = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_no_target_token_holds_prompt_text(setup, tmp_path):
    """Where a token of the whole conversation straddles the generation prompt's end, the prompt is tokenized as
    generation tokenizes it (alone, transformers' apply_chat_template with add_generation_prompt) and the targets
    are the reply's tokens only."""
    messages = [{"role": "user", "content": "What is 40 + 2?"}, {"role": "assistant", "content": "42"}]
    template = tmp_path / "spaced.jinja"
    template.write_text(SPACED)
    path = write_chats(str(tmp_path / "spaced.jsonl"), [messages])
    [doc] = list(documents(_cfg(setup, f"data.chat_template={template}").data, [path], "data.paths"))
    tok = AutoTokenizer.from_pretrained(setup[0])
    tok.chat_template = SPACED
    whole = tok(tok.apply_chat_template(messages, tokenize=False), return_offsets_mapping=True)
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True, return_dict=True)
    chars = len(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False))
    assert any(a < chars < b for a, b in whole["offset_mapping"]), "no token straddles the prompt's end"
    n = len(prompt["input_ids"])
    assert doc.ids[:n].tolist() == prompt["input_ids"] and not doc.targets[:n].any()
    assert doc.targets[n:].all() and tok.decode(doc.ids[n:]) == "42\n"
