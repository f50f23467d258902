"""The step's samples -> this rank's micro-batches for one model.

Every rank holds the whole step's token ids in flat buffers (``Ragged``: values + offsets,
identical everywhere); only the samples a rank packs become Python lists.
A model's data-parallel rank takes its share, balanced by token count; its context-parallel
ranks split each micro-batch's sequences (``data/packing.py``). Per-token results come back
through a ``flat_index`` field: the position of each response token in the step's flat
response-token buffer, so a sample's results stay attached to it however the samples are
reordered, packed or split (verl #1440, #2185 lost them).

Lockstep. A model whose forward runs a collective over a group that spans its DP ranks (an
MoE model at ep > 1: megatron's token dispatcher, alltoall or allgather, over the
expert-parallel group in every MoE layer of every micro-batch, forward and backward) needs
every DP rank to run as many micro-batches in each pass, or the rank with more waits for
ever. ``line_up`` pads a rank's micro-batches with empty ones up to the most any rank packs
(``agreed_count``); a dense model (or ep = 1) is left as it is, with no extra collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from vapo_megatron.config.layout import ModelLayout
from vapo_megatron.data.packing import MicroBatch, Sample, pack, pack_many
from vapo_megatron.models.router_replay import ROUTES
from vapo_megatron.parallel import collectives
from vapo_megatron.parallel.context_parallel import split_packed_for_cp
from vapo_megatron.parallel.devices import HOST

FLAT_INDEX = "flat_index"
LOCAL_INDEX = "local_index"
"""Position of a response token in this rank's own buffers (``step/scoring_pass.py``)."""
# ROUTES (``models/router_replay.py``): the engine's routed experts (routing replay). In a
# ``Sample``'s fields: int16 [prompt + response - 1, layers, top_k], one row per *input
# position* (not label-aligned); in a packed micro-batch: [1, t, layers, top_k] over the row's
# positions of this CP rank, -1 where a position has none (a sequence's last token, padding),
# placed by ``MicroBatchPlan.pack``.


class Ragged:
    """Variable-length rows in one flat tensor: row i is values[offsets[i]:offsets[i + 1]].

    values: [N]; offsets: [R + 1] int64 (0, ..., N), both on the host. Indexing gives a row
    as a view of values (``data/packing.Sample`` takes it as is: no per-token Python objects);
    ``lengths()`` reads the row lengths without touching the values.
    """

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        if values.dim() != 1 or offsets.dim() != 1 or int(offsets[-1]) != values.numel():
            raise ValueError(
                f"Ragged needs 1-D values [N] and offsets [R + 1] ending at N; got values "
                f"{tuple(values.shape)}, offsets {tuple(offsets.shape)} ending at "
                f"{int(offsets[-1]) if offsets.numel() else None}"
            )
        self.values, self.offsets = values, offsets
        self._bounds: list[int] | None = None

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._bounds is None:  # Python ints once: indexing a tensor per row costs more
            self._bounds = self.offsets.tolist()
        return self.values[self._bounds[i] : self._bounds[i + 1]]

    def lengths(self) -> torch.Tensor:
        """[R] int64 row lengths."""
        return self.offsets.diff()

    def select(self, rows: torch.Tensor) -> Ragged:
        """Rows ``rows`` ([K] int64, any order, repeats allowed) as a new Ragged."""
        return Ragged(
            self.values[gather_index(self.offsets, rows)], select_offsets(self.offsets, rows)
        )


def select_offsets(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[K + 1] offsets of rows ``rows`` of a flat buffer with offsets [R + 1], laid end to end."""
    return torch.nn.functional.pad(offsets.diff()[rows].cumsum(0), (1, 0))


def gather_index(offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[M] flat positions of rows ``rows`` of a buffer with offsets [R + 1], row after row."""
    lengths = offsets.diff()[rows]
    new = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    total = int(new[-1])
    shift = torch.repeat_interleave(offsets[rows] - new[:-1], lengths, output_size=total)
    return shift + torch.arange(total, dtype=torch.long, device=offsets.device)


def row_lengths(rows: Sequence) -> list[int]:
    """Lengths of rows given as a Ragged or as a sequence of lists."""
    if isinstance(rows, Ragged):
        return rows.lengths().tolist()
    return [len(r) for r in rows]


def response_offsets(lengths: Sequence[int]) -> torch.Tensor:
    """[S + 1] start of each sample's response tokens in the flat buffer (cu_seqlens)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.long, device=HOST)
    out[1:] = torch.tensor(list(lengths), dtype=torch.long, device=HOST).cumsum(0)
    return out


def dp_owners(token_counts: Sequence[int], dp_size: int) -> list[int]:
    """The data-parallel rank of each sample, balanced by tokens.

    Longest first, each to the rank with the fewest tokens so far (ties: lowest rank, then
    the sample's index), so the assignment is the same on every rank and independent of
    anything but the counts.
    """
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    loads = [0] * dp_size
    owners = [0] * len(token_counts)
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r)) if dp_size > 1 else 0
        loads[rank] += token_counts[i]
        owners[i] = rank
    return owners


def dp_share(token_counts: Sequence[int], dp_size: int, dp_rank: int) -> list[int]:
    """Indices of the samples data-parallel rank ``dp_rank`` takes (``dp_owners``), in
    ascending sample order."""
    return [i for i, rank in enumerate(dp_owners(token_counts, dp_size)) if rank == dp_rank]


def micro_batches(
    samples: Sequence[Sample],
    layout: ModelLayout,
    *,
    cp_rank: int,
    token_budget: int,
    field_names: Sequence[str],
) -> list[MicroBatch]:
    """Pack ``samples`` into micro-batches of at most ``token_budget`` tokens each (a longer
    sample gets one of its own). With no samples, one micro-batch with nothing to learn from
    (this rank still takes part in every collective). Under PP every micro-batch has one
    length; under SP rows divide by TP."""
    if not samples:
        return [empty_micro_batch(layout, cp_rank=cp_rank, field_names=field_names)]
    plan = plan_micro_batches(samples, layout, token_budget=token_budget)
    return plan.pack(plan.groups, cp_rank)


class MicroBatchPlan:
    """Which samples go into which micro-batch, and how each row is padded, decided before
    anything is packed (so a caller may pack them a few at a time).

    Without PP each sequence is padded on its own to the row's multiple under CP
    (``pack(pad_each=True)``): its CP chunks then depend on its length alone, the same in the
    scoring pass's micro-batches and in any mini-batch's. Under PP every row is padded to one
    length, which lengthens the last sequence of a row."""

    def __init__(self, groups: list[list[Sample]], layout: ModelLayout, pad_multiple: int):
        self.groups, self.layout, self.pad_multiple = groups, layout, pad_multiple
        self.pad_each = layout.cp > 1 and layout.pp == 1

    def pack(self, groups: Sequence[Sequence[Sample]], cp_rank: int) -> list[MicroBatch]:
        """Micro-batches of ``groups`` (some of ``self.groups``), written as one chunk
        (``pack_many``)."""
        routes = [[sample.fields.get(ROUTES) for sample in group] for group in groups]
        if routes and routes[0][0] is not None:  # per position, not per response token
            groups = [
                [
                    dataclasses.replace(
                        s, fields={k: v for k, v in s.fields.items() if k != ROUTES}
                    )
                    for s in group
                ]
                for group in groups
            ]
        mbs = pack_many(
            groups, cp_size=self.layout.cp, cp_rank=cp_rank, pad_multiple=self.pad_multiple,
            pad_each=self.pad_each,
        )  # fmt: skip
        if routes and routes[0][0] is not None:
            for mb, group_routes in zip(mbs, routes, strict=True):
                mb.fields[ROUTES] = route_row(
                    group_routes, mb, cp_size=self.layout.cp, cp_rank=cp_rank
                )
        return mbs


def route_row(
    routes: Sequence[torch.Tensor], mb: MicroBatch, *, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """The packed row's routes [1, t, layers, top_k] int16 for this CP rank: sequence j's
    routes [n_j, layers, top_k] at its padded start (``cu_seqlens_q_padded``), -1 elsewhere,
    split over CP as the tokens are (``split_packed_for_cp``)."""
    cu_padded = mb.packed_seq_params.cu_seqlens_q_padded.long()
    shape = routes[0].shape[1:]
    row = torch.full((mb.seq_length, *shape), -1, dtype=torch.int16, device=HOST)
    for start, r in zip(cu_padded.tolist(), routes, strict=False):
        row[start : start + r.shape[0]] = r
    if cp_size > 1:
        row = split_packed_for_cp(row, cu_padded, cp_size, cp_rank)
    return row[None]


def plan_micro_batches(
    samples: Sequence[Sample], layout: ModelLayout, *, token_budget: int
) -> MicroBatchPlan:
    """The micro-batches ``micro_batches`` packs ``samples`` (at least one) into."""
    cp_multiple = 2 * layout.cp if layout.cp > 1 else 1
    tp_multiple = layout.tp if layout.sequence_parallel else 1
    unit = cp_multiple * tp_multiple if layout.cp > 1 and layout.pp == 1 else cp_multiple
    groups: list[list[Sample]] = [[]]
    used = 0
    for sample in samples:
        length = -(-sample.num_tokens // unit) * unit
        if groups[-1] and used + length > token_budget:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += length
    pad_multiple = tp_multiple
    if layout.pp > 1:  # one row length for the pipeline: the longest packed row, rounded
        longest = max(_packed_length(g, cp_multiple) for g in groups)
        unit = cp_multiple * tp_multiple
        pad_multiple = -(-longest // unit) * unit // cp_multiple
    return MicroBatchPlan(groups, layout, pad_multiple)


def _packed_length(samples: Sequence[Sample], cp_multiple: int) -> int:
    return sum(-(-s.num_tokens // cp_multiple) * cp_multiple for s in samples)


def empty_micro_batch(
    layout: ModelLayout, *, cp_rank: int, field_names: Sequence[str], length: int | None = None
) -> MicroBatch:
    """A micro-batch whose every position is masked: zero loss, zero gradient, same collectives.
    It has no ``ROUTES`` (its routers keep their own top-k and count no agreement).
    ``length``: its row's tokens before the CP split (under PP the plan's one row length, a
    multiple of 2 * cp and of tp under SP); None: the shortest such row."""
    if length is None:
        length = 2 * layout.cp * max(layout.tp if layout.sequence_parallel else 1, 1)
    fields = {name: torch.zeros(1, device=HOST) for name in field_names if name != ROUTES}
    for index in (FLAT_INDEX, LOCAL_INDEX):
        if index in fields:
            fields[index] = torch.zeros(1, dtype=torch.long, device=HOST)
    if "positive" in fields:
        fields["positive"] = torch.zeros(1, dtype=torch.bool, device=HOST)
    sample = Sample(prompt=[0] * (length - 1), response=[0], fields=fields)
    mb = pack([sample], cp_size=layout.cp, cp_rank=cp_rank)
    mb.response_mask.zero_()
    mb.num_seqs = 0
    mb.response_runs = None if mb.response_runs is None else []
    return mb


def runs_in_lockstep(layout: ModelLayout) -> bool:
    """Whether every DP rank of a model of ``layout`` must run as many micro-batches in a pass:
    its forward runs a collective over a group that spans DP ranks. That is the MoE token
    dispatcher's over the EP group when ep > 1 (megatron-core 0.16.1, alltoall and allgather).
    The EP group spans DP ranks only where etp * ep > tp * cp, but ep > 1 is taken as the rule:
    one host all-reduce a pass is cheap, and a layout rule that is wrong hangs. Router losses
    reduce over TP x CP only, so an MoE model at ep = 1 runs as a dense one does."""
    return layout.ep > 1


def agreed_count(count: int, layout: ModelLayout, host_group: dist.ProcessGroup | None) -> int:
    """The most micro-batches any rank runs in this pass (``count`` here) where the model runs
    in lockstep (``runs_in_lockstep``), else ``count``. Collective over ``host_group`` then
    (gloo, every rank): the count is host bookkeeping known before anything reaches the
    device, so it needs no device tensor and no device sync to read back, and the max over
    every rank is the max over the model's DP x CP ranks (the TP and PP ranks of one DP x CP
    rank pack the same micro-batches). Every rank calls it at the same point of the pass."""
    if not runs_in_lockstep(layout):
        return count
    most = torch.tensor([count], dtype=torch.long, device=HOST)
    collectives.all_reduce(most, host_group, dist.ReduceOp.MAX)
    return int(most)


def pad_micro_batches(
    mbs: Sequence[MicroBatch],
    count: int,
    layout: ModelLayout,
    *,
    cp_rank: int,
    field_names: Sequence[str],
) -> list[MicroBatch]:
    """``mbs`` followed by empty micro-batches (``empty_micro_batch``: nothing to learn from,
    no routes) up to ``count``; under PP each of the row length of ``mbs`` (one length for
    the pipeline's schedule)."""
    length = mbs[0].seq_length if mbs and layout.pp > 1 else None
    pads = [
        empty_micro_batch(layout, cp_rank=cp_rank, field_names=field_names, length=length)
        for _ in range(count - len(mbs))
    ]
    return [*mbs, *pads]


def line_up(
    mbs: Sequence[MicroBatch],
    layout: ModelLayout,
    *,
    cp_rank: int,
    field_names: Sequence[str],
    host_group: dist.ProcessGroup | None,
) -> list[MicroBatch]:
    """This rank's micro-batches of one pass, padded with empty ones to as many as every DP
    rank runs (``agreed_count``; unchanged, with no collective, for a model that does not run
    in lockstep). Collective over ``host_group`` where it runs in lockstep."""
    count = agreed_count(len(mbs), layout, host_group)
    return pad_micro_batches(mbs, count, layout, cp_rank=cp_rank, field_names=field_names)


def build_samples(
    prompts: Sequence[list[int]],
    responses: Sequence[list[int]],
    indices: Sequence[int],
    offsets: torch.Tensor,
    fields: Callable[[int, slice], dict[str, torch.Tensor]] | None = None,
    *,
    flat_index: bool = True,
    routes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[Sample]:
    """Samples ``indices`` with their flat_index field (unless not ``flat_index``) and
    ``fields(i, flat_slice)``; with ``routes`` = (the step's routes [T, layers, top_k],
    their offsets [S + 1]: ``step/engine_routes.py``, ``step/critic_routes.py``) each sample's
    routes as its ``ROUTES`` field."""
    route_bounds = routes[1].tolist() if routes is not None else None
    out = []
    bounds = offsets.tolist() if len(indices) > 1 else None
    for i in indices:
        if bounds is None:
            flat = slice(int(offsets[i]), int(offsets[i + 1]))
        else:
            flat = slice(bounds[i], bounds[i + 1])
        extra = {}
        if flat_index:
            extra[FLAT_INDEX] = torch.arange(flat.start, flat.stop, dtype=torch.long, device=HOST)
        if fields is not None:
            extra.update(fields(i, flat))
        if route_bounds is not None:
            extra[ROUTES] = routes[0][route_bounds[i] : route_bounds[i + 1]]
        prompt, response = prompts[i], responses[i]
        if not isinstance(prompt, torch.Tensor):  # lists: a copy, as the caller may reuse them
            prompt, response = list(prompt), list(response)
        out.append(Sample(prompt=prompt, response=response, fields=extra))
    return out
