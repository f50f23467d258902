"""One ``run_step`` on the scale bench's stub session (``tools/bench_scale.py``: the 32B
recipe's step shape, the models stubbed) at 64 samples on one gloo rank, with the rollout
correction ``off`` or ``token`` (argv[1]). Prints what the policy's update was handed: the
engine's log-probs are kept for the correction's weights, and dropped after the scoring
pass's gap metric otherwise (``step/run.py``)."""

import dataclasses
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "tools"))

import bench_scale  # noqa: E402

from vapo_megatron.parallel.collectives import make_host_group  # noqa: E402
from vapo_megatron.step import rollout, run, updates  # noqa: E402


def main(correction: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    host = make_host_group()
    with tempfile.TemporaryDirectory() as run_dir:
        session = bench_scale.stub_session(64, False, host, Path(run_dir))
        cfg = session.config
        algo = cfg.algorithm
        fix = dataclasses.replace(algo.rollout_correction, truncate=correction)
        session.config = dataclasses.replace(
            cfg, algorithm=dataclasses.replace(algo, rollout_correction=fix)
        )
        rollout.score_responses = bench_scale.stub_grade
        run.sync_weights = lambda session: {}
        seen = {}
        update = run.update_models

        def recording_update(session, models, trajectories, fields, route, *args, **kwargs):
            seen["at_update"] = trajectories.rollout_logprobs
            return update(session, models, trajectories, fields, route, *args, **kwargs)

        weights = updates.rollout_weights
        calls = []

        def recording_weights(old, rollout_logprobs, *args, **kwargs):
            calls.append(rollout_logprobs.numel())
            return weights(old, rollout_logprobs, *args, **kwargs)

        run.update_models = recording_update
        updates.rollout_weights = recording_weights
        metrics = run.run_step(session, 0, pretrain=False)
    kept = seen["at_update"] is not None
    print(
        f"correction={correction} kept={kept} weight_calls={len(calls)} "
        f"gap={metrics['rollout/logprob_gap']:.6g}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
