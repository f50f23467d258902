"""``keep_freed_heap``: with it, host memory a step frees is reused by the next step without
page faults; without it (glibc's defaults) every round faults its pages in again. The ranks'
``GLIBC_TUNABLES`` (``launch_tunables``): whole-step arrays fault 2 MiB pages, not 4 KiB. Each
case runs in a fresh process (malloc's settings are the whole process's)."""

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vapo_megatron.launch.host_malloc import (
    keep_freed_heap,
    launch_tunables,
    user_malloc_setting,
)

pytestmark = pytest.mark.unit

ROUND = textwrap.dedent(
    """
    import resource, sys, torch
    from vapo_megatron.launch.host_malloc import keep_freed_heap
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
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, None),  # the launchers' own setting
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES"),
        ({}, None),
    ],
)
def test_the_users_own_malloc_settings_win(environ, owner):
    assert user_malloc_setting(environ) == owner
    if owner is not None:
        assert keep_freed_heap(environ) is False


BIG_ROUND = textwrap.dedent(
    """
    import resource, torch
    from vapo_megatron.launch.host_malloc import keep_freed_heap
    keep_freed_heap()

    def one_round():  # two 64 MiB arrays (above any mmap threshold), written, then freed
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [torch.ones(1 << 24, dtype=torch.float32) for _ in range(2)]
        del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    print(min(one_round() for _ in range(4)))
    """
)
BIG_PAGES = 2 * (64 << 20) // 4096


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (the bracketed word), or None without THP."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


def glibc_at_least(major: int, minor: int) -> bool:
    name, version = platform.libc_ver()
    return name == "glibc" and tuple(int(p) for p in version.split(".")[:2]) >= (major, minor)


@pytest.mark.skipif(
    thp_mode() not in ("madvise", "always") or not glibc_at_least(2, 35),
    reason="transparent huge pages for malloc need THP madvise/always and glibc >= 2.35",
)
def test_huge_pages_cut_the_faults_of_whole_step_arrays():
    """Arrays above the mmap threshold are fresh mappings every round: with 4 KiB pages every
    page faults; launched with the tunable the ranks get (``launch_tunables``) the kernel maps
    them 2 MiB at a time. Where THP is ``always`` the kernel does so without the tunable, so
    only the tuned case is held there."""

    def faults(tunables: str | None) -> int:
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO)}
        if tunables is not None:
            env["GLIBC_TUNABLES"] = tunables
        out = subprocess.run(
            [sys.executable, "-c", BIG_ROUND], capture_output=True, text=True, timeout=120,
            check=True, cwd=REPO, env=env,
        )  # fmt: skip
        return int(out.stdout)

    tuned = faults(launch_tunables(None))
    assert tuned < BIG_PAGES // 8, f"{tuned} faults with huge pages ({BIG_PAGES} 4 KiB pages)"
    if thp_mode() == "madvise":
        plain = faults(None)
        assert plain > BIG_PAGES // 2, f"{plain} of {BIG_PAGES} pages faulted without the tunable"


@pytest.mark.parametrize(
    "given, launched",
    [
        (None, "glibc.malloc.hugetlb=1"),
        ("", "glibc.malloc.hugetlb=1"),
        ("glibc.rtld.nns=2", "glibc.rtld.nns=2:glibc.malloc.hugetlb=1"),
        ("glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),  # the user's choice stands
        ("glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=2",
         "glibc.malloc.trim_threshold=1:glibc.malloc.hugetlb=2"),
    ],
)  # fmt: skip
def test_ranks_launch_with_huge_pages_unless_the_user_chose(given, launched):
    assert launch_tunables(given) == launched


def test_local_ranks_start_with_the_tunable():
    from vapo_megatron.launch.local_launch import run_local_ranks

    command = [sys.executable, "-c", "import os; print('T=' + os.environ['GLIBC_TUNABLES'])"]
    env = {"PATH": os.environ.get("PATH", ""), "GLIBC_TUNABLES": "glibc.rtld.nns=2"}
    (out,) = run_local_ranks(command, 1, timeout=60, env=env)
    assert "T=glibc.rtld.nns=2:glibc.malloc.hugetlb=1" in out
