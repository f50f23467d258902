"""Megatron-core on CPU through the shim, at several layouts in one 2-process launch.

Usage: ``python shim_worker.py OUT_DIR`` as 2 gloo ranks (``tests/launcher.py``). Every check
runs here; each rank writes the measured numbers to ``OUT_DIR/rank{r}.json`` and
``tests/distributed/test_cpu_shim.py`` asserts on them. References come from a TP=1/PP=1
model built from the same seed and fed the same data.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

SEED = 1234
VOCAB, SEQ, MICRO_BATCH, NUM_MICRO_BATCHES = 128, 32, 2, 4

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]


def make_batches(seed: int) -> list[Batch]:
    """NUM_MICRO_BATCHES micro-batches of random tokens, the same on every rank for a seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def build_gpt(vpp: int | None = None) -> list[GPTModel]:
    """The tiny GPT of this pipeline rank, one chunk per virtual stage, initialised from SEED."""
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        # Interleaved PP with batched p2p gives wrong results on gloo (see MEGATRON_ON_CPU.md).
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
    )
    config.finalize_model_grads_func = finalize_model_grads
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            vp_stage=stage,
        )
        chunks.append(gpt)
    return chunks


def build_model(
    vpp: int | None = None, *, distributed_optimizer: bool = False
) -> list[DistributedDataParallel]:
    """``build_gpt`` with each chunk wrapped in Megatron's DDP (bucketing on the first only)."""
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    return [
        DistributedDataParallel(gpt.config, ddp_config, gpt, disable_bucketing=i > 0)
        for i, gpt in enumerate(build_gpt(vpp))
    ]


def forward_step(data_iterator: Iterator[Batch], model: DistributedDataParallel):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).expand_as(tokens)
    token_losses = model(tokens, position_ids, None, labels=labels)  # [b, s]

    def loss_func(token_losses: torch.Tensor):
        loss = token_losses.mean()
        return loss, {"loss": loss.detach().clone()}

    return token_losses, loss_func


def train_step(chunks: list[DistributedDataParallel], batches: list[Batch]) -> float | None:
    """Forward and backward over the micro-batches; the mean loss on the last stage."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks],
        model=chunks,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.stack([m["loss"] for m in losses]).mean().item()


def global_name(name: str, chunk: DistributedDataParallel) -> str:
    """Parameter name in the TP=1/PP=1 model (layer index made global, tied output folded)."""
    name = name.removeprefix("module.")
    if name.startswith("decoder.layers."):
        local = int(name.split(".")[2])
        layer_number = chunk.module.decoder.layers[local].layer_number
        name = name.replace(f"layers.{local}.", f"layers.{layer_number - 1}.", 1)
    return name.replace("output_layer.weight", "embedding.word_embeddings.weight")


def gather_tp(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The full (TP=1) tensor of a TP-sharded parameter's local piece."""
    if (
        not getattr(param, "tensor_model_parallel", False)
        or ps.get_tensor_model_parallel_world_size() == 1
    ):
        return tensor.detach().clone()
    pieces = [torch.empty_like(tensor) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=param.partition_dim)


def full_tensors(chunks: list[DistributedDataParallel], read: Callable) -> dict[str, torch.Tensor]:
    """``read(param)`` for every parameter of this rank, gathered over TP, by global name."""
    return {
        global_name(name, chunk): gather_tp(read(param), param)
        for chunk in chunks
        for name, param in chunk.named_parameters()
    }


def load_full(chunks: list[DistributedDataParallel], full: dict[str, torch.Tensor]) -> None:
    """Copy TP=1 tensors (by global name) into the parameters of this rank (TP=1 only)."""
    assert ps.get_tensor_model_parallel_world_size() == 1
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                param.copy_(full[global_name(name, chunk)])


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() <= want.keys(), sorted(got.keys() - want.keys())
    return max((got[k] - want[k]).abs().max().item() for k in got)


def weights(param: torch.nn.Parameter) -> torch.Tensor:
    return param.detach()


def grads(param: torch.nn.Parameter) -> torch.Tensor:
    return param.main_grad


def make_optimizer(chunks: list[DistributedDataParallel], *, distributed: bool, clip: float):
    config = OptimizerConfig(
        optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed, clip_grad=clip
    )
    return get_megatron_optimizer(config, chunks)


def check_rng() -> dict[str, object]:
    """The tracker fork isolates its stream, queues nothing and keeps TP ranks apart."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    warnings: list[str] = []
    handler = _ListHandler(warnings)
    logging.getLogger(tensor_parallel.random.__name__).addHandler(handler)
    queued = len(torch.cuda._queued_calls)
    start = torch.get_rng_state()
    plain = torch.rand(8)
    torch.set_rng_state(start)
    with tracker.fork():
        forked = torch.rand(8)
    after_fork = torch.rand(8)
    for _ in range(50):
        with tracker.fork():
            torch.rand(1)
    with tracker.fork():
        forked_later = torch.rand(8)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    with tracker.fork():
        forked_reseeded = torch.rand(8)
    tp_forks = [torch.empty_like(forked_reseeded) for _ in range(2)]
    dist.all_gather(tp_forks, forked_reseeded, group=ps.get_tensor_model_parallel_group())
    return {
        "fork_leaves_default_stream": torch.equal(after_fork, plain),
        "fork_uses_own_stream": not torch.equal(forked, plain),
        "fork_state_advances": not torch.equal(forked_later, forked),
        "reseed_restarts_fork": torch.equal(forked_reseeded, forked),
        "tp_ranks_fork_differently": not torch.equal(tp_forks[0], tp_forks[1]),
        "queued_cuda_calls_added": len(torch.cuda._queued_calls) - queued,
        "fork_warnings": len(warnings),
    }


class _ListHandler(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record) -> None:
        self.sink.append(record.getMessage())


def check_rope_cp() -> float:
    """RoPE under context parallelism keeps chunks r and 2*cp-1-r (pinned index, ``.cuda()``)."""
    full = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)(SEQ)
    cp_group = dist.new_group([0, 1])
    rank_emb = RotaryEmbedding(
        kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=cp_group
    )(SEQ)
    chunks = full.chunk(4, dim=0)
    rank = dist.get_rank()
    return (rank_emb - torch.cat([chunks[rank], chunks[3 - rank]])).abs().max().item()


def run(out_dir: Path) -> dict[str, object]:
    result: dict[str, object] = {}
    batches = make_batches(seed=0)

    # TP=1, PP=1 (DP=2, both ranks fed the same batches): reference weights, loss and grads.
    initialize_megatron_cpu(tp=1, seed=SEED)
    ref = build_model()
    ref_weights = full_tensors(ref, weights)
    result["ref_loss"] = train_step(ref, batches)
    ref_grads = full_tensors(ref, grads)
    result["rope_cp_max_diff"] = check_rope_cp()

    # DP=2 with different data per rank: distributed optimizer equals the plain one.
    own_batches = make_batches(seed=1 + dist.get_rank())
    after: dict[bool, list[dict[str, torch.Tensor]]] = {}
    norms: dict[bool, list[float]] = {}
    for distributed in (False, True):
        model = build_model(distributed_optimizer=distributed)
        opt = make_optimizer(model, distributed=distributed, clip=0.5)
        after[distributed], norms[distributed] = [], []
        for _ in range(2):
            opt.zero_grad()  # else FP32Optimizer's param.grad aliases main_grad: doubled grads
            train_step(model, own_batches)
            _, grad_norm, _ = opt.step()
            norms[distributed].append(grad_norm)
            after[distributed].append(full_tensors(model, weights))
    result["distopt_max_diff"] = max(max_diff(d, p) for d, p in zip(after[True], after[False]))
    result["distopt_grad_norms"] = norms[True]
    result["plain_grad_norms"] = norms[False]

    # TP=2: same init and loss as TP=1, RNG tracker isolation, optimizer step, checkpoint.
    initialize_megatron_cpu(tp=2, seed=SEED)
    result["rng"] = check_rng()
    model = build_model()
    result["tp2_init_max_diff"] = max_diff(full_tensors(model, weights), ref_weights)
    result["tp2_loss"] = train_step(model, batches)
    result["tp2_grad_max_diff"] = max_diff(full_tensors(model, grads), ref_grads)
    before = full_tensors(model, weights)
    opt = make_optimizer(model, distributed=False, clip=1e-3)
    _, grad_norm, _ = opt.step()
    result["tp2_grad_norm"] = grad_norm
    result["tp2_step_min_change"] = min(
        (w - before[k]).abs().max().item() for k, w in full_tensors(model, weights).items()
    )
    result["tp2_loss_after_step"] = train_step(model, batches)
    result["ckpt_max_diff"] = checkpoint_round_trip(model[0].module, out_dir / "ckpt")

    # PP=2 (1F1B), then PP=2 x virtual PP=2 (interleaved): same loss and grads as PP=1.
    for name, vpp in (("pp2", None), ("vpp2", 2)):
        initialize_megatron_cpu(pp=2, vpp=vpp, seed=SEED)
        model = build_model(vpp=vpp)
        # Init draws depend on which layers a rank builds, so start from the reference weights.
        load_full(model, ref_weights)
        result[f"{name}_loss"] = train_step(model, batches)
        result[f"{name}_grad_max_diff"] = max_diff(full_tensors(model, grads), ref_grads)
    return result


def checkpoint_round_trip(model: GPTModel, ckpt_dir: Path) -> float:
    """Save with dist_checkpointing, load into a differently initialised model, compare."""
    if dist.get_rank() == 0:
        ckpt_dir.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt_dir))
    (fresh,) = build_gpt()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(ckpt_dir)))
    saved = dict(model.named_parameters())
    return max((p - saved[n]).abs().max().item() for n, p in fresh.named_parameters())


def main() -> None:
    out_dir = Path(sys.argv[1])
    result = run(out_dir)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    destroy()


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main()
