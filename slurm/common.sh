# shellcheck shell=bash
# Shared pieces of the sbatch scripts (slurm/vapo_qwen32b.sh, slurm/vapo_qwen7b_1node.sh).
# A script sets its defaults (RECIPE, MODEL_PRESET, NODES, GPUS_PER_NODE, RUN_DIR), sources
# this file and calls vapo_main. Environment variables (all optional):
#
#   RECIPE           recipe YAML, relative to the repository
#   RUN_DIR          trainer.run_dir: metrics, checkpoints (checkpoints/latest), exported policy
#   MODEL_PATH       model.path        (HF directory of the initial policy)
#   POLICY_LOAD      policy.load       (Megatron checkpoint from tools/convert.py hf-to-mcore)
#   CRITIC_INIT      critic.init_path  (reward-model checkpoint for the critic)
#   TRAIN_DATA       data.train_path   EVAL_DATA  data.eval_path
#   EXTRA_ARGS       more section.key=value overrides, space-separated
#   NODES            nodes; under Slurm the allocation decides (sbatch --nodes=N) and must agree
#   GPUS_PER_NODE    GPUs (= tasks) per node
#   GPU_TYPE         h100-80gb | h200-141gb (the dry run's memory plan)
#   CPUS_PER_TASK    cores per rank (srun --cpus-per-task); default: the job's --cpus-per-task
#   HF_MODEL_ID      Hugging Face id of model.path, for the download command the dry run prints
#   REWARD_MODEL_ID  Hugging Face id of a public reward model for critic.init_path (same)
#   MODEL_PRESET     planner preset when model.path is not on this machine (dry run)
#   CRITIC_PRESET    planner preset for critic.model (the critic's own model) when that is not
#                    on this machine (dry run and plan only; the run reads critic.model)
#   CONTAINER_IMAGE  pyxis/enroot image (a .sqsh or nvcr.io#...); "none": run on the host
#   BASE_IMAGE       image BUILD_IMAGE=1 starts from: vLLM's own (its torch is vLLM's pin); then
#                    containers/install.sh adds megatron-core, Transformer Engine and apex under
#                    containers/pins.txt, built against that torch
#   CONTAINER_MOUNTS extra pyxis mounts (src:dst,...); the repository is mounted at its own path
#   PYTHON           interpreter inside the container / on the host
#   LOG_ROOT         per-job, per-node logs: LOG_ROOT/JOBID/attempt-N/NODE.log
#   MAX_REQUEUES     stop requeueing after this many restarts
#   PREFLIGHT        1: check the recipe against the world size (tools/plan.py) before launching
#   DRY_RUN          1: print the resolved commands, environment and layout, check the inputs
#                    (slurm/check_inputs.py: data, model, checkpoints; one line per missing piece
#                    with the command that makes it), build DRY_RUN_RANKS of the job in one
#                    process (vapo-train --dry-run: the real groups, models, DDP buffers and
#                    optimizer shards on the meta device) and print the plan (tools/plan.py);
#                    start nothing
#   DRY_RUN_RANKS    ranks the dry run stands in for, comma-separated (default 0)
#   BUILD_IMAGE      1: build CONTAINER_IMAGE from BASE_IMAGE with the project installed, then exit
#
# Launch: one Slurm task per GPU (srun --ntasks-per-node=GPUS_PER_NODE), each task one trainer
# rank with RANK/LOCAL_RANK/WORLD_SIZE from SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS and the
# env:// rendezvous on the first node. Not torchrun per node, because preemption needs the
# signal in every rank: Slurm (and srun forwarding our USR1) delivers it to each task, where
# trainer/preemption.py records it and all ranks save at the same step boundary. torchrun's
# agent dies on SIGUSR1 (default action) and answers SIGTERM by killing its workers after a
# short grace period, before a 32B checkpoint is written; its elastic restarts are not needed
# either, since recovery is requeue + resume from checkpoints/latest.

VAPO_REPO="${VAPO_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"

vapo_defaults() {
    : "${RECIPE:?the script sets RECIPE}"
    : "${RUN_DIR:=runs/$(basename "${RECIPE%.yaml}")}"
    : "${GPUS_PER_NODE:=8}"
    : "${NODES:=${SLURM_JOB_NUM_NODES:-1}}"
    : "${GPU_TYPE:=h100-80gb}"
    # srun no longer inherits sbatch's --cpus-per-task (Slurm >= 22.05): pass it explicitly, or
    # each rank may be bound to one core shared by vLLM's scheduler, grading and data handling.
    : "${CPUS_PER_TASK:=${SLURM_CPUS_PER_TASK:-12}}"
    : "${HF_MODEL_ID:=HF_MODEL_ID}"
    : "${REWARD_MODEL_ID:=}"
    : "${MODEL_PRESET:=}"
    : "${CRITIC_PRESET:=}"
    : "${BASE_IMAGE:=vllm/vllm-openai:v0.32.0}"
    : "${CONTAINER_IMAGE:=$VAPO_REPO/containers/vapo-megatron.sqsh}"
    : "${CONTAINER_MOUNTS:=}"
    : "${PYTHON:=python}"
    : "${LOG_ROOT:=$RUN_DIR/slurm_logs}"
    : "${MAX_REQUEUES:=20}"
    : "${PREFLIGHT:=1}"
    : "${DRY_RUN:=0}"
    : "${DRY_RUN_RANKS:=0}"
    : "${BUILD_IMAGE:=0}"
    if [[ -n "${SLURM_JOB_NUM_NODES:-}" && "$NODES" != "$SLURM_JOB_NUM_NODES" ]]; then
        echo "NODES=$NODES but the allocation has $SLURM_JOB_NUM_NODES nodes;" \
            "submit with sbatch --nodes=$NODES (or leave NODES unset)" >&2
        return 2
    fi
    WORLD_SIZE_TOTAL=$((NODES * GPUS_PER_NODE))
    # Recipe overrides: the paths given in the environment, then EXTRA_ARGS.
    OVERRIDES=("trainer.run_dir=$RUN_DIR" "trainer.progress_bar=false")
    [[ -n "${MODEL_PATH:-}" ]] && OVERRIDES+=("model.path=$MODEL_PATH")
    [[ -n "${POLICY_LOAD:-}" ]] && OVERRIDES+=("policy.load=$POLICY_LOAD")
    [[ -n "${CRITIC_INIT:-}" ]] && OVERRIDES+=("critic.init_path=$CRITIC_INIT")
    [[ -n "${TRAIN_DATA:-}" ]] && OVERRIDES+=("data.train_path=$TRAIN_DATA")
    [[ -n "${EVAL_DATA:-}" ]] && OVERRIDES+=("data.eval_path=$EVAL_DATA")
    local extra=()
    read -r -a extra <<<"${EXTRA_ARGS:-}"
    OVERRIDES+=("${extra[@]}")
    return 0
}

# NCCL / InfiniBand / CUDA settings of a Megatron + vLLM job; each can be overridden by
# exporting it before sbatch (docs/cluster.md). Cluster-specific ones (NCCL_IB_HCA,
# NCCL_SOCKET_IFNAME, NCCL_IB_GID_INDEX, GLOO_SOCKET_IFNAME) are only passed on when set.
VAPO_ENV_VARS=(
    CUDA_DEVICE_MAX_CONNECTIONS NCCL_IB_TIMEOUT NCCL_IB_RETRY_CNT NCCL_DEBUG
    TORCH_NCCL_ASYNC_ERROR_HANDLING TORCH_NCCL_AVOID_RECORD_STREAMS NCCL_NVLS_ENABLE
    OMP_NUM_THREADS TOKENIZERS_PARALLELISM HF_HUB_OFFLINE VLLM_CONFIGURE_LOGGING GLIBC_TUNABLES
    MASTER_ADDR MASTER_PORT GPUS_PER_NODE NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX
    GLOO_SOCKET_IFNAME
)

vapo_export_env() {
    # Megatron orders TP/SP communication and compute on one hardware queue.
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
    export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-10}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    export TORCH_NCCL_AVOID_RECORD_STREAMS="${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}"
    # NVLink SHARP buffers take GPU memory in every communicator; vLLM and two models share it.
    export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
    export TOKENIZERS_PARALLELISM=false
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" # compute nodes download nothing
    export VLLM_CONFIGURE_LOGGING=0
    # Transparent huge pages for glibc malloc's mappings: the step's ~170 MB host arrays fault
    # 2 MiB at a time, not 4 KiB (vapo_megatron/launch/host_malloc.py); a user's own
    # glibc.malloc.hugetlb (=0 to turn it off) wins. glibc reads it at process start only.
    case ":${GLIBC_TUNABLES:-}:" in
    *:glibc.malloc.hugetlb=*) ;;
    *) export GLIBC_TUNABLES="${GLIBC_TUNABLES:+$GLIBC_TUNABLES:}glibc.malloc.hugetlb=1" ;;
    esac
    # Not PYTORCH_CUDA_ALLOC_CONF=expandable_segments: vLLM's sleep mode refuses it.
    [[ -n "${NCCL_IB_HCA:-}" ]] && export NCCL_IB_HCA
    [[ -n "${NCCL_SOCKET_IFNAME:-}" ]] && export NCCL_SOCKET_IFNAME
    [[ -n "${NCCL_IB_GID_INDEX:-}" ]] && export NCCL_IB_GID_INDEX # RoCE fabrics (often 3)
    # gloo picks the interface its host name resolves to unless told: the host group and
    # vLLM's gloo twins of its groups cross nodes over it (a comma-separated list of names;
    # not NCCL's ^/= prefix syntax, so it is not derived from NCCL_SOCKET_IFNAME).
    [[ -n "${GLOO_SOCKET_IFNAME:-}" ]] && export GLOO_SOCKET_IFNAME
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    else
        MASTER_ADDR="${MASTER_ADDR:-FIRST_NODE}"
    fi
    export MASTER_ADDR
    export MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
    export GPUS_PER_NODE
}

vapo_container_args() {
    CONTAINER_ARGS=()
    [[ "$CONTAINER_IMAGE" == none ]] && return 0
    local mounts="$VAPO_REPO:$VAPO_REPO"
    [[ -n "$CONTAINER_MOUNTS" ]] && mounts+=",$CONTAINER_MOUNTS"
    CONTAINER_ARGS=(--container-image="$CONTAINER_IMAGE" --container-mounts="$mounts"
        --container-workdir="$VAPO_REPO" --no-container-mount-home)
}

# One trainer rank per task: Slurm's task ids become torch.distributed's env:// variables.
# Single quotes on purpose: the variables expand in each task, not here.
# shellcheck disable=SC2016
VAPO_RANK_WRAPPER='export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=$GPUS_PER_NODE; exec "$@"'

vapo_commands() {
    ATTEMPT="${SLURM_RESTART_COUNT:-0}"
    LOG_DIR="$LOG_ROOT/${SLURM_JOB_ID:-dry-run}/attempt-$ATTEMPT"
    vapo_container_args
    TRAIN_CMD=("$PYTHON" -m vapo_megatron.train "$RECIPE" "${OVERRIDES[@]}")
    PLAN_CMD=("$PYTHON" tools/plan.py --recipe "$RECIPE" --nodes "$NODES"
        --gpus-per-node "$GPUS_PER_NODE" --gpu "$GPU_TYPE")
    [[ -n "$MODEL_PRESET" ]] && PLAN_CMD+=(--model "$MODEL_PRESET")
    [[ -n "$CRITIC_PRESET" ]] && PLAN_CMD+=(--critic-model "$CRITIC_PRESET")
    local item
    for item in "${OVERRIDES[@]}"; do PLAN_CMD+=(--set "$item"); done
    BUILD_CMD=("$PYTHON" -m vapo_megatron.train "$RECIPE" "${OVERRIDES[@]}" --dry-run
        --world-size "$WORLD_SIZE_TOTAL" --ranks "$DRY_RUN_RANKS")
    [[ -n "$MODEL_PRESET" ]] && BUILD_CMD+=(--model "$MODEL_PRESET")
    [[ -n "$CRITIC_PRESET" ]] && BUILD_CMD+=("critic.model=$CRITIC_PRESET")
    CHECK_CMD=("$PYTHON" slurm/check_inputs.py "$RECIPE" "${OVERRIDES[@]}"
        --hf-model "$HF_MODEL_ID")
    [[ -n "$REWARD_MODEL_ID" ]] && CHECK_CMD+=(--reward-model "$REWARD_MODEL_ID")
    SRUN_CMD=(srun --nodes="$NODES" --ntasks-per-node="$GPUS_PER_NODE" --gpu-bind=none
        --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 --label --chdir="$VAPO_REPO" --output="$LOG_DIR/%N.log"
        "${CONTAINER_ARGS[@]}" bash -c "$VAPO_RANK_WRAPPER" vapo-rank "${TRAIN_CMD[@]}")
    # The inputs are checked again on a compute node: it may see other file systems.
    local one_task=(srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_TASK"
        --chdir="$VAPO_REPO" "${CONTAINER_ARGS[@]}")
    PREFLIGHT_CHECK_CMD=("${one_task[@]}" "${CHECK_CMD[@]}")
    PREFLIGHT_CMD=("${one_task[@]}" "${PLAN_CMD[@]}")
}

vapo_print() {
    echo "== vapo: $RECIPE on $NODES node(s) x $GPUS_PER_NODE GPUs = $WORLD_SIZE_TOTAL ranks"
    echo "repository: $VAPO_REPO"
    echo "container:  $CONTAINER_IMAGE (BUILD_IMAGE=1 builds it from $BASE_IMAGE)"
    echo "logs:       $LOG_DIR/<node>.log"
    echo "-- environment"
    local var
    for var in "${VAPO_ENV_VARS[@]}"; do
        [[ -n "${!var:-}" ]] && echo "$var=${!var}"
    done
    echo "-- launch (one task per GPU)"
    printf '%q ' "${SRUN_CMD[@]}"
    echo
    echo "-- inputs check"
    printf '%q ' "${CHECK_CMD[@]}"
    echo
    echo "-- build of ranks $DRY_RUN_RANKS in one process (dry run only)"
    printf '%q ' "${BUILD_CMD[@]}"
    echo
    echo "-- layout check and memory plan"
    printf '%q ' "${PLAN_CMD[@]}"
    echo
}

vapo_build_image() {
    # The project's install step, once, into a squashfs that every job then starts from; then
    # the smoke test on the node's GPU (TE layer forward/backward, vLLM, megatron-core, apex).
    mkdir -p "$(dirname "$CONTAINER_IMAGE")"
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_TASK" --container-image="$BASE_IMAGE" \
        --container-save="$CONTAINER_IMAGE" --container-mounts="$VAPO_REPO:$VAPO_REPO" \
        --container-workdir="$VAPO_REPO" bash containers/install.sh || return $?
    srun --nodes=1 --ntasks=1 --gpus=1 --container-image="$CONTAINER_IMAGE" \
        --container-mounts="$VAPO_REPO:$VAPO_REPO" --container-workdir="$VAPO_REPO" \
        python3 containers/smoke_test.py
}

vapo_launch() {
    mkdir -p "$LOG_DIR"
    echo "job ${SLURM_JOB_ID:-?} attempt $ATTEMPT: logs in $LOG_DIR"
    if [[ "$PREFLIGHT" == 1 ]]; then
        "${PREFLIGHT_CHECK_CMD[@]}" || return 2
        "${PREFLIGHT_CMD[@]}" || return 2
    fi
    VAPO_REQUEUE=0
    # USR1 (sbatch --signal=B:USR1@lead) is our warning before the time limit: pass it to every
    # rank, which save at the next step boundary and exit 0; then requeue. A TERM (scancel,
    # preemption) reaches the ranks from Slurm directly; Slurm requeues preempted jobs itself.
    trap 'VAPO_REQUEUE=1; echo "USR1: asking the trainer to save"; kill -USR1 "$srun_pid" 2>/dev/null' USR1
    trap 'echo "TERM: the trainer saves at its next step boundary"' TERM
    "${SRUN_CMD[@]}" &
    srun_pid=$!
    local rc
    while :; do
        wait "$srun_pid"
        rc=$?
        kill -0 "$srun_pid" 2>/dev/null || break # else: a trapped signal interrupted wait
    done
    trap - USR1 TERM
    echo "trainer exited with $rc"
    if [[ "$rc" == 0 && "$VAPO_REQUEUE" == 1 ]]; then
        if ((ATTEMPT >= MAX_REQUEUES)); then
            echo "not requeueing: $ATTEMPT restarts (MAX_REQUEUES=$MAX_REQUEUES)"
        else
            echo "requeueing job $SLURM_JOB_ID; it resumes from $RUN_DIR/checkpoints/latest"
            scontrol requeue "$SLURM_JOB_ID"
        fi
    fi
    return "$rc"
}

vapo_main() {
    vapo_defaults || return $?
    cd "$VAPO_REPO" || return 1
    vapo_export_env
    vapo_commands
    if [[ "$BUILD_IMAGE" == 1 ]]; then
        vapo_build_image
        return $?
    fi
    vapo_print
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "-- inputs"
        "${CHECK_CMD[@]}"
        local inputs=$?
        echo "-- build"
        "${BUILD_CMD[@]}"
        local build=$?
        echo "-- plan"
        "${PLAN_CMD[@]}"
        local plan=$?
        ((inputs == 0)) || echo "dry run: inputs missing (MISSING/BAD lines above)" >&2
        ((build == 0)) || echo "dry run: the build of ranks $DRY_RUN_RANKS failed (above)" >&2
        ((plan != 0)) && return "$plan"
        return $((build != 0 ? build : inputs))
    fi
    if [[ -z "${SLURM_JOB_ID:-}" ]]; then
        echo "not inside a Slurm job: submit with sbatch, or set DRY_RUN=1" >&2
        return 2
    fi
    vapo_launch
}
