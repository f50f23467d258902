"""A complete tiny Hugging Face model directory for the synthetic task, built on the spot.

- Tokenizer: byte-level BPE trained on the task's problems and worked solutions, digit runs
  split off first, so any string round-trips exactly and each number is one token wherever it
  appears. DAPO's instruction (before and after the problem) is one added token each, and
  special tokens ``<|endoftext|>`` (eos, id 0) and ``<|pad|>`` (id 1).
- Policy: ``Qwen2ForCausalLM`` with random weights from the seed, in a shape vLLM's CPU build
  runs (head_dim 64) and Megatron splits at TP 2 / PP 2 (2 heads, 2 layers). Or (``family``)
  a tiny ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (:func:`tiny_qwen3_config`: qk norms,
  head_dim 64 != hidden / heads = 16; 4 experts, top 2), split at TP 2, PP 2, CP 2, EP 2 and
  EP 2 x TP 2; tied or untied embeddings.
- Warm-up (optional): a short supervised run on (prompt, solution) pairs of the train split,
  loss on the solution and eos tokens only, so RL starts from a low but non-zero pass rate;
  the solutions may slip (``slip_rate``) or be guesses (``guess_rate``). Measured on the 200
  eval prompts (seed 0, batch 16, lr 3e-3, one thread, ~0.09 CPU seconds a step): 4000 steps
  with slip 0.3: 81.5% greedy, 21.5% at temperature 1; 8000 steps with slip 0.15 and guess 0.5
  (the demo's, ~700 CPU seconds): 4.5% greedy (the guess is the likeliest first token), 18%
  at temperature 1.

Everything is a function of the seed: the corpus, the BPE merges, the initial weights and the
warm-up's data order; the warm-up runs on one CPU thread, so its weights are bit-identical.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from vapo_megatron.data.prompts import PromptRecord
from vapo_megatron.data.templates import DAPO_PREFIX, DAPO_SUFFIX, encode_prompt
from vapo_megatron.parallel.devices import HOST
from vapo_megatron.rewards.dapo_math import grade
from vapo_megatron.tiny.synthetic import (
    DATA_SOURCE,
    guessed_solution,
    make_rows,
    parse,
    read_rows,
    solve,
    worked_solution,
)

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
TOKENIZER_VOCAB_SIZE = 510
"""BPE vocabulary cap: 256 bytes, merges and the 2 special tokens, DAPO's 2 phrases on top.
The task's corpus runs out of merges first: the vocabulary comes out at ~400."""
WARMUP_TEMPLATES = ("dapo", "raw")
"""Prompt templates the tiny model can be built for (it has no chat template)."""
CORPUS_ROWS = 2000
"""Rows drawn for the tokenizer's corpus when no train split is given."""
TINY_FAMILIES = {
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
}
"""The HF model types a tiny model can be built as (:func:`tiny_model_config`), and the class
built for each."""


def train_tokenizer(
    texts: Sequence[str], *, vocab_size: int = TOKENIZER_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts``, with eos and pad tokens."""
    tokenizer = Tokenizer(models.BPE())
    # Digit runs split off first, so "50" is the same token in "8+42=50" and "Answer: 50".
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # DAPO's instruction is the same in every prompt of the 'dapo' template: one token for each
    # side keeps prompts ~20 tokens instead of ~70, which is most of the tiny model's compute.
    tokenizer.add_tokens(
        [
            AddedToken(phrase, normalized=False, special=False)
            for phrase in (DAPO_PREFIX, DAPO_SUFFIX)
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def tiny_qwen2_config(tokenizer: PreTrainedTokenizerFast) -> Qwen2Config:
    """The tiny policy's config: head_dim 64 for vLLM's CPU kernels, 2 heads and 2 layers for TP/PP 2."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )


def tiny_qwen3_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    moe: bool,
    tie_word_embeddings: bool = False,
    num_layers: int = 2,
    num_experts: int = 4,
    top_k: int = 2,
) -> Qwen3Config | Qwen3MoeConfig:
    """A tiny Qwen3 (``moe=False``) or Qwen3-MoE config on ``tokenizer``'s vocabulary.

    hidden 64, 4 query heads and 2 KV heads of head_dim 64 (query width 256 != hidden: the
    explicit head_dim path; 64 is a head size vLLM's CPU attention takes), qk norms; dense MLP
    width 128. MoE: every layer ``num_experts`` experts of width 32 (even: expert TP 2), top
    ``top_k`` renormalised (``norm_topk_prob``, as the published Qwen3-MoE checkpoints), no
    aux-loss output. Splits at TP 2 (heads), PP 2 (layers), EP 2 (experts).
    """
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        attention_bias=False,
        use_sliding_window=False,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if not moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        output_router_logits=False,
    )


def _tiny_sigmoid_moe(tokenizer: PreTrainedTokenizerFast, num_layers: int) -> dict[str, Any]:
    """What a tiny DeepSeek-V3 and GLM-4.5 share: hidden 64, 4 heads, dense width 128, the
    first layer dense, 8 routed experts of width 32 (even: expert TP 2) in 4 groups, top 4
    from the best 2 groups (top_k / topk_group = 2, the ratio at which transformers' and
    megatron's group scores agree), one shared expert, weights renormalised and scaled 2.5."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def tiny_deepseek_v3_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    num_layers: int = 3,
    yarn: bool = False,
    kv_lora_rank: int = 32,
    qk_rope_head_dim: int = 16,
) -> DeepseekV3Config:
    """A tiny DeepSeek-V3 (:func:`_tiny_sigmoid_moe`) with MLA: q_lora_rank 32, per head 16
    dims without RoPE and ``qk_rope_head_dim`` with, values 16, latent ``kv_lora_rank``.
    vLLM-CPU's MLA decode kernel takes only kv_lora_rank + qk_rope_head_dim = 576
    (DeepSeek-V3's 512 + 64: :data:`VLLM_CPU_MLA`), the small default is for Megatron-only
    tests. ``yarn``: DeepSeek-V3's YaRN scaling (factor 4 over 256 positions, mscale =
    mscale_all_dim = 1), else plain RoPE. ``topk_method``/``scoring_func`` are written as
    the published configs have them: vLLM's deepseek_v2.py builds the expert bias only with
    ``noaux_tc`` and routes by softmax unless told ``sigmoid``. Splits at TP 2 (heads, the
    latent widths), PP 2 (layers), EP 2 (experts)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0,
        }  # fmt: skip
    return DeepseekV3Config(
        **_tiny_sigmoid_moe(tokenizer, num_layers),
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=16,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=False,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


VLLM_CPU_MLA = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
"""The latent widths of a tiny DeepSeek-V3 that vLLM-CPU serves (its MLA decode kernel,
``cpu_mla.py``, takes kv_lora_rank + qk_rope_head_dim = 576 only)."""


def tiny_glm4_moe_config(
    tokenizer: PreTrainedTokenizerFast, *, num_layers: int = 3
) -> Glm4MoeConfig:
    """A tiny GLM-4.5 (:func:`_tiny_sigmoid_moe`): 4 query heads, 2 KV heads of head_dim 64
    (a width vLLM's CPU attention takes), q/k/v biases, qk norms (GLM-4.5's; Air has none),
    RoPE on the first half of each head (``partial_rotary_factor`` 0.5)."""
    return Glm4MoeConfig(
        **_tiny_sigmoid_moe(tokenizer, num_layers),
        num_key_value_heads=2,
        head_dim=64,
        attention_bias=True,
        use_qk_norm=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        partial_rotary_factor=0.5,
    )


def tiny_model_config(
    tokenizer: PreTrainedTokenizerFast, family: str = "qwen2", *, tie_word_embeddings: bool = False
) -> PretrainedConfig:
    """The tiny policy's config of ``family`` (one of :data:`TINY_FAMILIES`)."""
    if family == "qwen2":
        config = tiny_qwen2_config(tokenizer)
        config.tie_word_embeddings = tie_word_embeddings
        return config
    if family in ("qwen3", "qwen3_moe"):
        return tiny_qwen3_config(
            tokenizer, moe=family == "qwen3_moe", tie_word_embeddings=tie_word_embeddings
        )
    if family in ("deepseek_v3", "glm4_moe"):  # the recipes' models: vLLM-CPU serves them
        if family == "deepseek_v3":
            config = tiny_deepseek_v3_config(tokenizer, **VLLM_CPU_MLA)
        else:
            config = tiny_glm4_moe_config(tokenizer)
        config.tie_word_embeddings = tie_word_embeddings
        return config
    raise ValueError(
        f"tiny model family {family!r} is not known; choose one of {list(TINY_FAMILIES)}"
    )


def write_tiny_model(
    out_dir: str | Path,
    *,
    seed: int,
    warmup_steps: int = 0,
    train_path: str | Path | None = None,
    template: str = "dapo",
    slip_rate: float = 0.0,
    guess_rate: float = 0.0,
    family: str = "qwen2",
    tie_word_embeddings: bool = False,
) -> Path:
    """Writes tokenizer + policy (+ warm-up) to ``out_dir``; returns ``out_dir``.

    ``family``: the policy's HF model type (:data:`TINY_FAMILIES`, :func:`tiny_model_config`):
    the demo's Qwen2 by default, or a tiny Qwen3 / Qwen3-MoE with random weights from ``seed``;
    ``tie_word_embeddings``: lm_head shares the embedding.

    The tokenizer's corpus and the warm-up data are the rows of ``train_path`` (a plain JSONL
    split from ``synthetic.write_split``), or rows drawn from ``seed`` when it is None.
    ``template`` is how prompts are encoded in the warm-up; it must be the one the RL run uses.
    ``slip_rate``, ``guess_rate``: the warm-up's solutions slip at that rate a line, and that
    fraction of them are guesses with no working (``warm_up``).
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    for name, rate in (("slip_rate", slip_rate), ("guess_rate", guess_rate)):
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {rate}")
    if family not in TINY_FAMILIES:
        raise ValueError(
            f"tiny model family {family!r} is not known; choose one of {list(TINY_FAMILIES)}"
        )
    if template not in WARMUP_TEMPLATES:
        raise ValueError(
            f"template {template!r} cannot be used: the tiny tokenizer has no chat template; "
            f"choose one of {list(WARMUP_TEMPLATES)}"
        )
    rows = read_rows(train_path) if train_path is not None else make_rows(CORPUS_ROWS, seed)
    tokenizer = train_tokenizer(_corpus(rows))
    torch.manual_seed(seed)
    config = tiny_model_config(tokenizer, family, tie_word_embeddings=tie_word_embeddings)
    model = TINY_FAMILIES[family](config)
    if warmup_steps > 0:
        warm_up(
            model, tokenizer, rows, steps=warmup_steps, seed=seed, template=template,
            slip_rate=slip_rate, guess_rate=guess_rate,
        )  # fmt: skip
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def warm_up(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict[str, str]],
    *,
    steps: int,
    seed: int,
    template: str = "dapo",
    batch_size: int = 16,
    lr: float = 3e-3,
    slip_rate: float = 0.0,
    guess_rate: float = 0.0,
) -> dict[str, float]:
    """Supervised warm-up on (prompt, worked solution + eos); returns the last loss and seconds.

    With ``slip_rate`` > 0 each use of a problem draws its solution's slips afresh
    (``synthetic.worked_solution``): the model learns the arithmetic and also to slip at about
    that rate a line, which sampling at temperature 1 then does and RL can remove. With
    ``guess_rate`` > 0 that fraction of uses is a guessed answer with no working instead
    (``synthetic.guessed_solution``): the model learns to guess about that often.
    AdamW with a short linear ramp and cosine decay; batches of similar lengths are drawn in a
    seeded order, one epoch after another. Runs on one thread for bit-identical weights.
    """
    prompts = [_prompt_ids(row, tokenizer, template) for row in rows]
    problems = [parse(row["prompt"]) for row in rows]
    answers = [row["answer"] for row in rows]
    lengths = [
        len(prompt) + len(_response_ids(problem, tokenizer))
        for prompt, problem in zip(prompts, problems, strict=True)
    ]
    order_rng, slip_rng = random.Random(seed), random.Random(seed + 1)
    guess_rng = random.Random(seed + 2)
    batches: list[list[int]] = []
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ramp = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / ramp, 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))),
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model.train()
    start = time.perf_counter()
    loss = torch.zeros(())
    try:
        for _ in range(steps):
            if not batches:
                batches = length_bucketed_batches(lengths, batch_size, order_rng)
            batch = [
                (
                    prompts[i],
                    _guess_ids(answers[i], tokenizer, guess_rng)
                    if guess_rate > 0 and guess_rng.random() < guess_rate
                    else _response_ids(problems[i], tokenizer, slip_rate, slip_rng),
                )
                for i in batches.pop()
            ]
            input_ids, labels, attention_mask = collate(batch, tokenizer.pad_token_id)
            loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return {"loss": loss.item(), "seconds": time.perf_counter() - start}


@torch.no_grad()
def pass_rate(
    model: Any,
    tokenizer: PreTrainedTokenizerFast,
    rows: Sequence[dict[str, str]],
    *,
    temperature: float,
    seed: int = 0,
    template: str = "dapo",
    max_new_tokens: int = 96,
    batch_size: int = 32,
) -> float:
    """Fraction of ``rows`` DAPO's grader marks correct, sampled with ``transformers.generate``.

    ``temperature`` 0 is greedy; otherwise plain sampling (no top-k / top-p), as the rollout
    samples. Prompts are left-padded in batches of ``batch_size``.
    """
    torch.manual_seed(seed)
    model.eval()
    correct = 0
    for begin in range(0, len(rows), batch_size):
        chunk = rows[begin : begin + batch_size]
        prompts = [_prompt_ids(row, tokenizer, template) for row in chunk]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sampling = (
            {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
            if temperature > 0
            else {"do_sample": False}
        )
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            **sampling,
        )
        for row, response in zip(chunk, output[:, width:], strict=True):
            text = tokenizer.decode(response, skip_special_tokens=True)
            correct += grade(text, row["answer"]).acc == 1.0
    return correct / max(len(rows), 1)


def _corpus(rows: Sequence[dict[str, str]]) -> list[str]:
    """The tokenizer's training texts: each problem and its worked solution."""
    return [text for row in rows for text in (row["prompt"], solve(row["prompt"])[1])]


def _record(row: dict[str, str]) -> PromptRecord:
    return PromptRecord(
        index=0,
        data_source=row.get("data_source", DATA_SOURCE),
        messages=None,
        text=row["prompt"],
        answer=row["answer"],
    )


def _prompt_ids(
    row: dict[str, str], tokenizer: PreTrainedTokenizerFast, template: str
) -> list[int]:
    return encode_prompt(_record(row), tokenizer, template)


def _response_ids(
    problem: tuple[list[int], list[str]],
    tokenizer: PreTrainedTokenizerFast,
    slip_rate: float = 0.0,
    rng: random.Random | None = None,
) -> list[int]:
    """The worked solution (with slips drawn from ``rng`` at ``slip_rate``), then eos."""
    return _with_eos(worked_solution(*problem, slip_rate=slip_rate, rng=rng)[1], tokenizer)


def _guess_ids(answer: str, tokenizer: PreTrainedTokenizerFast, rng: random.Random) -> list[int]:
    """A guessed answer with no working (``synthetic.guessed_solution``), then eos."""
    return _with_eos(guessed_solution(answer, rng), tokenizer)


def _with_eos(text: str, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """The ids of ``text`` (no special tokens added), then eos: a response to train on."""
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, rng: random.Random
) -> list[list[int]]:
    """One epoch of batches (example indices), in an order drawn from ``rng``.

    Batches are cut from runs of 8 batches' worth of shuffled examples sorted by ``lengths``
    (tokens of prompt and solution), which cuts the padding (solutions run from ~10 to ~80
    tokens) by about half.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    run = 8 * batch_size
    batches = []
    for begin in range(0, len(order), run):
        chunk = sorted(order[begin : begin + run], key=lengths.__getitem__)
        batches.extend(chunk[b : b + batch_size] for b in range(0, len(chunk), batch_size))
    rng.shuffle(batches)
    return batches


def collate(
    batch: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input_ids, labels (-100 on prompt and padding), attention_mask: each [B, T]
    (host tensors: the tiny models train on the host). ``batch``: (prompt, response) ids."""
    width = max(len(p) + len(r) for p, r in batch)
    input_ids, labels, attention_mask = [], [], []
    for prompt, response in batch:
        pad = width - len(prompt) - len(response)
        input_ids.append(prompt + response + [pad_id] * pad)
        labels.append([-100] * len(prompt) + response + [-100] * pad)
        attention_mask.append([1] * (len(prompt) + len(response)) + [0] * pad)
    return (
        torch.tensor(input_ids, device=HOST),
        torch.tensor(labels, device=HOST),
        torch.tensor(attention_mask, device=HOST),
    )
