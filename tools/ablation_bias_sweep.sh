#!/bin/bash
# Issue 44: the long-trace rows with the critic started from the reward model that has the
# paper's value bias (docs/ablation.md, "The value model's bias"); finished runs are skipped,
# so this can be rerun where it stopped.
#   bash tools/ablation_bias_sweep.sh          # critic lr 2x the policy's (6e-5 / 3e-5), the paper's ratio
#   bash tools/ablation_bias_sweep.sh fast     # today's rates (critic 2e-3), as recipes/ablation_long.yaml
#   bash tools/ablation_bias_sweep.sh early    # the paper's ratio, the first 8 steps only (the
#                                              # diagnostics over the first steps: value profile,
#                                              # positive advantages of wrong answers)
# Seeds 1..3 (SEEDS=N to change), 40 steps (the recipe's; 8 with early).
cd "$(dirname "$0")/.."
case "${1:-paper}" in
  paper) recipe=recipes/ablation_long_unfinished.yaml out=runs/ablation_bias/critic_lr_2x
         report=docs/ablation_bias_critic_lr_2x.json png=docs/ablation_bias.png ;;
  fast) recipe=recipes/ablation_long_unfinished_fast_critic.yaml out=runs/ablation_bias/critic_lr_2e-3
        report=docs/ablation_bias_fast_critic.json png=docs/ablation_bias_fast_critic.png ;;
  early) recipe=recipes/ablation_long_unfinished.yaml out=runs/ablation_bias/critic_lr_2x_early
         report=docs/ablation_bias_early.json png=docs/ablation_bias_early.png steps=(--steps 8) ;;
  *) echo "usage: $0 [paper|fast|early]" >&2; exit 2 ;;
esac
nice -n 19 .venv/bin/python tools/ablate.py --recipe "$recipe" \
  --rows vapo,vapo_without_value_pretraining,vapo_without_decoupled_gae,ppo \
  --seeds "${SEEDS:-3}" "${steps[@]}" --out "$out" --json "$report" --png "$png" || exit
# Every setting's rows in one file, docs/ablation_bias.json (a row per preset and setting).
exec .venv/bin/python tools/ablation_bias_merge.py
