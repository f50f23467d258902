"""Issue 44: the value-bias sweeps' reports in one file, ``docs/ablation_bias.json``.

``tools/ablation_bias_sweep.sh`` writes one report per setting (``tools/ablate_report.py``'s
schema: ``rows`` by preset, ``evaluation_movement_shared``); this merges them, as
docs/ablation.json holds its sweeps: ``rows`` has a row per preset and setting, keyed
``<preset>@<setting>``, each with its ``setting``; ``settings`` says each setting's rates,
steps and report. A setting whose report is missing is left out (listed in ``missing``).

    python tools/ablation_bias_merge.py     # the sweep script runs it after each setting
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "critic_lr_2x": {
        "report": "docs/ablation_bias_critic_lr_2x.json", "policy_lr": 3e-5, "critic_lr": 6e-5,
        "steps": 40, "about": "the paper's critic:policy learning-rate ratio (2e-6 / 1e-6)",
    },
    "critic_lr_2e-3": {
        "report": "docs/ablation_bias_fast_critic.json", "policy_lr": 3e-5, "critic_lr": 2e-3,
        "steps": 40, "about": "today's rates (recipes/ablation_long.yaml), ~67x",
    },
    "critic_lr_2x_first_8_steps": {
        "report": "docs/ablation_bias_early.json", "policy_lr": 3e-5, "critic_lr": 6e-5,
        "steps": 8, "about": "the paper's ratio, the first 8 steps again with the diagnostics",
    },
}  # fmt: skip
"""Setting -> its report and what it ran (tools/ablation_bias_sweep.sh paper, fast, early)."""


def merge(repo: Path = REPO) -> dict:
    """The merged document (see the module's docstring)."""
    out: dict = {"issue": 44, "reward_model": "vapo_megatron/tiny/long/reward_model_unfinished",
                 "settings": {}, "rows": {}, "missing": []}  # fmt: skip
    for name, setting in SETTINGS.items():
        path = repo / setting["report"]
        if not path.exists():
            out["missing"].append(setting["report"])
            continue
        report = json.loads(path.read_text())
        shared = report.get("evaluation_movement_shared")
        out["settings"][name] = {**setting, "evaluation_movement_shared": shared}
        for preset, row in report["rows"].items():
            out["rows"][f"{preset}@{name}"] = {**row, "setting": name}
    return out


def main(argv: list[str]) -> int:
    target = REPO / "docs" / "ablation_bias.json"
    merged = merge()
    target.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"{target.relative_to(REPO)}: {len(merged['rows'])} rows, missing {merged['missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
