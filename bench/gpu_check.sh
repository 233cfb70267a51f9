#!/usr/bin/env bash
# Every GPU check in one run of under 8 minutes on one GPU (a lent device has 15 minutes a session, all tries
# together): the CUDA tests (1-GPU run against the CPU reference, bf16 MFU and the planner's peak against
# torch.cuda.max_memory_allocated, cpu_offload, compile), the trainer's overhead against a bare fully_shard loop
# (eager and compiled), our trainer against Accelerate's FSDP2, Muon's step against AdamW's, and llama_1b's MFU in
# bf16, and tp=2 against tp=1, ep=2 against ep=1, cp=2 against cp=1 and pp=2 against pp=1 where there are 2 GPUs. Each step has its own time limit (under 8 minutes in all, set-up included; the CUDA tests' limit leaves
# room for Inductor's cold compile); a failed step does not stop the others. Figures go to stdout and
# $OUT/gpu_check.log (OUT: the device tool's folder, else outputs/gpu_check).
# It sets up its own environment, assuming no .venv: a venv over the machine's python3 (which holds CUDA torch and
# transformers), with what is missing there from the wheels in .whl/ (bench/gpu_wheels.sh fetches them here; the
# device tool carries them: carry [".whl"]), and this package from the working tree (PYTHONPATH).
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

VENV="${GPU_CHECK_VENV:-/tmp/gpu_check_venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "== set-up: $VENV ($(date -Is))"
    python3 -m venv --system-site-packages "$VENV" || exit 1
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$VENV/bin/python" -m pip install -q --no-index --no-deps --no-cache-dir .whl/*.whl || exit 1
    fi
fi
PY="$VENV/bin/python"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this package, from the working tree (no build needed)

step() {  # step <seconds> <title> <command...>
    local limit="$1" title="$2"; shift 2
    echo "== $title ($(date -Is))"
    timeout "$limit" "$@"
    echo "== $title: exit $?"
}

step 20 "device" "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step 210 "CUDA tests" "$PY" -m pytest -x -q tests/test_gpu.py tests/metrics/test_flops.py
step 70 "overhead, llama_1b bf16" "$PY" bench/overhead.py --nproc 1 --steps 30 --repeats 1 \
    model=llama_1b precision=bf16 data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=8
step 50 "against Accelerate's FSDP2 (needs accelerate installed)" "$PY" bench/peers.py --nproc 1 --steps 30 \
    --repeats 1 model=llama_1b precision=bf16 data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=8
step 40 "Muon's optimizer step against AdamW's" "$PY" bench/optimizers.py --nproc 1 --steps 5 --repeats 2
step 60 "MFU, llama_1b bf16" "$PY" train.py model=llama_1b precision=bf16 data=synthetic data.seq_len=2048 \
    trainer.global_batch_size=8 trainer.micro_batch_size=8 trainer.max_steps=30 trainer.eval_interval=0 \
    checkpoint.interval=0 checkpoint.export=false logger=none hydra.run.dir="$OUT/mfu"
"$PY" - "$OUT/mfu" <<'PY'
import sys
from fsdp_research.metrics.sinks import step_metrics
for m in step_metrics(sys.argv[1])[-2:]:
    print({k: m.get(k) for k in ("step", "tokens_per_s", "mfu", "peak_mem_allocated_gib", "peak_mem_reserved_gib")})
PY
# An axis at 2 against 1 on 2 GPUs (NCCL refuses two ranks of a tp, ep, cp or pp group on one device), bf16, 20
# steps: pair <axis> <what> <overrides...>; the losses must agree.
pair() {
    local axis=$1 what=$2
    shift 2
    for n in 1 2; do
        step 60 "$what, $axis=$n on 2 GPUs" "$PY" train.py "$@" precision=bf16 data=synthetic trainer.max_steps=20 \
            trainer.eval_interval=0 trainer.log_interval=5 checkpoint.save=false checkpoint.export=false logger=none \
            distributed.nproc_per_node=2 "parallel.$axis=$n" hydra.run.dir="$OUT/$axis$n"
    done
}
if [[ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]]; then
    pair tp "tensor parallel" model=llama_mid data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=4
    # Expert parallel (NCCL's all-to-all): an MoE of qwen3_moe's shapes.
    pair ep "expert parallel" model=custom model.model_type=qwen3_moe model.config.hidden_size=512 \
        model.config.intermediate_size=1024 model.config.moe_intermediate_size=512 model.config.num_experts=8 \
        model.config.num_experts_per_tok=2 model.config.num_hidden_layers=4 model.config.num_attention_heads=8 \
        model.config.num_key_value_heads=8 model.config.vocab_size=8192 data.seq_len=1024 \
        trainer.global_batch_size=8 trainer.micro_batch_size=4
    # Context parallel (NCCL's all-to-all over heads): llama_mid at 8k tokens against dp_shard=2, the peaks.
    pair cp "context parallel" model=llama_mid model.config.max_position_embeddings=8192 data.seq_len=8192 \
        trainer.global_batch_size=2 trainer.micro_batch_size=1
    # Pipeline parallel (NCCL's send/recv between stages): llama_mid by 1F1B against dp_shard 2.
    pair pp "pipeline parallel" model=llama_mid data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=2
else
    echo "== tensor, expert, context and pipeline parallel: skipped (one GPU; each needs two)"
fi
"$PY" -m fsdp_research plan model=llama_1b precision=bf16 data.seq_len=2048 trainer.global_batch_size=8 \
    trainer.micro_batch_size=8 world_size=1 --device cuda | grep -E "peak|gathered"
