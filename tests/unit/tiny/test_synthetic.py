"""The synthetic task, its tokenizer and the tiny HF model directory."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from vapo_megatron.data.templates import dapo_instruction
from vapo_megatron.rewards.dapo_math import grade
from vapo_megatron.tiny.model import pass_rate, train_tokenizer, write_tiny_model
from vapo_megatron.tiny.synthetic import (
    MAX_TERMS,
    MAX_VALUE,
    MIN_TERMS,
    PREFIX,
    guessed_solution,
    make_problem,
    make_rows,
    make_splits,
    parse,
    read_rows,
    solve,
    worked_solution,
)

pytestmark = pytest.mark.unit
LINE = re.compile(r"([a-j]):(\d+)([-+*])(\d+)=(\d+)")


def left_to_right(prompt: str) -> int:
    """The prompt's value, read independently of the generator: operations left to right."""
    terms = prompt[len(PREFIX) :].split()
    value = int(terms[0].split("=")[1])
    for term in terms[1:]:
        op, x = term[2], int(term[3:])
        value = {"+": value + x, "-": value - x, "*": value * x}[op]
    return value


def problems(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    rng = random.Random(seed)
    return [make_problem(rng) for _ in range(n)]


def check_lines(prompt: str, solution: str) -> list[bool]:
    """Per line: does it apply the prompt's next term to the previous line's result exactly?

    Asserts the lines name the terms in order and start from the previous line's result.
    """
    operands, ops = parse(prompt)
    *steps, last = solution.split("\n")
    assert len(steps) == len(ops)
    value, exact = operands[0], []
    for i, step in enumerate(steps):
        letter, a, op, b, result = LINE.fullmatch(step).groups()
        assert letter == "abcdefghij"[i + 1] and int(a) == value
        assert (op, int(b)) == (ops[i], operands[i + 1])
        value = int(result)
        exact.append(
            value == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        )
    assert last == f"Answer: {value}"
    return exact


def test_solutions_end_in_the_right_answer():
    for prompt, answer, solution in problems(500):
        assert answer == str(left_to_right(prompt))
        assert all(check_lines(prompt, solution))
        assert grade(solution, answer).acc == 1.0
        assert solve(prompt) == (answer, solution)
        operands, ops = parse(prompt)
        partial = operands[0]
        for op, x in zip(ops, operands[1:], strict=True):
            partial = {"+": partial + x, "-": partial - x, "*": partial * x}[op]
            assert 0 <= partial <= MAX_VALUE
    # A wrong final line is graded wrong: the check above could fail.
    assert grade("b:1+1=2\nAnswer: 3", "2").acc == 0.0


def test_slips_are_drawn_at_the_rate_and_carried_on():
    rng = random.Random(5)
    drawn = problems(2000)
    lines = slipped = wrong = 0
    for prompt, answer, _ in drawn:
        slip_answer, solution = worked_solution(*parse(prompt), slip_rate=0.2, rng=rng)
        exact = check_lines(prompt, solution)  # the chain goes on from the slipped result
        lines, slipped = lines + len(exact), slipped + exact.count(False)
        wrong += slip_answer != answer
        for step in solution.split("\n")[:-1]:
            assert 0 <= int(step.split("=")[1]) <= MAX_VALUE
        if all(exact):
            assert slip_answer == answer
    assert abs(slipped / lines - 0.2) < 0.02
    assert 0.3 < wrong / len(drawn) < 0.8
    # No rate, no slips; a rate needs an rng; the rate is checked.
    prompt = drawn[0][0]
    assert worked_solution(*parse(prompt)) == solve(prompt)
    with pytest.raises(ValueError, match="rng"):
        worked_solution(*parse(prompt), slip_rate=0.1)
    with pytest.raises(ValueError, match="slip_rate"):
        worked_solution(*parse(prompt), slip_rate=1.0, rng=rng)


def test_guesses_are_near_and_never_right():
    rng = random.Random(2)
    offsets = set()
    for _, answer, _ in problems(500):
        guess = guessed_solution(answer, rng)
        assert re.fullmatch(r"Answer: \d+", guess)
        assert grade(guess, answer).acc == 0.0
        value = int(guess.split()[-1])
        assert 0 <= value <= MAX_VALUE and 1 <= abs(value - int(answer)) <= 9
        offsets.add(value - int(answer))
    assert len(offsets) > 10  # drawn, not one fixed offset
    assert {guessed_solution("0", rng) for _ in range(100)} == {
        f"Answer: {d}" for d in range(1, 10)
    }


def test_parse_refuses_other_text():
    for bad in ["Add the numbers: 1 2", PREFIX + "a=1", PREFIX + "a=1 c=+2", PREFIX + "a=+1 b=+2",
                PREFIX + "a=1 b=2", PREFIX + "a=1  b=+2"]:  # fmt: skip
        with pytest.raises(ValueError, match="not a synthetic problem"):
            parse(bad)


def test_lengths_vary_widely():
    drawn = problems(1000)
    num_lines = {solution.count("\n") for _, _, solution in drawn}
    assert num_lines == set(range(MIN_TERMS - 1, MAX_TERMS))
    chars = [len(solution) for _, _, solution in drawn]
    assert max(chars) > 4 * min(chars)
    assert {op for prompt, _, _ in drawn for op in parse(prompt)[1]} == {"+", "-", "*"}
    # A small alphabet: letters a..j and the fixed words.
    alphabet = set("".join(p + s for p, _, s in drawn))
    assert alphabet <= set("0123456789+-*= \n:abcdefghij") | set(PREFIX + "Answer")


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
    # 2-term problems number at most 9*9*3; far fewer rows than asked exist.
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
    # Trained on as many problems as the tiny model's (2000), every number is one token, so every
    # worked line is the same 8 tokens: letter, ':', number, operation, number, '=', number, '\n'.
    tokenizer = train_tokenizer([text for p, _, s in problems(2000) for text in (p, s)])
    for _, _, solution in held_out:
        for line in solution.split("\n")[:-1]:
            assert len(tokenizer(line + "\n")["input_ids"]) == 8, line


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
    problem = PREFIX + "a=1 b=+2"
    prompt = tokenizer(dapo_instruction(problem), return_tensors="pt")
    # The saved tokenizer keeps DAPO's instruction as one token each side.
    assert prompt["input_ids"].shape[1] == len(tokenizer(problem)["input_ids"]) + 2
    output = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert output.shape[1] > prompt["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(output[0]), str)


def test_weights_depend_only_on_the_seed_warm_up_included(tmp_path):
    def weights(name, seed, steps, slip_rate=0.0, guess_rate=0.0):
        path = write_tiny_model(
            tmp_path / name, seed=seed, warmup_steps=steps, slip_rate=slip_rate,
            guess_rate=guess_rate,
        )  # fmt: skip
        return load_file(path / "model.safetensors")

    init = weights("init", 0, 0)
    warm = weights("warm", 0, 2)
    warm_again = weights("warm_again", 0, 2)
    other = weights("other", 1, 0)
    slipped, slipped_again = weights("slip", 0, 3, 0.5), weights("slip_again", 0, 3, 0.5)
    guessed, guessed_again = weights("guess", 0, 3, 0.0, 0.5), weights("guess2", 0, 3, 0.0, 0.5)
    assert all(torch.equal(guessed[k], guessed_again[k]) for k in warm)
    assert not torch.equal(guessed["lm_head.weight"], slipped["lm_head.weight"])
    assert warm.keys() == warm_again.keys() == init.keys()
    assert all(torch.equal(warm[k], warm_again[k]) for k in warm)
    assert all(torch.equal(slipped[k], slipped_again[k]) for k in warm)
    assert not torch.equal(slipped["lm_head.weight"], weights("clean3", 0, 3)["lm_head.weight"])
    with pytest.raises(ValueError, match="slip_rate"):
        write_tiny_model(tmp_path / "bad", seed=0, slip_rate=-0.1)
    with pytest.raises(ValueError, match="guess_rate"):
        write_tiny_model(tmp_path / "bad", seed=0, guess_rate=1.0)
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
            text = f"b:1+1=2\nAnswer: {row['answer'] if self.calls % 2 == 0 else 'x'}"
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
