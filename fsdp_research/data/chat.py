"""Conversations and prompt/completion pairs as training documents: each record's token ids and which of them are
targets (data.loss_on), rendered with the tokenizer's own chat template. The assistant's tokens are the template's
`{% generation %}` blocks where it marks them (transformers' return_assistant_tokens_mask), else found by rendering
the conversation turn by turn: the text each assistant message adds after the generation prompt."""

import copy
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_research.config.data_schema import DataConfig, DataKind, LossOn
from fsdp_research.data.formats import hub_records, read_records
from fsdp_research.data.parts import first_file, resolve_files
from fsdp_research.data.tokenizer import load_tokenizer
from fsdp_research.errors import ConfigError

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Document:
    ids: np.ndarray  # int64 token ids
    targets: np.ndarray  # bool: token j is trained on (predicted from the tokens before it)
    # Preference data: 1 a preferred completion (chosen, or an example labelled desirable), 0 not; -1 none.
    label: int = -1
    # Prompts: the record as JSON (the prompt as given and the other fields, for the reward functions).
    record: str = ""


# How a run's prompts are tokenized (its samples, and `generate` on its export): a user's message in the chat
# template, a prompt/completion pair's prompt as the data tokenizes it (special tokens too), or plain text.
PROMPTS = "prompts.json"


def prompt_rendering(cfg: DataConfig) -> str:
    if cfg.kind in (DataKind.preference, DataKind.prompts):  # as the records are: messages (the first's) or text
        record = _first_record(cfg)
        if cfg.kind is DataKind.prompts:
            field = cfg.prompt_field
        else:
            field = cfg.completion_field if unpaired_examples(cfg) else cfg.chosen_field
        return "chat" if isinstance(record, dict) and isinstance(record.get(field), list) else "pair"
    if cfg.kind is not DataKind.chat:
        return "text"
    return "pair" if cfg.prompt_field else "chat"


def _first_record(cfg: DataConfig) -> Any:
    first = [first_file(cfg.paths, "data.paths")] if cfg.paths else None
    return next(records(cfg, first, "data.paths"), (None, None, {}))[2]


def unpaired_examples(cfg: DataConfig) -> bool:
    """Whether data=preference holds unpaired examples ({prompt, completion, label}: KTO's), as its first record."""
    record = _first_record(cfg)
    return isinstance(record, dict) and cfg.label_field in record


def chat_tokenizer(cfg: DataConfig):
    """The Hugging Face tokenizer with the template the data is rendered with (data.chat_template's file, else its
    own)."""
    tok = load_tokenizer(cfg.tokenizer).hf
    if tok is None:
        raise ConfigError(
            "data.tokenizer", f"data={cfg.kind.value} needs a Hugging Face tokenizer, not `byte`", "name one"
        )
    if cfg.chat_template:
        tok = copy.copy(tok)  # load_tokenizer's is shared: its own template stays
        try:
            with open(cfg.chat_template) as f:
                tok.chat_template = f.read()
        except OSError as err:
            raise ConfigError(
                "data.chat_template", f"cannot read {cfg.chat_template}: {err}", "name a Jinja file"
            ) from None
    elif not cfg.prompt_field and not tok.chat_template:
        raise ConfigError(
            "data.tokenizer",
            f"{cfg.tokenizer!r} has no chat template",
            "use a tokenizer that has one, or set data.chat_template to a Jinja file",
        )
    return tok


def _char_targets(tok, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The text's tokens and which are targets: the spans of chars, each tokenized apart from what comes before it
    (as generation sees a turn: its prompt tokenized alone, the reply from there), so that no token straddles a
    span's start (one that did would be a target holding prompt text); the rest as apply_chat_template tokenizes."""
    ids: list[int] = []
    targets: list[bool] = []
    cuts = [0, *(c for span in spans for c in span), len(text)]
    for k, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        piece = tok(text[start:stop], add_special_tokens=False)["input_ids"] if stop > start else []
        ids += piece
        targets += [k % 2 == 1] * len(piece)  # the odd pieces are the spans
    return np.asarray(ids, np.int64), np.asarray(targets, bool)


def _assistant_spans(tok, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the chars of each assistant message (what it adds after the generation
    prompt: its content and end of turn)."""
    text = tok.apply_chat_template(messages, tokenize=False)
    spans = []
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        upto = tok.apply_chat_template(messages[: k + 1], tokenize=False)
        if k:
            prompt = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        else:  # a first turn: what the template puts before it (a default system message, its header) is no target
            content = message.get("content") or ""
            prompt = upto[: upto.rindex(content)] if content else upto
        if not (text.startswith(upto) and upto.startswith(prompt)):
            raise ConfigError(
                "data.chat_template",
                "the template renders a conversation's start differently from the whole, so the assistant's tokens "
                "cannot be found turn by turn",
                "mark them with {% generation %} ... {% endgeneration %} in the template",
            )
        spans.append((len(prompt), len(upto)))
    return text, spans


# Prompt/completion records (TRL's field names), and ShareGPT's roles.
_PAIR = {"prompt", "completion"}
_SHAREGPT, _SHAREGPT_ROLES = {"from", "value"}, {"human": "user", "gpt": "assistant"}


def _messages(messages: Any) -> Any:
    """Messages as chat templates take them ({"role", "content"}); ShareGPT's ({"from": "human" | "gpt" | "system",
    "value"}) read as such."""
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and _SHAREGPT <= m.keys() for m in messages):
        return [{"role": _SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]} for m in messages]
    return messages


def _chat_document(tok, messages: list[dict], loss_on: LossOn) -> Document:
    if loss_on is LossOn.all:
        ids = np.asarray(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"], np.int64)
        return Document(ids, np.ones(len(ids), bool))
    if _GENERATION.search(tok.chat_template):
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, targets = np.asarray(out["input_ids"], np.int64), np.asarray(out["assistant_masks"], bool)
    else:
        text, spans = _assistant_spans(tok, messages)
        ids, targets = _char_targets(tok, text, spans)
    if loss_on is LossOn.last_assistant and targets.any():
        # The last run of targets: the last assistant message (a header's tokens part one from the next).
        starts = np.flatnonzero(targets & ~np.r_[False, targets[:-1]])
        targets[: starts[-1]] = False
    return Document(ids, targets)


def end_of_turn(tok) -> int | None:
    """The special token the chat template ends an assistant's turn with (ChatML's <|im_end|>, Llama 3's
    <|eot_id|>): the first special token after a turn's content; None without a template or such a token."""
    if not tok.chat_template:
        return None
    turn = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    try:
        ids, turn_tokens = _char_targets(tok, *_assistant_spans(tok, turn))
    except Exception:  # a template with requirements of its own: samples then stop at EOS only
        return None
    special = set(tok.all_special_ids)
    return next((int(i) for i in ids[turn_tokens] if i in special), None)


def _prompt_completion(tok, prompt: str, completion: str, loss_on: LossOn) -> Document:
    """As TRL tokenizes a pair: the prompt alone, the pair, the completion's tokens those past the prompt's; and
    the end-of-sequence token, a target."""
    prompt_ids = tok(prompt)["input_ids"]
    ids = np.asarray([*tok(prompt + completion)["input_ids"], tok.eos_token_id], np.int64)
    targets = np.arange(len(ids)) >= (0 if loss_on is LossOn.all else len(prompt_ids))
    return Document(ids, targets)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _implicit_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair without a prompt, as TRL's extract_prompt cuts it: their common start (by
    character for text, by message for conversations), a space before where they part going with the completions."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _tokenized(tok, prompt: Any, completions: tuple) -> tuple[list[int], list[list[int]]]:
    """(the prompt alone, the prompt with each completion) as TRL's DPO and KTO trainers tokenize them: a
    conversation's prompt with the generation prompt; a text completion with its end-of-sequence text appended."""
    if isinstance(prompt, list):

        def ids(messages, **kwargs):
            return tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]

        return ids(prompt, add_generation_prompt=True), [ids(prompt + c) for c in completions]
    eos = tok.eos_token or ""
    return tok(prompt)["input_ids"], [
        tok(prompt + (c if c.endswith(eos) else c + eos))["input_ids"] for c in completions
    ]


def _pair_documents(tok, prompt: Any, chosen: Any, rejected: Any) -> tuple[Document, Document]:
    """A preference pair's two documents as TRL's DPOTrainer tokenizes them (_tokenized), the prompt being the
    three's common start in tokens; the completions' tokens are the targets."""
    alone, whole = _tokenized(tok, prompt, (chosen, rejected))
    cut = min(_common_prefix(alone, w) for w in whole)
    docs = (Document(np.asarray(w, np.int64), np.arange(len(w)) >= cut, label) for w, label in zip(whole, (1, 0)))
    return next(docs), next(docs)


@dataclass(frozen=True)
class _Example:
    """An unpaired example (KTO's), tokenized, waiting for the rest of its chunk."""

    prompt: list[int]  # the prompt's tokens: the common start of it alone and with the completion
    whole: list[int]  # the prompt with the completion
    label: bool


def _example(tok, cfg: DataConfig, record: Any, path: str, where: str) -> _Example:
    prompt = _messages(_field(record, "data.prompt_field", cfg.prompt_field, path, where))
    completion = _messages(_field(record, "data.completion_field", cfg.completion_field, path, where))
    label = record[cfg.label_field]
    if not isinstance(label, bool):
        raise ConfigError(
            "data.label_field", f"{path} {where}: {cfg.label_field} is {label!r}, not true or false", "fix that record"
        )
    if {type(prompt), type(completion)} not in ({str}, {list}):
        raise ConfigError(
            "data.completion_field", f"{path} {where}: prompt and completion must both be text or messages", "fix it"
        )
    alone, (whole,) = _tokenized(tok, prompt, (completion,))
    return _Example(alone[: _common_prefix(alone, whole)], whole, label)


def _unpaired(chunk: list[_Example]) -> Iterator[Document]:
    """Each example's document and its KL document: its prompt with the completion of the example before it in the
    chunk (the first: the last's), as TRL's KTOTrainer rotates them within each chunk of its batch size."""
    for k, example in enumerate(chunk):
        before = chunk[k - 1]
        kl = example.prompt + before.whole[len(before.prompt) :]
        cut = len(example.prompt)
        yield Document(np.asarray(example.whole, np.int64), np.arange(len(example.whole)) >= cut, int(example.label))
        yield Document(np.asarray(kl, np.int64), np.arange(len(kl)) >= cut, int(example.label))


def _preference(tok, cfg: DataConfig, record: Any, path: str, where: str) -> tuple[Document, Document]:
    chosen = _messages(_field(record, "data.chosen_field", cfg.chosen_field, path, where))
    rejected = _messages(_field(record, "data.rejected_field", cfg.rejected_field, path, where))
    if cfg.prompt_field and cfg.prompt_field in record:
        prompt = _messages(record[cfg.prompt_field])
    else:
        prompt, chosen, rejected = _implicit_prompt(chosen, rejected)
    kinds = {type(x) for x in (prompt, chosen, rejected)}
    if kinds not in ({str}, {list}):
        raise ConfigError(
            "data.chosen_field",
            f"{path} {where}: prompt, chosen and rejected must all be text or all messages",
            "fix that record",
        )
    return _pair_documents(tok, prompt, chosen, rejected)


def _prompt(tok, cfg: DataConfig, record: Any, path: str, where: str) -> Document:
    """A prompt as TRL's GRPOTrainer tokenizes it (messages with the generation prompt; text with the tokenizer's
    special tokens), no target; its record kept as JSON."""
    prompt = _messages(_field(record, "data.prompt_field", cfg.prompt_field, path, where))
    if isinstance(prompt, list):
        ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    elif isinstance(prompt, str):
        ids = tok(prompt)["input_ids"]
    else:
        raise ConfigError(
            "data.prompt_field", f"{path} {where}: a {type(prompt).__name__}, not text or messages", "fix that record"
        )
    if not len(ids):
        raise ConfigError("data.prompt_field", f"{path} {where}: the prompt has no token", "fix that record")
    try:
        text = json.dumps(record, ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            "data.paths", f"{path} {where}: a field JSON cannot hold ({err})", "store it as text"
        ) from None
    return Document(np.asarray(ids, np.int64), np.zeros(len(ids), bool), record=text)


def _field(record: Any, key: str, name: str, path: str, where: str) -> Any:
    if key == "data.messages_field" and isinstance(record, dict) and name not in record and _PAIR <= record.keys():
        raise ConfigError(
            "data.prompt_field",
            f"{path} {where} is a prompt/completion pair, not a conversation",
            "set data.prompt_field=prompt data.completion_field=completion",
        )
    if not isinstance(record, dict) or name not in record:
        fields = ", ".join(sorted(map(str, record))) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(key, f"{path} {where} has no field {name!r} (its fields: {fields})", "set it to one of them")
    return record[name]


def records(cfg: DataConfig, paths: list[str] | None, key: str) -> Iterator[tuple[str, str, Any]]:
    """(source, where, record) of each record of the files `paths` names, in order; paths None: of the hub
    dataset data.hub_name names (load_dataset's split, as data=hub reads it)."""
    if paths is None:
        for where, record in hub_records(cfg.hub_name, cfg.hub_config, cfg.split, cfg.cache_dir):
            yield cfg.hub_name, where, record
        return
    for path in resolve_files(paths, key):
        for where, record in read_records(path):
            yield path, where, record


def _documents_of(tok, cfg: DataConfig, source: Iterator[tuple[str, str, Any]]) -> Iterator[Document]:
    """The documents of each record: a conversation's, a preference pair's two, an unpaired example's two (its own
    and its KL document, yielded a chunk of data.kl_chunk examples at a time)."""
    chunk: list[_Example] = []
    paired = None  # preference data: pairs or unpaired examples, as the first record is
    for path, where, record in source:
        try:
            if cfg.kind is DataKind.preference:
                unpaired = isinstance(record, dict) and cfg.label_field in record
                paired = not unpaired if paired is None else paired
                if paired == unpaired:
                    raise ConfigError(
                        "data.paths",
                        f"{path} {where}: {'an unpaired example' if unpaired else 'a pair'} among "
                        f"{'pairs' if paired else 'unpaired examples'}",
                        "keep one kind to a run",
                    )
                if paired:
                    yield from _preference(tok, cfg, record, path, where)
                    continue
                chunk.append(_example(tok, cfg, record, path, where))
                if len(chunk) == cfg.kl_chunk:
                    yield from _unpaired(chunk)
                    chunk = []
            elif cfg.kind is DataKind.prompts:
                yield _prompt(tok, cfg, record, path, where)
            elif cfg.prompt_field or cfg.completion_field:
                prompt = _field(record, "data.prompt_field", cfg.prompt_field, path, where)
                completion = _field(record, "data.completion_field", cfg.completion_field, path, where)
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise ConfigError(
                        "data.prompt_field", f"{path} {where}: prompt and completion must be text", "fix that record"
                    )
                yield _prompt_completion(tok, prompt, completion, cfg.loss_on)
            else:
                messages = _field(record, "data.messages_field", cfg.messages_field, path, where)
                yield _chat_document(tok, _messages(messages), cfg.loss_on)
        except ConfigError:
            raise
        except Exception as err:  # the template's own complaint (a role it rejects, a malformed message)
            text = str(err).strip().splitlines()
            raise ConfigError(
                "data.paths",
                f"{path} {where}: the chat template rejects it ({text[0] if text else err!r})",
                "fix that record, or the template",
            ) from None
    yield from _unpaired(chunk)


def check_chat(cfg: DataConfig) -> None:
    """data=chat before any compute: the tokenizer and its template, the first record of the first file (its
    fields, its roles) rendered, as the eval files' first."""
    if cfg.sources:
        raise ConfigError("data.sources", f"data={cfg.kind.value} reads data.paths, not a mixture", "give data.paths")
    if cfg.kind is DataKind.prompts and not cfg.prompt_field:
        raise ConfigError("data.prompt_field", "data=prompts reads each record's prompt from it", "set it: prompt")
    if cfg.kind is DataKind.chat and bool(cfg.prompt_field) != bool(cfg.completion_field):
        raise ConfigError(
            "data.prompt_field", "prompt/completion pairs need both fields", "set data.completion_field too"
        )
    if bool(cfg.paths) == bool(cfg.hub_name):
        raise ConfigError(
            "data.paths",
            f"data={cfg.kind.value} reads files or a hub dataset: {'both' if cfg.paths else 'neither'} given",
            "give data.paths=[...] or data.hub_name=<dataset>",
        )
    tok = chat_tokenizer(cfg)
    firsts = [("data.eval_paths", [first_file(cfg.eval_paths, "data.eval_paths")])] if cfg.eval_paths else []
    first = [first_file(cfg.paths, "data.paths")] if cfg.paths else None
    for key, paths in [("data.paths", first), *firsts]:
        next(_documents_of(tok, cfg, records(cfg, paths, key)), None)


def documents(cfg: DataConfig, paths: list[str] | None, key: str) -> Iterator[Document]:
    """Every record of `paths` (see records) as a document, in order."""
    return _documents_of(chat_tokenizer(cfg), cfg, records(cfg, paths, key))
