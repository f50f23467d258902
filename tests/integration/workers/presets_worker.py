"""Worker: every algorithm preset runs one training step in one session (world 1).

The session is built once (policy, critic, one vLLM engine); each preset then swaps in its
AlgoConfig with the batch shrunk to the tiny task (its shape kept: n = 1 stays 1) and runs one
step. Usage: python presets_worker.py RECIPE key=value...
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import torch

from vapo_megatron.algorithms.presets import PRESETS, algo_preset
from vapo_megatron.config.recipe import load_recipe
from vapo_megatron.step.run import run_step
from vapo_megatron.trainer.session import Session
from vapo_megatron.weights import hf_io


def main(recipe: str, overrides: list[str]) -> None:
    config = load_recipe(recipe, overrides)
    session = Session(config, Path(config.trainer.run_dir))
    for i, name in enumerate(sorted(PRESETS)):
        base = algo_preset(name)
        n = 1 if base.samples_per_prompt == 1 else 4
        algo = dataclasses.replace(
            base, prompts_per_step=16 // n, samples_per_prompt=n,
            overlong_buffer_len=None if base.overlong_buffer_len is None else 32,
        )  # fmt: skip
        session.config = session.context.config = dataclasses.replace(config, algorithm=algo)
        metrics = run_step(session.context, i + 1, pretrain=False)
        assert math.isfinite(metrics["policy/pg_loss"]), (name, metrics)
        assert algo.uses_critic == ("critic/value_loss" in metrics), name
        if algo.uses_critic:
            assert math.isfinite(metrics["critic/value_loss"]), (name, metrics)
        print(f"preset {name}: one step, pg_loss {metrics['policy/pg_loss']:+.4f}", flush=True)
    check_critic_reload(session, config)
    session.close()


def check_critic_reload(session: Session, config) -> None:
    """NeMo-RL #3821, slime #1878: a loaded critic's value head equals the saved one."""
    out = Path(config.trainer.run_dir) / "critic_export"
    session.critic.export_hf(
        out, hf_config=hf_io.read_config(config.model.path),
        assets_from=config.model.path, host_group=session.host_group,
    )  # fmt: skip
    source = hf_io.HFCheckpoint(out)
    saved = dict(source.read(source.names))
    session.critic.load_hf({k: torch.randn_like(v) for k, v in saved.items()})  # scramble
    session.load_critic(out)
    now = dict(session.critic.hf_weights())
    assert set(now) == set(saved) and "score.weight" in saved
    assert all(torch.equal(now[k], saved[k]) for k in saved), "a reloaded critic differs"
    print("critic reload: every tensor, value head included, equals the saved one", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
