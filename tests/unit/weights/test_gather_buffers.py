"""The weight stream's buffer pool (weights/gather.GatherBuffers): reuse only what nobody holds."""

import pytest
import torch

from vapo_megatron.weights.gather import GatherBuffers

pytestmark = pytest.mark.unit
CPU = torch.device("cpu")


def test_a_dropped_buffer_is_reused_in_any_shape():
    pool = GatherBuffers()
    a = pool.take((4, 5), torch.float32, CPU)
    pointer = a.data_ptr()
    del a
    b = pool.take((20,), torch.float32, CPU)
    assert b.data_ptr() == pointer and b.shape == (20,)
    assert pool.nbytes() == 80


def test_a_buffer_with_a_live_view_is_not_reused():
    pool = GatherBuffers()
    a = pool.take((10,), torch.float32, CPU)
    view = a[2:5]
    del a
    b = pool.take((10,), torch.float32, CPU)
    assert b.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
    assert pool.nbytes() == 80
    del view, b
    c = pool.take((2, 5), torch.float32, CPU)
    assert pool.nbytes() == 80 and c.numel() == 10


def test_other_sizes_and_dtypes_get_their_own_buffer():
    pool = GatherBuffers()
    pool.take((10,), torch.float32, CPU)
    pool.take((11,), torch.float32, CPU)
    pool.take((10,), torch.bfloat16, CPU)
    assert pool.nbytes() == 40 + 44 + 20


def test_limit_drops_free_buffers_least_recently_used_first():
    pool = GatherBuffers(limit_bytes=100)
    a = pool.take((10,), torch.float32, CPU)  # 40 bytes
    b = pool.take((5,), torch.float32, CPU)  # 20 bytes
    del a, b
    c = pool.take((15,), torch.float32, CPU)  # 60 bytes: 120 > 100, the 40-byte one goes
    assert pool.nbytes() == 80
    d = pool.take((5,), torch.float32, CPU)  # the 20-byte one is still there
    assert pool.nbytes() == 80
    del c, d


def test_buffers_in_use_are_never_dropped():
    pool = GatherBuffers(limit_bytes=10)
    held = [pool.take((10,), torch.float32, CPU) for _ in range(3)]
    for i, tensor in enumerate(held):
        tensor.fill_(i)
    assert pool.nbytes() == 120  # over the limit by what is in use
    assert [t[0].item() for t in held] == [0, 1, 2]
