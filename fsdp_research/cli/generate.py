"""fsdp-research generate <export dir | run dir> --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N] [--adapter]:
a run's export continued by transformers' generate (greedy), in this process alone: the merged model, or with
--adapter (or where no merged model was written) the base with the LoRA adapter through PEFT. Prompts are tokenized
as the run's samples were (its export's prompts.json): a user's message in the chat template for conversations, as
the data tokenizes a pair's prompt for prompt/completion data, plain text otherwise (with the byte tokenizer: its
UTF-8 bytes); an export without the record (made elsewhere): the chat template where the tokenizer has one."""

import argparse
import json
import os
from collections.abc import Sequence

from fsdp_research.cli.common import fail
from fsdp_research.data.chat import PROMPTS, end_of_turn
from fsdp_research.data.tokenizer import Tokenizer, load_tokenizer, model_tokenizer
from fsdp_research.model.lora import ADAPTER_DIR


def _export_dir(path: str) -> str:
    """A run dir's export, or the export dir itself."""
    inside = os.path.join(path, "export")
    return inside if os.path.isdir(inside) else path


def _record(export: str) -> dict:
    """The export's prompts.json: how the run tokenized its prompts (fsdp_research.data.chat.prompt_rendering) and
    its data.tokenizer; {} for an export made elsewhere."""
    try:
        with open(os.path.join(export, PROMPTS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _load(export: str, adapter: bool, byte: bool):
    """(model, tokenizer) of an export: the merged weights, or the base with the adapter (PEFT); the byte tokenizer
    (fsdp_research.data.tokenizer's, which has no files to save) where the run trained with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = os.path.join(export, ADAPTER_DIR)
    merged = os.path.exists(os.path.join(export, "config.json"))
    if not merged and not os.path.isdir(adapter_dir):
        raise FileNotFoundError(f"{export} holds neither a model (config.json) nor a LoRA adapter ({ADAPTER_DIR}/)")
    if adapter or not merged:
        from peft import PeftModel

        with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
            base = json.load(f)["base_model_name_or_path"]
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)
        # The run's tokenizer, saved beside the adapter (an adapter made elsewhere: the base's).
        own = os.path.exists(os.path.join(adapter_dir, "tokenizer_config.json"))
        tokenizer_dir = adapter_dir if own else base
    else:
        model, tokenizer_dir = AutoModelForCausalLM.from_pretrained(export), export
    if byte:
        return model.eval(), load_tokenizer("byte")
    if model_tokenizer(tokenizer_dir) is None:  # transformers' own error says it in a cut-off line
        raise FileNotFoundError(
            f"{tokenizer_dir} holds no tokenizer and its {PROMPTS} names none; fix: save the run's tokenizer there, "
            "or export the run's checkpoint again (fsdp-research export), which names it"
        )
    return model.eval(), AutoTokenizer.from_pretrained(tokenizer_dir)


def _prompting(tokenizer, rendering: str | None):
    """(a prompt's ids, the ids generation stops at, a completion's text from its ids) as the run's samples have
    them: the end of the document, and of the assistant's turn for conversations."""
    if isinstance(tokenizer, Tokenizer):  # the byte tokenizer: a prompt's UTF-8 bytes
        return tokenizer.prompt_ids, [tokenizer.eos_id], tokenizer.decode
    rendering = rendering or ("chat" if tokenizer.chat_template else "text")

    def encode(prompt: str) -> list[int]:
        if rendering == "chat":
            messages = [{"role": "user", "content": prompt}]
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(prompt, add_special_tokens=rendering == "pair")["input_ids"]

    stop = [tokenizer.eos_token_id, *([end_of_turn(tokenizer)] if rendering == "chat" else [])]
    return encode, [i for i in stop if i is not None], lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research generate", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("path", help="a run's export dir, or its run dir")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for several")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--adapter", action="store_true", help="the base with the LoRA adapter, not the merged model")
    args = parser.parse_intermixed_args(argv)
    import torch

    export = _export_dir(args.path)
    record = _record(export)
    try:
        model, tokenizer = _load(export, args.adapter, record.get("tokenizer") == "byte")
    except (OSError, ValueError, KeyError) as err:
        return fail(f"{args.path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
    encode, stop, decode = _prompting(tokenizer, record.get("rendering"))
    for prompt in args.prompt:
        ids = torch.tensor([encode(prompt)])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stop or None
            )
        print(f"{prompt} -> {decode(out[0, ids.shape[1] :].tolist())}")
    return 0
