"""Moving weights between Megatron and Hugging Face: the one owner of names, gathers, buckets,
files and streams.

Read top-down from the weight sync (step 2 of a step, ``step/weight_sync.py``, which hands the
engine the buckets of ``ModelEngine.hf_buckets``):

- ``stream.py``: the whole model's full HF-named tensors on every rank, in buckets that the
  engine loads as they come: each pipeline stage gathers its own, then the stages broadcast
  their buckets over the pipeline group.
- ``gather.py``: one stage's HF tensors gathered over tensor parallelism (and HF tensors
  loaded into this rank's shards), with the pooled buffers they go through.
- ``buckets.py``: named tensors in byte-bounded buckets (the stream's messages).
- ``record.py``: the name table, the one HF <-> Megatron name / shape / TP-split map that
  every path above and below reads.

Around it: ``hf_io.py`` (safetensors files and ``config.json``), ``convert.py`` (offline
HF <-> Megatron checkpoint conversion, ``tools/convert.py``), ``export.py`` (a trained model
as an HF directory, through the same stream), ``critic.py`` (a critic's HF tensors from the
policy's or a reward model's).

Nothing here is imported by ``rollout/``: the engine sees HF names and tensors only
(``tests/unit/rollout/test_rollout_imports.py``); the weights take tensors and process groups,
never the run's session or the engines.
"""
