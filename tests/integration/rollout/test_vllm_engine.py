"""The rollout engine against transformers, on tiny random Qwen2 models (vLLM's CPU build).

Run with the vLLM environment (see docs/rollout.md); skipped where vllm is not installed.
"""

import math
import time

import pytest
import torch

from vapo_megatron.weights.buckets import iter_buckets

vllm = pytest.importorskip("vllm", reason="vllm is not installed (see docs/rollout.md)")
transformers = pytest.importorskip("transformers")

from vapo_megatron.rollout.engine import RolloutConfig, RolloutEngine  # noqa: E402
from vapo_megatron.rollout.vllm_args import (  # noqa: E402
    VLLM_VERSION,
    check_vllm_version,
    cpu_thread_binding,
)

pytestmark = pytest.mark.integration

MAX_NEW_TOKENS = 12
# Lengths straddle vLLM's CPU KV block (128 tokens), so the prefix cache holds full blocks
# of the longest prompt: after a weight update those blocks are stale.
PROMPT_LENGTHS = (3, 17, 150)


def make_qwen2(path, seed, *, hidden=128, heads=2, kv_heads=1, layers=2, vocab=512, ffn=256):
    """Save a random Qwen2 (fp32) to ``path``; return the model.

    head_dim = hidden / heads must be one vLLM's CPU attention supports (64 here). Weights
    are drawn wider than the default init so that next-token distributions are peaked and
    greedy choices are not near-ties.
    """
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.1 if param.dim() > 1 else 0.05)
    model.save_pretrained(path)
    return model


def prompts(vocab=512, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt_ids, max_new_tokens=MAX_NEW_TOKENS):
    out = []
    for ids in prompt_ids:
        generated = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(generated[0, len(ids) :].tolist())
    return out


def hf_token_logprobs(model, prompt, response, temperature=1.0):
    """Log-softmax of transformers' logits at the positions that predict each response token."""
    prompt, response = list(prompt), list(response)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    # Token t of the response is predicted at the position before it.
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logits.log_softmax(-1)[positions, torch.tensor(response)]


def greedy(engine, prompt_ids, **kwargs):
    samples = engine.generate(prompt_ids, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, **kwargs)
    return [s.response_token_ids.tolist() for s in samples], samples


def hf_tensors(model):
    return [(name, p.detach().clone()) for name, p in model.state_dict().items()]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_qwen2")
    a = make_qwen2(root / "a", seed=0)
    b = make_qwen2(root / "b", seed=1)
    return {"a": a, "b": b, "a_path": str(root / "a")}


class TestInProcessEngine:
    """One TP=1 engine shared by these tests; it is shut down before the tests below start.

    vLLM keeps its parallel state per process: shutting an engine down tears it down for
    every engine of the process, so engines here never overlap.
    """

    @pytest.fixture(scope="class")
    def engine(self, models):
        config = RolloutConfig(
            model_path=models["a_path"], dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20
        )
        engine = RolloutEngine(config)
        print(f"\nengine start (TP=1, in-process): {engine.start_seconds:.1f} s")
        yield engine
        engine.shutdown()

    def test_seeded_sampling_of_more_prompt_tokens_than_one_scheduler_step(self, engine):
        """200 prompts x 8 samples of 25 tokens hold 40k prompt tokens, more than one
        scheduler step; vLLM 0.32's CPU worker crashed seeded sampling when it split a
        prefill ("CPU Generator does not use offset"). The same seed repeats exactly."""
        prompt_ids = [[5 + i % 50] * 25 for i in range(200)]
        first = engine.generate(prompt_ids, n=8, temperature=1.0, max_new_tokens=4, seed=11)
        again = engine.generate(prompt_ids, n=8, temperature=1.0, max_new_tokens=4, seed=11)
        assert len(first) == 1600
        assert [s.response_token_ids for s in first] == [s.response_token_ids for s in again]

    def test_greedy_matches_transformers(self, engine, models):
        prompt_ids = prompts()
        got, samples = greedy(engine, prompt_ids)
        assert got == hf_greedy(models["a"], prompt_ids)
        assert [s.prompt_index for s in samples] == list(range(len(prompt_ids)))
        assert all(s.sample_index == 0 and s.finish_reason == "length" for s in samples)
        assert all(len(s.logprobs) == MAX_NEW_TOKENS for s in samples)

    def test_update_weights_switches_models(self, engine, models):
        prompt_ids = prompts()
        before, before_samples = greedy(engine, prompt_ids)
        want_b = hf_greedy(models["b"], prompt_ids)
        assert before != want_b

        # 40 kB buckets split q/k/v and gate/up of a layer across messages.
        stats = engine.update_weights(iter_buckets(hf_tensors(models["b"]), 40_000))
        n_params = sum(p.numel() for p in models["b"].parameters())
        assert stats.num_tensors == len(models["b"].state_dict())
        assert stats.num_bytes == 4 * n_params and stats.num_buckets > 10
        got_b, _ = greedy(engine, prompt_ids)
        assert got_b == want_b

        # Back to A, in reverse order and one bucket: exactly the engine's first output.
        engine.update_weights([list(reversed(hf_tensors(models["a"])))])
        after, after_samples = greedy(engine, prompt_ids)
        assert after == before
        assert [s.logprobs for s in after_samples] == [s.logprobs for s in before_samples]

    def test_partial_update_keeps_the_rest(self, engine, models):
        prompt_ids = prompts()
        want_a, _ = greedy(engine, prompt_ids)
        layer0_b = [(n, t) for n, t in hf_tensors(models["b"]) if ".layers.0." in n]
        engine.update_weights([layer0_b])
        mixed, _ = greedy(engine, prompt_ids)
        assert mixed != want_a
        engine.update_weights([[t for t in hf_tensors(models["a"]) if ".layers.0." in t[0]]])
        assert greedy(engine, prompt_ids)[0] == want_a

    def test_logprobs_match_transformers(self, engine, models):
        """vLLM's log-probs of its own samples vs transformers' log-softmax at the same positions.

        Both run the same fp32 weights; they differ only in kernels (vLLM's CPU attention and
        fused ops vs eager torch), i.e. in fp32 rounding. Measured: mean |ratio - 1| ~7e-7,
        largest log-prob gap ~3e-6. The bounds (1e-5 and 1e-4) leave 10-40x room for other
        CPUs and thread counts and stay far below a real error: a log-prob read one position
        off, for the wrong token, or after temperature moves it by O(0.1-1).
        """
        prompt_ids = prompts()
        samples = engine.generate(prompt_ids, n=2, temperature=1.0, max_new_tokens=10, seed=123)
        ratios, gaps = [], []
        for s in samples:
            want = hf_token_logprobs(models["a"], prompt_ids[s.prompt_index], s.response_token_ids)
            got = torch.tensor(s.logprobs, dtype=torch.float64)
            ratios.append((got - want).exp().sub(1).abs())
            gaps.append((got - want).abs().max().item())
        mean_ratio_error = torch.cat(ratios).mean().item()
        print(
            f"\nmean |exp(logp_vllm - logp_hf) - 1| = {mean_ratio_error:.2e}, max gap {max(gaps):.2e}"
        )
        assert mean_ratio_error < 1e-5
        assert max(gaps) < 1e-4

    def test_stop_token_ends_the_response(self, engine, models):
        prompt_ids = prompts()[:1]
        full = hf_greedy(models["a"], prompt_ids)[0]
        stop = full[3]
        assert stop not in full[:3]
        samples = engine.generate(
            prompt_ids, temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=[stop]
        )
        assert (
            samples[0].response_token_ids.tolist() == full[:4]
        )  # the stop token is part of the response
        assert samples[0].finish_reason == "stop"
        assert len(samples[0].logprobs) == 4

    def test_seeded_sampling(self, engine):
        same_prompt_twice = [prompts()[0]] * 2
        run = lambda seed: engine.generate(  # noqa: E731
            same_prompt_twice, n=3, temperature=1.0, max_new_tokens=8, seed=seed
        )
        first, again = run(5), run(5)
        assert [s.response_token_ids for s in first] == [s.response_token_ids for s in again]
        assert [(s.prompt_index, s.sample_index) for s in first] == [
            (p, i) for p in range(2) for i in range(3)
        ]
        # Six samples of one prompt, six distinct seeds: no two share a random stream.
        assert len({tuple(s.response_token_ids) for s in first}) == 6
        assert [s.response_token_ids for s in run(6)] != [s.response_token_ids for s in first]

    def test_empty_and_invalid_requests(self, engine):
        assert engine.generate([], max_new_tokens=4) == []
        with pytest.raises(ValueError, match="n must be >= 1"):
            engine.generate(prompts()[:1], n=0, max_new_tokens=4)

    def test_sleep_and_wake_up_are_no_ops_on_cpu(self, engine):
        assert engine.is_cpu
        prompt_ids = prompts()[:1]
        before, _ = greedy(engine, prompt_ids)
        engine.sleep()
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert greedy(engine, prompt_ids)[0] == before
        with pytest.raises(ValueError, match="wake_up tags"):
            engine.wake_up(["scheduling"])


def test_processed_logprobs_follow_temperature(models):
    """logprobs_mode='processed_logprobs' returns log-probs of the distribution sampled from."""
    config = RolloutConfig(
        model_path=models["a_path"],
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=32 << 20,
        logprobs_mode="processed_logprobs",
    )
    engine = RolloutEngine(config)
    try:
        prompt_ids = prompts()
        samples = engine.generate(prompt_ids, temperature=0.7, max_new_tokens=8, seed=1)
    finally:
        engine.shutdown()
    for s in samples:
        prompt = prompt_ids[s.prompt_index]
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        want = hf_token_logprobs(models["a"], prompt, s.response_token_ids, temperature=0.7)
        raw = hf_token_logprobs(models["a"], prompt, s.response_token_ids)
        assert (got - want).abs().max() < 1e-4
        assert (got - raw).abs().max() > 0.1


def test_version_check():
    check_vllm_version(VLLM_VERSION)
    check_vllm_version(VLLM_VERSION + "+cpu")
    assert vllm.__version__.split("+")[0] == VLLM_VERSION
    with pytest.raises(RuntimeError) as error:
        check_vllm_version("0.31.1", "/somewhere/vllm")
    message = str(error.value)
    assert "0.31.1" in message and VLLM_VERSION in message and "pip install" in message


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="dtype must be"):
        RolloutConfig(model_path="m", dtype="auto")
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        RolloutConfig(model_path="m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="weight_bucket_bytes must be > 0"):
        RolloutConfig(model_path="m", weight_bucket_bytes=0)
    with pytest.raises(ValueError, match="logprobs_mode must be"):
        RolloutConfig(model_path="m", logprobs_mode="raw_logits")


def test_cpu_thread_binding():
    assert cpu_thread_binding(2, [1, 0]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert cpu_thread_binding(1, [0, 1]) == "0,1"
    with pytest.raises(ValueError, match="at least"):
        cpu_thread_binding(3, [0, 1])


def test_tensor_parallel_2(models, tmp_path):
    """TP=2 (two worker processes): greedy parity, weight updates through the RPC queue."""
    # Two KV heads so that each rank holds one (TP=2 with one KV head replicates it).
    a = make_qwen2(tmp_path / "a", seed=2, kv_heads=2)
    prompt_ids = prompts()
    config = RolloutConfig(
        model_path=str(tmp_path / "a"),
        tensor_parallel_size=2,
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=32 << 20,
    )
    engine = RolloutEngine(config)
    print(f"\nengine start (TP=2, worker processes): {engine.start_seconds:.1f} s")
    try:
        before, _ = greedy(engine, prompt_ids)
        assert before == hf_greedy(a, prompt_ids)
        b = make_qwen2(tmp_path / "b", seed=3, kv_heads=2)
        engine.update_weights(iter_buckets(hf_tensors(b), 40_000))
        assert greedy(engine, prompt_ids)[0] == hf_greedy(b, prompt_ids)
        engine.update_weights([hf_tensors(a)])
        assert greedy(engine, prompt_ids)[0] == before
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_benchmark_weight_update(tmp_path, tp):
    """Start time, update_weights throughput vs memcpy, and peak extra memory per rank.

    A ~230 MB fp32 Qwen2 (hidden 1024, 2 layers, vocab 16384). Run with
    ``pytest -m slow -s -k benchmark tests/integration/rollout/test_vllm_engine.py``.
    """
    model = make_qwen2(
        tmp_path / "m", seed=0, hidden=1024, heads=8, kv_heads=2, layers=2, vocab=16384, ffn=2816
    )
    tensors = hf_tensors(model)
    del model
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    config = RolloutConfig(
        model_path=str(tmp_path / "m"),
        tensor_parallel_size=tp,
        dtype="float32",
        max_model_len=256,
        kv_cache_bytes=32 << 20,
    )
    engine = RolloutEngine(config)
    try:
        prompt_ids = prompts(vocab=16384)
        want, _ = greedy(engine, prompt_ids)
        # Baseline: copy the same tensors into memory that is already allocated and touched,
        # as the engine's parameters are. Best of 3, like the updates below.
        destination = [torch.empty_like(t) for _, t in tensors]
        memcpy_seconds = []
        for _ in range(4):
            start = time.perf_counter()
            for dst, (_, src) in zip(destination, tensors, strict=True):
                dst.copy_(src)
            memcpy_seconds.append(time.perf_counter() - start)
        del destination
        print(
            f"\nTP={tp}: start {engine.start_seconds:.1f} s, model {total / 1e6:.0f} MB, "
            f"memcpy (Tensor.copy_) {total / min(memcpy_seconds[1:]) / 1e9:.2f} GB/s"
        )
        for bucket_mb in (16, 64, 256):
            engine.update_weights(iter_buckets(tensors, bucket_mb << 20))  # warm-up
            rss = engine.reset_peak_memory()
            runs = [engine.update_weights(iter_buckets(tensors, bucket_mb << 20)) for _ in range(3)]
            extra = [
                (peak - now) / 1e6 for peak, now in zip(engine.peak_memory(), rss, strict=True)
            ]
            seconds = min(r.seconds for r in runs)
            print(
                f"bucket {bucket_mb:>3} MB: {runs[0].num_buckets:>2} buckets, {seconds:.2f} s, "
                f"{total / seconds / 1e9:.2f} GB/s, "
                f"peak extra memory per rank {', '.join(f'{e:.0f}' for e in extra)} MB"
            )
            assert runs[0].num_bytes == total and math.isfinite(seconds)
        assert greedy(engine, prompt_ids)[0] == want
    finally:
        engine.shutdown()
