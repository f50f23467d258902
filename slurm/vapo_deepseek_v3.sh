#!/bin/bash
# VAPO on DeepSeek-V3 (MoE with MLA, TP 8 x EP 128; the critic DeepSeek-V3 from the policy),
# 128 nodes x 8 H100.
#
#   sbatch slurm/vapo_deepseek_v3.sh                                 # from the repository root
#   DRY_RUN=1 bash slurm/vapo_deepseek_v3.sh                         # print and validate, start nothing
#   DRY_RUN=1 DRY_RUN_RANKS=0 bash slurm/vapo_deepseek_v3.sh         # and build rank 0 on meta (slow: docs/scaling.md)
#
# Everything else (environment, container, requeue on USR1, logs) as slurm/vapo_qwen32b.sh;
# the variables are listed in slurm/common.sh. The recipe's header has the plan.
#SBATCH --job-name=vapo-deepseek-v3
#SBATCH --nodes=128
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@1800
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=vapo-deepseek-v3-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_deepseek_v3.yaml}"
: "${RUN_DIR:=runs/vapo_deepseek_v3}"
: "${MODEL_PRESET:=deepseek-v3}"
: "${CRITIC_PRESET:=}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=128}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=deepseek-ai/DeepSeek-V3}"
: "${REWARD_MODEL_ID:=}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
