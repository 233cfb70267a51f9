"""Deliberate breaks: each entry plants one small, plausible bug in the package and runs the few tests meant to catch
it; the bug must make them fail.

Why: the suite is to run in 25 minutes and keep every proof. Its tests get merged, narrowed and moved to make that
time, and a test that still passes may no longer prove what it was written for. Each break here names the behaviour
(a gradient's divide factor, a loss mask, an exit code, ...) by the code that implements it and by the tests that
must notice when it goes wrong. The code is found by its definition's name, parsed with `ast` from every module of
fsdp_research/ and train.py, not by file path, so a break keeps working when the code moves between modules; a name
found nowhere or twice is refused, as is a snippet that is not in that definition exactly once.

    python scripts/breaks.py                    every break
    python scripts/breaks.py --only NAME,NAME   some of them
    python scripts/breaks.py --list             where each symbol is now; no test runs
    python scripts/breaks.py --root DIR         against another checkout (its files edited, its tests run)
    python scripts/breaks.py --check-baseline   first run each break's targets on the untouched code: they must pass

A break is caught when pytest exits 1 (tests failed), missed when it exits 0; any other exit (2 interrupted or a
usage error, 4, 5 no tests collected), a replacement that does not parse or a timeout is an error of the break's
setup. The edited file is always restored, also on Ctrl-C and SIGTERM. Exits 0 only if every break was caught.
Standard library only."""

from __future__ import annotations

import argparse
import ast
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What a whole-package break searches: the package and the Hydra entry point.
PACKAGE, ENTRY = "fsdp_research", "train.py"
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]


@dataclass(frozen=True)
class Break:
    name: str
    # A definition's qualified name: `func`, `Class.method`, `outer.inner`.
    symbol: str
    # Exactly once in the definition's source; replaced by `new`.
    old: str
    new: str
    # pytest node ids or paths, each optionally followed by `-k EXPR` (one -k per break: pytest takes the last).
    targets: tuple[str, ...]


BREAKS: list[Break] = [
    Break(
        "ep_grad_divide",
        "apply_fsdp",
        "modules[0].set_gradient_divide_factor(float(mesh.size()))",
        "modules[0].set_gradient_divide_factor(float(experts.size()))",
        # ep=2 on 2 ranks: the experts' own group is 1 rank, so their gradients come out twice too large; AdamW would
        # hide that from the weights, the logged gradient norms do not.
        (
            "tests/distributed/test_expert_parallel.py::"
            "test_losses_and_export_match_the_single_process_reference[qwen3_moe-ep2-2]",
        ),
    ),
    Break(
        "chat_loss_mask",
        "_char_targets",
        "targets += [k % 2 == 1] * len(piece)",
        "targets += [k % 2 == 0] * len(piece)",
        ("tests/data/test_chat.py::test_targets_are_transformers_assistant_masks",),
    ),
    Break(
        "reshard_last_block",
        "_block_reshard_flags",
        "[True] * (n_blocks - 1) + [False]",
        "[False] + [True] * (n_blocks - 1)",
        ("tests/distributed/test_sharding_plan.py::test_plan_of_each_strategy",),
    ),
    Break(
        "reshard_applied",
        "apply_fsdp",
        "reshard_after_forward=unit.reshard_after_forward,",
        "reshard_after_forward=True,",
        # The plan stays right; only what stays gathered after a forward on real ranks shows the units ignore it.
        ("tests/distributed/test_sharding_plan.py::test_applied_plan_matches",),
    ),
    Break(
        "packed_loss_weight",
        "step_weight",
        "lay.world_size // (lay.tp * lay.pp) * micro_steps / total.clamp(min=1)",
        "lay.world_size // (lay.tp * lay.pp) / total.clamp(min=1)",
        ("tests/train/test_sft.py::test_the_first_step_is_transformers_mean_over_the_steps_targets",),
    ),
    Break(
        "lora_merge_scale",
        "merged",
        "(b.float() @ a.float()) * layer.scaling[ADAPTER]",
        "(b.float() @ a.float()) / layer.scaling[ADAPTER]",
        ("tests/model/test_lora.py::test_lora_trains_as_peft_and_torch_adamw_at_any_world_size",),
    ),
    Break(
        "cp_chunk_order",
        "chunk_order",
        "for c in (r, 2 * cp - 1 - r)",
        "for c in (2 * cp - 1 - r, r)",
        ("tests/distributed/test_context_parallel.py::test_split_attention_equals_whole_sequence_attention",),
    ),
    Break(
        "data_resume_position",
        "Prefetcher._run",
        "batch = self.fetch(step)",
        "batch = self.fetch(step - first)",
        # A resume reads the first steps' batches again; runs that start at step 0 are unchanged.
        ("tests/distributed/test_expert_parallel.py::test_an_ep_checkpoint_resumes_at_ep_1",),
    ),
    Break(
        "planner_optimizer_bytes",
        "_fsdp_moments",
        "optimizer=int(m.optimizer_copies * grad_shards)",
        "optimizer=int(m.optimizer_copies * grad_shards / n)",
        ("tests/planner/test_plan.py::test_llama_7b_on_8_ranks",),
    ),
    Break(
        "bad_input_exit_code",
        "launch",
        "sys.exit(2)",
        "sys.exit(1)",
        # A tokenizer that is not the pretrained model's: refused inside the run, exit 2 from launch().
        ("tests/data/test_tokenizer.py::test_a_pretrained_model_trains_and_exports_with_its_own_tokenizer",),
    ),
    Break(
        "held_signals",
        "HeldAfter.__exit__",
        "self._before = {num: signal.signal(num, self._hold) for num in FORWARDED}",
        "self._before = {}",
        # A SIGTERM as rank 0 records a failed run: its default action leaves status.json `running`.
        ("tests/train/test_faults.py::test_a_sigterm_as_a_failed_run_is_recorded_ends_it_after_the_record",),
    ),
    Break(
        "muon_lr_adjust",
        "adjusted_lr",
        "math.sqrt(max(1, rows / cols))",
        "math.sqrt(max(1, cols / rows))",
        ("tests/optim/test_muon.py::test_unsharded_steps_are_torch_muons_bitwise",),
    ),
    Break(
        "lr_warmup",
        "multiplier",
        "return (step + 1) / warmup",
        "return step / warmup",
        ("tests/optim/test_schedules.py::test_schedule_shapes",),
    ),
    Break(
        "grad_clip",
        "clip_",
        "max=1.0",
        "min=1.0",
        ("tests/distributed/test_precision.py::test_gpt2_keeps_tied_embeddings_and_matches_plain_pytorch",),
    ),
    Break(
        "tied_head_flops",
        "matmul_parameters",
        "if id(p) not in kept",
        "if id(p) in kept",
        # (The re-tie after materialize is no break here: FSDP2's to_empty keeps shared parameters shared; only
        # sharding=ddp_classic unties them, and no test trains a tied model under it.)
        ("tests/metrics/test_flops.py::test_embedding_lookups_are_not_matmuls",),
    ),
    Break(
        "pp_tied_gradient",
        "Pipeline.run",
        "dist.all_reduce(self.shared.grad.to_local(), group=self.ends)",
        "pass",
        ("tests/distributed/test_pipeline.py::test_tied_embeddings_are_one_weight_across_the_end_stages",),
    ),
    Break(
        "pp_step_stats",
        "Pipeline.run",
        "self._stats = self._stats[-self.micro_steps :]",
        "pass",
        ("tests/distributed/test_pipeline.py::test_a_step_s_stats_are_its_micro_batches_as_at_1_rank",),
    ),
    Break(
        "zb_deferred_reduction",
        "Pipeline.run",
        "with deferred_reduction(self._model) if self.zero_bubble else contextlib.nullcontext():",
        "with contextlib.nullcontext():",
        ("tests/distributed/test_pipeline.py::test_tied_embeddings_are_one_weight_across_the_end_stages",),
    ),
    Break(
        "zb_fp32_accumulation",
        "WeightPassStage.backward_weight_one_chunk",
        "for param in self.params:",
        "for param in []:",
        ("tests/distributed/test_pipeline.py::test_the_weight_pass_sums_bf16_gradients_in_fp32",),
    ),
    Break(
        "pp_norm_over_stages",
        "reduce_squares",
        'dist.all_reduce(whole, group=root.get_group("pp"))',
        "pass",
        ("tests/distributed/test_pipeline.py::test_losses_norms_and_weights_match_the_single_process_reference",),
    ),
    Break(
        "grpo_clip_high",
        "PolicyLoss.upper",
        "return self.epsilon if self.epsilon_high is None else self.epsilon_high",
        "return self.epsilon",
        # DAPO's clip-higher ignored: the ratios between 1.2 and 1.28 with a positive advantage are clipped.
        ("tests/train/test_grpo.py::test_each_loss_is_trl_s_and_so_are_its_gradients",),
    ),
    Break(
        "grpo_old_logps",
        "GRPO.loss",
        'old = self.step["old"][rows] if self.iterations > 1 else logps.detach()',
        "old = logps.detach()",
        # num_iterations 2: the second step's ratio against the policy as it is, not as it sampled: 1, never clipped.
        ("tests/train/test_grpo_runs.py::test_num_iterations_trains_each_rollout_again_and_resumes_within_one",),
    ),
    Break(
        "grpo_kept_rollouts",
        "GRPO.state_dict",
        "self._gathered(v.long() if v.dtype == torch.bool else v)",
        "torch.cat([v.long() if v.dtype == torch.bool else v] * self.ranks)",
        # Each rank's rollouts kept as if every rank's (DCP writes rank 0's): a resume trains on rank 0's twice.
        ("tests/train/test_grpo_runs.py::test_num_iterations_trains_each_rollout_again_and_resumes_within_one",),
    ),
    Break(
        "grpo_rank_keys",
        "GRPO._step_keys",
        "first = self.rank * (completions // self.group)",
        "first = 0",
        # Rollout keys by the rank's own prompt positions: rank 1 samples with rank 0's noise, unlike one process.
        ("tests/train/test_grpo_runs.py::test_the_reward_rises_and_tp_x_dp_ranks_and_a_resume_log_one_rank_s",),
    ),
    Break(
        "planner_grpo_sequence",
        "GRPO.planned_sequence",
        "return seq_len + max_completion_length, max_completion_length + 1, 2",
        "return seq_len, seq_len, 0",
        # The update planned over the prompts alone: its activations a third of the tracker's.
        ("tests/planner/test_grpo_plan.py::test_generation_and_update_within_10_percent_of_the_tracker",),
    ),
    Break(
        "planner_kv_cache",
        "generation_moments",
        "per_position = 2 * m.n_blocks",
        "per_position = m.n_blocks",
        # Keys or values, not both: half of what transformers' cache holds.
        ("tests/planner/test_grpo_plan.py::test_kv_cache_is_transformers_dynamic_cache",),
    ),
    Break(
        "grpo_eval_keys",
        "GRPO.evaluate",
        "(t.seed, _EVAL, d, k % group)",
        "(t.seed, _EVAL, k, 0)",
        # The eval's noise by a completion's place in the rank's batch: another world size, other completions.
        ("tests/train/test_grpo_runs.py::test_the_reward_rises_and_tp_x_dp_ranks_and_a_resume_log_one_rank_s",),
    ),
    Break(
        "grpo_tp_rewards",
        "one_per_data_rank",
        "return parts[::tp]",
        "return parts",
        # Under tp every rank's rewards gathered, a tp group's twice: a data-parallel rank's advantages are another's.
        ("tests/train/test_grpo_runs.py::test_the_reward_rises_and_tp_x_dp_ranks_and_a_resume_log_one_rank_s",),
    ),
    Break(
        "rollout_positions",
        "generate",
        "positions[:, -1:] + 1",
        "positions[:, -1:]",
        # Each decoded token at its predecessor's position: the cached batch no longer the model fed alone.
        ("tests/train/test_rollouts.py::test_each_prompt_gets_what_the_model_gives_it_alone_and_its_logps",),
    ),
    Break(
        "prompt_record_offset",
        "TokenStore.record",
        "int(self._record_ends[document]), int(self._record_ends[document + 1])",
        "int(self._record_ends[document + 1]), int(self._record_ends[document + 2])",
        # Each prompt given the next one's record (its answer, its tests).
        ("tests/data/test_prompts.py::test_prompts_are_trl_s_tokens_and_their_records_the_rows",),
    ),
    Break(
        "planner_pp_receives",
        "_receives",
        "(s > 0 and s - 1 not in held)",
        "(s > 0)",
        # A V's middle stages sending each other their hidden states over the pp group's links.
        ("tests/planner/test_plan.py::test_pipeline_ranks_receive_what_torchs_schedules_send_them",),
    ),
]


@dataclass(frozen=True)
class Site:
    """Where a break's snippet is: the file, its definition's first line, the snippet's offset in the file text."""

    path: Path
    line: int
    offset: int


class Refused(Exception):
    """A break that cannot be applied as written (its symbol or snippet is not found exactly once)."""


def sources(root: Path) -> list[Path]:
    files = sorted(p for p in (root / PACKAGE).rglob("*.py") if "__pycache__" not in p.parts)
    return files + [root / ENTRY] if (root / ENTRY).exists() else files


def definitions(tree: ast.Module) -> list[tuple[str, ast.AST]]:
    """(qualified name, node) of every function and class, nested ones as `outer.inner`."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def line_offsets(text: str) -> list[int]:
    # ast counts lines by "\n" alone (str.splitlines also splits on form feeds and other separators).
    return [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]


def parsed(root: Path) -> list[tuple[Path, str, list[tuple[str, ast.AST]]]]:
    """(path, text, its definitions) of every module a break may edit, as they are now."""
    found = []
    for path in sources(root):
        text = path.read_text()
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as err:
            print(f"warning: {path.relative_to(root)} does not parse ({err.msg}, line {err.lineno})", file=sys.stderr)
            continue
        found.append((path, text, definitions(tree)))
    return found


def locate(b: Break, root: Path, modules: list | None = None) -> Site:
    """The one place b's snippet is: inside the one definition named b.symbol, in `modules` (parsed(root)'s; read
    afresh when None: a break run edits and restores files). Raises Refused."""
    modules = parsed(root) if modules is None else modules
    matches = [(path, text, node) for path, text, defs in modules for name, node in defs if name == b.symbol]
    if len(matches) != 1:
        where = ", ".join(f"{p.relative_to(root)}:{n.lineno}" for p, _, n in matches)
        found = f"found {len(matches)} times ({where})" if matches else "found nowhere"
        raise Refused(f"symbol {b.symbol!r} {found} in {PACKAGE}/ and {ENTRY}")
    path, text, node = matches[0]
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    offsets = line_offsets(text)
    start, end = offsets[first - 1], offsets[node.end_lineno] if node.end_lineno < len(offsets) else len(text)
    count = text.count(b.old, start, end)
    if count != 1:
        raise Refused(f"{b.old!r} occurs {count} times in {b.symbol} ({path.relative_to(root)}:{node.lineno})")
    return Site(path, node.lineno, text.index(b.old, start, end))


def pytest_args(targets: tuple[str, ...]) -> list[str]:
    return [arg for target in targets for arg in shlex.split(target)]


def _interrupt(signum, frame) -> None:
    # SIGTERM as Ctrl-C: unwinds through the finally that restores the file.
    raise KeyboardInterrupt


def run_pytest(root: Path, targets: tuple[str, ...], timeout: float) -> tuple[int | None, str]:
    """(pytest's exit code, None on timeout; its output), run in root with root first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    # Output to a file, not a pipe: a process the tests leave behind cannot hold the read open. Its own session, so
    # that a timeout or Ctrl-C ends every process the tests started.
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(
            [sys.executable, *PYTEST, *pytest_args(targets)],
            cwd=root,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        code = None
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            if code is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        out.seek(0)
        return code, out.read().decode(errors="replace")


def restore(path: Path, original: str, mutated: str, b: Break, offset: int, mtime_ns: int) -> None:
    current = path.read_text()
    if current == mutated:
        path.write_text(original)
        os.utime(path, ns=(time.time_ns(), mtime_ns))
    elif current[offset : offset + len(b.new)] == b.new:
        # Someone else edited the file meanwhile: undo the break alone, keep their edit.
        path.write_text(current[:offset] + b.old + current[offset + len(b.new) :])
        print(f"warning: {path} changed during break {b.name}; only the break was undone", file=sys.stderr)
    elif current != original:
        print(
            f"WARNING: {path} changed during break {b.name}: put back {b.old!r} for {b.new!r} by hand", file=sys.stderr
        )


def apply_and_test(b: Break, root: Path, site: Site, timeout: float) -> tuple[int | None, str]:
    original = site.path.read_text()
    mutated = original[: site.offset] + b.new + original[site.offset + len(b.old) :]
    try:
        ast.parse(mutated)
    except SyntaxError as err:
        return 2, f"the replacement does not parse: {err.msg}, line {err.lineno}"
    stat = site.path.stat()
    try:
        site.path.write_text(mutated)
        # A .pyc serves any source of its mtime (in whole seconds) and size: the mutation must not share both.
        if site.path.stat().st_mtime_ns // 10**9 == stat.st_mtime_ns // 10**9:
            os.utime(site.path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
        return run_pytest(root, b.targets, timeout)
    finally:
        restore(site.path, original, mutated, b, site.offset, stat.st_mtime_ns)


def report(status: str, b: Break, rel: str, seconds: float, output: str = "") -> None:
    print(f"{status:<6}  {b.name}  {b.symbol} in {rel}  {seconds:.0f}s  ({' '.join(b.targets)})", flush=True)
    if output:
        tail = output.strip().splitlines()[-25:]
        print("\n".join(f"    {line}" for line in tail), flush=True)


def list_breaks(breaks: list[Break], root: Path) -> int:
    bad, modules = 0, parsed(root)  # nothing is edited while listing: parsed once
    for b in breaks:
        try:
            site = locate(b, root, modules)
            print(f"{b.name}  {b.symbol}  {site.path.relative_to(root)}:{site.line}  ({' '.join(b.targets)})")
        except Refused as err:
            bad += 1
            print(f"{b.name}  REFUSED: {err}")
    return 1 if bad else 0


def check_baseline(breaks: list[Break], root: Path, timeout: float) -> list[str]:
    """The names of the breaks whose targets do not pass on the untouched code (their proof would prove nothing)."""
    failing = []
    for targets in dict.fromkeys(b.targets for b in breaks):
        started = time.monotonic()
        code, output = run_pytest(root, targets, timeout)
        names = [b.name for b in breaks if b.targets == targets]
        status = "passes" if code == 0 else "FAILS"
        print(f"{status:<6}  untouched  {time.monotonic() - started:.0f}s  ({' '.join(targets)})", flush=True)
        if code != 0:
            print("\n".join(f"    {line}" for line in output.strip().splitlines()[-25:]), flush=True)
            failing += names
    return failing


def run_break(b: Break, root: Path, timeout: float, failing: bool) -> str:
    """Apply b, run its targets, restore; print its line. Returns its count's key: caught, missed or errors."""
    started = time.monotonic()
    if failing:
        report("ERROR", b, "-", 0.0, "its targets fail on the untouched code")
        return "errors"
    try:
        site = locate(b, root)
    except Refused as err:
        report("ERROR", b, "-", 0.0, str(err))
        return "errors"
    code, output = apply_and_test(b, root, site, timeout)
    rel, seconds = str(site.path.relative_to(root)), time.monotonic() - started
    if code == 1:
        report("caught", b, rel, seconds)
        return "caught"
    if code == 0:
        report("MISSED", b, rel, seconds, output)
        return "missed"
    why = f"pytest exit {code}" if code is not None else f"timed out after {timeout:.0f}s"
    report("ERROR", b, rel, seconds, f"{output}\n{why}")
    return "errors"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated break names")
    parser.add_argument("--list", action="store_true", help="where each break's symbol is now; no test runs")
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to break and test (default: this one)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per break's pytest (default 1800)")
    parser.add_argument("--check-baseline", action="store_true", help="first run the targets on the untouched code")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if not (root / PACKAGE).is_dir():
        parser.error(f"{root} holds no {PACKAGE}/")
    names = [b.name for b in BREAKS]
    assert len(set(names)) == len(names), "break names must be unique"
    assert all(pytest_args(b.targets).count("-k") <= 1 for b in BREAKS), "one -k per break: pytest takes the last"
    breaks = BREAKS
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"no break named {', '.join(unknown)} (the breaks: {', '.join(names)})")
        breaks = [b for b in BREAKS if b.name in wanted]
    if args.list:
        return list_breaks(breaks, root)

    signal.signal(signal.SIGTERM, _interrupt)
    counts = {"caught": 0, "missed": 0, "errors": 0}
    try:
        failing = check_baseline(breaks, root, args.timeout) if args.check_baseline else []
        for b in breaks:
            counts[run_break(b, root, args.timeout, b.name in failing)] += 1
    except KeyboardInterrupt:
        print("interrupted (the edited file is restored)", file=sys.stderr)
        return 130
    finally:
        print(f"{counts['caught']} caught, {counts['missed']} missed, {counts['errors']} errors")
    return 0 if counts["caught"] == len(breaks) else 1


if __name__ == "__main__":
    sys.exit(main())
