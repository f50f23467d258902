#!/bin/bash
# Issue 29: the long-trace sweep's runs continued from step 40 to step 80 (docs/ablation.md).
# Each finished 40-step run of runs/ablation_long is copied (less its summary) and resumed
# from its last checkpoint; finished runs are skipped, so this can be rerun where it stopped.
cd "$(dirname "$0")/.."
for src in runs/ablation_long/*/seed_*; do
  dst=runs/ablation_long80/${src#runs/ablation_long/}
  if [ -f "$src/summary.json" ] && [ ! -d "$dst" ]; then
    mkdir -p "$(dirname "$dst")" && cp -r "$src" "$dst" && rm "$dst/summary.json"
  fi
done
exec nice -n 19 .venv/bin/python tools/ablate.py --recipe recipes/ablation_long.yaml --steps 80 \
  --rows vapo,vapo_without_value_pretraining,vapo_without_decoupled_gae,vapo_without_length_adaptive_gae,ppo,dapo,grpo \
  --seeds 3 --out runs/ablation_long80 --json runs/ablation_long80/report.json --png runs/ablation_long80/curves.png
