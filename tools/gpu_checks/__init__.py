"""The parts of ``tools/gpu_check.py`` (that script's docstring says what each one runs and
holds), one module per concern; ``parts`` lists them in run order.

- ``frame``: a part's verdict, seconds and printed line; the JSON summary.
- ``tiny``: the tiny Qwen2 and the random step every part uses.
- ``context``: what the parts share (groups, engines, outputs).
- ``twin``: --cpu's NCCL twin (the project's collectives read the default group as NCCL).
- ``compare``: the training state of an engine and bit-for-bit comparisons.
- ``step_parts``: groups, engines, the flat path's scoring and updates (world 1).
- ``interop_parts``: the weight stream into HF, HF logits, Transformer Engine's spec.
- ``checkpoint_parts``: training checkpoints and model-weight checkpoints.
- ``recipe32b_parts``: the 32B recipe's path: shard path, distributed optimizer, overlaps,
  recompute, several steps.
- ``offload_part``: the training state's round trip to pinned host memory.
- ``moe_part``: the tiny Qwen3-MoE with routing replay (local spec, world 1).
- ``moe_compare``: two builds of that MoE on the same weights and routes: logits, gradients.
- ``moe_te_part``: Transformer Engine's MoE spec (grouped GEMM, permute fusion, alltoall)
  against the local spec.
- ``moe_ep_part``, ``moe_ep_worker``: EP 2 against EP 1 on 2 launched ranks.
- ``vllm_routes_part``, ``vllm_routes_worker``: vLLM TP 2 with routed experts on 2 launched
  ranks.
- ``spawn``: the 2-rank launch of a worker module and its ranks' results.
- ``verdict``: which skips fail the check, the JSON summary, the last line, the exit status.
- ``parts``: name -> part, in run order.
"""
