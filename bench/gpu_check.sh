#!/usr/bin/env bash
# Every GPU check in one run of under 8 minutes on one GPU (a lent device has 15 minutes a session, all tries
# together): the CUDA tests (1-GPU run against the CPU reference, bf16 MFU and the planner's peak against
# torch.cuda.max_memory_allocated, cpu_offload, compile), the trainer's overhead against a bare fully_shard loop
# (eager and compiled), our trainer against Accelerate's FSDP2, Muon's step against AdamW's, and llama_1b's MFU in
# bf16. Each step has its own time limit (under 8 minutes in all); a failed step does not stop the others. Figures
# go to stdout and $OUT/gpu_check.log (OUT: the device tool's folder, else outputs/gpu_check).
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; fi
OUT="${OUT:-outputs/gpu_check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

step() {  # step <seconds> <title> <command...>
    local limit="$1" title="$2"; shift 2
    echo "== $title ($(date -Is))"
    timeout "$limit" "$@"
    echo "== $title: exit $?"
}

step 20 "device" "$PY" -c "import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
step 120 "CUDA tests" "$PY" -m pytest -x -q tests/test_gpu.py tests/test_flops.py
step 100 "overhead, llama_1b bf16" "$PY" bench/overhead.py --nproc 1 --steps 30 --repeats 1 \
    model=llama_1b precision=bf16 data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=8
step 90 "against Accelerate's FSDP2 (needs accelerate installed)" "$PY" bench/peers.py --nproc 1 --steps 30 \
    --repeats 1 model=llama_1b precision=bf16 data.seq_len=1024 trainer.global_batch_size=8 trainer.micro_batch_size=8
step 60 "Muon's optimizer step against AdamW's" "$PY" bench/optimizers.py --nproc 1 --steps 5 --repeats 2
step 80 "MFU, llama_1b bf16" "$PY" train.py model=llama_1b precision=bf16 data=synthetic data.seq_len=2048 \
    trainer.global_batch_size=8 trainer.micro_batch_size=8 trainer.max_steps=30 trainer.eval_interval=0 \
    checkpoint.interval=0 checkpoint.export=false logger=none hydra.run.dir="$OUT/mfu"
"$PY" - "$OUT/mfu" <<'PY'
import sys
from fsdp_research.sinks import step_metrics
for m in step_metrics(sys.argv[1])[-2:]:
    print({k: m.get(k) for k in ("step", "tokens_per_s", "mfu", "peak_mem_allocated_gib", "peak_mem_reserved_gib")})
PY
"$PY" -m fsdp_research plan model=llama_1b precision=bf16 data.seq_len=2048 trainer.global_batch_size=8 \
    trainer.micro_batch_size=8 world_size=1 --device cuda | grep -E "peak|gathered"
