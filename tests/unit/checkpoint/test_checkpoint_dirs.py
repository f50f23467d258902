"""The checkpoint directory's rules (latest pointer, markers, fallback, pruning) and the
preemption flag's signal handling, on one process without torch.distributed."""

import logging
import os
import signal

import pytest

from vapo_megatron.checkpoint.directory import (
    LATEST,
    MARKER,
    complete_steps,
    latest_step,
    publish,
    step_dir_name,
)
from vapo_megatron.trainer.preemption import PreemptionFlag

pytestmark = pytest.mark.unit


def save(root, step, keep_last=0, token="abcd"):
    """What save_train_checkpoint does on disk, minus the tensors."""
    tmp = root / f"{step_dir_name(step)}.tmp-{token}"
    (tmp / "policy" / "weights").mkdir(parents=True)
    (tmp / "policy" / "weights" / "__0_0.distcp").write_text(f"state of step {step}")
    return publish(tmp, root, step, keep_last=keep_last)


def names(root):
    return sorted(entry.name for entry in root.iterdir())


def test_empty_or_missing_root(tmp_path):
    assert latest_step(tmp_path / "nothing") is None
    assert latest_step(tmp_path) is None
    assert complete_steps(tmp_path) == []


def test_publish_marks_renames_and_points_latest(tmp_path):
    final = save(tmp_path, 7)
    assert final == tmp_path / "step_00000007"
    assert (final / MARKER).is_file()
    assert (final / "policy" / "weights" / "__0_0.distcp").read_text() == "state of step 7"
    assert (tmp_path / LATEST).read_text() == "7\n"
    assert names(tmp_path) == [LATEST, "step_00000007"]
    assert latest_step(tmp_path) == 7


def test_half_written_directories_are_never_chosen(tmp_path):
    save(tmp_path, 2)
    (tmp_path / "step_00000003.tmp-dead").mkdir()  # a save killed before its rename
    (tmp_path / "step_00000003.tmp-dead" / MARKER).write_text("")  # even with a marker
    (tmp_path / "step_00000004").mkdir()  # a step directory without its marker
    assert complete_steps(tmp_path) == [2]
    assert latest_step(tmp_path) == 2


@pytest.mark.parametrize("pointer", ["4\n", "garbage", None])
def test_latest_broken_falls_back_to_newest_complete(tmp_path, caplog, pointer):
    save(tmp_path, 2)
    save(tmp_path, 3)
    (tmp_path / "step_00000004").mkdir()
    if pointer is None:
        (tmp_path / LATEST).unlink()
    else:
        (tmp_path / LATEST).write_text(pointer)
    with caplog.at_level(logging.WARNING):
        assert latest_step(tmp_path) == 3
    assert "newest complete checkpoint, step 3" in caplog.text


def test_latest_wins_over_newer_complete_directory(tmp_path):
    save(tmp_path, 2)
    save(tmp_path, 3)
    (tmp_path / LATEST).write_text("2\n")
    assert latest_step(tmp_path) == 2


def test_next_save_removes_leftover_tmp_directories(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "step_00000002.tmp-killed").mkdir()
    (tmp_path / "step_00000002.tmp-killed" / "junk").write_text("x")
    save(tmp_path, 2, token="ffff")
    assert names(tmp_path) == [LATEST, "step_00000001", "step_00000002"]


def test_keep_last(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep_last=2)
    assert names(tmp_path) == [LATEST, "step_00000002", "step_00000003"]
    (tmp_path / "step_00000001").mkdir()  # an old directory without marker goes too
    save(tmp_path, 5, keep_last=2)
    assert names(tmp_path) == [LATEST, "step_00000003", "step_00000005"]
    save(tmp_path, 6, keep_last=1)
    assert names(tmp_path) == [LATEST, "step_00000006"]


def test_keep_last_zero_keeps_all(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep_last=0)
    assert complete_steps(tmp_path) == [1, 2, 3]


def test_same_step_saved_again_replaces_it(tmp_path):
    save(tmp_path, 4)
    tmp = tmp_path / "step_00000004.tmp-beef"
    tmp.mkdir()
    (tmp / "new").write_text("again")
    publish(tmp, tmp_path, 4, keep_last=0)
    assert names(tmp_path) == [LATEST, "step_00000004"]
    assert names(tmp_path / "step_00000004") == [MARKER, "new"]


def test_preemption_flag_records_signal_and_chains_previous_handler():
    seen = []
    old_usr1 = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        flag = PreemptionFlag()
        assert flag.received is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.received == signal.SIGUSR1
        assert seen == [signal.SIGUSR1]  # the handler installed before still ran
        os.kill(os.getpid(), signal.SIGTERM)  # default not chained: the process lives on
        assert flag.received == signal.SIGUSR1  # the first signal is kept
        flag.uninstall()
        assert signal.getsignal(signal.SIGTERM) == old_term
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, old_usr1)
        signal.signal(signal.SIGTERM, old_term)
