"""Teacher-forced probe of a long-trace policy: the probability it gives each part of a correct trace.

    python tools/probe_tiny_long.py [--model vapo_megatron/tiny/long/model] [--prompts 100]

For the first N held-out prompts (``eval.jsonl`` beside the model directory, or ``--eval``)
the model reads the prompt (encoded as the trainer encodes it) and the correct worked solution
with its eos (encoded as the warm-up encoded it: the trained pre-tokenizer, which keeps digit
runs together) and scores every response token. Printed:

- per part of a line (``1 a:7+7=14`` newline: round, letter, ``:``, value, sign, operand,
  ``=``, result, newline; ``Answer:`` and its value; eos), the mean probability of the correct
  token; a token that spans parts (a merge such as `` a:``) is its own part, named by both;
- the share of lines whose every token is the model's argmax (greedy lines right, teacher-forced);
- the expected temperature-1 pass rate: the mean over prompts of exp(sum of the correct
  tokens' log-probabilities), the chance of sampling exactly the correct trace (a lucky wrong
  trace, ~1 in 9 slipped ones, is not counted).

The last line of stdout is the same as one JSON object. docs/ablation.md's tables of the
warm-up's probes were measured this way. Reads the model and nothing else; one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

DEFAULT_MODEL = REPO_ROOT / "vapo_megatron" / "tiny" / "long" / "model"
LINE = re.compile(r"(\d+)( [a-z])(:)(\d+)([-+])(\d+)(=)(\d+)")
LINE_PARTS = ("round", "letter", ":", "value", "sign", "operand", "=", "result")
ANSWER = re.compile(r"(Answer:)( \d+)")
ANSWER_PARTS = ("Answer:", "answer")
ORDER = (*LINE_PARTS, "newline", *ANSWER_PARTS, "eos")


def char_parts(text: str) -> list[str]:
    """The part of a line (``LINE_PARTS``, "newline", ``ANSWER_PARTS``) each character of a
    worked solution belongs to. ValueError for a line that is neither a step nor the answer."""
    parts: list[str] = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        step, answer = LINE.fullmatch(line), ANSWER.fullmatch(line)
        match, names = (step, LINE_PARTS) if step else (answer, ANSWER_PARTS)
        if match is None:
            raise ValueError(f"line {i} of the solution is neither a step nor the answer: {line!r}")
        for group, name in enumerate(names, start=1):
            parts += [name] * len(match.group(group))
        if i < len(lines) - 1:
            parts.append("newline")
    return parts


def token_parts(text: str, offsets: list[tuple[int, int]]) -> list[str]:
    """Each token's part: the parts of the characters it covers, joined by '+' when several."""
    chars = char_parts(text)
    out = []
    for start, end in offsets:
        names = list(dict.fromkeys(chars[start:end]))
        out.append("+".join(names))
    return out


def probe(model_dir: Path, eval_path: Path, prompts: int) -> dict:
    """The measures above for the first ``prompts`` rows of ``eval_path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from vapo_megatron.tiny.long_model import prompt_ids
    from vapo_megatron.tiny.long_trace import read_rows, solve
    from vapo_megatron.tiny.model import EOS_TOKEN, PAD_TOKEN

    torch.set_num_threads(1)
    rows = read_rows(eval_path)[:prompts]
    if not rows:
        raise ValueError(f"{eval_path} has no rows to probe")
    trainer_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    warmup_tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    probs: dict[str, list[float]] = {}
    line_right: list[bool] = []
    exact: list[float] = []
    for row in rows:
        text = solve(row["prompt"])[1]
        encoded = warmup_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        response = [*encoded["input_ids"], warmup_tokenizer.eos_token_id]
        parts = [*token_parts(text, encoded["offset_mapping"]), "eos"]
        prompt = prompt_ids(row, trainer_tokenizer)
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(response)
        correct = logp.gather(1, target[:, None]).squeeze(1)
        argmax_right = (logits.argmax(-1) == target).tolist()
        for name, value in zip(parts, correct.exp().tolist(), strict=True):
            probs.setdefault(name, []).append(value)
        exact.append(math.exp(float(correct.sum())))
        line_ok = True  # a line ends at its newline; the answer line at eos
        for name, right in zip(parts, argmax_right, strict=True):
            line_ok = line_ok and right
            if name.endswith("newline") or name == "eos":
                line_right.append(line_ok)
                line_ok = True
    known = [name for name in ORDER if name in probs]
    return {
        "model": str(model_dir), "prompts": len(rows),
        "p_correct": {name: round(statistics.mean(probs[name]), 4)
                      for name in known + sorted(set(probs) - set(known))},
        "greedy_lines_right": round(statistics.mean(line_right), 4),
        "expected_pass_t1": round(statistics.mean(exact), 4),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF policy directory")
    parser.add_argument("--eval", type=Path, help="held-out rows (default: MODEL/../eval.jsonl)")
    parser.add_argument("--prompts", type=int, default=100, help="rows probed (the first N)")
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    eval_path = args.eval or args.model.parent / "eval.jsonl"
    for path in (args.model / "config.json", eval_path):
        if not path.is_file():
            parser.error(f"{path} not found (--model is an HF directory, --eval a jsonl of rows)")
    result = probe(args.model, eval_path, args.prompts)
    print(f"{result['prompts']} held-out prompts, teacher-forced on the correct traces")
    print("| " + " | ".join(result["p_correct"]) + " |")
    print("|" + "---|" * len(result["p_correct"]))
    print("| " + " | ".join(f"{p:.3f}" for p in result["p_correct"].values()) + " |")
    print(f"greedy lines right {result['greedy_lines_right']:.1%}, "
          f"expected pass at T = 1 {result['expected_pass_t1']:.1%}")  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
