"""tools/gpu_check.py --cpu's NCCL twin (``tools/gpu_checks/twin.py``, issue 25).

On a GPU the default group is NCCL and the project's object collectives refuse it; on CPU
everything is gloo, so a checkpoint call that forgot the host group passed on CPU and could
not pass on a GPU. With the twin installed the project's collectives read every group but
the host group as NCCL (torch still runs gloo), and the same mistake fails on CPU.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from tests.launcher import REPO_ROOT
from vapo_megatron.checkpoint.load import load_train_checkpoint
from vapo_megatron.parallel import collectives

sys.path.insert(0, str(REPO_ROOT / "tools"))
from gpu_checks import twin as nccl_twin  # noqa: E402  (tools/ is not a package)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


@pytest.fixture
def host():
    """The job's host group, with the twin installed for the test (undone after)."""
    group = collectives.make_host_group()
    undo = nccl_twin.install([group])
    yield group
    undo()


def test_default_and_model_groups_read_as_nccl_the_host_group_as_gloo(host):
    model_group = dist.new_group([0])  # as build_model_groups makes them: no backend named
    assert collectives.group_backend(None) == "nccl"
    assert collectives.group_backend(model_group) == "nccl"
    assert collectives.group_backend(host) == "gloo"
    assert dist.get_backend() == "gloo"  # torch itself still runs gloo
    # An NCCL group wants the training device, which on CPU is the host: tensor collectives
    # of the model groups keep working.
    assert collectives.group_device(None) == torch.device("cpu")
    counts = torch.ones(2, device="cpu")
    collectives.all_reduce(counts, model_group)
    assert counts.tolist() == [1.0, 1.0]


def test_object_collectives_fail_on_the_default_group_and_run_on_the_host_group(host):
    with pytest.raises(ValueError, match="only on a gloo group"):
        collectives.broadcast_object("x", None)
    with pytest.raises(ValueError, match="only on a gloo group"):
        collectives.all_gather_objects("x", None)
    assert collectives.broadcast_object("x", host) == "x"
    assert nccl_twin.backends_as_read(host) == {"default": "nccl", "host": "gloo"}


def test_a_checkpoint_call_without_the_host_group_fails_as_on_a_gpu(host, tmp_path):
    """The mistake gpu_check's checkpoint parts had (no ``group=``): rank 0's broadcast of
    the step to load went over the default group."""
    with pytest.raises(ValueError, match="Pass the host group"):
        load_train_checkpoint(tmp_path, {})
    assert load_train_checkpoint(tmp_path, {}, group=host) is None  # no checkpoint yet


def test_undo_gives_the_real_backends_back():
    group = collectives.make_host_group()
    nccl_twin.install([group])()
    assert collectives.group_backend(None) == "gloo"
    assert collectives.broadcast_object("x", None) == "x"
