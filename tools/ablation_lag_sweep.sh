#!/bin/bash
# Issue 42: generation k steps behind (rollout.lag) on the long-trace task (docs/ablation.md,
# "Generation k steps behind: V-trace GAE"): synchronous VAPO, lag 1 and 4 with V-trace GAE and
# with plain GAE; every lag row weights the policy loss by token-level TIS (tools/ablate.py,
# LAG_POLICY_LOSS). Finished runs are skipped, so this can be rerun where it stopped.
#   bash tools/ablation_lag_sweep.sh                       # the five rows, seeds 1..3
#   ROWS=vapo_lag16,vapo_lag16_uncorrected SEEDS=1 bash tools/ablation_lag_sweep.sh
# The report goes to runs/ablation_lag/report.{md,json} (not docs/ablation.json, which holds
# the other sweeps' rows: the lag rows are merged into it by hand).
cd "$(dirname "$0")/.."
exec nice -n 19 .venv/bin/python tools/ablate.py --recipe recipes/ablation_long.yaml \
  --rows "${ROWS:-vapo,vapo_lag1,vapo_lag4,vapo_lag1_uncorrected,vapo_lag4_uncorrected}" \
  --seeds "${SEEDS:-3}" --out "${OUT:-runs/ablation_lag}" --png "${PNG:-docs/ablation_lag.png}"
