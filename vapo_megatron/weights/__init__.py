"""Moving weights between Megatron and Hugging Face: the one owner of names, gathers, buckets,
files and streams.

Read top-down from the weight sync (step 2 of a step):

- ``sync.py``: the policy's weights into the rollout engine replicas (wake, stream, wake).
- ``stream.py``: the whole model's full HF-named tensors on every rank: each pipeline stage
  gathers its own, then the stages broadcast their buckets over the pipeline group.
- ``gather.py``: one stage's HF tensors gathered over tensor parallelism (and HF tensors
  loaded into this rank's shards), with the pooled buffers they go through.
- ``buckets.py``: named tensors in byte-bounded buckets (the stream's PP messages, the
  engine's loads).
- ``record.py``: the name table, the one HF <-> Megatron name / shape / TP-split map that
  every path above and below reads.

Around it: ``hf_io.py`` (safetensors files and ``config.json``), ``convert.py`` (offline
HF <-> Megatron checkpoint conversion, ``tools/convert.py``), ``export.py`` (a trained model
as an HF directory, through the same stream), ``critic.py`` (a critic's HF tensors from the
policy's or a reward model's).

Nothing here is imported by ``rollout/`` except ``buckets.py`` (plain torch): the engine sees
HF names and tensors only (``tests/unit/test_rollout_imports.py``).
"""
