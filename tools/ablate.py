"""The paper's Table 1 in miniature: VAPO, its seven ablations and the baselines on the tiny task.

    python tools/ablate.py [--recipe recipes/demo.yaml] [--seeds 3] [--rows NAME,NAME]
        [--steps N] [--out runs/ablate] [section.key=value ...]

Each row is a preset (algorithm.preset), or a preset with recipe overrides (``VARIANTS``: VAPO
with a critic smaller than the policy). Each row x seed (trainer.seed) is one vapo-train run of
the recipe in
OUT/NAME/seed_S, from the same warmed-up policy and its Megatron checkpoint (tools/demo.py's
assets). The presets keep their shape at the recipe's scale (``scaled_algorithm``): the same
samples per step, one sample per prompt where the paper's baseline draws one, the recipe's
critic-pretraining steps where the preset pretrains, DAPO's overlong buffer at the paper's share
of the response length, and the critic started from the policy (the tiny task has no reward
model). A run whose summary.json exists is skipped and an interrupted one resumes from its
checkpoint, so a half-finished sweep continues where it stopped. Runs go seed by seed (every
row's seed 1 first), so a sweep cut short still compares every row. Prints the table (held-out
avg@k after the last step: mean and spread over seeds; steps; seconds) and writes it to
OUT/table.md and OUT/table.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vapo_megatron.run_log import quiet_dependencies  # noqa: E402

quiet_dependencies()

from ablate_report import write_report  # noqa: E402
from demo import DEFAULT_RECIPE, pass_rate, prepare_assets  # noqa: E402
from plot_curves import read_metrics  # noqa: E402

from vapo_megatron.algorithms.presets import PRESETS  # noqa: E402
from vapo_megatron.config.recipe import load_recipe  # noqa: E402
from vapo_megatron.config.train import TrainConfig  # noqa: E402

# Table 1's rows in its order, then the baselines the paper compares with elsewhere.
ROWS = (
    ("vapo", "VAPO"),
    ("vapo_small_critic", "VAPO, critic 1 layer x half width"),
    ("vapo_without_value_pretraining", "w/o Value-Pretraining"),
    ("vapo_without_decoupled_gae", "w/o Decoupled-GAE"),
    ("vapo_without_length_adaptive_gae", "w/o Length-adaptive GAE"),
    ("vapo_without_clip_higher", "w/o Clip-Higher"),
    ("vapo_without_token_level_loss", "w/o Token-level Loss"),
    ("vapo_without_positive_lm_loss", "w/o Positive Example LM Loss"),
    ("vapo_without_group_sampling", "w/o Group-Sampling"),
    ("ppo", "Vanilla PPO"),
    ("vc_ppo", "VC-PPO"),
    ("grpo", "GRPO"),
    ("dapo", "DAPO"),
    ("orz", "ORZ (PPO, lambda = 1)"),
    ("vapo_lag1", "VAPO, lag 1, V-trace GAE"),
    ("vapo_lag4", "VAPO, lag 4, V-trace GAE"),
    ("vapo_lag1_uncorrected", "VAPO, lag 1, plain GAE"),
    ("vapo_lag4_uncorrected", "VAPO, lag 4, plain GAE"),
    ("vapo_lag8", "VAPO, lag 8, V-trace GAE"),
    ("vapo_lag8_uncorrected", "VAPO, lag 8, plain GAE"),
    ("vapo_lag16", "VAPO, lag 16, V-trace GAE"),
    ("vapo_lag16_uncorrected", "VAPO, lag 16, plain GAE"),
)
PAPER_AIME24 = {
    "vapo": 60, "vapo_without_value_pretraining": 11, "vapo_without_decoupled_gae": 33,
    "vapo_without_length_adaptive_gae": 45, "vapo_without_clip_higher": 46,
    "vapo_without_token_level_loss": 53, "vapo_without_positive_lm_loss": 54,
    "vapo_without_group_sampling": 55, "ppo": 5, "dapo": 50,
}  # fmt: skip
"""avg@32 on AIME 2024 in the paper's Table 1 (Qwen2.5-32B); the other rows are not in it."""
VARIANTS: dict[str, str] = {
    "vapo_small_critic": "vapo",
    **{f"vapo_lag{k}{s}": "vapo" for k in (1, 4, 8, 16) for s in ("", "_uncorrected")},
}
"""Rows that are a preset run with other recipe values (``variant_overrides``)."""
LAG_POLICY_LOSS = ['algorithm.rollout_correction.truncate="token"']
"""Every lag row's policy loss: the decoupled objective, each token's PPO loss weighted by
min(pi_old / mu, 2) (token-level TIS at its default C), so the lag rows differ in GAE alone."""
LAG_OVERRIDES: dict[str, list[str]] = {
    f"vapo_lag{k}{s}": [f"rollout.lag={k}", *LAG_POLICY_LOSS]
    + (['algorithm.off_policy_correction="none"'] if s else [])
    for k in (1, 4, 8, 16)
    for s in ("", "_uncorrected")
}
"""Issue 42: generation k steps behind (rollout.lag), GAE with V-trace traces or plain."""
PAPER_MAX_NEW_TOKENS = 20480
"""The paper's response length, against which DAPO's 4096-token overlong buffer is scaled."""


def scaled_algorithm(name: str, config: TrainConfig) -> dict[str, object]:
    """algorithm.* overrides that give preset ``name`` its shape at the recipe's scale.

    The recipe's algorithm keys are VAPO at the tiny scale; the preset's own keys win over
    them, rescaled: the step keeps the recipe's samples (prompts x samples), drawn one per
    prompt where the preset draws one; a preset that pretrains the critic does so for the
    recipe's number of steps; the overlong buffer keeps its share of the response length.
    """
    preset, algo = PRESETS[name], config.algorithm
    out: dict[str, object] = {"preset": name, **preset}
    if "samples_per_prompt" in preset:
        samples = preset["samples_per_prompt"]
        out["samples_per_prompt"] = samples
        out["prompts_per_step"] = config.samples_per_step // samples
    if preset.get("value_pretrain_steps"):
        out["value_pretrain_steps"] = algo.value_pretrain_steps
    if preset.get("overlong_buffer_len"):
        share = preset["overlong_buffer_len"] / PAPER_MAX_NEW_TOKENS
        out["overlong_buffer_len"] = max(1, round(share * config.rollout.max_new_tokens))
    if preset.get("advantage_estimator", "gae") == "gae" and not config.critic.init_path:
        # The demo's task has no reward model; the long-trace recipe (recipes/ablation_long.yaml)
        # names its own, and the presets that start from one (vapo, ppo, vc_ppo) keep it.
        out["critic_init"] = "policy"
    return out


def variant_overrides(name: str, config: TrainConfig) -> list[str]:
    """Recipe overrides of row ``name`` beyond its preset's algorithm keys. vapo_small_critic:
    the critic is its own model, the tiny reward model (1 layer, half the policy's width, the
    policy's tokenizer; tiny/reward_model.py) written next to the policy on first use,
    and starts from it (a value head on another model's trunk cannot start from the policy).
    vapo_lag*: ``LAG_OVERRIDES``."""
    if name in LAG_OVERRIDES:
        return list(LAG_OVERRIDES[name])
    if name != "vapo_small_critic":
        return []
    critic = Path(config.model.path).parent / "small_critic"
    return [f"critic.model={critic}", "critic.create_tiny=true",
            'algorithm.critic_init="reward_model"']  # fmt: skip


def run_one(recipe: Path, overrides: list[str], run_dir: Path) -> dict:
    """One vapo-train run (skipped when run_dir/summary.json exists); returns its result."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        command = [sys.executable, "-m", "vapo_megatron.train", str(recipe), *overrides,
                   f"trainer.run_dir={run_dir}", "trainer.progress_bar=false"]  # fmt: skip
        with open(_log_path(run_dir), "a") as log:
            status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if status != 0:
            raise RuntimeError(f"{run_dir} failed (exit {status}); see {_log_path(run_dir)}")
    summary = json.loads(summary_path.read_text())
    evals = read_metrics(run_dir / "metrics.jsonl")["eval"]
    train = read_metrics(run_dir / "metrics.jsonl").get("train", {})
    return {
        "pass_rate_before": pass_rate(evals[0])["rate"] if 0 in evals else None,
        "pass_rate_after": pass_rate(evals[summary["steps"]])["rate"],
        "steps": summary["steps"],
        "critic_pretrain_steps": summary.get("critic_pretrain_steps", 0),
        "skipped_steps": sum(1 for row in train.values() if row.get("skipped_step")),
        "seconds": summary["seconds"],
    }


def table(results: dict[str, list[dict]]) -> str:
    """Markdown: one row per preset, mean and spread (sample std; min-max with 2 seeds) of the
    held-out pass rate after training, in points, next to the paper's AIME 2024 avg@32."""
    lines = [
        "| run | preset | held-out avg@k (points) | seeds | start | steps | seconds | paper AIME24 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in ROWS:
        runs = results.get(name)
        if not runs:
            continue
        after = [100 * r["pass_rate_after"] for r in runs]
        spread = f" ± {statistics.stdev(after):.1f}" if len(after) > 1 else ""
        before = [100 * r["pass_rate_before"] for r in runs if r["pass_rate_before"] is not None]
        start = f"{statistics.mean(before):.1f}" if before else "-"
        steps = runs[0]["steps"]
        pretrain = runs[0]["critic_pretrain_steps"]
        steps_text = f"{steps} + {pretrain} critic" if pretrain else str(steps)
        seconds = statistics.mean(r["seconds"] for r in runs)
        paper = PAPER_AIME24.get(name, "-")
        lines.append(
            f"| {label} | `{name}` | {statistics.mean(after):.1f}{spread} | {len(runs)} | "
            f"{start} | {steps_text} | {seconds:.0f} | {paper} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=DEFAULT_RECIPE)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N (trainer.seed)")
    parser.add_argument(
        "--rows",
        "--only",
        dest="only",
        help="comma-separated row names (default: every row but the lag rows, vapo_lag*)",
    )
    parser.add_argument("--steps", type=int, help="VAPO steps per run (default: the recipe's)")
    parser.add_argument("--out", type=Path, default=Path("runs/ablate"))
    parser.add_argument("--json", type=Path, help="also write the report (ablate_report.py) here")
    parser.add_argument("--png", type=Path, help="held-out curves per row (default OUT/curves.png)")
    parser.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = parser.parse_args(argv)
    names = [name for name, _ in ROWS if name not in LAG_OVERRIDES]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in dict(ROWS)]
        if unknown:
            print(
                f"error: unknown row(s) {unknown}; choose from {list(dict(ROWS))}", file=sys.stderr
            )
            return 2
        names = wanted
    if args.seeds < 1:
        print(f"error: --seeds must be >= 1, got {args.seeds}", file=sys.stderr)
        return 2
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.steps={args.steps}")
    # The trainer's own checkpoints are enough to resume a run; the demo's periodic ones and
    # the HF export cost time the sweep does not need.
    overrides += ["trainer.checkpoint_every=0", "trainer.export_hf=false"]
    try:
        config = load_recipe(args.recipe, overrides)
        if config.model.create_tiny:
            prepare_assets(config)
        elif not (Path(config.model.path) / "config.json").is_file():
            raise ValueError(
                f"model.path={config.model.path} holds no model; build it first (the long-trace "
                "recipes: python tools/make_tiny_long.py vapo_megatron/tiny/long)"
            )
        plans = {
            name: _algorithm_overrides(scaled_algorithm(VARIANTS.get(name, name), config))
            + variant_overrides(name, config)
            for name in names
        }
        for plan in plans.values():  # refuse a bad combination before hours of runs
            load_recipe(args.recipe, overrides + plan).check(config.trainer.local_world_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    results: dict[str, list[dict]] = {}
    started = time.perf_counter()
    # Seed-major: every row's seed 1 before any row's seed 2, so an interrupted sweep has
    # every row to compare.
    for seed in range(1, args.seeds + 1):
        for name in names:
            run_dir = args.out / name / f"seed_{seed}"
            run_dir.mkdir(parents=True, exist_ok=True)
            state = "done, skipped" if (run_dir / "summary.json").is_file() else "running"
            print(f"ablate: {name} seed {seed}: {state} ({run_dir})", flush=True)
            run_overrides = [*overrides, *plans[name], f"trainer.seed={seed}"]
            try:
                result = run_one(args.recipe, run_overrides, run_dir)
            except RuntimeError as err:
                print(f"ablate: {err}", file=sys.stderr)
                return 1
            results.setdefault(name, []).append(result)
            # After every run, so an interrupted sweep keeps what it has (OUT/report.*).
            write_report(args.out, dict(ROWS), json_path=args.json,
                         png_path=args.png or args.out / "curves.png")  # fmt: skip
            print(
                f"ablate: {name} seed {seed}: {100 * result['pass_rate_after']:.1f} points after "
                f"{result['steps']} steps, {result['seconds']:.0f} s",
                flush=True,
            )
    text = table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "table.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    print(f"ablate: {time.perf_counter() - started:.0f} s; table in {args.out / 'table.md'}")
    return 0


def _algorithm_overrides(plan: dict[str, object]) -> list[str]:
    return [f"algorithm.{key}={json.dumps(value)}" for key, value in plan.items()]


def _log_path(run_dir: Path) -> Path:
    return run_dir / "train.log"


if __name__ == "__main__":
    sys.exit(main())
