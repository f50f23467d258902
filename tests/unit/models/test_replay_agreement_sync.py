"""The routing-replay agreement metric counts on the router's device and reaches the host once
per pass (``models/router_replay.py``): no router call copies its counts to the host (on a GPU
each such copy waits for the stream, 48 times a micro-batch at Qwen3-30B-A3B).

One gloo rank, the tiny megatron MoE GPTModel of ``test_router_replay.py``: every call that
would move a tensor's values to the host (``.to("cpu")``, ``.cpu()``, ``.item()``,
``.tolist()``, ``.numpy()``) is counted during a forward with routes given and during the
same forward without them; the two counts must be equal (the routers' own code is the same),
and ``take_agreement`` makes one such copy for all routers and gives the same counts.
"""

import sys
from pathlib import Path

import pytest

HOST_READS = ("item", "tolist", "cpu", "numpy")


def host_copies(run) -> int:
    """Run ``run()``; how many calls moved tensor values to the host."""
    import torch
    from torch.overrides import TorchFunctionMode

    count = 0
    reads = {getattr(torch.Tensor, name) for name in HOST_READS}

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal count
            kwargs = kwargs or {}
            targets = [*args[1:], kwargs.get("device")]
            to_host = func is torch.Tensor.to and any(
                (isinstance(t, str) and t.startswith("cpu"))
                or (isinstance(t, torch.device) and t.type == "cpu")
                for t in targets
            )
            if func in reads or to_host:
                count += 1
            return func(*args, **kwargs)

    with Count():
        run()
    return count


def worker(out_dir: str) -> None:
    import torch
    from megatron.core.transformer.moe import moe_utils

    from tests.unit.models.test_router_replay import LAYERS, TOKENS, TOP_K, VOCAB, build, forward
    from vapo_megatron.models.router_replay import ModelRouterReplay
    from vapo_megatron.parallel.cpu_shim import destroy, initialize_megatron_cpu

    initialize_megatron_cpu()
    if not hasattr(moe_utils, "te_general_gemm"):  # no TE: megatron's gating linear reads it
        moe_utils.te_general_gemm = None
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    model = build(False)
    replay = ModelRouterReplay([model])
    replay.record()
    forward(model, tokens)
    own = replay.recorded()
    replay.clear()

    without = host_copies(lambda: forward(model, tokens))
    replay.set_routes(own, replay=True)
    given = host_copies(lambda: forward(model, tokens))
    replay.clear()
    assert given == without, f"{given - without} host copies in {LAYERS} router calls"
    router_device = {router.weight.device for router in replay.routers}
    assert {i.agree.device for i in replay.instances} == router_device
    box = []
    assert host_copies(lambda: box.append(replay.take_agreement())) == 1
    hits, total = box[0].tolist()
    assert box[0].dtype == torch.float64 and hits == total == TOKENS * LAYERS * TOP_K
    assert replay.take_agreement().tolist() == [0.0, 0.0]
    Path(out_dir, "ok").write_text("ok")
    destroy()


if __name__ == "__main__":
    worker(sys.argv[1])


@pytest.mark.unit
def test_agreement_stays_on_the_router_device_until_taken(tmp_path: Path) -> None:
    from tests.launcher import run_workers

    run_workers(__file__, 1, str(tmp_path), timeout=300)
    assert (tmp_path / "ok").exists()
