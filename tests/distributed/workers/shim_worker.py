"""Megatron-core on CPU through the shim: several layouts in one 2-process gloo launch.

Usage: ``python shim_worker.py OUT_DIR`` as 2 ranks (``tests/launcher.py``). Each rank writes
what it measured to ``OUT_DIR/rank{r}.json``; ``tests/distributed/test_cpu_shim.py`` asserts
on it. The reference is the TP=1/PP=1 model built from the same seed and fed the same batches.
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
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model

from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu
from vapo_megatron.parallel.groups import ParallelGroups

SEED = 1234
VOCAB, SEQ, MICRO_BATCH, NUM_MICRO_BATCHES = 128, 32, 2, 4

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens [b, s], labels [b, s]
Model = list[DistributedDataParallel]  # one chunk per virtual pipeline stage


def make_batches(seed: int) -> list[Batch]:
    """NUM_MICRO_BATCHES micro-batches of random tokens; the same on every rank for a seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=gen)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def build_model(
    vpp: int | None = None, *, distributed_optimizer: bool = False, bf16: bool = False
) -> Model:
    """The tiny GPT chunks of this pipeline rank, initialised from SEED, wrapped in DDP."""
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        # Interleaved PP with batched p2p is wrong on gloo (MEGATRON_ON_CPU.md, traps).
        overlap_p2p_comm=vpp is not None,
        batch_p2p_comm=vpp is None,
    )
    config.finalize_model_grads_func = finalize_model_grads
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, grad_reduce_in_fp32=bf16
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    model = []
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
        module = Float16Module(config, gpt) if bf16 else gpt
        model.append(
            DistributedDataParallel(config, ddp_config, module, disable_bucketing=vp_stage > 0)
        )
    return model


def forward_step(data_iterator: Iterator[Batch], model: DistributedDataParallel):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).expand_as(tokens)
    token_losses = model(tokens, position_ids, None, labels=labels)  # [b, s]

    def loss_func(token_losses: torch.Tensor):
        loss = token_losses.float().mean()
        return loss, {"loss": loss.detach().clone()}

    return token_losses, loss_func


def train_step(model: Model, batches: list[Batch]) -> float | None:
    """Forward and backward over the micro-batches; their mean loss on the last stage."""
    for chunk in model:
        chunk.zero_grad_buffer()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in model],
        model=model,
        num_microbatches=len(batches),
        seq_length=SEQ,
        micro_batch_size=MICRO_BATCH,
    )
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.stack([m["loss"] for m in losses]).mean().item()


def make_optimizer(
    model: Model, *, distributed: bool, clip: float, bf16: bool = False, lr=1e-2, eps=1e-8
):
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        adam_eps=eps,
        bf16=bf16,
        use_distributed_optimizer=distributed,
        clip_grad=clip,
    )
    return get_megatron_optimizer(config, model)


def global_name(name: str, chunk: DistributedDataParallel) -> str:
    """A parameter's name in the TP=1/PP=1 model: global layer index, tied output folded."""
    name = name.removeprefix("module.").removeprefix("module.")  # DDP, then Float16Module
    if name.startswith("decoder.layers."):
        local = int(name.split(".")[2])
        layer_number = get_attr_wrapped_model(chunk, "decoder").layers[local].layer_number
        name = name.replace(f"layers.{local}.", f"layers.{layer_number - 1}.", 1)
    return name.replace("output_layer.weight", "embedding.word_embeddings.weight")


def gather_tp(tensor: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """The full (TP=1) tensor of the local piece of a TP-sharded parameter."""
    tp_size = ps.get_tensor_model_parallel_world_size()
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    pieces = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(pieces, tensor.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=param.partition_dim)


def full_tensors(model: Model, read: Callable) -> dict[str, torch.Tensor]:
    """``read(param)`` for every parameter of this rank, gathered over TP, by global name."""
    return {
        global_name(name, chunk): gather_tp(read(param), param)
        for chunk in model
        for name, param in chunk.named_parameters()
    }


def weights(param: torch.nn.Parameter) -> torch.Tensor:
    return param.detach()


def grads(param: torch.nn.Parameter) -> torch.Tensor:
    return param.main_grad


def load_full(model: Model, full: dict[str, torch.Tensor]) -> None:
    """Copy TP=1 tensors, by global name, into this rank's parameters (TP=1 layouts only)."""
    assert ps.get_tensor_model_parallel_world_size() == 1
    with torch.no_grad():
        for chunk in model:
            for name, param in chunk.named_parameters():
                param.copy_(full[global_name(name, chunk)])


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() <= want.keys(), sorted(got.keys() - want.keys())
    return max((got[k].float() - want[k].float()).abs().max().item() for k in got)


def max_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest elementwise |got - want| / |want| (|want| floored at 1e-3)."""
    return max(
        ((got[k].float() - want[k].float()).abs() / want[k].float().abs().clamp(min=1e-3))
        .max()
        .item()
        for k in got
    )


def norm_rel_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """|got - want| / |want| over all tensors together (2-norms)."""
    diff = sum((got[k].double() - want[k].double()).square().sum() for k in got)
    return (diff / sum(want[k].double().square().sum() for k in got)).sqrt().item()


def group_sizes(groups: ParallelGroups) -> list[int]:
    return [groups.size(g) for g in (groups.tp, groups.pp, groups.cp, groups.dp, groups.dp_cp)]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_rng() -> dict[str, object]:
    """The tracker fork isolates its stream, queues no CUDA call and differs across TP ranks."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    records = _Records()
    logging.getLogger(tensor_parallel.random.__name__).addHandler(records)
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
    per_tp_rank = [torch.empty_like(forked_reseeded) for _ in range(2)]
    dist.all_gather(per_tp_rank, forked_reseeded, group=ps.get_tensor_model_parallel_group())
    return {
        "fork_leaves_default_stream": torch.equal(after_fork, plain),
        "fork_uses_own_stream": not torch.equal(forked, plain),
        "fork_state_advances": not torch.equal(forked_later, forked),
        "reseed_restarts_fork": torch.equal(forked_reseeded, forked),
        "tp_ranks_fork_differently": not torch.equal(per_tp_rank[0], per_tp_rank[1]),
        "queued_cuda_calls_added": len(torch.cuda._queued_calls) - queued,
        "fork_warnings": len(records.messages),
    }


def check_rope_cp() -> float:
    """RoPE under context parallelism: rank r keeps chunks r and 2*cp-1-r of the table."""
    full = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)(SEQ)
    cp_group = dist.new_group([0, 1])
    rank_table = RotaryEmbedding(
        kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True, cp_group=cp_group
    )(SEQ)
    chunks = full.chunk(4, dim=0)
    rank = dist.get_rank()
    return (rank_table - torch.cat([chunks[rank], chunks[3 - rank]])).abs().max().item()


def check_distributed_optimizer(bf16: bool) -> dict[str, object]:
    """Two Adam steps at DP=2, each rank with its own batches: distributed == plain."""
    batches = make_batches(seed=1 + dist.get_rank())
    steps: dict[bool, list[dict[str, torch.Tensor]]] = {}
    norms: dict[bool, list[float]] = {}
    initial = full_tensors(build_model(bf16=bf16), weights)
    for distributed in (False, True):
        model = build_model(distributed_optimizer=distributed, bf16=bf16)
        # eps >> sqrt(v) makes Adam's update lr * m / eps, linear in the grads: grads that differ
        # by a rounding give updates that differ by as little (with eps=1e-8 the first update is
        # lr * sign(g), and a grad that rounding moves across 0 flips a weight by 2 * lr).
        optimizer = make_optimizer(
            model, distributed=distributed, clip=0.5, bf16=bf16, lr=1.0, eps=1.0
        )
        steps[distributed], norms[distributed] = [], []
        for _ in range(2):
            # Without it the plain optimizer's param.grad aliases main_grad: doubled grads.
            optimizer.zero_grad()
            train_step(model, batches)
            _, grad_norm, _ = optimizer.step()
            norms[distributed].append(grad_norm)
            steps[distributed].append(full_tensors(model, weights))
    return {
        "max_rel_diff": max(
            max_rel_diff(d, p) for d, p in zip(steps[True], steps[False], strict=True)
        ),
        "norm_rel_diff": max(
            norm_rel_diff(d, p) for d, p in zip(steps[True], steps[False], strict=True)
        ),
        "update_rel_size": norm_rel_diff(steps[False][-1], initial),
        "grad_norms": norms[True],
        "plain_grad_norms": norms[False],
    }


def check_checkpoint(model: GPTModel, ckpt_dir: Path) -> dict[str, float]:
    """dist_checkpointing save, then load into a model that differs: bit-exact weights."""
    if dist.get_rank() == 0:
        ckpt_dir.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(ckpt_dir))
    fresh = build_model()[0].module
    saved = dict(model.named_parameters())

    def diff() -> float:
        return max((p - saved[n]).abs().max().item() for n, p in fresh.named_parameters())

    before = diff()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(ckpt_dir)))
    return {"diff_before_load": before, "diff_after_load": diff()}


def run(out_dir: Path) -> dict[str, object]:
    result: dict[str, object] = {}
    batches = make_batches(seed=0)

    # TP=1, PP=1, DP=2 (both ranks fed the same batches): the reference.
    result["groups_dp2"] = group_sizes(initialize_megatron_cpu(tp=1, seed=SEED))
    ref = build_model()
    ref_weights = full_tensors(ref, weights)
    result["ref_loss"] = train_step(ref, batches)
    ref_grads = full_tensors(ref, grads)
    result["rope_cp_max_diff"] = check_rope_cp()
    result["distopt_fp32"] = check_distributed_optimizer(bf16=False)
    result["distopt_bf16"] = check_distributed_optimizer(bf16=True)

    # TP=2: RNG tracker, same init/loss/grads as TP=1, optimizer step with clipping, checkpoint.
    result["groups_tp2"] = group_sizes(initialize_megatron_cpu(tp=2, seed=SEED))
    result["rng"] = check_rng()
    model = build_model()
    result["tp2_init_max_diff"] = max_diff(full_tensors(model, weights), ref_weights)
    result["tp2_loss"] = train_step(model, batches)
    result["tp2_grad_max_diff"] = max_diff(full_tensors(model, grads), ref_grads)
    before = full_tensors(model, weights)
    _, result["tp2_grad_norm"], _ = make_optimizer(model, distributed=False, clip=1e-3).step()
    result["tp2_step_min_change"] = min(
        (w - before[k]).abs().max().item() for k, w in full_tensors(model, weights).items()
    )
    result["tp2_loss_after_step"] = train_step(model, batches)
    result["ckpt"] = check_checkpoint(model[0].module, out_dir / "ckpt")

    # PP=2 (1F1B), then PP=2 x virtual PP=2 (interleaved): same loss and grads as PP=1.
    for name, vpp in (("pp2", None), ("vpp2", 2)):
        result[f"groups_{name}"] = group_sizes(initialize_megatron_cpu(pp=2, vpp=vpp, seed=SEED))
        model = build_model(vpp=vpp)
        # Init draws depend on which layers a rank builds, so start from the reference weights.
        load_full(model, ref_weights)
        result[f"{name}_loss"] = train_step(model, batches)
        result[f"{name}_grad_max_diff"] = max_diff(full_tensors(model, grads), ref_grads)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    result = run(out_dir)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result, indent=1))
    destroy()


if __name__ == "__main__":  # dist_checkpointing's writer spawns processes that import this file
    main()
