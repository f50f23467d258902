"""Convert checkpoints between Hugging Face and megatron-core, and check a conversion.

    python tools/convert.py hf-to-mcore --hf DIR --out DIR --tp N --pp M [--ep E --etp T]
        [--critic-from policy|reward-model] [--dtype bf16|fp32] [--mtp-in-model] [--force]
    python tools/convert.py mcore-to-hf --ckpt DIR --out DIR [--hf-config DIR]
        [--max-shard-size 5GB] [--force]
    python tools/convert.py verify --hf DIR --ckpt DIR [--tp N --pp M]

hf-to-mcore and verify run as TP x PP processes (gloo, on the CPU); with expert parallelism
(MoE models: --ep, and --etp the expert TP, default TP) as PP x lcm(TP, ETP x EP), since
megatron cuts the expert groups from the TP x DP ranks of a stage. Started plainly, the tool
starts them itself on this machine; under torchrun/srun (WORLD_SIZE set) it is one of them and
the world size must be a multiple of that. mcore-to-hf is one process and reads a checkpoint
saved at any TP/PP/EP. Each command prints, last, one JSON line with what it did. Exit status: 0
done/passed, 1 verify out of tolerance, 2 bad input (the message says what to change).
Details, memory and time: docs/convert.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import sys
import time
import warnings
from pathlib import Path

# Conversion is I/O: it runs on the CPU with gloo even where GPUs exist.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# megatron's notes about absent Transformer Engine/Apex and torch's deprecations inside
# megatron's checkpointing say nothing about the conversion; errors still show.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).* not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from vapo_megatron.checkpoint import model as ckpt  # noqa: E402
from vapo_megatron.launch.local_launch import relaunch_as_local_ranks  # noqa: E402
from vapo_megatron.models.config import HFModelConfig  # noqa: E402
from vapo_megatron.parallel.collectives import all_gather_objects  # noqa: E402
from vapo_megatron.weights import convert as conv  # noqa: E402
from vapo_megatron.weights import hf_io  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# verify: pass when max |diff| <= atol + rtol * max |reference| and the next-token argmax agrees
# on at least min_agreement of the positions; both sides compute in fp32. "exact": both hold
# the same numbers; "bf16": the conversion rounded the HF weights to bf16. Set from tiny-model
# measurements with margin (docs/convert.md).
TOLERANCES = {
    "exact": {"atol": 1e-4, "rtol": 1e-4, "min_agreement": 0.99},
    "bf16": {"atol": 5e-2, "rtol": 2e-2, "min_agreement": 0.9},
}
NUM_PROMPTS, PROMPT_LEN, PROMPT_SEED = 4, 32, 1234


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mcore-to-hf":
            return _mcore_to_hf(args)
        world = _world_size(args)
        # Checked before starting ranks, so that bad input fails once and fast.
        if args.command == "hf-to-mcore":
            checked = _check_hf_to_mcore(args)
        else:
            checked = _check_verify(args)
        if "WORLD_SIZE" not in os.environ and world > 1:
            return relaunch_as_local_ranks(world)
        _init_process_group(world)
        if args.command == "hf-to-mcore":
            return _hf_to_mcore(args, checked)
        return _verify(args, *checked)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron checkpoint")
    to_mcore.add_argument("--hf", required=True, help="HF model directory (config + safetensors)")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to write")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size to save at")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to save at")
    to_mcore.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size to save at (MoE models)"
    )
    to_mcore.add_argument(
        "--etp", type=int, help="expert tensor-parallel size to save at (default: --tp)"
    )
    to_mcore.add_argument(
        "--critic-from",
        choices=["policy", "reward-model"],
        help="make a critic: the policy's trunk with a zero value head, or a reward model's "
        "trunk and score.weight (any supported size: the checkpoint keeps the reward model's "
        "own config; a run whose critic is not the policy's model names it as critic.model)",
    )
    to_mcore.add_argument(
        "--dtype", choices=sorted(DTYPES), help="checkpoint dtype (default: the HF tensors')"
    )
    to_mcore.add_argument(
        "--mtp-in-model",
        action="store_true",
        help="put the MTP layers (num_nextn_predict_layers) into the model, for a policy trained "
        "with policy.mtp.loss_weight > 0; default: carried beside it as files (mtp/)",
    )
    to_mcore.add_argument("--force", action="store_true", help="replace a non-empty --out")

    to_hf = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF directory")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint directory (any TP/PP)")
    to_hf.add_argument("--out", required=True, help="HF directory to write")
    to_hf.add_argument(
        "--hf-config", help="take config.json and tokenizer files from this HF directory"
    )
    to_hf.add_argument("--max-shard-size", default="5GB", help="safetensors shard size cap")
    to_hf.add_argument("--force", action="store_true", help="replace a non-empty --out")

    verify = sub.add_parser("verify", help="compare logits of an HF model and a checkpoint")
    verify.add_argument("--hf", required=True, help="HF model directory")
    verify.add_argument("--ckpt", required=True, help="checkpoint directory")
    verify.add_argument("--tp", type=int, default=1, help="tensor-parallel size to load at")
    verify.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to load at")
    return parser


def _world_size(args: argparse.Namespace) -> int:
    """Ranks a command runs as: PP x lcm(TP, expert TP x EP) (TP x PP without experts)."""
    ep, etp = getattr(args, "ep", 1), getattr(args, "etp", None)
    return args.pp * math.lcm(args.tp, (args.tp if etp is None else etp) * ep)


# ----- commands -----


def _check_hf_to_mcore(args: argparse.Namespace) -> conv.HFSource:
    dtype = DTYPES[args.dtype] if args.dtype else None
    source = conv.inspect_hf(
        args.hf, critic_from=args.critic_from, dtype=dtype, mtp=args.mtp_in_model
    )
    conv.check_layout(source.hf, args.tp, args.pp, args.ep, args.etp)
    conv.check_output_dir(args.out, force=args.force, inputs=[args.hf])
    return source


def _hf_to_mcore(args: argparse.Namespace, source: conv.HFSource) -> int:
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

    initialize_megatron_cpu(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    start = time.perf_counter()
    meta = conv.hf_to_mcore(source, args.out, force=args.force)
    seconds = time.perf_counter() - start
    peaks = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, _peak_rss_gb())
    rank = dist.get_rank()
    destroy()
    if rank != 0:
        return 0
    _report(
        "hf-to-mcore",
        seconds,
        source.checkpoint.nbytes,
        peak_rss_gb=round(sum(peaks), 3),
        peak_rss_gb_per_rank=max(peaks),
        ranks=len(peaks),
        head=meta.head,
        tp=meta.tp,
        pp=meta.pp,
        ep=args.ep,
        etp=args.tp if args.etp is None else args.etp,
        dtype=meta.dtype,
        padded_vocab_size=meta.padded_vocab_size,
    )
    return 0


def _mcore_to_hf(args: argparse.Namespace) -> int:
    from vapo_megatron.parallel.cpu_shim import initialize_megatron_cpu

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("mcore-to-hf runs as one process: start it without torchrun/srun")
    ckpt.load_metadata(args.ckpt)  # bad input fails before megatron's import
    _init_process_group(1)
    initialize_megatron_cpu(tp=1, pp=1)
    start = time.perf_counter()
    meta = conv.mcore_to_hf(
        args.ckpt,
        args.out,
        hf_config_dir=args.hf_config,
        force=args.force,
        max_shard_bytes=_parse_size(args.max_shard_size),
    )
    seconds = time.perf_counter() - start
    nbytes = hf_io.HFCheckpoint(args.out).nbytes
    if dist.is_initialized():
        dist.destroy_process_group()
    _report(
        "mcore-to-hf",
        seconds,
        nbytes,
        peak_rss_gb=_peak_rss_gb(),
        head=meta.head,
        architecture=meta.architecture,
        saved_tp=meta.tp,
        saved_pp=meta.pp,
    )
    return 0


def _check_verify(args: argparse.Namespace):
    meta = ckpt.load_metadata(args.ckpt)
    hf_dir = hf_io.HFCheckpoint(args.hf)
    hf = HFModelConfig.from_hf(hf_dir.config)
    hf_head = "value" if "score.weight" in hf_dir.tensors else "lm"
    if hf_head != meta.head:
        kinds = {"lm": "policy (causal LM)", "value": "critic / reward model"}
        raise ValueError(
            f"{args.hf} is a {kinds[hf_head]} but {args.ckpt} is a {kinds[meta.head]}: compare "
            "like with like (export a critic with mcore-to-hf to compare its trunk)"
        )
    ckpt.check_compatible(meta, hf, meta.head, args.ckpt)
    conv.check_layout(hf, args.tp, args.pp)
    # bf16 tolerance when the conversion rounded the HF weights to bf16, else the weights are
    # the same numbers on both sides and only fp32 arithmetic differs.
    hf_dtypes = {info.dtype for info in hf_dir.tensors.values()}
    rounded = meta.torch_dtype == torch.bfloat16 and hf_dtypes != {torch.bfloat16}
    return meta, hf, "bf16" if rounded else "exact"


def _verify(args: argparse.Namespace, meta, hf: HFModelConfig, precision: str) -> int:
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

    initialize_megatron_cpu(tp=args.tp, pp=args.pp)
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    length = min(PROMPT_LEN, hf.max_position_embeddings)
    tokens = torch.randint(0, hf.vocab_size, (NUM_PROMPTS, length), generator=gen)
    ours = _megatron_outputs(hf, meta.head, args.ckpt, tokens)
    report = None
    if ours is not None:  # the last pipeline stage's first TP rank compares
        reference = _hf_outputs(args.hf, meta.head, tokens)
        report = _compare(ours, reference, precision, meta.head)
    # Rank 0 prints (the one rank a plain start shows on the console).
    (report,) = [r for r in all_gather_objects(report, None) if r is not None]
    if dist.get_rank() == 0:
        _report("verify", 0.0, 0, **report, tp=args.tp, pp=args.pp)
    destroy()
    return int(not report["passed"])


# ----- verify -----


def _megatron_outputs(
    hf: HFModelConfig, head: str, ckpt_dir: str, tokens: torch.Tensor
) -> torch.Tensor | None:
    """Logits [b, s, vocab] (or values [b, s, 1]) in fp32 on the rank that compares, else None."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from vapo_megatron.config.layout import ModelLayout
    from vapo_megatron.models.provider import build_model, transformer_config

    layout = ModelLayout(
        tp=ps.get_tensor_model_parallel_world_size(), pp=ps.get_pipeline_model_parallel_world_size()
    )
    config = transformer_config(hf, layout, params_dtype=torch.float32)
    config.perform_initialization = False
    chunks = build_model(hf, config, head=head)
    ckpt.load_model_weights(chunks, ckpt_dir, hf=hf, head=head)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)

    def forward_step(data_iterator, model):
        output = model(next(data_iterator), positions, attention_mask=None)
        return output, lambda out, non_loss_data=False: out.detach().clone()

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([tokens]),
            model=chunks[0].eval(),
            num_microbatches=1,
            seq_length=tokens.shape[1],
            micro_batch_size=tokens.shape[0],
            forward_only=True,
            collect_non_loss_data=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    output = outputs[0]
    if head == "lm" and ps.get_tensor_model_parallel_world_size() > 1:
        pieces = [
            torch.empty_like(output) for _ in range(ps.get_tensor_model_parallel_world_size())
        ]
        dist.all_gather(pieces, output.contiguous(), group=ps.get_tensor_model_parallel_group())
        output = torch.cat(pieces, dim=-1)
    if ps.get_tensor_model_parallel_rank() != 0:
        return None
    return output[..., : hf.vocab_size].float() if head == "lm" else output.float()


def _hf_outputs(hf_dir: str, head: str, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits [b, s, vocab] (policy) or per-token scores [b, s, 1] (critic)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with torch.no_grad():
        if head == "lm":
            model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
            return model.eval()(input_ids=tokens).logits.float()
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            hf_dir, dtype=torch.float32
        ).eval()
        # Every position's score, as the critic reads it (the HF head pools the last token).
        return model.score(model.model(input_ids=tokens).last_hidden_state).float()


def _compare(ours: torch.Tensor, reference: torch.Tensor, precision: str, head: str) -> dict:
    diff = (ours - reference).abs()
    tol = TOLERANCES[precision]
    limit = tol["atol"] + tol["rtol"] * reference.abs().max().item()
    agreement = None
    if head == "lm":
        agreement = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    passed = diff.max().item() <= limit and (agreement is None or agreement >= tol["min_agreement"])
    return {
        "passed": passed,
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "next_token_agreement": agreement,
        "tolerance": {"max_abs_diff": limit, **tol, "precision": precision},
        "positions": reference.shape[0] * reference.shape[1],
    }


# ----- processes -----


def _init_process_group(world: int) -> None:
    if "WORLD_SIZE" not in os.environ or world == 1 and os.environ["WORLD_SIZE"] == "1":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return
    dist.init_process_group("gloo")
    if dist.get_world_size() % world:
        raise ValueError(
            f"WORLD_SIZE={dist.get_world_size()} is not a multiple of the {world} ranks the "
            "layout needs (tp * pp, or pp * lcm(tp, etp * ep) with experts)"
        )


def _peak_rss_gb() -> float:
    """Peak resident memory of this process and of its largest finished child, in GB."""
    kb = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return round(kb * 1024 / 1e9, 3)


def _report(command: str, seconds: float, nbytes: int, **fields) -> None:
    summary = {"command": command, **fields}
    if nbytes:
        summary.update(
            seconds=round(seconds, 3),
            gb=round(nbytes / 1e9, 4),
            seconds_per_gb=round(seconds / (nbytes / 1e9), 3),
        )
    print(json.dumps(summary), flush=True)


def _parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"--max-shard-size {text!r}: use e.g. 5GB, 500MB, 2GiB or a byte count")
    unit = (match[2] or "B").upper()
    scale = 1024 if "I" in unit else 1000
    power = "BKMGT".index(unit[0])
    return int(float(match[1]) * scale**power)


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    sys.exit(main())
