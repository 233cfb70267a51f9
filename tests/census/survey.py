"""For every decoder-only text family: does transformers itself build, save, load and run its tiny model, and what is
notable about it (MoE, router biases, fp32 modules, _no_split_modules, default dropout).

    python -m tests.census.survey [--out FILE] [--only TYPE ...]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

# One thread: the numbers are per family, and the machines this runs on are small.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests.census import families  # noqa: E402


def _cell(value, key: str = "") -> str:
    if key == "no_split_modules" and not value:
        return "EMPTY" if value is not None else "None"  # FSDP wrapping has nothing to go by
    if value in (None, [], {}, ()):
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, (list, tuple, set)):
        return ",".join(map(str, value))
    return str(value)


_COLUMNS = (
    ("moe", "moe"),
    ("router_bias", "router_bias"),
    ("keep_in_fp32", "fp32"),
    ("keep_in_fp32_strict", "fp32_strict"),
    ("no_split_modules", "no_split"),
    ("default_dropout", "dropout>0"),
    ("tied", "tied"),
    ("no_grad", "no_grad"),
    ("sdpa", "sdpa"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--only", nargs="*", help="these model types only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    lines = []

    def say(line=""):
        lines.append(line)
        print(line, flush=True)

    header = ["model_type", "class", "params", "attn", "seconds", "result", *(name for _, name in _COLUMNS)]
    say("\t".join(header))
    checks = []
    for model_type in args.only or families.FAMILIES:
        c = families.check(model_type)
        checks.append(c)
        row = [
            c.model_type,
            c.model_class or "-",
            str(c.parameters),
            c.attn_implementation or "-",
            f"{c.seconds:.2f}",
            "ok" if c.reason is None else f"FAIL {c.reason}",
            *(_cell(c.notes.get(key), key) for key, _ in _COLUMNS),
        ]
        say("\t".join(row))

    mapping = families.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    kinds = collections.Counter(reason.split(":")[0] for reason in families.EXCLUDED.values())
    failing = [c for c in checks if c.reason is not None]
    say()
    say(f"families in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: {len(mapping)}")
    say(f"excluded: {len(families.EXCLUDED)} ({', '.join(f'{k} {n}' for k, n in kinds.most_common())})")
    for kind, _ in kinds.most_common():
        say(f"  {kind}: {' '.join(t for t, r in families.EXCLUDED.items() if r.split(':')[0] == kind)}")
    say(f"decoder-only text: {len(families.FAMILIES)}")
    say(f"checked: {len(checks)}, in {sum(c.seconds for c in checks):.1f} s")
    say(f"built, saved, loaded and run by transformers: {len(checks) - len(failing)}")
    say(f"failing in transformers: {len(failing)}")
    for c in failing:
        say(f"  {c.model_type}: {c.reason}")

    def families_where(title, test):
        names = [c.model_type for c in checks if test(c.notes)]
        say(f"{title}: {len(names)}")
        say(f"  {' '.join(names)}")

    say()
    families_where("MoE", lambda n: n.get("moe"))
    families_where("router biases (e_score_correction_bias, expert_bias, router.bias)", lambda n: n.get("router_bias"))
    families_where("_keep_in_fp32_modules", lambda n: n.get("keep_in_fp32"))
    families_where("_keep_in_fp32_modules_strict", lambda n: n.get("keep_in_fp32_strict"))
    families_where(
        "empty _no_split_modules (None or [])", lambda n: "no_split_modules" in n and not n["no_split_modules"]
    )
    families_where("dropout > 0 by default", lambda n: n.get("default_dropout"))
    families_where("parameters without a gradient", lambda n: n.get("no_grad"))
    families_where("eager attention (sdpa not supported)", lambda n: "not supported" in n.get("sdpa", ""))
    say(f"transformers bugs the tiny configs step around: {len(families.WORKAROUNDS)}")
    for model_type, workaround in families.WORKAROUNDS.items():
        say(f"  {model_type}: {workaround}")
    if args.out:
        with open(args.out, "w") as out:
            out.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
