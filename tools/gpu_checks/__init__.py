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
- ``parts``: name -> part, in run order.
"""
