#!/bin/bash
# VAPO on Qwen3-235B-A22B (MoE, EP 32) with a Qwen3-32B critic of its own, 32 nodes x 8 H100.
#
#   sbatch slurm/vapo_qwen3_235b_a22b.sh                              # from the repository root
#   DRY_RUN=1 bash slurm/vapo_qwen3_235b_a22b.sh                      # print and validate, start nothing
#   DRY_RUN=1 DRY_RUN_RANKS=0,255 bash slurm/vapo_qwen3_235b_a22b.sh   # and build the first and last rank on meta
#
# Everything else (environment, container, requeue on USR1, logs) as slurm/vapo_qwen32b.sh;
# the variables are listed in slurm/common.sh. The recipe's header has the plan.
#SBATCH --job-name=vapo-qwen3-235b
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@1200
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=vapo-qwen3-235b-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_qwen3_235b_a22b.yaml}"
: "${RUN_DIR:=runs/vapo_qwen3_235b_a22b}"
: "${MODEL_PRESET:=qwen3-235b-a22b}"
: "${CRITIC_PRESET:=qwen3-32b}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=32}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=Qwen/Qwen3-235B-A22B}"
: "${REWARD_MODEL_ID:=nvidia/Qwen-3-Nemotron-32B-Reward}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
