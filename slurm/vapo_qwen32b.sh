#!/bin/bash
# VAPO on Qwen2.5-32B (policy + critic, colocated vLLM), as in the paper: 16 nodes x 8 H100.
#
#   sbatch slurm/vapo_qwen32b.sh                          # from the repository root
#   sbatch --nodes=32 --time=48:00:00 slurm/vapo_qwen32b.sh   # #SBATCH values: sbatch flags
#   DRY_RUN=1 bash slurm/vapo_qwen32b.sh                  # print and validate, start nothing
#   BUILD_IMAGE=1 sbatch --nodes=1 slurm/vapo_qwen32b.sh  # once: the container image
#
# Environment (defaults below; the full list, with the launch choice, is in slurm/common.sh):
#   RECIPE=recipes/vapo_qwen2.5_32b.yaml  RUN_DIR=runs/vapo_qwen2.5_32b
#   MODEL_PATH, POLICY_LOAD, CRITIC_INIT, TRAIN_DATA, EVAL_DATA: checkpoint and data paths
#   (recipe overrides); EXTRA_ARGS="section.key=value ..."
#   CONTAINER_IMAGE=containers/vapo-megatron.sqsh (built by BUILD_IMAGE=1 from
#   BASE_IMAGE=vllm/vllm-openai:v0.32.0 by containers/install.sh: megatron-core, Transformer
#   Engine and apex against vLLM's torch, pinned in containers/pins.txt, then
#   containers/smoke_test.py on one GPU); "none": host python
#   CPUS_PER_TASK=12 (srun --cpus-per-task; srun does not inherit it from sbatch)
#   NODES=16 (dry run; under Slurm the allocation decides)  GPUS_PER_NODE=8  GPU_TYPE=h100-80gb
#
# Time limit: USR1 reaches this script 20 minutes before the limit (long enough for a step at
# 20k-token responses plus a checkpoint); every rank saves at the next step boundary, exits 0,
# and the job requeues itself and resumes from RUN_DIR/checkpoints/latest.
#SBATCH --job-name=vapo-qwen32b
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@1200
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=vapo-qwen32b-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_qwen2.5_32b.yaml}"
: "${RUN_DIR:=runs/vapo_qwen2.5_32b}"
: "${MODEL_PRESET:=qwen2.5-32b}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=16}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=Qwen/Qwen2.5-32B}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
