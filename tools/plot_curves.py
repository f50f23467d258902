"""Draws a run's training curves from its metrics.jsonl into one PNG.

    python tools/plot_curves.py RUN_DIR [--out RUN_DIR/curves.png]

Six panels: score (train and held-out eval), response length, explained variance (critic
pretraining steps drawn before step 0), lambda_policy, losses and clip fractions. A resumed run
may log a step twice; the last line of each (phase, step) wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (panel title, [(phase, metric key, label)]); eval keys are matched by prefix (avg@k).
PANELS = (
    ("score", [("train", "score", "train score"), ("train", "acc", "train acc"),
               ("eval", "avg@", "held-out avg@k")]),
    ("response length", [("train", "response_length/mean", "mean"),
                         ("train", "response_length/max", "max"),
                         ("eval", "response_length/mean", "held-out mean")]),
    ("explained variance", [("critic_pretrain", "critic/explained_variance", "critic pretraining"),
                            ("train", "critic/explained_variance", "VAPO steps")]),
    ("lambda_policy", [("train", "lambda_policy/mean", "mean"),
                       ("train", "lambda_policy/min", "min"),
                       ("train", "lambda_policy/max", "max")]),
    ("losses", [("train", "policy/pg_loss", "policy pg_loss"),
                ("train", "policy/nll_positive", "positive NLL"),
                ("critic_pretrain", "critic/value_loss", "value loss (pretraining)"),
                ("train", "critic/value_loss", "value loss")]),
    ("clip fractions", [("train", "policy/clip_frac_low", "ratio < 1-eps_low"),
                        ("train", "policy/clip_frac_high", "ratio > 1+eps_high"),
                        ("train", "critic/value_clip_frac", "value clip"),
                        ("train", "response_length/clip_frac", "truncated responses")]),
)  # fmt: skip


def read_metrics(path: str | Path) -> dict[str, dict[int, dict]]:
    """phase -> step -> the last logged row of that step."""
    out: dict[str, dict[int, dict]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row["phase"], {})[row["step"]] = row
    return out


def plot_curves(metrics_path: str | Path, out_png: str | Path, *, title: str = "") -> Path:
    """Writes the six panels of ``metrics_path`` to ``out_png``; returns ``out_png``."""
    rows = read_metrics(metrics_path)
    num_pretrain = max(rows.get("critic_pretrain", {}), default=0)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (name, series) in zip(axes.flat, PANELS, strict=True):
        for phase, key, label in series:
            xs, ys = [], []
            for step, row in sorted(rows.get(phase, {}).items()):
                value = _value(row, key)
                if isinstance(value, (int, float)):
                    # Critic pretraining precedes VAPO step 0: its steps are drawn at -P..-1.
                    xs.append(step - num_pretrain - 1 if phase == "critic_pretrain" else step)
                    ys.append(value)
            if xs:
                style = "o-" if phase == "eval" else "-"
                ax.plot(xs, ys, style, label=label, markersize=4)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png


def _value(row: dict, key: str) -> float | None:
    """``row[key]``; a key ending in '@' matches the first key it begins (avg@k for any k)."""
    if key.endswith("@"):
        return next((v for k, v in row.items() if k.startswith(key)), None)
    return row.get(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args()
    out = plot_curves(args.run_dir / "metrics.jsonl", args.out or args.run_dir / "curves.png")
    print(out)


if __name__ == "__main__":
    main()
