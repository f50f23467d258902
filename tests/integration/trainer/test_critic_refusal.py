"""vapo-train refuses, at start, a critic.init_path that is not there, naming both starts."""

import subprocess
from pathlib import Path

import pytest

from tests.integration.trainer_runs import make_assets, plain_command, plain_env

pytestmark = pytest.mark.integration


def test_vapo_train_refuses_an_absent_reward_model(tmp_path: Path) -> None:
    assets = make_assets(tmp_path / "assets")
    missing = tmp_path / "rm-tp1"
    command = plain_command(tmp_path / "run", assets, "algorithm.critic_init=reward_model",
                            f"critic.init_path={missing}", "trainer.steps=1")  # fmt: skip
    done = subprocess.run(command, env=plain_env(), capture_output=True, text=True, timeout=300)
    logs = done.stdout + done.stderr
    logs += "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*") if p.is_file())
    assert done.returncode == 2, logs[-4000:]
    assert f"critic.init_path={missing} does not exist (algorithm.critic_init=reward_model)" in logs
    assert "--critic-from reward-model" in logs and "--critic-from policy" in logs
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
