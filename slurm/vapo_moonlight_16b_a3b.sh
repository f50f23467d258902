#!/bin/bash
# VAPO on Moonlight-16B-A3B (DeepSeek-V3 architecture, EP 16; the critic Moonlight from the
# policy), 2 nodes x 8 H100.
#
#   sbatch slurm/vapo_moonlight_16b_a3b.sh                              # from the repository root
#   DRY_RUN=1 bash slurm/vapo_moonlight_16b_a3b.sh                      # print and validate, start nothing
#   DRY_RUN=1 DRY_RUN_RANKS=0,15 bash slurm/vapo_moonlight_16b_a3b.sh   # and build the first and last rank on meta
#
# Everything else (environment, container, requeue on USR1, logs) as slurm/vapo_qwen32b.sh;
# the variables are listed in slurm/common.sh. The recipe's header has the plan.
#SBATCH --job-name=vapo-moonlight
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=vapo-moonlight-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_moonlight_16b_a3b.yaml}"
: "${RUN_DIR:=runs/vapo_moonlight_16b_a3b}"
: "${MODEL_PRESET:=moonlight-16b-a3b}"
: "${CRITIC_PRESET:=}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=2}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=moonshotai/Moonlight-16B-A3B}"
: "${REWARD_MODEL_ID:=}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
