"""GPU check: the trainer's own code paths on one device, part by part, in under a minute.

Written for the first GPU this project meets (one H200, no vLLM, no Transformer Engine) and run
on CPU by the test suite (``--cpu``, gloo; ``tests/integration/test_gpu_check.py``). Nothing is
downloaded: a tiny Qwen2 (hidden 64, 2 layers, 4 heads of 16, vocabulary 256) is written with
random weights into a temporary HF directory, and the data are random token ids.

Parts (each timed; a failure is printed and the next part still runs):

- ``distributed``: ``trainer/session.py::init_distributed`` as under torchrun (NCCL on GPU,
  gloo on CPU), one all-reduce of a device tensor, both models' process groups.
- ``default_layer_spec``: which layer spec the trainer picks by itself (``models/provider.py``):
  Transformer Engine's when it imports on a GPU, else the local spec this check builds with.
- ``engines``: the policy and the critic ``ModelEngine`` (local spec) loaded from the HF files
  as ``Session`` loads them; parameters on the device.
- ``scoring``: ``score_flat`` with ``logprob_scoring_fn`` / ``value_scoring_fn`` on a packed step
  of 3 prompts x 2 responses (several micro-batches).
- ``update_critic``, ``update_policy``: GAE, then one ``train_on`` each with ``value_loss_fn`` /
  ``policy_loss_fn``, fields as ``trainer/step.py::run_step`` builds them; loss, grad norm, and
  that the weights moved.
- ``weight_stream``: ``stream_policy_weights`` into a ``transformers`` Qwen2 in process; every
  tensor of the stream's plan arrives, and every HF parameter is set.
- ``hf_logits``: that HF model's logits vs the Megatron policy's on the packed micro-batches;
  max |diff| within a tolerance set by the dtype (skipped only when transformers is absent).
- ``checkpoint``: ``save_train_checkpoint`` / ``load_train_checkpoint`` as the loop resumes, into
  fresh engines; weights, Adam state and scheduler equal the saved ones bit for bit.
- ``checkpoint_weights``: ``save_model_weights`` / ``load_model_weights`` (the reshardable
  dist_checkpointing format ``policy.load`` and ``tools/convert.py`` read), bit for bit.
- ``te_spec``: the policy with Transformer Engine's layer spec, loaded and scored; log-probs vs
  the local spec's. Skipped when ``transformer_engine`` does not import (and with ``--cpu``).

Each part prints one line (name, ok/failed/skipped, seconds, key numbers; peak CUDA memory on
GPU). The last line of stdout is one JSON object; ``"ok": true`` only when every part ran and
passed, ``te_spec`` and (without transformers) ``hf_logits`` excepted. Exit code 0 iff ok.

    python tools/gpu_check.py                  # CUDA, NCCL world of 1, bf16
    python tools/gpu_check.py --cpu            # CPU, gloo, fp32 (never touches CUDA)
"""

# ruff: noqa: E402  (--cpu must hide CUDA before torch is imported)

from __future__ import annotations

import os
import sys

if "--cpu" in sys.argv[1:]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import argparse
import faulthandler
import importlib
import json
import math
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from vapo_megatron.algorithms.presets import algo_preset
from vapo_megatron.models import hf_io
from vapo_megatron.models.checkpoint import load_model_weights, make_metadata, save_model_weights
from vapo_megatron.models.config import HFModelConfig
from vapo_megatron.models.provider import (
    ModelLayout,
    default_layer_spec,
    layer_spec_kind,
    local_spec,
)
from vapo_megatron.models.record import ModelChunk, ModelRecord
from vapo_megatron.parallel.model_groups import (
    build_model_groups,
    ensure_global_memory_buffer,
    seed_rng_tracker,
)
from vapo_megatron.rollout.weight_stream import stream_plan, stream_policy_weights
from vapo_megatron.trainer import advantage_phase as adv
from vapo_megatron.trainer.batching import FLAT_INDEX, build_samples, micro_batches
from vapo_megatron.trainer.batching import response_offsets as flat_offsets
from vapo_megatron.trainer.checkpointing import (
    TrainableState,
    load_train_checkpoint,
    save_train_checkpoint,
)
from vapo_megatron.trainer.loss_fns import (
    logprob_scoring_fn,
    policy_loss_fn,
    value_loss_fn,
    value_scoring_fn,
)
from vapo_megatron.trainer.model_engine import ModelEngine, OptimSettings
from vapo_megatron.trainer.scoring import score_flat
from vapo_megatron.trainer.session import _critic_from_policy, init_distributed
from vapo_megatron.trainer.updates import train_on

SEED = 1234
CPU = torch.device("cpu")
HF_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "initializer_range": 0.02,
    "bos_token_id": None,
    "eos_token_id": 0,
}
PROMPTS, SAMPLES_PER_PROMPT = 3, 2
TOKEN_BUDGET = 64
"""Micro-batch token budget: the step's ~130 tokens make several micro-batches."""
OPTIM = OptimSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0)
"""A large learning rate, so one update visibly moves bf16 weights."""
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 8 * 2.0**-7}
"""Allowed max |logit diff| between two implementations, per unit of max(1, max |logit|): fp32
agrees to ~1e-6 on CPU (kernel and reduction order on GPU add a little); bf16 rounds each
activation to 8 bits of mantissa, a few times per layer. A wrong weight mapping or RoPE base
moves logits by a large fraction of their scale."""
PARTS = (
    "distributed", "default_layer_spec", "engines", "scoring", "update_critic", "update_policy",
    "weight_stream", "hf_logits", "checkpoint", "checkpoint_weights", "te_spec",
)  # fmt: skip
OPTIONAL_PARTS = {"te_spec", "hf_logits"}
"""Parts whose 'skipped' (their reason: a package not importable, or --cpu) still lets ok be true."""


class Skipped(Exception):
    """A part that cannot run here; its message says why."""


class CheckFailed(Exception):
    """A part ran but a number is out of bounds."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def importable(module: str) -> tuple[bool, str]:
    """(whether ``module`` imports, its version or the error)."""
    try:
        mod = importlib.import_module(module)
    except Exception as err:  # TE raises more than ImportError when its libraries are off
        return False, f"{type(err).__name__}: {err}".splitlines()[0][:200]
    return True, str(getattr(mod, "__version__", "?"))


def random_hf_tensors(hf: HFModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every HF tensor of the policy, random at a scale that gives logits of order 1 (so the
    logits check has something to compare), on the CPU as a checkpoint file holds them."""
    record = ModelRecord(hf, "lm")
    gen = torch.Generator(device=CPU).manual_seed(SEED)
    out = {}
    for name in record.hf_names(ModelChunk.whole(hf.num_layers)):
        shape = record.hf_shape(name)
        noise = torch.randn(shape, generator=gen, device=CPU)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith(".bias"):
            tensor = 0.1 * noise
        elif name == "model.embed_tokens.weight":
            tensor = noise
        else:  # [out, in] matrices: unit-variance outputs from unit-variance inputs
            tensor = noise / shape[-1] ** 0.5
        out[name] = tensor.to(dtype)
    return out


def write_hf_dir(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    path.mkdir(parents=True)
    hf_io.write_config(path, {**HF_CONFIG, "dtype": str(dtype).removeprefix("torch.")})
    writer = hf_io.SafetensorsWriter(path)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()


def random_step(vocab_size: int) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """Prompts (each repeated SAMPLES_PER_PROMPT times, as group sampling does), responses of
    random token ids and 0/1 rewards."""
    gen = torch.Generator(device=CPU).manual_seed(SEED + 1)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=gen, device=CPU).tolist()

    prompts, responses, rewards = [], [], []
    for p in range(PROMPTS):
        prompt = ids(6 + 3 * p)
        for s in range(SAMPLES_PER_PROMPT):
            prompts.append(prompt)
            responses.append(ids(5 + 7 * p + 4 * s))
            rewards.append(float((p + s) % 2))
    return prompts, responses, rewards


def tensors_of(engine: ModelEngine) -> dict[str, torch.Tensor]:
    """Everything a resume must restore: chunk state (weights), optimizer main params and Adam
    moments, keyed by where they sit (scheduler state is compared apart)."""
    out = {}
    for i, chunk in enumerate(engine.chunks):
        for key, value in chunk.state_dict().items():
            if isinstance(value, torch.Tensor):
                out[f"chunk{i}.{key}"] = value.detach().clone()
    opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    for o, opt in enumerate(opts):
        inner = opt.optimizer
        params = [p for group in inner.param_groups for p in group["params"]]
        for j, param in enumerate(params):
            out[f"opt{o}.param{j}"] = param.detach().clone()
            for key, value in inner.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    out[f"opt{o}.param{j}.{key}"] = value.detach().clone()
    return out


def compare_exact(
    saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], what: str
) -> tuple[int, float]:
    """(tensors compared, max |diff|); CheckFailed unless the names and every value agree."""
    check(sorted(saved) == sorted(loaded), f"{what}: names differ: {set(saved) ^ set(loaded)}")
    worst = 0.0
    differ = []
    for key, value in saved.items():
        other = loaded[key]
        if value.shape != other.shape or value.dtype != other.dtype:
            differ.append(f"{key} {tuple(value.shape)}/{value.dtype} vs {tuple(other.shape)}")
            continue
        if not torch.equal(value, other.to(value.device)):
            diff = (value.double() - other.to(value.device).double()).abs().max().item()
            worst = max(worst, diff)
            differ.append(f"{key} ({diff:.3g})")
    check(not differ, f"{what}: {len(differ)} of {len(saved)} differ: {differ[:5]}")
    return len(saved), worst


def max_change(before: list[torch.Tensor], engine: ModelEngine) -> float:
    after = [p.detach() for chunk in engine.chunks for p in chunk.parameters()]
    pairs = zip(after, before, strict=True)
    return max((a.double() - b.double()).abs().max().item() for a, b in pairs)


def param_snapshot(engine: ModelEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in engine.chunks for p in chunk.parameters()]


class GPUCheck:
    """The parts, in order, sharing what they built."""

    def __init__(self, device: torch.device, dtype: torch.dtype, workdir: Path) -> None:
        self.device, self.dtype, self.workdir = device, dtype, workdir
        self.results: dict[str, dict] = {}
        self.hf = HFModelConfig.from_hf(HF_CONFIG)
        self.algo = algo_preset("vapo")
        self.prompts, self.responses, self.rewards = random_step(self.hf.vocab_size)
        self.offsets = flat_offsets([len(r) for r in self.responses])
        self.hf_dir = workdir / "hf_policy"
        self.te = importable("transformer_engine")
        self.transformers = importable("transformers")
        # Filled by the parts:
        self.policy_groups = self.critic_groups = None
        self.policy: ModelEngine | None = None
        self.critic: ModelEngine | None = None
        self.policy_tensors: dict[str, torch.Tensor] | None = None
        self.old_logprobs = self.values = None
        self.hf_model = None
        self.current, self.current_start = None, 0.0
        """The part running now (for the watchdog)."""

    # ---- the frame around each part ----

    def run(self, name: str, part: Callable[[dict], None]) -> None:
        self.current, self.current_start = name, time.perf_counter()
        numbers: dict = {}
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        status, error = "ok", None
        try:
            part(numbers)
            if cuda:
                torch.cuda.synchronize(self.device)  # a kernel's error shows here
        except Skipped as skip:
            status, error = "skipped", str(skip)
        except CheckFailed as err:  # a number out of bounds: the line says it all
            status, error = "failed", f"CheckFailed: {err}"
        except Exception as err:
            status, error = "failed", f"{type(err).__name__}: {err}"
            traceback.print_exc(file=sys.stderr)
        seconds = time.perf_counter() - start
        if cuda:
            try:
                numbers["peak_cuda_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            except Exception as err:  # after a CUDA error the context may be gone
                numbers["peak_cuda_gib"] = f"unreadable ({type(err).__name__})"
        self.results[name] = {"status": status, "seconds": round(seconds, 3), **numbers}
        if error is not None:
            self.results[name]["error"] = error[:2000]
        shown = "  ".join(f"{k}={_fmt(v)}" for k, v in numbers.items())
        line = f"{name:<20} {status:<8} {seconds:7.2f} s  {shown}"
        if error is not None:
            line += f"  [{error.splitlines()[0][:300]}]"
        print(line, flush=True)

    def need(self, *names: str) -> None:
        for name in names:
            if self.results.get(name, {}).get("status") != "ok":
                raise CheckFailed(f"not run: needs part {name!r}, which did not pass")

    def engine(self, head: str, groups, layer_spec=None) -> ModelEngine:
        return ModelEngine(
            self.hf, ModelLayout(), head=head, optim=OPTIM, groups=groups,
            params_dtype=self.dtype, layer_spec=layer_spec or local_spec(),
        )  # fmt: skip

    # ---- the parts ----

    def distributed(self, numbers: dict) -> None:
        init_distributed()
        backend = dist.get_backend()
        numbers["backend"] = backend
        check(
            backend == ("nccl" if self.device.type == "cuda" else "gloo"),
            f"backend {backend} on {self.device}",
        )
        if self.device.type == "cuda":
            current = torch.device("cuda", torch.cuda.current_device())
            check(current == self.device, f"current device {current}, expected {self.device}")
        x = torch.full((4,), 2.0, device=self.device)
        dist.all_reduce(x)
        check(torch.equal(x, torch.full((4,), 2.0, device=self.device)), f"all_reduce gave {x}")
        self.policy_groups = build_model_groups(tp=1, pp=1, cp=1)
        self.critic_groups = build_model_groups(tp=1, pp=1, cp=1)
        ensure_global_memory_buffer()
        seed_rng_tracker(self.policy_groups, seed=SEED)
        numbers["world_size"] = dist.get_world_size()

    def default_layer_spec(self, numbers: dict) -> None:
        spec = default_layer_spec()
        numbers["kind"] = layer_spec_kind(spec)
        expected = "te" if self.te[0] and self.device.type == "cuda" else "local"
        numbers["expected"] = expected
        check(numbers["kind"] == expected, f"the trainer builds with {numbers['kind']!r}")
        if expected == "local":
            check(spec == local_spec(), f"not the local spec the other parts use: {spec}")

    def engines(self, numbers: dict) -> None:
        self.need("distributed")
        write_hf_dir(self.hf_dir, random_hf_tensors(self.hf, self.dtype), self.dtype)
        source = hf_io.HFCheckpoint(self.hf_dir)  # as Session reads model.path
        self.policy_tensors = dict(source.read(source.names))
        self.policy = self.engine("lm", self.policy_groups)
        self.policy.load_hf(self.policy_tensors)
        self.critic = self.engine("value", self.critic_groups)
        self.critic.load_hf(_critic_from_policy(self.policy_tensors, self.hf, 0.1, SEED))
        for name, engine in (("policy", self.policy), ("critic", self.critic)):
            params = [p for chunk in engine.chunks for p in chunk.parameters()]
            numbers[f"{name}_params"] = sum(p.numel() for p in params)
            where = {str(p.device) for p in params} | {str(p.dtype) for p in params}
            want = {str(self.device), str(self.dtype)}
            check(where == want, f"{name} parameters on/in {sorted(where)}, want {sorted(want)}")
            check(engine.device == self.device, f"{name} engine.device is {engine.device}")

    def scoring(self, numbers: dict) -> None:
        self.need("engines")
        logprobs = score_flat(
            self.policy, self.prompts, self.responses, output_key="logprobs",
            token_budget=TOKEN_BUDGET,
            scoring_fn=logprob_scoring_fn(self.policy.vocab_slice, temperature=1.0),
        )  # fmt: skip
        values = score_flat(
            self.critic, self.prompts, self.responses, output_key="values",
            token_budget=TOKEN_BUDGET, scoring_fn=value_scoring_fn(),
        )  # fmt: skip
        total = int(self.offsets[-1])
        numbers.update(
            tokens=total, out_device=str(logprobs.device),
            mean_logprob=logprobs.double().mean().item(), mean_value=values.double().mean().item(),
        )  # fmt: skip
        for name, out in (("logprobs", logprobs), ("values", values)):
            check(out.shape == (total,), f"{name} shape {tuple(out.shape)}, want ({total},)")
            check(bool(torch.isfinite(out).all()), f"{name} not finite")
        check(bool((logprobs <= 1e-4).all()), f"log-probs above 0: {logprobs.max().item()}")
        self.old_logprobs, self.values = logprobs, values

    def _step_inputs(self, numbers: dict):
        """Old log-probs and values from the scoring pass (placeholders if it failed, so the
        updates still run), then advantages and returns as run_step computes them."""
        values, old_logprobs = self.values, self.old_logprobs
        if values is None or old_logprobs is None:
            numbers["inputs"] = "placeholders (scoring did not pass)"
            total = int(self.offsets[-1])
            values = torch.zeros(total, dtype=torch.float32, device=CPU)
            old_logprobs = torch.full(
                (total,), -float(torch.log(torch.tensor(self.hf.vocab_size, device=CPU))),
                dtype=torch.float32, device=CPU,
            )  # fmt: skip
        advantages, returns, _ = adv.gae_advantages(self.algo, self.rewards, values, self.offsets)
        advantages = adv.whiten(advantages)
        return old_logprobs, values, advantages, returns

    def update_critic(self, numbers: dict) -> None:
        self.need("engines")
        _, values, _, returns = self._step_inputs(numbers)

        def critic_fields(i: int, flat: slice) -> dict[str, torch.Tensor]:
            return {"returns": returns[flat], "old_values": values[flat]}

        samples = build_samples(
            self.prompts, self.responses, range(len(self.prompts)), self.offsets, critic_fields
        )
        before = param_snapshot(self.critic)
        metrics = train_on(
            self.critic, samples, lambda norm: value_loss_fn(self.algo, norm),
            field_names=[FLAT_INDEX, "returns", "old_values"], token_budget=TOKEN_BUDGET,
        )  # fmt: skip
        self._update_numbers(numbers, metrics, "value_loss", before, self.critic)

    def update_policy(self, numbers: dict) -> None:
        self.need("engines")
        old_logprobs, _, advantages, _ = self._step_inputs(numbers)
        positive = [reward > 0 for reward in self.rewards]

        def policy_fields(i: int, flat: slice) -> dict[str, torch.Tensor]:
            length = flat.stop - flat.start
            where = old_logprobs.device
            return {
                "old_logprobs": old_logprobs[flat],
                "advantages": advantages[flat],
                "positive": torch.full((length,), positive[i], dtype=torch.bool, device=where),
                "seq_num_tokens": torch.full((length,), float(length), device=where),
            }

        samples = build_samples(
            self.prompts, self.responses, range(len(self.prompts)), self.offsets, policy_fields
        )
        vocab = self.policy.vocab_slice
        before = param_snapshot(self.policy)
        metrics = train_on(
            self.policy, samples,
            lambda norm: policy_loss_fn(self.algo, norm, vocab, temperature=1.0),
            field_names=[FLAT_INDEX, "old_logprobs", "advantages", "positive", "seq_num_tokens"],
            token_budget=TOKEN_BUDGET,
        )  # fmt: skip
        self._update_numbers(numbers, metrics, "pg_loss", before, self.policy)
        if "entropy" in metrics:
            numbers["entropy"] = metrics["entropy"]

    def _update_numbers(self, numbers, metrics, loss_key, before, engine) -> None:
        numbers.update(
            loss=metrics.get(loss_key, float("nan")), grad_norm=metrics["grad_norm"],
            tokens=metrics["num_tokens"], max_weight_change=max_change(before, engine),
        )  # fmt: skip
        check(loss_key in metrics, f"no {loss_key} in the metrics {sorted(metrics)}")
        check(math.isfinite(metrics[loss_key]), f"{loss_key} not finite")
        grad_norm = metrics["grad_norm"]
        check(0 < grad_norm < float("inf"), f"grad norm {grad_norm}")
        check(numbers["max_weight_change"] > 0, "the update left every weight unchanged")

    def weight_stream(self, numbers: dict) -> None:
        self.need("engines")
        policy = self.policy
        plan = stream_plan(policy.record, policy.config, pp_size=1)
        targets = None
        if self.transformers[0]:
            from transformers import Qwen2Config, Qwen2ForCausalLM

            config = Qwen2Config.from_pretrained(self.hf_dir)  # a local directory: no download
            # As from_pretrained(dtype=) builds it: RoPE's inv_freq stays fp32 (.to() would not).
            with torch.device(self.device):
                model = Qwen2ForCausalLM._from_config(config, dtype=self.dtype).eval()
            targets = dict(model.named_parameters())
        changed, count, num_bytes, devices = 0, 0, 0, set()
        with torch.no_grad():
            for bucket in stream_policy_weights(
                policy.chunks, policy.record, policy.config,
                tp_group=policy.groups.parallel.tp, pp_group=policy.groups.parallel.pp,
                bucket_bytes=1 << 20,
            ):  # fmt: skip
                for name, tensor in bucket:
                    want_name, meta = plan[count]
                    check(
                        (name, tuple(tensor.shape), tensor.dtype)
                        == (want_name, tuple(meta.shape), meta.dtype),
                        f"tensor {count}: {name} {tuple(tensor.shape)} {tensor.dtype}, plan says "
                        f"{want_name} {tuple(meta.shape)} {meta.dtype}",
                    )
                    count += 1
                    num_bytes += tensor.numel() * tensor.element_size()
                    devices.add(str(tensor.device))
                    initial = self.policy_tensors[name]
                    changed += not torch.equal(tensor.to(CPU), initial)
                    if targets is not None:
                        check(name in targets, f"{name}: no such HF parameter (or sent twice)")
                        targets.pop(name).copy_(tensor)  # the in-process handoff
        numbers.update(tensors=count, mb=num_bytes / 1e6, changed=changed, devices=sorted(devices))
        check(count == len(plan), f"{count} tensors streamed, the plan has {len(plan)}")
        if self.results.get("update_policy", {}).get("status") == "ok":
            check(changed > 0, "the stream carries the weights from before the policy update")
        if targets is None:
            numbers["hf_model"] = "skipped: transformers not importable"
            return
        check(not targets, f"HF parameters the stream never set: {sorted(targets)}")
        self.hf_model = model

    def hf_logits(self, numbers: dict) -> None:
        if not self.transformers[0]:
            raise Skipped(f"transformers not importable ({self.transformers[1]})")
        self.need("weight_stream")
        policy = self.policy
        samples = build_samples(
            self.prompts, self.responses, range(len(self.prompts)), self.offsets
        )
        mbs = micro_batches(
            samples, policy.layout, cp_rank=policy.cp_rank, token_budget=TOKEN_BUDGET,
            field_names=[FLAT_INDEX],
        )  # fmt: skip

        def keep_logits(logits: torch.Tensor, mb):
            return logits.new_zeros((), dtype=torch.float32), {"logits": logits.detach().clone()}

        outputs = policy.run(mbs, keep_logits, forward_only=True)
        vocab = self.hf.vocab_size
        worst, scale, positions = 0.0, 1.0, 0
        with torch.no_grad():
            for mb, out in zip(mbs, outputs, strict=True):
                megatron = out["logits"][0, :, :vocab].float()  # [t, V] packed
                cu = mb.packed_seq_params.cu_seqlens_q_padded.tolist()
                lengths = mb.packed_seq_params.cu_seqlens_q.diff().tolist()
                for start, length in zip(cu[:-1], lengths, strict=True):
                    tokens = mb.tokens[0, start : start + length].to(self.device)
                    ref = self.hf_model(input_ids=tokens[None]).logits[0].float()
                    mine = megatron[start : start + length].to(self.device)
                    worst = max(worst, (ref - mine).abs().max().item())
                    scale = max(scale, ref.abs().max().item())
                    positions += length
        tolerance = LOGIT_TOLERANCE[self.dtype] * scale
        numbers.update(
            max_abs_diff=worst, tolerance=tolerance, max_abs_logit=scale, positions=positions,
            micro_batches=len(mbs),
        )  # fmt: skip
        check(worst <= tolerance, f"max |HF - Megatron| logit {worst:.3g} > {tolerance:.3g}")

    def checkpoint(self, numbers: dict) -> None:
        self.need("engines")
        engines = {"policy": self.policy, "critic": self.critic}
        saved = {name: tensors_of(e) for name, e in engines.items()}
        schedulers = {name: e.scheduler.state_dict() for name, e in engines.items()}
        root = self.workdir / "checkpoints"
        start = time.perf_counter()
        states = {name: TrainableState.from_engine(e) for name, e in engines.items()}
        save_train_checkpoint(root, 1, states, {"step": 1}, keep_last=1)
        numbers["save_s"] = time.perf_counter() - start
        fresh = {
            "policy": self.engine("lm", self.policy_groups),
            "critic": self.engine("value", self.critic_groups),
        }
        initial = tensors_of(fresh["policy"])
        differed = sum(
            not torch.equal(v, initial[k].to(v.device))
            for k, v in saved["policy"].items()
            if k.startswith("chunk")
        )
        start = time.perf_counter()
        extra = load_train_checkpoint(
            root, {name: TrainableState.from_engine(e) for name, e in fresh.items()}
        )
        numbers["load_s"] = time.perf_counter() - start
        numbers["mb_on_disk"] = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) / 1e6
        check(extra == {"step": 1}, f"extra came back as {extra}")
        check(differed > 0, "fresh engines already equal the saved ones: the check is vacuous")
        compared = 0
        for name, engine in fresh.items():
            n, _ = compare_exact(saved[name], tensors_of(engine), name)
            compared += n
            check(engine.scheduler.state_dict() == schedulers[name], f"{name} scheduler differs")
            check(
                {str(p.device) for c in engine.chunks for p in c.parameters()}
                == {str(self.device)},
                f"{name}: loaded parameters not on {self.device}",
            )
        numbers["tensors_equal"] = compared

    def checkpoint_weights(self, numbers: dict) -> None:
        self.need("engines")
        compared = 0
        for name, head, engine, groups in (
            ("policy", "lm", self.policy, self.policy_groups),
            ("critic", "value", self.critic, self.critic_groups),
        ):
            directory = self.workdir / f"weights_{name}"
            meta = make_metadata(HF_CONFIG, head=head, tp=1, pp=1, dtype=self.dtype)
            dp_cp = groups.pg_collection.dp_cp
            save_model_weights(engine.chunks, directory, meta, dp_cp_group=dp_cp)
            fresh = self.engine(head, groups)
            load_model_weights(fresh.chunks, directory, hf=self.hf, head=head, dp_cp_group=dp_cp)
            fresh.optimizer.reload_model_params()  # as Session does after loading
            want = {k: v for k, v in tensors_of(engine).items() if k.startswith("chunk")}
            have = {k: v for k, v in tensors_of(fresh).items() if k.startswith("chunk")}
            want = {k: v for k, v in want.items() if not k.endswith("_extra_state")}
            have = {k: v for k, v in have.items() if not k.endswith("_extra_state")}
            n, _ = compare_exact(want, have, name)
            compared += n
        numbers["tensors_equal"] = compared

    def te_spec(self, numbers: dict) -> None:
        if self.device.type != "cuda":
            raise Skipped("Transformer Engine runs on CUDA only (--cpu)")
        if not self.te[0]:
            raise Skipped(f"transformer_engine not importable ({self.te[1]})")
        self.need("distributed", "engines", "scoring")
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        numbers["te_version"] = self.te[1]
        engine = self.engine("lm", self.policy_groups, get_gpt_layer_with_transformer_engine_spec())
        engine.load_hf(self.policy_tensors)  # the weights the scoring pass saw
        logprobs = score_flat(
            engine, self.prompts, self.responses, output_key="logprobs",
            token_budget=TOKEN_BUDGET,
            scoring_fn=logprob_scoring_fn(engine.vocab_slice, temperature=1.0),
        )  # fmt: skip
        worst = (logprobs - self.old_logprobs.to(logprobs.device)).abs().max().item()
        scale = max(1.0, self.old_logprobs.abs().max().item())
        tolerance = LOGIT_TOLERANCE[self.dtype] * scale
        numbers.update(max_abs_logprob_diff=worst, tolerance=tolerance)
        check(worst <= tolerance, f"TE vs local log-probs differ by {worst:.3g} > {tolerance:.3g}")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU with gloo (no CUDA)")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None,
        help="parameter dtype (default: bfloat16 on GPU, float32 with --cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=420.0,
        help="seconds before a hung check prints its JSON line and exits 1 (default 420)",
    )  # fmt: skip
    args = parser.parse_args()
    started = time.perf_counter()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        print("gpu_check runs as one process (a world of 1): start it without torchrun")
        return 2
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("HF_HUB_OFFLINE", "1"),
    ):  # fmt: skip
        os.environ.setdefault(key, value)
    if args.cpu:
        device = CPU
    elif torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device: run with --cpu for the CPU twin", file=sys.stderr)
        return 2
    default_dtype = "float32" if args.cpu else "bfloat16"
    dtype = getattr(torch, args.dtype or default_dtype)
    from megatron.core.package_info import __version__ as megatron_version

    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "megatron_core": megatron_version,
        "python": sys.version.split()[0],
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        checker = GPUCheck(device, dtype, Path(tmp))
        header["transformers"] = checker.transformers[1]
        header["transformer_engine"] = checker.te[1]
        print("  ".join(f"{k}={v}" for k, v in header.items()), flush=True)
        watchdog = threading.Timer(
            args.timeout, _timed_out, (checker, header, args.timeout, started)
        )
        watchdog.daemon = True
        watchdog.start()
        for name in PARTS:
            checker.run(name, getattr(checker, name))
        watchdog.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()
    summary = _summary(checker.results, header, started)
    print(json.dumps(summary, default=str), flush=True)
    return 0 if summary["ok"] else 1


def _summary(results: dict[str, dict], header: dict, started: float) -> dict:
    for name in PARTS:
        results.setdefault(name, {"status": "failed", "error": "not run: the check timed out"})
    ok = all(
        r["status"] == "ok" or (r["status"] == "skipped" and name in OPTIONAL_PARTS)
        for name, r in results.items()
    )
    return {
        "ok": ok,
        **header,
        "wall_seconds": round(time.perf_counter() - started, 2),
        "skipped": {n: r["error"] for n, r in results.items() if r["status"] == "skipped"},
        "failed": sorted(n for n, r in results.items() if r["status"] == "failed"),
        "parts": results,
    }


def _timed_out(checker: GPUCheck, header: dict, limit: float, started: float) -> None:
    """The watchdog: a part hung (a collective, a kernel). Dump every thread's stack, mark the
    part failed, print the JSON line anyway and leave: a hang must not cost the whole run."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    name = checker.current or PARTS[0]
    checker.results[name] = {
        "status": "failed",
        "seconds": round(time.perf_counter() - checker.current_start, 3),
        "error": f"timed out: the check passed --timeout {limit:g} s in this part",
    }
    print(f"{name:<20} failed   (timed out after --timeout {limit:g} s)", flush=True)
    print(json.dumps(_summary(dict(checker.results), header, started), default=str), flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
