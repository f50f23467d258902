"""vapo-train started plainly refuses a bad recipe or override in its own process, before it
starts any rank, with the message a rank would give (issue 40: the ranks took 20-30 s to say
it)."""

import logging
import subprocess
import time

import pytest

from tests.launcher import REPO_ROOT
from vapo_megatron import train

pytestmark = pytest.mark.unit
TINY = str(REPO_ROOT / "recipes" / "tiny_cpu.yaml")
DENSE_MODEL = REPO_ROOT / "vapo_megatron" / "tiny" / "demo" / "model"


class RankStarted(Exception):
    """A rank process was started."""


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """main() as a plain start (no launcher environment), with every process start recorded
    and stopped; the root logger restored afterwards (main sets up its own handlers)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    started = []

    def popen(*args, **kwargs):
        started.append(args)
        raise RankStarted

    monkeypatch.setattr(subprocess, "Popen", popen)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    common = [f"model.path={DENSE_MODEL}", "model.create_tiny=false",
              f"trainer.run_dir={tmp_path / 'run'}"]  # fmt: skip

    def run(*overrides: str) -> tuple[int | None, float]:
        began = time.perf_counter()
        try:
            code = train.main([TINY, *common, *overrides])
        except RankStarted:
            code = None
        return code, time.perf_counter() - began

    yield run, started
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.mark.parametrize(
    "override, message",
    [
        ("policy.layout.tp=3", "policy.layout needs tp * pp * cp = 3 ranks per replica"),
        ("policy.layout.ep=2", "policy.layout.ep=2: expert parallelism needs a mixture-of-experts"),
        ("critic.layout.pp=2 critic.layout.vpp=2", "pp * vpp = 4 must divide num_layers=2"),
        ("rollout.temperature=-1", "rollout.temperature=-1.0 is not a temperature"),
        ("algorithm.critic_init=reward_model", "critic_init=reward_model needs critic.init_path"),
    ],
)  # fmt: skip
def test_a_bad_recipe_fails_before_any_rank_starts(launcher, capsys, override, message):
    run, started = launcher
    code, seconds = run(*override.split())
    assert (code, started) == (2, []), "a rank was started for a recipe the ranks refuse"
    assert message in capsys.readouterr().err
    assert seconds < 2.0, f"the refusal took {seconds:.1f} s"


def test_a_good_recipe_starts_the_ranks(launcher):
    run, started = launcher
    code, _ = run()
    assert code is None and len(started) == 1  # the first rank's start, stopped here
