"""fsdp-research export <step dir> <out dir> [--dtype D] [--shard-size S]: a resume checkpoint as a Hugging Face
directory, in this process alone (no process group, no GPU)."""

import argparse
import os
from collections.abc import Sequence

from omegaconf import OmegaConf

from fsdp_research.checkpoint.dcp import verify
from fsdp_research.checkpoint.hf_export import export_dtype, load_checkpoint_weights, write_hf_dir, write_state_dir
from fsdp_research.cli.common import fail
from fsdp_research.config.sizes import export_shard_size
from fsdp_research.errors import ConfigError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-research export", description=__doc__.split(":", 1)[1].strip())
    parser.add_argument("step_dir")
    parser.add_argument("out_dir")
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16 or float16 (default: the run's checkpoint.export_dtype, else its training dtype)",
    )
    parser.add_argument("--shard-size", default="5GB")
    args = parser.parse_intermixed_args(argv)
    from transformers import AutoConfig

    problem = verify(args.step_dir)
    if problem:
        return fail(f"{args.step_dir}: {problem}")
    train_cfg = OmegaConf.load(os.path.join(args.step_dir, "train_config.yaml"))
    if args.dtype:
        train_cfg.checkpoint.export_dtype = args.dtype
    try:
        dtype, shard_size = export_dtype(train_cfg), export_shard_size(args.shard_size)
    except ConfigError as err:
        return fail(err)
    if train_cfg.model.get("lora", {}).get("r") is not None:
        return fail(
            f"{args.step_dir}: a LoRA run's checkpoint holds its adapters only, not a model; its export (the adapter "
            "and the merged model) is written at the end of the run"
        )
    weights = load_checkpoint_weights(args.step_dir)
    if os.path.exists(os.path.join(args.step_dir, "config.json")):
        write_hf_dir(
            weights,
            AutoConfig.from_pretrained(args.step_dir),
            args.out_dir,
            dtype,
            shard_size,
            train_cfg.data.tokenizer,
        )
    else:  # a model of one's own (model._target_): its state_dict
        write_state_dir(weights, args.out_dir, dtype, shard_size, train_cfg.data.tokenizer)
    print(f"wrote {args.out_dir}")
    return 0
