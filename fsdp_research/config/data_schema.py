"""The data group's schema (data=local_text|hub|synthetic|chat|preference|prompts): sources, tokenizer, windows,
eval sets, and the chat, preference and prompt data's rendering, targets, truncation and packing."""

from dataclasses import dataclass, field
from enum import Enum


class DataKind(str, Enum):
    local_text = "local_text"
    hub = "hub"
    synthetic = "synthetic"
    chat = "chat"
    preference = "preference"
    # Prompts alone (TRL's prompt-only format), for an objective that generates the completions (objective=grpo).
    prompts = "prompts"

    @property
    def templated(self) -> bool:
        """Records rendered (a chat template, a prompt and its completion, or a prompt alone) into documents."""
        return self in (DataKind.chat, DataKind.preference, DataKind.prompts)


class LossOn(str, Enum):
    assistant = "assistant"
    last_assistant = "last_assistant"
    all = "all"


class Truncation(str, Enum):
    drop = "drop"
    truncate = "truncate"
    error = "error"


@dataclass
class SourceConfig:
    """One source of a mixture."""

    paths: list[str] = field(default_factory=list)
    text_field: str = "text"
    # Its share of the samples: weights are normalized over the sources.
    weight: float = 1.0


@dataclass
class DataConfig:
    kind: DataKind = DataKind.local_text
    # local_text: files, directories written by datasets.save_to_disk, or globs; by name: .txt/.md/... (one document
    # per file), .jsonl/.json (also .gz/.zst), .parquet, .csv, .arrow. Empty: the running Python's stdlib sources.
    paths: list[str] = field(default_factory=list)
    # The field (column) that holds each record's text.
    text_field: str = "text"
    # A mixture (instead of paths): [{paths, text_field, weight}, ...], sampled by weight.
    sources: list[SourceConfig] = field(default_factory=list)
    seq_len: int = 128
    # "auto" (the pretrained model's own tokenizer where its directory holds one, else byte), "byte" (no download),
    # or a Hugging Face tokenizer: a local directory, or a name in the local cache.
    tokenizer: str = "auto"
    # hub: datasets.load_dataset(hub_name, hub_config, split=split, streaming=streaming).
    hub_name: str | None = None
    hub_config: str | None = None
    split: str = "train"
    streaming: bool = False
    # With streaming, how many documents to take.
    max_documents: int = 10000
    # synthetic: how many random windows.
    num_sequences: int = 4096
    # >0: each source reads only its first N windows (the start of its token store; held-out ones included): a
    # small slice, cycled epoch after epoch. The store is still built whole, once. 0: all of them.
    max_windows: int = 0
    # >0: step s trains on global batch s mod N, so the first N batches repeat (a function of the step alone: the
    # same on every rank and on resume). A model that cannot drive the loss on one batch towards 0 has a bug.
    overfit_batches: int = 0
    # Fraction of each source's windows held out for eval.
    eval_fraction: float = 0.05
    # Hugging Face datasets' cache (hub).
    cache_dir: str | None = None
    # Token stores; null: $FSDP_RESEARCH_CACHE/token_stores, by default ~/.cache/fsdp_research/token_stores. All
    # nodes of a job must see it.
    store_dir: str | None = None
    # Tokenization processes per rank when a store is built; 0: this rank's share of the node's cores.
    build_workers: int = 0
    # chat: each record's conversation ([{role, content}, ...]), rendered with the tokenizer's chat template (or the
    # Jinja file chat_template names); or prompt/completion pairs of text (both fields set: TRL's format).
    # prompts: each record's prompt_field (text, or messages rendered with the generation prompt), its other fields
    # kept beside it for the reward functions.
    messages_field: str = "messages"
    prompt_field: str | None = None
    completion_field: str | None = None
    chat_template: str | None = None
    # preference: each record's preferred and dispreferred completion (TRL's fields: text, or messages); the prompt
    # is prompt_field's, or without one (prompt_field null, or a record without it) their common start.
    chosen_field: str = "chosen"
    rejected_field: str = "rejected"
    # preference, unpaired (KTO's {prompt, completion, label}): a record holding label_field is an example, its label
    # true (desirable) or false. Each example's KL document is its prompt with the completion of the example before it
    # within chunks of kl_chunk records (TRL's KTOTrainer: its per_device_train_batch_size).
    label_field: str = "label"
    kl_chunk: int = 8
    # The targets: every assistant message (its end-of-turn token included, its role header not), the last one, or
    # every token.
    loss_on: LossOn = LossOn.assistant
    # A conversation longer than seq_len: dropped (counted in the log), cut to seq_len, or an error (a prompt: cut
    # to its last seq_len tokens, where its generation prompt is).
    truncation: Truncation = Truncation.drop
    # chat: whole conversations packed into each window (never split); false: one per window, padded.
    packing: bool = True
    # Each packed document attends to itself only, its positions from 0 (null: true for chat).
    document_masking: bool | None = None
    # Eval files in the training data's format, evaluated whole (every document once) instead of held-out windows.
    eval_paths: list[str] = field(default_factory=list)
    # Several eval sets, by name ({web: [paths], code: [paths]}): eval_loss/<name> each, eval_loss over all.
    eval_sources: dict[str, list[str]] = field(default_factory=dict)
