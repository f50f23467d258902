#!/bin/bash
# Issue 29's long-trace sweep (docs/ablation.md, "Long traces"); finished runs are skipped.
cd "$(dirname "$0")/.."
exec nice -n 19 .venv/bin/python tools/ablate.py --recipe recipes/ablation_long.yaml \
  --rows vapo,vapo_without_value_pretraining,vapo_without_decoupled_gae,vapo_without_length_adaptive_gae,ppo,dapo,grpo \
  --seeds 3 --out runs/ablation_long --json docs/ablation.json --png docs/ablation_long.png
