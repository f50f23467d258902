"""``keep_freed_heap``: with it, host memory a step frees is reused by the next step without
page faults; without it (glibc's defaults) every round faults its pages in again. Each case runs
in a fresh process (mallopt changes the whole process)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vapo_megatron.trainer.host_malloc import keep_freed_heap, user_malloc_setting

pytestmark = pytest.mark.unit

ROUND = textwrap.dedent(
    """
    import resource, sys, torch
    from vapo_megatron.trainer.host_malloc import keep_freed_heap
    applied = keep_freed_heap() if sys.argv[1] == "tuned" else False

    def one_round():  # 256 blocks of 1 MiB, each written (as a step's rows are), then freed
        blocks = [torch.ones(1 << 18, dtype=torch.float32) for _ in range(256)]
        del blocks

    one_round()  # the first round faults its pages in either way
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_round()
    print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
)
REPO = Path(__file__).resolve().parents[3]
PAGES = 256 * (1 << 20) // 4096
"""The pages one round writes (4 KiB pages)."""


def faults_of_second_round(mode: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", ROUND, mode], capture_output=True, text=True, timeout=120,
        check=True, cwd=REPO, env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_are_reused_without_faults():
    applied, tuned = faults_of_second_round("tuned")
    assert applied
    _, default = faults_of_second_round("default")
    assert default > PAGES // 2, f"glibc's defaults faulted {default} of {PAGES} pages"
    assert tuned < PAGES // 10, f"{tuned} faults with the freed heap kept ({PAGES} pages)"


@pytest.mark.parametrize(
    "environ, owner",
    [
        ({"MALLOC_TRIM_THRESHOLD_": "1"}, "MALLOC_TRIM_THRESHOLD_"),
        ({"MALLOC_MMAP_THRESHOLD_": "1"}, "MALLOC_MMAP_THRESHOLD_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
        ({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, None),
        ({}, None),
    ],
)
def test_the_users_own_malloc_settings_win(environ, owner):
    assert user_malloc_setting(environ) == owner
    if owner is not None:
        assert keep_freed_heap(environ) is False


BIG_ROUND = textwrap.dedent(
    """
    import resource, sys, torch
    from vapo_megatron.trainer.host_malloc import keep_freed_heap, step_heap
    applied = keep_freed_heap()

    def one_round():  # two 64 MiB arrays (above any mmap threshold), written, then freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(1 << 24, dtype=torch.float32) for _ in range(2)]
        del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def rounds(scoped):
        with step_heap() if scoped else open("/dev/null"):
            return [one_round() for _ in range(8)]

    print(applied, min(rounds(sys.argv[1] == "scoped")[1:]))
    """
)
BIG_PAGES = 2 * (64 << 20) // 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_step_heap_keeps_whole_step_arrays_and_ends_with_its_scope():
    """Arrays above the mmap threshold are fresh mappings every round (every page faulted);
    inside ``step_heap`` they come from the heap, and once it has grown to the rounds' layout
    (after 2-5 rounds, by where the address space lets the heap grow: as a rank's faults fall
    over the first steps in the bench) a round reuses the pages. Without it every round
    faults. (That the scope's end turns mmap back on is held by the recorder below.)"""

    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", BIG_ROUND, mode], capture_output=True, text=True,
            timeout=120, check=True, cwd=REPO,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        applied, best = out.stdout.split()
        return applied == "True", int(best)

    applied, scoped = run("scoped")
    assert applied
    assert scoped < BIG_PAGES // 10, f"{scoped} faults at best in step_heap ({BIG_PAGES} pages)"
    _, unscoped = run("plain")
    assert unscoped > BIG_PAGES // 2, f"outside step_heap: {unscoped} of {BIG_PAGES} pages"


def test_step_heap_does_nothing_unless_the_heap_settings_were_applied(monkeypatch):
    from vapo_megatron.trainer import host_malloc

    calls = []
    monkeypatch.setattr(host_malloc, "_MALLOPT", None)
    with host_malloc.step_heap():
        pass
    monkeypatch.setattr(host_malloc, "_MALLOPT", lambda *args: calls.append(args) or 1)
    with host_malloc.step_heap(), host_malloc.step_heap():  # re-entrant: one switch
        assert calls == [(host_malloc.M_MMAP_MAX, 0)]
    assert calls[-1] == (host_malloc.M_MMAP_MAX, host_malloc.DEFAULT_MMAP_MAX)
    assert len(calls) == 2
