#!/bin/bash
# VAPO on Qwen2.5-32B with the 7B critic from nvidia/AceMath-7B-RM (docs/cluster.md), 16 nodes x 8 H100.
#
#   sbatch slurm/vapo_qwen32b_rm7b.sh                              # from the repository root
#   DRY_RUN=1 bash slurm/vapo_qwen32b_rm7b.sh                      # print and validate, start nothing
#   DRY_RUN=1 DRY_RUN_RANKS=0,127 bash slurm/vapo_qwen32b_rm7b.sh   # and build the first and last rank on meta
#
# Everything else (environment, container, requeue on USR1, logs) as slurm/vapo_qwen32b.sh;
# the variables are listed in slurm/common.sh. The recipe's header has the plan.
#SBATCH --job-name=vapo-qwen32b-rm7b
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
#SBATCH --output=vapo-qwen32b-rm7b-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_qwen2.5_32b_rm7b.yaml}"
: "${RUN_DIR:=runs/vapo_qwen2.5_32b_rm7b}"
: "${MODEL_PRESET:=qwen2.5-32b}"
: "${CRITIC_PRESET:=acemath-7b-rm-32k}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=16}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=Qwen/Qwen2.5-32B}"
: "${REWARD_MODEL_ID:=nvidia/AceMath-7B-RM}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
