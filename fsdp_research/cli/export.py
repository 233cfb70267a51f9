"""fsdp-research export <checkpoint | run dir> <out dir> [--dtype D] [--shard-size S]: a resume checkpoint (a run
dir: its newest complete one) as a Hugging Face directory, in this process alone (no GPU), as the run's end exports
it; a LoRA run's (its adapters alone): the adapter in PEFT's format and the merged model, on its base."""

import argparse
import os
from collections.abc import Sequence

from omegaconf import OmegaConf

from fsdp_research.checkpoint.hf_export import (
    export_adapted,
    export_dtype,
    load_checkpoint_weights,
    write_hf_dir,
    write_prompting,
    write_state_dir,
)
from fsdp_research.checkpoint.resume import checkpoints_in, is_step_dir, verify
from fsdp_research.cli.common import fail
from fsdp_research.config.sizes import export_shard_size
from fsdp_research.errors import CheckpointError, ConfigError


def _step_dir(path: str) -> str:
    """A checkpoint as given, or a run dir's newest complete one (where none is complete, its newest, of which
    verify says what is wrong)."""
    if is_step_dir(path):
        return path
    found = [d for _, d in checkpoints_in(os.path.join(path, "checkpoints"))]
    return next((d for d in found if verify(d) is None), found[0] if found else path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research export", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("step_dir", help="a checkpoint (checkpoints/step_<N>), or a run dir")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16 or float16 (default: the run's checkpoint.export_dtype, else its training dtype)",
    )
    parser.add_argument("--shard-size", default="5GB")
    args = parser.parse_intermixed_args(argv)
    from transformers import AutoConfig

    step_dir = _step_dir(args.step_dir)
    problem = verify(step_dir)
    if problem:
        return fail(f"{step_dir}: {problem}")
    train_cfg = OmegaConf.load(os.path.join(step_dir, "train_config.yaml"))
    if args.dtype:
        train_cfg.checkpoint.export_dtype = args.dtype
    train_cfg.checkpoint.export_shard_size = args.shard_size
    try:
        dtype, shard_size = export_dtype(train_cfg), export_shard_size(args.shard_size)
    except ConfigError as err:
        return fail(err)
    own_model = not os.path.exists(os.path.join(step_dir, "config.json"))  # model._target_: its state_dict
    hf_config = None if own_model else AutoConfig.from_pretrained(step_dir)
    if train_cfg.model.get("lora", {}).get("r") is not None:
        try:
            export_adapted(step_dir, train_cfg, hf_config, args.out_dir)
        except (ConfigError, CheckpointError) as err:
            return fail(err)
    else:
        weights = load_checkpoint_weights(step_dir)
        if own_model:
            write_state_dir(weights, args.out_dir, dtype, shard_size, train_cfg.data.tokenizer)
        else:
            write_hf_dir(weights, hf_config, args.out_dir, dtype, shard_size, train_cfg.data.tokenizer)
        write_prompting(train_cfg, args.out_dir)
    print(f"wrote {args.out_dir}")
    return 0
