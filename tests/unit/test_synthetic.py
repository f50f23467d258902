"""The synthetic task, its tokenizer and the tiny HF model directory."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_megatron.data.synthetic import (
    CHAIN_PREFIX,
    MAX_TERMS,
    MIN_TERMS,
    SUM_PREFIX,
    make_problem,
    make_rows,
    make_splits,
    read_rows,
)
from vapo_megatron.data.templates import dapo_instruction
from vapo_megatron.data.tiny_model import pass_rate, train_tokenizer, write_tiny_model
from vapo_megatron.rewards.dapo_math import grade

pytestmark = pytest.mark.unit


def left_to_right(prompt: str) -> int:
    """The prompt's value, read independently of the generator: operations left to right."""
    if prompt.startswith(SUM_PREFIX):
        return sum(int(x) for x in prompt[len(SUM_PREFIX) :].split())
    tokens = re.findall(r"\d+|[-+*]", prompt[len(CHAIN_PREFIX) :])
    value = int(tokens[0])
    for op, x in zip(tokens[1::2], tokens[2::2], strict=True):
        value = {"+": value + int(x), "-": value - int(x), "*": value * int(x)}[op]
    return value


def problems(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def test_solutions_end_in_the_right_answer():
    for prompt, answer, solution in problems(500):
        assert answer == str(left_to_right(prompt))
        *steps, last = solution.split("\n")
        assert last == f"Answer: {answer}"
        assert grade(solution, answer).acc == 1.0
        # Each step applies one operation to the previous step's result.
        previous = None
        for step in steps:
            lhs, rhs = step.split("=")
            a, op, b = re.fullmatch(r"(-?\d+)([-+*])(\d+)", lhs).groups()
            assert previous is None or int(a) == previous
            previous = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
            assert int(rhs) == previous
        assert str(previous) == answer
    # A wrong final line is graded wrong: the check above could fail.
    assert grade("1+1=2\nAnswer: 3", "2").acc == 0.0


def test_lengths_vary_widely_and_both_kinds_occur():
    drawn = problems(1000)
    num_lines = {solution.count("\n") for _, _, solution in drawn}
    assert num_lines == set(range(MIN_TERMS - 1, MAX_TERMS))
    chars = [len(solution) for _, _, solution in drawn]
    assert max(chars) > 6 * min(chars)
    kinds = {prompt.split(":")[0] for prompt, _, _ in drawn}
    assert kinds == {SUM_PREFIX.split(":")[0], CHAIN_PREFIX.split(":")[0]}
    # A small alphabet: letters only from the fixed words.
    alphabet = set("".join(p + s for p, _, s in drawn))
    assert alphabet <= set("0123456789+-*= \n:") | set(SUM_PREFIX + CHAIN_PREFIX + "Answer")


def test_splits_are_disjoint_and_deterministic(tmp_path):
    train, eval_ = make_splits(tmp_path / "a", 300, 50, seed=3)
    train_rows, eval_rows = read_rows(train), read_rows(eval_)
    assert len(train_rows) == 300 and len(eval_rows) == 50
    train_prompts = {r["prompt"] for r in train_rows}
    assert len(train_prompts) == 300
    assert train_prompts.isdisjoint(r["prompt"] for r in eval_rows)
    for row in train_rows + eval_rows:
        assert set(row) == {"prompt", "answer", "data_source"}
        assert row["data_source"] == "math_dapo" and row["answer"] == str(
            left_to_right(row["prompt"])
        )
    again_train, again_eval = make_splits(tmp_path / "b", 300, 50, seed=3)
    assert again_train.read_bytes() == train.read_bytes()
    assert again_eval.read_bytes() == eval_.read_bytes()
    other_train, _ = make_splits(tmp_path / "c", 300, 50, seed=4)
    assert other_train.read_bytes() != train.read_bytes()
    # Each line is one JSON object.
    assert json.loads(train.read_text().splitlines()[0]) == train_rows[0]


def test_exhausted_problem_space_is_an_error():
    # 2-operand sums and chains number at most 9*9*4; far fewer rows than asked exist.
    with pytest.raises(ValueError, match="distinct problems"):
        make_rows(10, seed=0, exclude={p for p, _, _ in problems(20000)})


def test_tokenizer_round_trips_and_is_deterministic():
    drawn = problems(300)
    texts = [dapo_instruction(p) for p, _, _ in drawn] + [s for _, _, s in drawn]
    tokenizer = train_tokenizer(texts)
    assert train_tokenizer(texts).get_vocab() == tokenizer.get_vocab()
    held_out = problems(100, seed=9)
    for text in [dapo_instruction(p) for p, _, _ in held_out] + [s for _, _, s in held_out]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    eos = tokenizer.eos_token_id
    assert tokenizer.decode([eos]) == "<|endoftext|>" and tokenizer.pad_token_id != eos
    # DAPO's instruction is one token each side of the problem.
    problem = held_out[0][0]
    assert (
        len(tokenizer(dapo_instruction(problem))["input_ids"])
        == len(tokenizer(problem)["input_ids"]) + 2
    )
    # Numbers and words are merged: far fewer tokens than characters.
    solution = held_out[0][2]
    assert len(tokenizer(solution)["input_ids"]) < 0.75 * len(solution)


def test_model_dir_loads_and_generates(tmp_path):
    path = write_tiny_model(tmp_path / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (
        128,
        2,
        1,
    )
    assert config.head_dim == 64 and config.num_hidden_layers == 2
    assert config.vocab_size == len(tokenizer) and not config.tie_word_embeddings
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert (path / "model.safetensors").exists()
    prompt = tokenizer(dapo_instruction("Add the numbers: 1 2"), return_tensors="pt")
    # The saved tokenizer keeps DAPO's instruction as one token each side.
    assert prompt["input_ids"].shape[1] == len(tokenizer("Add the numbers: 1 2")["input_ids"]) + 2
    output = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(output[0]), str)


def test_weights_depend_only_on_the_seed_warm_up_included(tmp_path):
    def weights(name, seed, steps):
        path = write_tiny_model(tmp_path / name, seed=seed, warmup_steps=steps)
        return load_file(path / "model.safetensors")

    init = weights("init", 0, 0)
    warm = weights("warm", 0, 2)
    warm_again = weights("warm_again", 0, 2)
    other = weights("other", 1, 0)
    assert warm.keys() == warm_again.keys() == init.keys()
    assert all(torch.equal(warm[k], warm_again[k]) for k in warm)
    assert not torch.equal(warm["model.embed_tokens.weight"], init["model.embed_tokens.weight"])
    assert not torch.equal(other["lm_head.weight"], init["lm_head.weight"])


class AnswersEveryOtherRow:
    """Stands in for a model: appends "Answer: <truth>" (even rows) or "Answer: x" (odd rows)."""

    def __init__(self, tokenizer, rows):
        self.tokenizer, self.rows, self.calls = tokenizer, rows, 0

    def eval(self):
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **_):
        responses = []
        for _ in range(input_ids.shape[0]):
            row = self.rows[self.calls]
            text = f"1+1=2\nAnswer: {row['answer'] if self.calls % 2 == 0 else 'x'}"
            responses.append(self.tokenizer(text)["input_ids"] + [eos_token_id])
            self.calls += 1
        width = max(map(len, responses))
        padded = [r + [pad_token_id] * (width - len(r)) for r in responses]
        return torch.cat([input_ids, torch.tensor(padded)], dim=1)


def test_pass_rate_grades_only_the_responses():
    rows = make_rows(10, seed=0)
    tokenizer = train_tokenizer([r["prompt"] for r in rows])
    model = AnswersEveryOtherRow(tokenizer, rows)
    assert pass_rate(model, tokenizer, rows, temperature=1.0, batch_size=4) == 0.5
    assert model.calls == 10
