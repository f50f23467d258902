import pytest
import torch

from vapo_megatron.weights.buckets import bucket_nbytes, iter_buckets

pytestmark = pytest.mark.unit


def named(*numels, dtype=torch.float32):
    return [(f"t{i}", torch.full((n,), float(i), dtype=dtype)) for i, n in enumerate(numels)]


def names(buckets):
    return [[name for name, _ in bucket] for bucket in buckets]


def test_groups_in_order_up_to_the_bound():
    # fp32: 4 bytes per element; bound 40 bytes = 10 elements.
    buckets = list(iter_buckets(named(4, 4, 2, 3, 5, 5), 40))
    assert names(buckets) == [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]]
    assert [bucket_nbytes(b) for b in buckets] == [40, 32, 20]


def test_concatenation_gives_back_the_input():
    tensors = named(7, 1, 12, 3, 3, 9, 2)
    buckets = list(iter_buckets(iter(tensors), 24))
    flat = [item for bucket in buckets for item in bucket]
    assert [name for name, _ in flat] == [name for name, _ in tensors]
    for (_, got), (_, want) in zip(flat, tensors, strict=True):
        assert got is want  # no copy without a dtype cast
    assert all(bucket for bucket in buckets)


def test_oversized_tensor_goes_alone():
    # t1 (100 bytes) exceeds the 40-byte bound: the bucket before it closes, it goes alone.
    buckets = list(iter_buckets(named(2, 25, 3, 30, 30), 40))
    assert names(buckets) == [["t0"], ["t1"], ["t2"], ["t3"], ["t4"]]
    assert bucket_nbytes(buckets[1]) == 100


def test_exact_fit_and_single_large_bucket():
    assert names(iter_buckets(named(5, 5), 40)) == [["t0", "t1"]]
    assert names(iter_buckets(named(5, 5, 5), 1 << 30)) == [["t0", "t1", "t2"]]


def test_empty_input_and_empty_tensors():
    assert list(iter_buckets([], 10)) == []
    # Zero-byte tensors never close a bucket, and are kept.
    assert names(iter_buckets(named(0, 2, 0), 8)) == [["t0", "t1", "t2"]]


def test_sizes_follow_each_tensors_dtype():
    mixed = [
        ("a", torch.zeros(4, dtype=torch.float32)),  # 16 bytes
        ("b", torch.zeros(8, dtype=torch.bfloat16)),  # 16 bytes
        ("c", torch.zeros(2, dtype=torch.int64)),  # 16 bytes
    ]
    assert names(iter_buckets(mixed, 32)) == [["a", "b"], ["c"]]


def test_dtype_cast_applies_to_floating_tensors_only():
    stream = [
        ("w", torch.randn(6, dtype=torch.float32)),
        ("ids", torch.arange(3)),
        ("v", torch.randn(6, dtype=torch.float32)),
    ]
    # bf16: w and v are 12 bytes each, ids stays int64 (24 bytes).
    buckets = list(iter_buckets(stream, 36, dtype=torch.bfloat16))
    assert names(buckets) == [["w", "ids"], ["v"]]
    w, ids = buckets[0][0][1], buckets[0][1][1]
    assert w.dtype == torch.bfloat16 and ids.dtype == torch.int64
    torch.testing.assert_close(w, stream[0][1].to(torch.bfloat16), rtol=0, atol=0)


def test_lazy_consumption():
    consumed = []

    def stream():
        for i in range(5):
            consumed.append(i)
            yield f"t{i}", torch.zeros(5)  # 20 bytes each

    buckets = iter_buckets(stream(), 40)
    assert names([next(buckets)]) == [["t0", "t1"]]
    assert consumed == [0, 1, 2]  # t2 was read to learn that the bucket was full


@pytest.mark.parametrize("bad", [0, -1])
def test_rejects_non_positive_bound(bad):
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        list(iter_buckets(named(1), bad))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="floating-point"):
        list(iter_buckets(named(1), 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="'x': expected a torch.Tensor"):
        list(iter_buckets([("x", [1.0, 2.0])], 8))


def plan_of(tensors):
    return [(name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in tensors]


def test_a_plan_closes_a_bucket_before_pulling_the_tensor_that_does_not_fit():
    consumed = []
    tensors = named(5, 5, 5, 12, 1)  # 20, 20, 20, 48, 4 bytes

    def stream():
        for item in tensors:
            consumed.append(item[0])
            yield item

    buckets = iter_buckets(stream(), 40, plan=plan_of(tensors))
    assert names([next(buckets)]) == [["t0", "t1"]]
    assert consumed == ["t0", "t1"]  # t2 is not produced while the bucket is held
    assert names([next(buckets)]) == [["t2"]]
    assert consumed == ["t0", "t1", "t2"]
    assert names(buckets) == [["t3"], ["t4"]]  # the oversized t3 alone, as without a plan
    # Same buckets as without a plan, for any bound.
    for bound in (1, 20, 40, 64, 1 << 20):
        assert names(iter_buckets(tensors, bound, plan=plan_of(tensors))) == names(
            iter_buckets(tensors, bound)
        )


def test_a_plan_counts_sizes_after_the_cast():
    tensors = [("w", torch.randn(6)), ("ids", torch.arange(3)), ("v", torch.randn(6))]
    buckets = list(iter_buckets(tensors, 36, dtype=torch.bfloat16, plan=plan_of(tensors)))
    assert names(buckets) == [["w", "ids"], ["v"]]
    assert buckets[0][0][1].dtype == torch.bfloat16


def test_a_stream_that_departs_from_its_plan_is_refused():
    tensors = named(2, 3, 4)
    plan = plan_of(tensors)
    with pytest.raises(ValueError, match="'t1' .* where the plan lists 't2'"):
        list(iter_buckets([tensors[0], tensors[1]], 64, plan=[plan[0], plan[2]]))
    with pytest.raises(ValueError, match=r"where the plan lists 't1' \(3,\)"):
        list(iter_buckets([tensors[0], ("t1", torch.zeros(5))], 64, plan=plan[:2]))
    with pytest.raises(ValueError, match="torch.float64 where the plan lists 't0'"):
        list(iter_buckets([("t0", torch.zeros(2, dtype=torch.float64))], 64, plan=plan[:1]))
    with pytest.raises(ValueError, match="ended before 't2'"):
        list(iter_buckets(tensors[:2], 64, plan=plan))
    with pytest.raises(ValueError, match="'t2' comes after the last tensor of the plan"):
        list(iter_buckets(tensors, 64, plan=plan[:2]))
