"""The ablation sweep's numbers: per-seed results of OUT/ROW/seed_S runs -> table, JSON, curves.

    python tools/ablate_report.py OUT [--json docs/ablation.json] [--png docs/ablation_long.png]

Reads every finished or partly finished run under OUT (OUT/ROW/seed_S/metrics.jsonl; a run is
finished when its summary.json exists) and writes:

- the JSON (``report``): per row, the preset, the seeds, each seed's held-out pass rate after
  its last step (``finals``), their mean and sample standard deviation, the start (before the
  first step), the steps, and the per-row diagnostics (``diagnostics``) averaged over seeds:
  the critic's explained variance and its values' mean minus the returns' mean (the bias a
  critic started from a reward model carries) and its value at the first response token
  minus the return there (``first_token_bias``, from the step's ``critic/value_first_token``
  and ``critic/return_first_token``), the value and return at the quarters and the last
  token of the responses, the share of wrong answers' tokens with a positive advantage
  (``advantages/positive_share_failing``, before whitening) over the first and last fifth of
  the steps,
  the mean response length over the steps, the clip fractions, and the held-out curve;
  ``late``: per seed the mean of the evaluations in the last half of the steps (less noisy
  than one evaluation), and ``paired``: each row's late mean minus VAPO's, seed by seed, with
  its 95% interval (a row separates from VAPO beyond noise when the interval leaves out 0),
  and the late evaluations' least-squares slope (points per 10 steps; mean over seeds with
  its interval: a curve still rising beyond noise leaves out 0);
- the markdown table, with the paper's AIME 2024 column beside it (OUT/report.md; the JSON
  also goes to OUT/report.json);
- a PNG of the held-out curves, one panel per row, one line per seed.

tools/ablate.py calls ``write_report`` after every run, so an interrupted sweep leaves its
results so far. Unfinished runs are listed (``unfinished``) but left out of the means.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "tools"))

from plot_curves import read_metrics  # noqa: E402

PAPER_AIME24 = {
    "vapo": 60, "vapo_without_value_pretraining": 11, "vapo_without_decoupled_gae": 33,
    "vapo_without_length_adaptive_gae": 45, "vapo_without_clip_higher": 46,
    "vapo_without_token_level_loss": 53, "vapo_without_positive_lm_loss": 54,
    "vapo_without_group_sampling": 55, "ppo": 5, "grpo": 47, "dapo": 50,
}  # fmt: skip
"""The paper's Table 1 (Qwen2.5-32B, AIME 2024 avg@32); GRPO is its DeepSeek-R1-Zero-Qwen-32B row."""
DIAGNOSTIC_KEYS = {
    "explained_variance": "critic/explained_variance",
    "response_length": "response_length/mean",
    "clip_frac_low": "policy/clip_frac_low",
    "clip_frac_high": "policy/clip_frac_high",
    "truncated": "response_length/clip_frac",
    "value_first_token": "critic/value_first_token",
    "return_first_token": "critic/return_first_token",
    **{
        f"{kind}_{point}": f"critic/{kind}_{point}"
        for point in ("q1", "half", "q3", "last")
        for kind in ("value", "return")
    },
    "positive_share_failing": "advantages/positive_share_failing",
    "positive_share_passing": "advantages/positive_share_passing",
}
"""Diagnostic name -> the trainer's metric (train phase)."""
REFERENCE = "vapo"
"""The row the others are compared with, seed by seed (``paired``)."""
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228}  # fmt: skip
"""Student's t, two-sided 95%, by degrees of freedom (the paired differences' seeds - 1)."""


def eval_rate(row: dict) -> float:
    """avg@k of one eval row (the first key avg@K without a '/')."""
    return next(v for k, v in row.items() if k.startswith("avg@") and "/" not in k)


def seed_result(run_dir: Path) -> dict:
    """One run's result: held-out curve {step: rate}, start, final (None while unfinished),
    steps, critic-pretraining steps, seconds, and per-step train diagnostics."""
    metrics = (
        read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else {}
    )
    evals = {step: eval_rate(row) for step, row in metrics.get("eval", {}).items()}
    train = metrics.get("train", {})
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    steps = summary["steps"] if summary else max(train, default=0)
    series = {name: {s: row[key] for s, row in train.items() if _finite(row.get(key))}
              for name, key in DIAGNOSTIC_KEYS.items()}  # fmt: skip
    series["value_bias"] = {
        s: row["critic/values_mean"] - row["critic/returns_mean"]
        for s, row in train.items()
        if _finite(row.get("critic/values_mean")) and _finite(row.get("critic/returns_mean"))
    }
    series["first_token_bias"] = {
        s: row["critic/value_first_token"] - row["critic/return_first_token"]
        for s, row in train.items()
        if _finite(row.get("critic/value_first_token"))
        and _finite(row.get("critic/return_first_token"))
    }
    late = {step: rate for step, rate in evals.items() if 2 * step > steps} if summary else {}
    return {
        "curve": evals,
        "start": evals.get(0),
        "late": statistics.mean(late.values()) if late else None,
        "late_slope": _line(late)[2] if len(late) > 1 else None,
        "final": evals.get(steps) if summary else None,
        "steps": steps,
        "critic_pretrain_steps": max(metrics.get("critic_pretrain", {}), default=0),
        "seconds": summary.get("seconds") if summary else None,
        "series": series,
    }


def row_report(preset: str, seeds: dict[int, dict]) -> dict:
    """A row of docs/ablation.json from its seeds' ``seed_result``s (finished ones counted)."""
    done = {s: r for s, r in sorted(seeds.items()) if r["final"] is not None}
    finals = [100 * r["final"] for r in done.values()]
    late = [100 * r["late"] for r in done.values()]  # a finished run's last step is late
    slopes = [1000 * r["late_slope"] for r in done.values() if r["late_slope"] is not None]
    starts = [100 * r["start"] for r in done.values() if r["start"] is not None]
    return {
        "preset": preset,
        "seeds": list(done),
        "finals": [round(x, 2) for x in finals],
        "mean": round(statistics.mean(finals), 2) if finals else None,
        "sd": round(statistics.stdev(finals), 2) if len(finals) > 1 else None,
        "late": {
            "finals": [round(x, 2) for x in late],
            "mean": round(statistics.mean(late), 2) if late else None,
            "sd": round(statistics.stdev(late), 2) if len(late) > 1 else None,
            "slope": _mean_interval(slopes),
        },
        "start": round(statistics.mean(starts), 2) if starts else None,
        "steps": max((r["steps"] for r in done.values()), default=0),
        "critic_pretrain_steps": max((r["critic_pretrain_steps"] for r in done.values()), default=0),
        "seconds": [r["seconds"] for r in done.values()],
        "paper_aime24": PAPER_AIME24.get(preset),
        "unfinished": sorted(s for s in seeds if s not in done),
        "diagnostics": diagnostics(list(done.values())),
        "curves": {str(s): {str(k): round(100 * v, 2) for k, v in sorted(r["curve"].items())}
                   for s, r in done.items()},
    }  # fmt: skip


def paired(rows: dict, reference: str = REFERENCE) -> None:
    """Adds to each row ``paired``: its late mean minus the reference row's, seed by seed over
    the seeds both finished (the same start and evaluation prompts, and the same sampling
    seeds at each evaluation, so what the two share cancels), as mean, sample sd, seeds and
    the 95% interval of the mean (Student's t). A row separates from the reference beyond
    noise when the interval leaves out 0. Nothing is added without the reference row or
    without two common seeds."""
    ref = rows.get(reference)
    if ref is None:
        return
    ref_late = dict(zip(ref["seeds"], ref["late"]["finals"], strict=True))
    for name, row in rows.items():
        if name == reference:
            continue
        diffs = [x - ref_late[s] for s, x in zip(row["seeds"], row["late"]["finals"], strict=True)
                 if s in ref_late]  # fmt: skip
        if len(diffs) < 2:
            continue
        row["paired"] = {"reference": reference, **_mean_interval(diffs)}


def shared_movement(rows: dict) -> dict | None:
    """How much of the evaluations' movement about each run's own trend all rows share. Each
    run's curve (steps > 0) less its least-squares line; at each (seed, step) the rows' mean
    of those residuals is the shared part. Returns the shared part's share of the residuals'
    variance (``fraction``), the rows, and the share expected were the rows' residuals
    independent (1 / rows). The same seed evaluates every row on the same prompts with the
    same sampling seeds, so a share well above 1 / rows says the ups and downs of the curves
    are the evaluation's sampling, common to policies that barely differ, not learning."""
    runs = [(seed, {int(k): v for k, v in curve.items() if int(k) > 0})
            for row in rows.values() for seed, curve in row["curves"].items()]  # fmt: skip
    deviations = {}  # (seed, step) -> each row's residual from its run's line
    for seed, curve in runs:
        if len(curve) < 3:  # a line through two points leaves no residual
            continue
        mx, my, slope = _line(curve)
        for step, value in curve.items():
            deviations.setdefault((seed, step), []).append(value - my - slope * (step - mx))
    cells = [d for d in deviations.values() if len(d) > 1]
    total = sum(x * x for d in cells for x in d)
    if not cells or total == 0:
        return None
    shared = sum(len(d) * statistics.mean(d) ** 2 for d in cells)
    counted = sum(1 for row in rows.values() if row["curves"])
    return {"fraction": round(shared / total, 3), "rows": counted,
            "independent": round(1 / counted, 3)}  # fmt: skip


def _mean_interval(values: list[float]) -> dict | None:
    """Mean, sample sd, count and the mean's 95% interval (Student's t); None under 2 values."""
    if len(values) < 2:
        return None
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = T_975.get(len(values) - 1, 1.96) * sd / math.sqrt(len(values))
    return {"seeds": len(values), "mean": round(mean, 2), "sd": round(sd, 2),
            "ci95": [round(mean - half, 2), round(mean + half, 2)]}  # fmt: skip


def _line(points: dict[int, float]) -> tuple[float, float, float]:
    """The least-squares line of rate over step: (mean step, mean rate, slope)."""
    mx, my = statistics.mean(points), statistics.mean(points.values())
    sxx = sum((x - mx) ** 2 for x in points)
    return mx, my, sum((x - mx) * (y - my) for x, y in points.items()) / sxx


def diagnostics(runs: list[dict]) -> dict:
    """Per diagnostic, its mean over seeds over the first and the last fifth of the steps."""
    out = {}
    for name in [*DIAGNOSTIC_KEYS, "value_bias", "first_token_bias"]:
        first, last = [], []
        for run in runs:
            series = run["series"][name]
            if series:
                steps = sorted(series)
                fifth = max(1, len(steps) // 5)
                first.append(statistics.mean(series[s] for s in steps[:fifth]))
                last.append(statistics.mean(series[s] for s in steps[-fifth:]))
        if first:
            out[name] = {"first_fifth": round(statistics.mean(first), 4),
                         "last_fifth": round(statistics.mean(last), 4)}  # fmt: skip
    return out


def report(out_dir: Path, labels: dict[str, str]) -> dict:
    """Every row under ``out_dir`` (in ``labels``' order, then any other), as row_report."""
    rows = {}
    names = [n for n in labels if (out_dir / n).is_dir()]
    names += sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name not in labels)
    for name in names:
        seeds = {int(p.name.split("_")[1]): seed_result(p)
                 for p in sorted((out_dir / name).glob("seed_*"))}  # fmt: skip
        if seeds:
            rows[name] = {"row": labels.get(name, name), **row_report(name, seeds)}
    paired(rows)
    return rows


def table(rows: dict) -> str:
    """Markdown: held-out pass rate after the last step (mean ± sd over seeds), the start,
    steps, diagnostics (EV, value bias over all tokens and at the first response token, first
    -> last fifth; response length; clip-high fraction), the paper."""
    lines = [
        "| run | preset | held-out (points) | seeds | start | steps | EV | V - R | V0 - R0 | response tokens | clip high | paper AIME24 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, row in rows.items():
        if row["mean"] is None:
            continue
        sd = f" ± {row['sd']:.1f}" if row["sd"] is not None else ""
        steps = f"{row['steps']}" + (f" + {row['critic_pretrain_steps']} critic"
                                     if row["critic_pretrain_steps"] else "")  # fmt: skip
        diag = row["diagnostics"]
        lines.append(
            f"| {row['row']} | `{name}` | {row['mean']:.1f}{sd} | {len(row['seeds'])} | "
            f"{_num(row['start'], 1)} | {steps} | {_span(diag, 'explained_variance', 2)} | "
            f"{_span(diag, 'value_bias', 2)} | {_span(diag, 'first_token_bias', 2)} | "
            f"{_span(diag, 'response_length', 0)} | "
            f"{_span(diag, 'clip_frac_high', 3)} | {_num(row['paper_aime24'], 0)} |"
        )
    return "\n".join(lines)


def late_table(rows: dict) -> str:
    """Markdown: per row the mean held-out pass rate over the evaluations in the last half of
    the steps (per seed; mean ± sd over seeds), and its paired difference from the reference
    row (mean ± sd over seeds, 95% interval)."""
    lines = [
        "| run | late held-out (points) | per seed | minus VAPO, paired | 95% interval "
        "| late slope (points / 10 steps) | 95% interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows.values():
        late = row["late"]
        if late["mean"] is None:
            continue
        sd = f" ± {late['sd']:.1f}" if late["sd"] is not None else ""
        seeds = ", ".join(f"{x:.1f}" for x in late["finals"])
        cells = [f"{late['mean']:.1f}{sd}", seeds]
        for stat in (row.get("paired"), late["slope"]):
            if stat is None:
                cells += ["-", "-"]
            else:
                cells += [f"{stat['mean']:+.1f} ± {stat['sd']:.1f}",
                          f"{stat['ci95'][0]:+.1f} to {stat['ci95'][1]:+.1f}"]  # fmt: skip
        lines.append(f"| {row['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: dict, out_png: Path) -> Path:
    """One panel per row: the held-out pass rate over the steps, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [row for row in rows.values() if row["curves"]]
    cols = min(4, max(1, len(shown)))
    nrows = max(1, math.ceil(len(shown) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False,
                             sharey=True, constrained_layout=True)  # fmt: skip
    for ax, row in zip(axes.flat, shown, strict=False):
        for seed, curve in row["curves"].items():
            ax.plot([int(s) for s in curve], list(curve.values()), "o-", ms=3, label=f"seed {seed}")
        ax.set_title(f"{row['row']}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("held-out pass rate (%)")
    for ax in list(axes.flat)[len(shown) :]:
        ax.axis("off")
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
    return out_png


def write_report(out_dir: Path, labels: dict[str, str], *, json_path: Path | None = None,
                 png_path: Path | None = None, meta: dict | None = None) -> dict:  # fmt: skip
    """Writes OUT/report.md and OUT/report.json (and ``json_path``, ``png_path`` when given);
    returns the rows."""
    rows = report(out_dir, labels)
    text = table(rows) + "\n\n" + late_table(rows)
    document = {**(meta or {}), "evaluation_movement_shared": shared_movement(rows), "rows": rows}
    (out_dir / "report.md").write_text(text + "\n")
    (out_dir / "report.json").write_text(json.dumps(document, indent=1) + "\n")
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=1) + "\n")
    if png_path is not None and rows:
        plot(rows, png_path)
    return rows


def _span(diag: dict, name: str, digits: int) -> str:
    if name not in diag:
        return "-"
    d = diag[name]
    return f"{d['first_fifth']:.{digits}f} -> {d['last_fifth']:.{digits}f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    from ablate import ROWS

    rows = write_report(args.out_dir, dict(ROWS), json_path=args.json, png_path=args.png)
    print(table(rows) + "\n\n" + late_table(rows))
    shared = shared_movement(rows)
    if shared is not None:
        print(f"\nthe evaluations' movement about each run's trend shared by all {shared['rows']} "
              f"rows: {shared['fraction']:.0%} of its variance ({shared['independent']:.0%} if "
              "independent)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
