# Sourced by train.sbatch and array.sbatch inside a batch job: the steps both share.
#   FSDP_RESEARCH_ROOT  the repository (default: the submission dir); train.py and .venv are found there
#   FSDP_RUN_DIR        the run dir (set by the caller; resubmit.sh fixes it so the run resumes)
#   PYTHON              the interpreter (default: <repository>/.venv/bin/python if present, else python)
set -euo pipefail

REPO="${FSDP_RESEARCH_ROOT:-$SLURM_SUBMIT_DIR}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; fi
fi

# All output of this job, requeued incarnations appended, goes to <run dir>/slurm.out (SLURM cannot create
# the run dir for its own --output file, so the script redirects itself).
log_to_run_dir() {
    mkdir -p "$FSDP_RUN_DIR"
    exec >>"$FSDP_RUN_DIR/slurm.out" 2>&1
    echo "== job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST} at $(date -Is)"
}

# keep_for_resubmit <script name> <args...>: copies this job's script into the run dir with resubmit.sh, which
# submits it again with the same arguments and resources into the same run dir (so it resumes there).
keep_for_resubmit() {
    local name="$1"; shift
    cp "$0" "$FSDP_RUN_DIR/$name"
    local run_dir flags
    run_dir="$(cd "$FSDP_RUN_DIR" && pwd)"
    flags=(--job-name="$SLURM_JOB_NAME" --partition="$SLURM_JOB_PARTITION" --nodes="$SLURM_JOB_NUM_NODES"
           --ntasks-per-node="$((SLURM_NTASKS / SLURM_JOB_NUM_NODES))" --time="$(squeue -h -j "$SLURM_JOB_ID" -o %l)")
    if [[ -n "${SLURM_JOB_ACCOUNT:-}" ]]; then flags+=(--account="$SLURM_JOB_ACCOUNT"); fi
    if [[ -n "${SLURM_GPUS_PER_NODE:-}" ]]; then flags+=(--gpus-per-node="$SLURM_GPUS_PER_NODE"); fi
    if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then flags+=(--cpus-per-task="$SLURM_CPUS_PER_TASK"); fi
    {
        echo "#!/bin/bash"
        echo "# Submits this run again as it was; it resumes from its newest checkpoint in $run_dir."
        printf 'cd %q\n' "$SLURM_SUBMIT_DIR"
        printf 'FSDP_RESEARCH_ROOT=%q FSDP_RUN_DIR=%q exec sbatch' "$REPO" "$run_dir"
        printf ' %q' "${flags[@]}" "$run_dir/$name" "$@"
        echo
    } >"$FSDP_RUN_DIR/resubmit.sh"
    chmod +x "$FSDP_RUN_DIR/resubmit.sh"
}

# Whether a node of this allocation is gone: a one-task-per-node step cannot start on it.
node_lost() {
    ! timeout 60 srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 true >/dev/null 2>&1
}

# run_train <overrides...>: train.py on every task of the allocation, in the run dir. When the step failed
# because a node of the allocation is lost, the job goes back to the queue: it resumes from its newest
# checkpoint on the nodes that remain or come back.
run_train() {
    export PYTHONUNBUFFERED=1
    # srun runs in the background so that this shell can take a signal sent to the batch shell only
    # (scancel --signal=USR2 --batch, --signal=B:USR2@<s>) and pass it on: srun forwards it to every task.
    srun --kill-on-bad-exit=1 "$PYTHON" "$REPO/train.py" "hydra.run.dir=$FSDP_RUN_DIR" "$@" &
    local step=$! rc
    trap "kill -USR2 $step 2>/dev/null || true" USR2
    # A trapped signal ends `wait` early (status > 128) while srun runs on: wait again.
    while true; do
        rc=0
        wait "$step" || rc=$?
        ((rc > 128)) && kill -0 "$step" 2>/dev/null || break
    done
    if ((rc != 0)) && node_lost; then
        echo "== job ${SLURM_JOB_ID}: a node of the allocation is lost (step exit $rc): requeueing at $(date -Is)"
        scontrol requeue "$SLURM_JOB_ID" && return 0
    fi
    return "$rc"
}
