"""The long-trace task's tiny models: a warmed-up Qwen2 policy and its outcome reward model.

- ``write_long_policy``: tokenizer (``tiny_model.train_tokenizer`` on this task's corpus) and a
  ``Qwen2ForCausalLM`` of the demo's shape (``tiny_model.tiny_qwen2_config``: 2 layers, hidden
  128, 0.4 M parameters), warmed up by supervised steps on worked solutions of fresh problems
  (none held out) that slip at ``slip_rate`` a line (``long_trace.worked_solution``). The
  policy learns every step and to slip at about that rate, so at temperature 1 it fails more
  often the longer the trace. The warm-up's length matters more than the model's size: the
  sums modulo 100 are learned late (docs/ablation.md, "Why the first build was weak").
- ``write_reward_model``: the outcome reward model (ORM) the paper starts its critic from, in
  miniature: a ``Qwen2ForSequenceClassification`` whose trunk is the warmed-up policy's and whose
  scalar head (``score``, zero at first) is trained, with the trunk, on the policy's own samples
  (temperature 1) to predict the verifier's score (+1 / -1) at the response's last token only.
  Its values at earlier tokens were never trained, so they are biased, as the paper says of a
  critic initialised from a reward model; the value pretraining has to fix them.
- ``write_unfinished_reward_model`` (issue 44): the same, trained also on unfinished prefixes
  of the responses (cut at uniformly random points) labelled as failures, so it learns
  "unfinished = bad" and values a half-finished response low: the sign of the paper's bias
  (values too low early in a response), which the first ORM lacks; measured, its values stay
  low to the last token rather than rising (docs/ablation.md, "The value model's bias").

Both run on one CPU thread, every draw from the seed, so a rebuild on the same CPU is
bit-identical. Prompts are encoded with the 'raw' template (the recipes' ``data.template``).
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from vapo_megatron.data.prompts import PromptRecord
from vapo_megatron.data.templates import encode_prompt
from vapo_megatron.rewards.long_trace import WRONG, grade
from vapo_megatron.tiny.long_trace import make_rows, parse, read_rows, solve, worked_solution
from vapo_megatron.tiny.model import (
    collate,
    length_bucketed_batches,
    tiny_qwen2_config,
    train_tokenizer,
)

logger = logging.getLogger("vapo_megatron")

MAX_RESPONSE_TOKENS = 700
"""Sampling cap: the longest correct response is ~575 tokens."""
WARMUP_PROBLEMS = 40000
"""Fresh problems the warm-up draws its batches from (16 x 3000 steps is 1.2 passes)."""
MAX_POSITIONS = 1024
"""The models' max_position_embeddings (tiny_qwen2_config's); prompt + response stay below."""
UNFINISHED_SCORE = WRONG.score
"""The target of an unfinished prefix in ``write_unfinished_reward_model``: the verifier's
failing score (-1)."""


def write_long_policy(
    out_dir: str | Path,
    *,
    train_path: str | Path,
    eval_path: str | Path,
    seed: int,
    warmup_steps: int,
    slip_rate: float,
    warmup_problems: int = WARMUP_PROBLEMS,
    lr: float = 3e-3,
    batch_size: int = 16,
) -> dict[str, float]:
    """Writes the tokenizer and the warmed-up policy to ``out_dir``; returns the warm-up's
    last loss. The tokenizer's corpus is the rows of ``train_path`` (``long_trace.make_splits``);
    the warm-up's problems are ``warmup_problems`` fresh ones drawn from ``seed + 2``, none of
    them a prompt of ``eval_path`` (the held-out pass rates measure unseen programs)."""
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate must be in [0, 1), got {slip_rate}")
    train_rows = read_rows(train_path)
    held_out = {row["prompt"] for row in read_rows(eval_path)}
    rows = make_rows(warmup_problems, seed + 2, exclude=held_out)
    tokenizer = train_tokenizer(
        [t for r in train_rows for t in (r["prompt"], solve(r["prompt"])[1])]
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.config.save_pretrained(out_dir)  # its model_type (qwen2) picks the tokenizer class
    # Prompts as the trainer and vLLM will encode them: transformers loads this directory as a
    # Qwen2Tokenizer, whose pre-tokenizer splits every digit (the trained one groups them; the
    # task's prompts have one-digit numbers, so both give the same ids); responses are the
    # model's own tokens, which nobody re-encodes.
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(out_dir)
    prompts = [prompt_ids(row, loaded) for row in rows]
    problems = [parse(row["prompt"]) for row in rows]
    slip_rng = random.Random(seed + 1)

    def batch_of(indices: list[int]) -> list[tuple[list[int], list[int]]]:
        return [
            (prompts[i], _with_eos(worked_solution(problems[i], slip_rate=slip_rate,
                                                   rng=slip_rng)[1], tokenizer))
            for i in indices
        ]  # fmt: skip

    lengths = [len(p) + len(_with_eos(solve(r["prompt"])[1], tokenizer)) for p, r in
               zip(prompts, rows, strict=True)]  # fmt: skip

    def loss_of(batch: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        input_ids, labels, mask = collate(batch, tokenizer.pad_token_id)
        return model(input_ids=input_ids, attention_mask=mask, labels=labels).loss

    result = _train(model, lengths, batch_of, loss_of, steps=warmup_steps, seed=seed, lr=lr,
                    batch_size=batch_size)  # fmt: skip
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out_dir)
    return result


def write_reward_model(
    out_dir: str | Path,
    *,
    policy_dir: str | Path,
    rows: Sequence[dict[str, str]],
    seed: int,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 16,
) -> dict[str, float]:
    """Trains the ORM on one temperature-1 sample of the policy per row of ``rows`` and writes
    it to ``out_dir`` (HF Qwen2ForSequenceClassification, num_labels 1, with the tokenizer).
    Returns the samples' pass rate, their mean length, and the last loss."""

    def finished(samples: list[dict[str, Any]]) -> list[tuple[list[int], float]]:
        return [(s["ids"], s["score"]) for s in samples]

    return _write_orm(out_dir, policy_dir=policy_dir, rows=rows, label=finished, seed=seed,
                      steps=steps, lr=lr, batch_size=batch_size)  # fmt: skip


def write_unfinished_reward_model(
    out_dir: str | Path,
    *,
    policy_dir: str | Path,
    rows: Sequence[dict[str, str]],
    seed: int,
    steps: int,
    prefixes_per_response: float = 0.25,
    lr: float = 1e-3,
    batch_size: int = 16,
) -> dict[str, float]:
    """The ORM of ``write_reward_model`` (same samples, start and loss) trained also on
    unfinished prefixes of the responses labelled as failures (``unfinished_examples``, on
    average ``prefixes_per_response`` a response): it learns "unfinished = bad", the way a
    reward model comes to value a half-finished response low (VC-PPO's bias of a critic
    started from it). At one prefix a response or more every state it values is mostly a
    prefix, and its values are -1 all along; at 0.25 they start near -1 and rise toward the
    mean score (docs/ablation.md, "The value model's bias")."""
    if prefixes_per_response < 0:
        raise ValueError(f"prefixes_per_response must be >= 0, got {prefixes_per_response}")
    cuts = random.Random(seed + 3)  # seed + 1 and + 2 draw the policy's warm-up
    prefixes = []

    def with_prefixes(samples: list[dict[str, Any]]) -> list[tuple[list[int], float]]:
        items = unfinished_examples(samples, prefixes_per_response=prefixes_per_response, rng=cuts)
        prefixes.append(len(items) - len(samples))
        return items

    result = _write_orm(out_dir, policy_dir=policy_dir, rows=rows, label=with_prefixes, seed=seed,
                        steps=steps, lr=lr, batch_size=batch_size)  # fmt: skip
    return {**result, "prefixes": prefixes[0]}


def unfinished_examples(
    samples: Sequence[dict[str, Any]], *, prefixes_per_response: float, rng: random.Random
) -> list[tuple[list[int], float]]:
    """(ids, target at the last id) of each graded sample (``sample``'s dicts): the finished
    response with the verifier's score, then its prefixes with ``UNFINISHED_SCORE``: the
    whole part of ``prefixes_per_response`` of them, and one more with the probability of its
    fractional part. A prefix is the prompt and the response's first c tokens, c drawn
    uniformly from 0..R-1 (R its response tokens, eos included: the states s_0..s_{R-1} a
    critic values, s_0 the prompt alone)."""
    whole, part = divmod(prefixes_per_response, 1.0)
    items = []
    for s in samples:
        items.append((s["ids"], s["score"]))
        count = int(whole) + (1 if part > 0 and rng.random() < part else 0)
        for _ in range(count if s["response_tokens"] > 0 else 0):
            cut = rng.randrange(s["response_tokens"])
            items.append((s["ids"][: s["prompt_tokens"] + cut], UNFINISHED_SCORE))
    return items


def _write_orm(out_dir, *, policy_dir, rows, label, seed, steps, lr, batch_size) -> dict:
    """An ORM on the policy's trunk with a zero ``score`` head, fitted (MSE at each item's last
    token) to ``label(samples)`` of one temperature-1 sample per row, written to ``out_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = Qwen2ForCausalLM.from_pretrained(policy_dir)
    samples = sample(policy, tokenizer, rows, temperature=1.0, seed=seed)
    config = policy.config
    config.num_labels = 1
    config.architectures = ["Qwen2ForSequenceClassification"]
    orm = Qwen2ForSequenceClassification(config)
    orm.model.load_state_dict(policy.model.state_dict())
    torch.nn.init.zeros_(orm.score.weight)
    items = label(samples)
    lengths = [len(ids) for ids, _ in items]

    def loss_of(batch: list[tuple[list[int], float]]) -> torch.Tensor:
        values = last_token_values(orm, [ids for ids, _ in batch], tokenizer.pad_token_id)
        target = torch.tensor([score for _, score in batch], dtype=values.dtype, device="cpu")
        return torch.nn.functional.mse_loss(values, target)

    def batch_of(indices: list[int]) -> list[tuple[list[int], float]]:
        return [items[i] for i in indices]

    result = _train(orm, lengths, batch_of, loss_of, steps=steps, seed=seed, lr=lr,
                    batch_size=batch_size)  # fmt: skip
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    orm.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {
        "samples": len(samples),
        "samples_pass_rate": statistics.mean(s["acc"] for s in samples),
        "samples_mean_tokens": statistics.mean(s["response_tokens"] for s in samples),
        **result,
    }


@torch.no_grad()
def sample(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict[str, str]],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int = MAX_RESPONSE_TOKENS,
    batch_size: int = 128,
) -> list[dict[str, Any]]:
    """One sample per row (``transformers.generate``; temperature 0 is greedy), graded by the
    verifier: dicts of 'ids' (prompt + response + eos when it ended), 'prompt_tokens',
    'response_tokens', 'text', 'score', 'acc'."""
    torch.manual_seed(seed)
    model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    # Batches of problems with similar step counts: generate runs to the batch's longest.
    order = sorted(range(len(rows)), key=lambda i: parse(rows[i]["prompt"])[0])
    out: list[dict[str, Any]] = [{}] * len(rows)
    for begin in range(0, len(rows), batch_size):
        where = order[begin : begin + batch_size]
        chunk = [rows[i] for i in where]
        prompts = [prompt_ids(row, tokenizer) for row in chunk]
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cpu")
        mask = (input_ids != pad).long()
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            eos_token_id=eos,
            pad_token_id=pad,
            max_new_tokens=max_new_tokens,
            **sampling,
        )
        for i, row, prompt, response in zip(where, chunk, prompts, generated[:, width:].tolist(),
                                            strict=True):  # fmt: skip
            if eos in response:
                response = response[: response.index(eos) + 1]
            text = tokenizer.decode(response, skip_special_tokens=True)
            verdict = grade(text, row["answer"]) if eos in response else grade("", row["answer"])
            out[i] = {"ids": prompt + response, "prompt_tokens": len(prompt),
                      "response_tokens": len(response), "text": text,
                      "score": verdict.score, "acc": verdict.acc}  # fmt: skip
    return out


def last_token_values(orm: Any, sequences: Sequence[list[int]], pad_id: int) -> torch.Tensor:
    """The score head at each sequence's last token: [B] (right-padded batch)."""
    width = max(map(len, sequences))
    input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in sequences], device="cpu")
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device="cpu")
    hidden = orm.model(input_ids=input_ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    last = torch.tensor([len(s) - 1 for s in sequences], device="cpu")
    return orm.score(hidden[torch.arange(len(sequences), device="cpu"), last]).squeeze(-1)


@torch.no_grad()
def token_values(orm: Any, ids: list[int]) -> torch.Tensor:
    """The score head at every token of one sequence: [T]."""
    hidden = orm.model(input_ids=torch.tensor([ids], device="cpu")).last_hidden_state
    return orm.score(hidden[0]).squeeze(-1)


def prompt_ids(row: dict[str, str], tokenizer: Any) -> list[int]:
    """A row's prompt encoded as the recipes encode it (template 'raw')."""
    record = PromptRecord(index=0, data_source=row["data_source"], messages=None,
                          text=row["prompt"], answer=row["answer"])  # fmt: skip
    return encode_prompt(record, tokenizer, "raw")


def _train(model, lengths, batch_of, loss_of, *, steps, seed, lr, batch_size) -> dict[str, float]:
    """AdamW with a linear ramp and cosine decay over ``steps`` batches of similar lengths, in
    a seeded order, on one thread; returns the mean loss of the last 5% of steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ramp = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / ramp, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1))))
    )
    order_rng, batches, tail = random.Random(seed), [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model.train()
    try:
        for step in range(steps):
            if not batches:
                batches = length_bucketed_batches(lengths, batch_size, order_rng)
            loss = loss_of(batch_of(batches.pop()))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            if step >= steps - max(1, steps // 20):
                tail.append(loss.item())
            if (step + 1) % 100 == 0:
                logger.info("tiny_long: step %d/%d, loss %.4f", step + 1, steps, loss.item())
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return {"loss": statistics.mean(tail)}


def _with_eos(text: str, tokenizer: Any) -> list[int]:
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
