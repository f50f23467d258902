#!/bin/bash
# VAPO on Qwen2.5-7B on one node of 8 H100: the same launch as slurm/vapo_qwen32b.sh (see
# slurm/common.sh for every environment variable), with the 7B recipe.
#
#   sbatch slurm/vapo_qwen7b_1node.sh
#   DRY_RUN=1 bash slurm/vapo_qwen7b_1node.sh
#
# Defaults: RECIPE=recipes/vapo_qwen2.5_7b.yaml RUN_DIR=runs/vapo_qwen2.5_7b NODES=1
# GPUS_PER_NODE=8; USR1 10 minutes before the limit -> checkpoint -> requeue -> resume.
#SBATCH --job-name=vapo-qwen7b
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=vapo-qwen7b-%j.out

set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$here/common.sh" ]] || here="${SLURM_SUBMIT_DIR:?run from the repository root}/slurm"
: "${RECIPE:=recipes/vapo_qwen2.5_7b.yaml}"
: "${RUN_DIR:=runs/vapo_qwen2.5_7b}"
: "${MODEL_PRESET:=qwen2.5-7b}"
[[ -n "${SLURM_JOB_ID:-}" ]] || : "${NODES:=1}"
: "${GPUS_PER_NODE:=8}"
: "${HF_MODEL_ID:=Qwen/Qwen2.5-7B}"
# shellcheck source=slurm/common.sh
source "$here/common.sh"
vapo_main "$@"
