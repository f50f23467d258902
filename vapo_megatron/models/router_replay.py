"""Routing replay (R3) with megatron-core 0.16.1's ``RouterReplay``, one instance set per model.

megatron (``transformer/moe/router_replay.py``): a ``TopKRouter`` built with
``moe_enable_routing_replay`` owns a ``RouterReplay``; ``moe_utils.topk_routing_with_score_function``
asks it for the top-k (``get_replay_topk``): RECORD computes and keeps the top-k indices,
REPLAY_FORWARD uses the indices last given by ``set_target_indices``, REPLAY_BACKWARD pops
them in the order they were given (the recompute of a checkpointed layer in the backward
pass sees its micro-batches in forward order, also under 1F1B). The probabilities of replayed
experts are the router's own scores gathered at them, so the router still gets gradients.
megatron keeps *every* instance in one process-global list (``global_router_replay_instances``,
in construction order) and its static setters act on all of them: with the policy and the
critic in one process the two models would take each other's routes.

``ModelRouterReplay`` therefore takes one model's instances out of that list (making them for
routers built without the flag), and drives only them. Its instances decide on their own
whether a call is the forward or the recompute in the backward pass (inside the autograd
engine, ``torch._C._current_graph_task_id() != -1``), so one setting serves the scoring pass
(forward only), the update's forward and its backward under full or selective recompute.

Routes handed in are this micro-batch's tokens as the router sees them (the packed row of
this CP rank, in order; with sequence parallelism this TP rank's slice): [tokens, layers,
top_k] over *this rank's* layers (``ModelRouterReplay.layers``: the global layers of its
routers, every chunk, in order; under PP a stage's, so no rank carries another stage's
routes), int, -1 where a token has no recorded route (the last response token, padding):
those tokens keep the trainer's own top-k. While routes are set, each instance counts how
many of the given experts the trainer's own top-k also picked (the agreement metric), with
replay on or off, on the router's device: the counts come to the host once per pass
(``take_agreement``), not at every router call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from vapo_megatron.parallel.devices import HOST

ROUTES = "routes"
"""The micro-batch field of the engine's routed experts (``step/batching.py`` places them):
[1, t, layers, top_k] int16 over the packed row's positions of this CP rank, -1: none."""


class _ModelReplay(RouterReplay):
    """One router's replay state; not in megatron's global list."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.replay = False
        # [matches, given experts], int64 on the router's device: counting never syncs.
        self.agree = torch.zeros(2, dtype=torch.long, device=device)

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward and not self.replay:  # compare-only: nothing to keep in step
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.replay_backward_list.pop(0) if in_backward else self.target_topk_idx
        probs, own = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        target = target.to(own)  # own's device and dtype (the routes may come as int16)
        if target.shape != own.shape:
            raise ValueError(
                f"routes of shape {tuple(target.shape)} for a router that sees "
                f"{tuple(own.shape)} (tokens, top_k): the routes must be this micro-batch's "
                "tokens as the router sees them (this CP rank's row, this TP rank's slice under SP)"
            )
        given = (target >= 0).all(-1, keepdim=True)
        if not in_backward:
            with torch.no_grad():
                hits = (target[:, :, None] == own[:, None, :]).any(-1) & given
                self.agree += torch.stack([hits.sum(), given.sum() * topk])
        if not self.replay:
            return probs, own
        top = torch.where(given, target, own)
        return scores.gather(1, top), top


class ModelRouterReplay:
    """The replay instances of one model's routers (every chunk of it on this rank)."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module]) -> None:
        # The decoder's routers only: an MTP layer's (models/mtp.py, layer number past
        # num_layers) has no recorded routes and routes from its own scores in every pass.
        self.chunk_routers = [
            [
                m
                for m in chunk.modules()
                if isinstance(m, TopKRouter) and m.layer_number <= m.config.num_layers
            ]
            for chunk in model_chunks
        ]
        self.routers = [router for routers in self.chunk_routers for router in routers]
        if not self.routers:
            raise ValueError("routing replay needs an MoE model; this one has no router")
        ours = set()
        for router in self.routers:
            if router.router_replay is not None:  # built with moe_enable_routing_replay
                ours.add(id(router.router_replay))
            router.router_replay = _ModelReplay(router.weight.device)
        # Routers built with the flag put an instance in megatron's global list; it is unused now.
        global_list = RouterReplay.global_router_replay_instances
        global_list[:] = [r for r in global_list if id(r) not in ours]
        self.top_k = self.routers[0].topk
        self.num_layers = self.routers[0].config.num_layers
        self.layers = [router.layer_number - 1 for router in self.routers]
        """This rank's routers' global layers, in ``routers`` order (every chunk)."""

    @property
    def instances(self) -> list[_ModelReplay]:
        return [router.router_replay for router in self.routers]

    def set_routes(self, routes: torch.Tensor, *, replay: bool, chunk: int | None = None) -> None:
        """Routes [tokens, len(layers), top_k] (this rank's layers, ``layers`` order; -1:
        none) for the next forward (and its recompute in the backward pass) of model chunk
        ``chunk`` (None: every chunk). ``replay`` False: the trainer routes on its own and
        only the agreement is counted. Appends: call once per micro-batch and chunk, in the
        schedule's order."""
        if routes.dim() != 3 or routes.shape[1:] != (len(self.layers), self.top_k):
            raise ValueError(
                f"routes must be [tokens, {len(self.layers)} (this rank's layers {self.layers}), "
                f"top_k={self.top_k}], got {tuple(routes.shape)}"
            )
        first = 0 if chunk is None else sum(len(r) for r in self.chunk_routers[:chunk])
        routers = self.routers if chunk is None else self.chunk_routers[chunk]
        for j, router in enumerate(routers):
            instance = router.router_replay
            instance.replay = replay
            instance.set_target_indices(routes[:, first + j])
            instance.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def set_micro_batch_routes(
        self,
        fields: dict[str, torch.Tensor],
        num_tokens: int,
        *,
        replay: bool,
        chunk: int,
        sequence_parallel: tuple[int, int] | None = None,
    ) -> None:
        """``set_routes`` from a micro-batch's ``ROUTES`` field [1, t, layers, top_k] (none:
        every token keeps its own top-k); ``num_tokens``: t, this CP rank's row.
        ``sequence_parallel`` (tp, tp_rank): the router sees this TP rank's slice of the row."""
        routes = fields.get(ROUTES)
        if routes is None:
            routes = torch.full(
                (num_tokens, len(self.layers), self.top_k), -1, dtype=torch.int16,
                device=self.routers[0].weight.device,
            )  # fmt: skip
        else:
            routes = routes[0]
        if sequence_parallel is not None:
            tp, tp_rank = sequence_parallel
            routes = routes.chunk(tp)[tp_rank]
        self.set_routes(routes, replay=replay, chunk=chunk)

    def record(self, chunk: int | None = None) -> None:
        """Keep the top-k each router of model chunk ``chunk`` (None: every chunk) computes in
        the next forward (``recorded``, ``take_recorded``): the router routes on its own."""
        routers = self.routers if chunk is None else self.chunk_routers[chunk]
        for router in routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)

    def take_recorded(self, chunk: int, out: torch.Tensor) -> None:
        """Write the top-k chunk ``chunk``'s routers kept in the last forward into ``out``
        [tokens, len(layers), top_k] (columns in ``layers`` order; on the routers' device),
        and forget them. megatron's RECORD keeps each router's last call only: take them after
        every micro-batch's forward."""
        first = sum(len(r) for r in self.chunk_routers[:chunk])
        for j, router in enumerate(self.chunk_routers[chunk]):
            instance = router.router_replay
            top = instance.get_recorded_indices()
            if top is None:
                raise RuntimeError(
                    f"router of layer {router.layer_number} recorded nothing: call "
                    "record(chunk) before the chunk's forward"
                )
            if top.shape != out[:, first + j].shape:
                raise ValueError(
                    f"router of layer {router.layer_number} saw {tuple(top.shape)} (tokens, "
                    f"top_k), expected {tuple(out[:, first + j].shape)}"
                )
            out[:, first + j] = top.to(out.dtype)
            instance.recorded_topk_idx = None

    def recorded(self) -> torch.Tensor:
        """The last recorded forward's routes, int16 [tokens, len(layers), top_k] on the
        host (this rank's layers, as ``set_routes`` takes them)."""
        tops = [instance.get_recorded_indices() for instance in self.instances]
        if any(top is None for top in tops):
            raise RuntimeError("no routes recorded: call record() before the forward")
        return torch.stack(tops, 1).to(HOST, torch.int16)

    def clear(self) -> None:
        """Back to the router's own top-k; drops routes (the agreement counts stay)."""
        for instance in self.instances:
            instance.clear_indices()
            instance.clear_router_replay_action()

    def take_agreement(self) -> torch.Tensor:
        """[matches, given] float64 on the host, summed over this rank's routers since the
        last call: the share of the given experts the trainer's own top-k also picked is their
        ratio. The one device-to-host copy of the counts (once per pass)."""
        counts = torch.stack([instance.agree for instance in self.instances])
        for instance in self.instances:
            instance.agree.zero_()
        return counts.sum(0).to(HOST, torch.float64)
