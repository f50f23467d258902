"""Routed experts of each generated sequence, recorded inside vLLM's CPU engine.

On GPU, vLLM 0.32 returns them itself (``enable_return_routed_experts=True``:
``CompletionOutput.routed_experts``). Its contract, read in vllm 0.32's
``model_executor/layers/fused_moe/routed_experts_capturer.py`` (``RoutedExpertsCapturer``,
``bind_routed_experts_capturer``), ``distributed/aux_output_connector/connector.py``
(``take_output``) and ``outputs.py``: a numpy array ``[num_prompt_tokens + num_output_tokens
- 1, num_hidden_layers, num_experts_per_tok]`` per completion, one row per token the engine
*forwarded*, in sequence order: every prompt token (``SamplingParams.routed_experts_prompt_start``
= 0) and every generated token but the last (sampled, never fed back); row t, layer l holds the
top-k expert ids (logical, before EPLB's mapping, in the router's top-k order) that layer
``layer_id = l`` chose for token t; uint8 for <= 256 experts, else uint16.

On CPU that path is closed (it needs Model Runner V2, which needs Triton). The engine runs in
our process in eager mode, so this recorder binds a capture function at the very point vLLM's
native capturer binds its own (``BaseRouter.set_capture_fn`` on each ``MoERunner``'s router,
called by ``BaseRouter.select_experts`` with the step's ``topk_ids`` [step_tokens, top_k]),
and maps each step's token rows back to requests with the model runner's batch layout
(``input_batch.req_ids`` and ``query_start_loc``: request i's scheduled tokens are rows
``qsl[i]:qsl[i + 1]``, prefill chunks and decode steps alike) and the positions the model is
called with (so a chunked or recomputed prefill lands on its own rows). The result is the
native layout above, as int16 (``ROUTE_DTYPE``), so both paths feed one trajectory field.

Needs prefix caching off (a cached prompt block is never forwarded, so it has no routes here;
vLLM's native path keeps routes per KV block for that) and vLLM's model forward in this
process (the in-process and external_launcher executors).
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

ROUTE_DTYPE = torch.int16
"""Routes travel as int16: expert ids below 32768 (every published MoE has <= 512 experts)."""


class RouteRecorder:
    """Binds to one vLLM worker's model and records the routed experts of every request it
    forwards while ``recording``; ``take`` gives a finished request's [T - 1, layers, top_k]."""

    def __init__(self) -> None:
        self.recording = False
        self.num_layers = 0
        self.moe_layers: list[int] = []
        self.top_k = 0
        self._runner = None
        self._step: dict | None = None
        self._chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self._index: dict[str, list[str]] | None = None

    def attach(self, worker) -> int:
        """Bind to ``worker`` (vLLM's worker object, e.g. from ``LLM.collective_rpc``): a capture
        function on every MoE router and a pre/post hook on the model's forward. Returns the
        number of MoE layers bound (ValueError when the model has none)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = worker.model_runner
        layers = []
        for module in runner.model.modules():
            if not isinstance(module, MoERunner):
                continue
            if not isinstance(module.router, BaseRouter) or module._quant_method.is_monolithic:
                raise ValueError(
                    f"cannot record routes of MoE layer {module.layer_id}: its router "
                    f"{type(module.router).__name__} has no capture point (vLLM's native "
                    "enable_return_routed_experts is the way on this engine)"
                )
            module.router.set_capture_fn(partial(self._capture, module.layer_id))
            layers.append(module)
        if not layers:
            raise ValueError("the engine's model has no MoE layer: there are no routes to record")
        self.num_layers = 1 + max(m.layer_id for m in layers)
        # DeepSeek-V3/GLM-4.5's first layers are dense: their columns stay -1 (no routes).
        self.moe_layers = sorted(m.layer_id for m in layers)
        self.top_k = layers[0].moe_config.experts_per_token
        self._runner = runner
        runner.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        runner.model.register_forward_hook(self._after_forward)
        return len(layers)

    def start(self) -> None:
        """Forget earlier requests and record from the next forward on."""
        self._chunks.clear()
        self._index = None
        self.recording = True

    def stop(self) -> None:
        self.recording = False

    def request_of(self, request_id: str, index: int, n: int) -> str:
        """The engine's own id of completion ``index`` of ``LLM.generate``'s request
        ``request_id`` (vllm 0.32, ``v1/engine/parallel_sampling.py`` and
        ``input_processor.py``: the engine appends ``-<random>`` to each request id, and with
        n > 1 each completion is a child request ``f"{index}_{parent id}"``)."""
        want = f"{index}_{request_id}" if n > 1 else request_id
        if self._index is None:  # once per generate call: each take removes its key
            self._index = {}
            for key in self._chunks:
                for head in {key, key.rpartition("-")[0]} - {""}:
                    self._index.setdefault(head, []).append(key)
        found = self._index.get(want, [])
        if len(found) != 1:
            raise KeyError(
                f"{len(found)} recorded requests match completion {index} of request "
                f"{request_id!r} (recorded: {sorted(self._chunks)[:8]}...)"
            )
        return found[0]

    def take(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The routes of request ``request_id`` with ``num_tokens`` tokens in all (prompt and
        output): int16 [num_tokens - 1, layers, top_k], rows in sequence order; a dense layer's
        column is -1. Forgets them."""
        chunks = self._chunks.pop(request_id, None)
        if chunks is None:
            raise KeyError(f"no routes were recorded for request {request_id!r}")
        out = torch.full((num_tokens - 1, self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE)
        for start, rows in chunks:
            end = min(start + rows.shape[0], num_tokens - 1)
            out[start:end] = rows[: end - start]
        unrecorded = out[:, self.moe_layers] < 0
        if bool(unrecorded.any()):
            missing = int(unrecorded.any(dim=(1, 2)).sum())
            raise RuntimeError(
                f"request {request_id!r}: {missing} of {num_tokens - 1} forwarded tokens have no "
                "recorded route (is prefix caching on? the recorder needs it off)"
            )
        return out

    def _before_forward(self, module, args, kwargs) -> None:
        if not self.recording:
            return
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        batch = self._runner.input_batch
        num_reqs = batch.num_reqs
        starts = np.asarray(self._runner.query_start_loc.np[: num_reqs + 1]).tolist()
        self._step = {
            "req_ids": list(batch.req_ids[:num_reqs]),
            "starts": starts,
            "positions": positions[: starts[-1]].to("cpu", torch.long),
            "rows": torch.full((starts[-1], self.num_layers, self.top_k), -1, dtype=ROUTE_DTYPE),
        }

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self._step is None:
            return
        rows = self._step["rows"]
        rows[:, layer_id] = topk_ids[: rows.shape[0]].to("cpu", ROUTE_DTYPE)

    def _after_forward(self, module, args, output) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        starts, positions, rows = step["starts"], step["positions"], step["rows"]
        for i, request_id in enumerate(step["req_ids"]):
            lo, hi = starts[i], starts[i + 1]
            if hi > lo:
                first = int(positions[lo])
                self._chunks.setdefault(request_id, []).append((first, rows[lo:hi]))
