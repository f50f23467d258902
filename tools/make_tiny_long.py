"""Writes the long-trace task (issue 29): its splits, the warmed-up tiny policy and its reward model.

    python tools/make_tiny_long.py OUT_DIR [--seed 0] [--warmup-steps 3000] [--slip-rate 0.02]
        [--warmup-problems 40000] [--orm-prompts 256] [--orm-steps 150] [--n-train 2000]
        [--n-eval 200] [--eval-prompts 100]
        [--unfinished [--unfinished-prefixes 0.25] [--unfinished-steps 150]]

OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl (``tiny/long_trace.py``, graded by the long_trace
verifier), OUT_DIR/model (tokenizer + Qwen2ForCausalLM warmed up on slipping traces of fresh
problems; the defaults are the shipped build, ~28 minutes on a shared core) and
OUT_DIR/reward_model (Qwen2ForSequenceClassification: the policy's trunk and a scalar head
trained on the policy's own samples with the verifier's score at the last token only;
``tiny/long_model.py``). Prints one JSON line: sizes, seconds, the policy's pass rates (greedy
and temperature 1) and response lengths on the eval split, and the reward model's fit on fresh
samples of the eval prompts (sign accuracy at the last token, and its value at the first
response token against the mean score, the bias value pretraining removes). Like
tools/make_tiny.py, OUT_DIR/stamp.json records the parameters and a rerun with the same ones
does nothing. vapo_megatron/tiny/long holds the output of the stamp's command; the
recipes recipes/ablation_long*.yaml read it from there. Convert the reward model for a critic
with ``tools/convert.py hf-to-mcore --hf OUT_DIR/reward_model --out DIR --critic-from
reward-model``.

``--unfinished`` also writes OUT_DIR/reward_model_unfinished (issue 44): the same reward model
(same samples, start and loss) trained as well on ``--unfinished-prefixes`` prefixes a response
(on average), cut at uniformly random points and labelled as failures (-1): the paper's biased
reward model, whose values are low early in a response (``tiny/long_model.py:
write_unfinished_reward_model``). The stamp records it under "reward_model_unfinished" (its
parameters, the policy's SHA-256 it was built from, its weights' SHA-256, its fit) and both
reward models' value profiles along held-out responses under "reward_profile"
(tools/reward_profile.py); a rerun with the same parameters does nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from make_tiny import sha256  # noqa: E402

STAMP_VERSION = 2
"""Bump when the task, tokenizer or models change, so old outputs are rebuilt."""
UNFINISHED_VERSION = 1
"""Bump when the unfinished-prefix reward model's construction changes."""
UNFINISHED_DIR = "reward_model_unfinished"
UNFINISHED_KEYS = ("unfinished", "unfinished_prefixes", "unfinished_steps")
"""Options of the second reward model alone: not part of the main build's parameters."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=3000)
    parser.add_argument("--slip-rate", type=float, default=0.02, help="warm-up lines that slip")
    parser.add_argument("--warmup-problems", type=int, default=40000, help="fresh, none held out")
    parser.add_argument("--orm-prompts", type=int, default=256, help="train prompts sampled")
    parser.add_argument("--orm-steps", type=int, default=150)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    parser.add_argument("--eval-prompts", type=int, default=100)
    parser.add_argument(
        "--unfinished",
        action="store_true",
        help="also the reward model trained on unfinished prefixes (issue 44)",
    )
    parser.add_argument(
        "--unfinished-prefixes",
        type=float,
        default=0.25,
        help="unfinished prefixes (labelled -1) per response, on average",
    )
    parser.add_argument("--unfinished-steps", type=int, default=150)
    args = parser.parse_args(argv)
    if args.unfinished_prefixes < 0 or args.unfinished_steps < 1:
        parser.error(
            f"--unfinished-prefixes must be >= 0 and --unfinished-steps >= 1, got "
            f"{args.unfinished_prefixes} and {args.unfinished_steps}"
        )
    if not 0 < args.orm_prompts <= args.n_train:
        parser.error(
            f"--orm-prompts must be in 1..--n-train ({args.n_train}), got {args.orm_prompts}"
        )
    return args


def policy_measures(model_dir: Path, rows: list[dict], seed: int) -> dict[str, float]:
    """The policy's pass rates (greedy, T = 1) and T = 1 response lengths on ``rows``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vapo_megatron.tiny.long_model import sample

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = sample(model, tokenizer, rows, temperature=0.0, seed=seed)
    hot = sample(model, tokenizer, rows, temperature=1.0, seed=seed)
    lengths = [s["response_tokens"] for s in hot]
    return {
        "pass_rate_greedy": statistics.mean(s["acc"] for s in greedy),
        "pass_rate_t1": statistics.mean(s["acc"] for s in hot),
        "t1_response_tokens_mean": statistics.mean(lengths),
        "t1_response_tokens_max": max(lengths),
        "t1_response_tokens_sd": statistics.pstdev(lengths),
    }


def reward_model_measures(orm_dir: Path, model_dir: Path, rows: list[dict], seed: int) -> dict:
    """The reward model on fresh T = 1 samples of ``rows``: how often the sign of its value at
    the last token is the verifier's, and its mean value at the first response token and at
    the last against the mean score."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from vapo_megatron.tiny.long_model import sample, token_values

    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    orm = AutoModelForSequenceClassification.from_pretrained(orm_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = sample(policy, tokenizer, rows, temperature=1.0, seed=seed + 100)
    first, last, right = [], [], 0
    for s in samples:
        values = token_values(orm, s["ids"])
        first.append(values[s["prompt_tokens"]].item())
        last.append(values[-1].item())
        right += (last[-1] > 0) == (s["score"] > 0)
    return {
        "orm_last_token_sign_accuracy": right / len(samples),
        "orm_value_first_response_token_mean": statistics.mean(first),
        "orm_value_last_token_mean": statistics.mean(last),
        "orm_eval_score_mean": statistics.mean(s["score"] for s in samples),
    }


def build(args: argparse.Namespace) -> dict:
    """Writes everything into args.out_dir; returns the result line."""
    from vapo_megatron.tiny.long_model import write_long_policy, write_reward_model
    from vapo_megatron.tiny.long_trace import make_splits, read_rows

    out_dir: Path = args.out_dir
    start, start_cpu = time.perf_counter(), time.process_time()
    train_path, eval_path = make_splits(out_dir, args.n_train, args.n_eval, args.seed)
    model_dir, orm_dir = out_dir / "model", out_dir / "reward_model"
    warm = write_long_policy(model_dir, train_path=train_path, eval_path=eval_path,
                             seed=args.seed, warmup_steps=args.warmup_steps,
                             slip_rate=args.slip_rate,
                             warmup_problems=args.warmup_problems)  # fmt: skip
    warm_seconds = time.perf_counter() - start
    orm = write_reward_model(orm_dir, policy_dir=model_dir, seed=args.seed,
                             rows=read_rows(train_path)[: args.orm_prompts],
                             steps=args.orm_steps)  # fmt: skip
    eval_rows = read_rows(eval_path)[: args.eval_prompts]
    return {
        "model": str(model_dir), "reward_model": str(orm_dir),
        "model_mb": round((model_dir / "model.safetensors").stat().st_size / 2**20, 2),
        "model_sha256": sha256(model_dir / "model.safetensors"),
        "reward_model_sha256": sha256(orm_dir / "model.safetensors"),
        "train_sha256": sha256(train_path), "eval_sha256": sha256(eval_path),
        "warmup_loss": round(warm["loss"], 4), "warmup_seconds": round(warm_seconds, 1),
        **{f"orm_{k}": round(v, 4) for k, v in orm.items()},
        **{k: round(v, 4) for k, v in policy_measures(model_dir, eval_rows, args.seed).items()},
        **{k: round(v, 4) for k, v in
           reward_model_measures(orm_dir, model_dir, eval_rows, args.seed).items()},
        "seconds": round(time.perf_counter() - start, 1),
        "cpu_seconds": round(time.process_time() - start_cpu, 1),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    stamp = build_once(args)
    if args.unfinished:
        stamp = build_unfinished_once(args, stamp)
        print(json.dumps(stamp["reward_model_unfinished"]["result"]))


def build_once(args: argparse.Namespace) -> dict:
    """The task, policy and reward model (``build``) unless the stamp has these parameters;
    prints the result line and returns the stamp."""
    params = {"version": STAMP_VERSION, **{k: v for k, v in vars(args).items()
                                           if k != "out_dir" and k not in UNFINISHED_KEYS}}  # fmt: skip
    stamp_path = args.out_dir / "stamp.json"
    outputs = ("model/config.json", "reward_model/config.json", "train.jsonl", "eval.jsonl")
    if stamp_path.exists() and all((args.out_dir / p).exists() for p in outputs):
        stamp = json.loads(stamp_path.read_text())
        if stamp["params"] == params:
            print(json.dumps({**stamp["result"], "reused": True}))
            return stamp
    result = build(args)
    command = "python tools/make_tiny_long.py OUT_DIR " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in params.items() if k != "version"
    )
    stamp = {"params": params, "result": result, "command": command}
    stamp_path.write_text(json.dumps(stamp, indent=2) + "\n")
    print(json.dumps(result))
    return stamp


def build_unfinished_once(args: argparse.Namespace, stamp: dict) -> dict:
    """OUT_DIR/reward_model_unfinished and both reward models' profiles, unless the stamp has
    them for these parameters and this policy; returns the stamp."""
    params = {"version": UNFINISHED_VERSION, "seed": args.seed, "orm_prompts": args.orm_prompts,
              "prefixes_per_response": args.unfinished_prefixes, "steps": args.unfinished_steps,
              "eval_prompts": args.eval_prompts, "n_eval": args.n_eval,
              "model_sha256": stamp["result"]["model_sha256"]}  # fmt: skip
    done = stamp.get("reward_model_unfinished", {})
    if done.get("params") == params and (args.out_dir / UNFINISHED_DIR / "config.json").exists():
        done["result"]["reused"] = True
        return stamp
    result, profile = build_unfinished(args)
    command = stamp["command"] + (
        f" --unfinished --unfinished-prefixes {args.unfinished_prefixes}"
        f" --unfinished-steps {args.unfinished_steps}"
    )
    stamp["reward_model_unfinished"] = {"params": params, "result": result, "command": command}
    stamp["reward_profile"] = profile
    (args.out_dir / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def build_unfinished(args: argparse.Namespace) -> tuple[dict, dict]:
    """Writes OUT_DIR/reward_model_unfinished from OUT_DIR's policy and training prompts;
    returns its result (SHA-256, samples, loss, fit as ``reward_model_measures``) and the
    profiles of both reward models on the held-out prompts (tools/reward_profile.py)."""
    from reward_profile import MODELS, measure

    from vapo_megatron.tiny.long_model import write_unfinished_reward_model
    from vapo_megatron.tiny.long_trace import read_rows

    out_dir: Path = args.out_dir
    model_dir, orm_dir = out_dir / "model", out_dir / UNFINISHED_DIR
    start, start_cpu = time.perf_counter(), time.process_time()
    fit = write_unfinished_reward_model(
        orm_dir, policy_dir=model_dir, seed=args.seed, steps=args.unfinished_steps,
        rows=read_rows(out_dir / "train.jsonl")[: args.orm_prompts],
        prefixes_per_response=args.unfinished_prefixes,
    )  # fmt: skip
    build_seconds = time.perf_counter() - start
    eval_rows = read_rows(out_dir / "eval.jsonl")[: args.eval_prompts]
    measures = reward_model_measures(orm_dir, model_dir, eval_rows, args.seed)
    result = {
        "reward_model": str(orm_dir),
        "reward_model_sha256": sha256(orm_dir / "model.safetensors"),
        **{f"orm_{k}": round(v, 4) for k, v in fit.items()},
        **{k: round(v, 4) for k, v in measures.items()},
        "build_seconds": round(build_seconds, 1),
    }
    profile = measure(out_dir, MODELS, args.n_eval, args.seed)
    profile["sha256"] = {name: sha256(out_dir / name / "model.safetensors") for name in MODELS}
    result["seconds"] = round(time.perf_counter() - start, 1)
    result["cpu_seconds"] = round(time.process_time() - start_cpu, 1)
    return result, _rounded(profile)


def _rounded(value):
    """Floats in nested dicts and lists to 4 decimals (the stamp's precision)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
