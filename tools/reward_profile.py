"""The reward models' values along held-out responses: the bias a critic started from one carries (issue 44).

    python tools/reward_profile.py [DIR] [--models reward_model,reward_model_unfinished]
        [--prompts 200] [--seed 0] [--png docs/reward_bias.png] [--json OUT.json] [--stamp]

Samples the policy DIR/model at temperature 1 once on the first ``--prompts`` held-out prompts
(DIR/eval.jsonl; seed + 100, the samples of make_tiny_long.py's reward-model fit) and reads
each reward model DIR/NAME at every position of every response. Values are the critic's
V(s_t) (docs/design.md, "Positions"): the value of the state before response token t, read at
the token before it (the last prompt token for t = 0), t = 0..R-1. The profile is their mean
at fractions f of the response (t = round(f (R - 1)): f = 0 the first response token, 1 the
last), next to the mean return (gamma 1, the reward at the last token: the verifier's score)
and to the model's score after the last token (what a reward model is trained to give). Also
per model, on the failing responses, the mean GAE advantage at the first token with lambda
0.95 (VC-PPO's): positive when the values rise along a response that fails, the paper's
"better than expected" early tokens. Prints a markdown table; ``--png`` draws the profiles.
make_tiny_long.py --unfinished records the same numbers in DIR/stamp.json
("reward_profile"); ``--stamp`` prints and draws those instead of measuring again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_DIR = Path("vapo_megatron/tiny/long")
MODELS = ("reward_model", "reward_model_unfinished")
TABLE_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The table's positions: the first response token, the ends of its quarters, the last."""
PLOT_FRACTIONS = tuple(i / 20 for i in range(21))
LAMBDA = 0.95
"""The lambda of the first-token advantage (VC-PPO's, the paper's PPO)."""


def state_values(orm: Any, ids: list[int], prompt_tokens: int) -> tuple[torch.Tensor, float]:
    """(V(s_t) for t = 0..R-1: [R], the score after the last token) of one sequence of
    ``prompt_tokens`` prompt ids and R = len(ids) - prompt_tokens response ids."""
    from vapo_megatron.tiny.long_model import token_values

    values = token_values(orm, ids)  # [P + R]: the head after each token
    return values[prompt_tokens - 1 : -1], values[-1].item()


def first_token_advantage(values: torch.Tensor, score: float, lam: float = LAMBDA) -> float:
    """GAE's advantage at t = 0 (gamma 1) of one response: values [R], the score at its last
    token, the value after it 0."""
    from vapo_megatron.algorithms.gae import gae_padded

    rewards = torch.zeros(1, values.numel(), dtype=torch.float64, device="cpu")
    rewards[0, -1] = score
    mask = torch.ones(1, values.numel(), dtype=torch.bool, device="cpu")
    advantages, _ = gae_padded(rewards, values.double()[None], mask, lam)
    return advantages[0, 0].item()


def profile(orm: Any, samples: Sequence[dict], fractions: Sequence[float]) -> dict[str, Any]:
    """One reward model over graded samples (dicts of 'ids', 'prompt_tokens', 'score', 'acc'):
    the mean V(s_t) at each fraction (all, passing, failing responses), the mean score after
    the last token, and the failing responses' mean first-token advantage."""
    at: dict[str, list[list[float]]] = {"all": [], "pass": [], "fail": []}
    after, advantage_fail = [], []
    for s in samples:
        values, final = state_values(orm, s["ids"], s["prompt_tokens"])
        last = values.numel() - 1
        point = [values[round(f * last)].item() for f in fractions]
        at["all"].append(point)
        at["pass" if s["acc"] > 0 else "fail"].append(point)
        after.append(final)
        if s["acc"] == 0:
            advantage_fail.append(first_token_advantage(values, s["score"]))
    return {
        **{group: _column_means(rows, len(fractions)) for group, rows in at.items()},
        "score_after_last": statistics.mean(after),
        "first_token_advantage_fail": statistics.mean(advantage_fail) if advantage_fail else None,
    }


def measure(directory: Path, models: Sequence[str], prompts: int, seed: int) -> dict[str, Any]:
    """Samples the held-out prompts once and profiles every reward model on them."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from vapo_megatron.tiny.long_model import sample
    from vapo_megatron.tiny.long_trace import read_rows

    policy = AutoModelForCausalLM.from_pretrained(directory / "model")
    tokenizer = AutoTokenizer.from_pretrained(directory / "model")
    rows = read_rows(directory / "eval.jsonl")[:prompts]
    samples = sample(policy, tokenizer, rows, temperature=1.0, seed=seed + 100)
    out: dict[str, Any] = {
        "prompts": len(rows),
        "seed": seed + 100,
        "lambda": LAMBDA,
        "mean_return": statistics.mean(s["score"] for s in samples),
        "pass_rate": statistics.mean(s["acc"] for s in samples),
        "response_tokens_mean": statistics.mean(s["response_tokens"] for s in samples),
        "fractions": list(PLOT_FRACTIONS),
        "models": {},
    }
    for name in models:
        orm = AutoModelForSequenceClassification.from_pretrained(directory / name)
        out["models"][name] = profile(orm, samples, PLOT_FRACTIONS)
    return out


def markdown(result: dict[str, Any]) -> str:
    """The table: per model (all / passing / failing responses) the mean V(s_t) at
    TABLE_FRACTIONS, the score after the last token, and the mean return beside them."""
    columns = [result["fractions"].index(f) for f in TABLE_FRACTIONS]
    lines = [
        "| reward model | responses | first token | 1/4 | 1/2 | 3/4 | last token | "
        "score after last | mean return | A(s_0), lambda 0.95, failing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, prof in result["models"].items():
        for group in ("all", "pass", "fail"):
            values = " | ".join(_signed(prof[group][i]) for i in columns)
            extra = (
                f"{_signed(prof['score_after_last'])} | {_signed(result['mean_return'])} | "
                f"{_signed(prof['first_token_advantage_fail'])}"
                if group == "all"
                else "| |"
            )
            lines.append(f"| `{name}` | {group} | {values} | {extra} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """The mean V(s_t) along the response per model (solid: all responses; dashed: failing),
    with the mean return as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, prof) in enumerate(result["models"].items()):
        color = f"C{i}"
        ax.plot(result["fractions"], prof["all"], color=color, marker="o", ms=3, label=name)
        ax.plot(result["fractions"], prof["fail"], color=color, ls="--", lw=1,
                label=f"{name}, failing")  # fmt: skip
    ax.axhline(result["mean_return"], color="k", lw=1, label="mean return")
    ax.set_xlabel("position in the response (fraction of its tokens)")
    ax.set_ylabel("mean V(s_t)")
    ax.set_title(f"Reward models on {result['prompts']} held-out responses (T = 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}"


def _column_means(rows: list[list[float]], width: int) -> list[float | None]:
    if not rows:
        return [None] * width
    return [statistics.mean(row[i] for row in rows) for i in range(width)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, nargs="?", default=DEFAULT_DIR)
    parser.add_argument("--models", default=",".join(MODELS), help="reward models under DIR")
    parser.add_argument("--prompts", type=int, default=200, help="held-out prompts sampled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stamp", action="store_true", help="the profile in DIR/stamp.json")
    args = parser.parse_args(argv)
    if args.stamp:
        return report(json.loads((args.directory / "stamp.json").read_text())["reward_profile"],
                      args)  # fmt: skip
    models = [m for m in args.models.split(",") if m]
    missing = [m for m in models if not (args.directory / m / "config.json").is_file()]
    if missing:
        print(f"error: no reward model at {[str(args.directory / m) for m in missing]}; build it "
              "with tools/make_tiny_long.py (--unfinished)", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(1)
    return report(measure(args.directory, models, args.prompts, args.seed), args)


def report(result: dict[str, Any], args: argparse.Namespace) -> int:
    print(markdown(result))
    if args.png:
        plot(result, args.png)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
