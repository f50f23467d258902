"""Sequences -> model micro-batches: packed (THD, no padding between sequences) or padded.

A sample is a prompt plus a response. Everything per token is *label-aligned*: position i
carries the token after it (``labels[i] = tokens[i + 1]``), and the per-token fields at i
(response mask, old log-prob, value, advantage, ...) belong to that next token, so the state
before response token t is read at the position of the token before it (DESIGN.md,
"Positions"). The last position of each sequence predicts nothing and is masked.

Context parallelism: every sequence is padded to a multiple of 2 * CP and each CP rank keeps
its two load-balanced chunks of it (``parallel/context_parallel.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from vapo_megatron.parallel.context_parallel import split_for_cp, split_packed_for_cp
from vapo_megatron.parallel.devices import HOST

IDS = torch.int32
"""Token ids and labels of a micro-batch on the host: every vocabulary we load is below 2**31
(Qwen's 152k), and packing is bound by the bytes it writes (docs/benchmarks.md)."""


@dataclass
class Sample:
    """One prompt and response, with optional label-aligned per-response-token fields."""

    prompt: list[int] | torch.Tensor
    """Prompt token ids (at least one): a list or a 1-D host tensor (e.g. a view of the step's
    flat token buffer, so no per-token Python objects are made)."""
    response: list[int] | torch.Tensor
    """Response token ids (a list or a 1-D host tensor)."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per response token values [len(response)] (old log-probs, advantages, ...)."""

    @property
    def num_tokens(self) -> int:
        """Prompt and response tokens (what a micro-batch's token budget counts)."""
        return _length(self.prompt) + _length(self.response)


@dataclass
class MicroBatch:
    """Model inputs and label-aligned per-token fields of this CP rank, all [b, s] ([1, t] packed)."""

    tokens: torch.Tensor
    """Input ids, int32 on the host (``IDS``); int64 once moved (``to``)."""
    position_ids: torch.Tensor | None
    """Padded rows: each row's positions. Packed rows: None, and none are built (8 bytes a
    token on the host and over PCIe): a RoPE model restarts positions at each sequence from
    ``packed_seq_params`` (megatron's GPTModel reads ``position_ids`` only for learned
    absolute position embeddings, multimodal RoPE and multi-token prediction, none of which
    our families use; ``ModelEngine`` checks), as Megatron-LM's own RL path
    (``rl_utils.get_logprobs``) passes None with packed sequences. ``packed_positions``
    builds them where a caller wants them (tests, tools)."""
    labels: torch.Tensor
    """The next token's id at each position (0 where none), int32 on the host as ``tokens``."""
    response_mask: torch.Tensor
    """True where the label is a response token (the positions that count)."""
    fields: dict[str, torch.Tensor]
    seq_length: int
    """Length of the row before the context-parallel split (what the schedule is told)."""
    packed_seq_params: PackedSeqParams | None = None
    num_seqs: int = 0
    """Sequences in the micro-batch."""
    response_runs: list[tuple[int, int]] | None = None
    """(first position, length) of each sequence's response positions in the row, in order:
    the positions ``response_mask`` marks, as runs (reading a row's outputs by a few slices
    is cheaper than a masked select over every position). None where the row is split over
    CP (a sequence's positions are no longer one run) or padded (``pad``)."""

    def with_fields(self, names: Sequence[str]) -> MicroBatch:
        """This micro-batch carrying only the fields ``names`` (no copy)."""
        return dataclasses.replace(self, fields={name: self.fields[name] for name in names})

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on ``device`` (the model's): the one place a
        micro-batch leaves the host. Packing builds on the host; the model's engine moves each
        micro-batch right before its forward, so a step holds one on the device at a time.

        Token ids and labels cross as int32 (``IDS``: half the bytes packing writes and PCIe
        carries) and are widened to int64 on ``device``, what megatron's embedding and the
        log-probs' gather index with. cu_seqlens go as int32 (what Transformer Engine's packed
        attention takes). Copies are ``non_blocking``; the host side is not pinned: a
        micro-batch of 16k tokens is well under 1 MB (tokens, labels, mask and a few fields),
        tens of microseconds over PCIe, less than pinning it would cost.
        """
        non_blocking = device.type == "cuda"

        def move(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=non_blocking)

        params = self.packed_seq_params
        if params is not None:
            params = dataclasses.replace(
                params,
                **{
                    name: move(getattr(params, name).to(torch.int32))
                    for name in (
                        "cu_seqlens_q",
                        "cu_seqlens_kv",
                        "cu_seqlens_q_padded",
                        "cu_seqlens_kv_padded",
                    )  # fmt: skip
                    if getattr(params, name) is not None
                },
            )
        positions = self.position_ids
        return dataclasses.replace(
            self,
            tokens=move(self.tokens).long(),
            position_ids=None if positions is None else move(positions),
            labels=move(self.labels).long(),
            response_mask=move(self.response_mask),
            fields={name: move(value) for name, value in self.fields.items()},
            packed_seq_params=params,
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _cp_multiple(cp_size: int) -> int:
    """What each sequence's length must divide by: 2 * CP chunks under CP, anything without."""
    return 2 * cp_size if cp_size > 1 else 1


def _check(samples: Sequence[Sample]) -> list[str]:
    """The field names every sample carries; ValueError for an empty batch or mixed fields."""
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    names = sorted(samples[0].fields)
    for i, sample in enumerate(samples):
        if sorted(sample.fields) != names:
            raise ValueError(f"sample {i} has fields {sorted(sample.fields)}, sample 0 has {names}")
    return names


def _length(ids: list[int] | torch.Tensor) -> int:
    """Number of token ids (``len`` of a tensor goes through Python-level checks: ~10x
    slower, and the step asks for thousands of them)."""
    return ids.shape[0] if isinstance(ids, torch.Tensor) else len(ids)


def _check_sample(sample: Sample, n_prompt: int, n_resp: int) -> None:
    """ValueError for a sample without a prompt token or with a field of the wrong length."""
    if n_prompt == 0:
        raise ValueError("a sample needs at least one prompt token (the state before the response)")
    for name, values in sample.fields.items():
        if values.shape != (n_resp,):
            raise ValueError(
                f"field {name!r} must have one value per response token ({n_resp}), got {tuple(values.shape)}"
            )


def _aligned(sample: Sample) -> tuple[torch.Tensor, ...]:
    """tokens, labels, response mask and label-aligned fields of one sample (unpadded)."""
    n_prompt, n_resp = len(sample.prompt), len(sample.response)
    _check_sample(sample, n_prompt, n_resp)
    tokens = torch.cat(
        [torch.as_tensor(ids, dtype=IDS, device=HOST) for ids in (sample.prompt, sample.response)]
    )
    length = tokens.numel()
    labels = torch.zeros(length, dtype=IDS, device=HOST)
    labels[:-1] = tokens[1:]
    mask = torch.zeros(length, dtype=torch.bool, device=HOST)
    mask[n_prompt - 1 : n_prompt - 1 + n_resp] = True
    fields = {}
    for name, values in sample.fields.items():
        full = torch.zeros(length, dtype=values.dtype, device=HOST)
        full[n_prompt - 1 : n_prompt - 1 + n_resp] = values
        fields[name] = full
    return tokens, labels, mask, fields


def _ids(ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Token ids as an ``IDS`` tensor: a tensor of that dtype as it is (a view), else converted."""
    if isinstance(ids, torch.Tensor):
        return ids if ids.dtype == IDS else ids.to(IDS)
    return torch.tensor(ids, dtype=IDS, device=HOST)


def _padded_widths(
    lengths: Sequence[int], cp_size: int, pad_multiple: int, pad_each: bool
) -> list[int]:
    """Each sequence's width in the row (``pack``'s padding rule); they sum to the row's."""
    unit = _cp_multiple(cp_size) * (pad_multiple if pad_each else 1)
    padded = [_round_up(n, unit) for n in lengths]
    total = _round_up(sum(padded), _cp_multiple(cp_size) * pad_multiple)
    padded[-1] += total - sum(padded)
    return padded


def pack(
    samples: Sequence[Sample],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_multiple: int = 1,
    pad_each: bool = False,
) -> MicroBatch:
    """Pack samples into one THD row [1, t] for this CP rank.

    Under CP each sequence is padded to a multiple of 2 * cp_size (the padding is masked and never
    attended to by real tokens); the last one further so the row's length is a multiple of
    ``pad_multiple`` (times 2 * cp_size under CP; e.g. the TP size with sequence parallelism).
    With ``pad_each`` every sequence is padded to that whole multiple instead, so no sequence
    is lengthened for the row: a sequence's CP chunks then depend on its own length alone and
    are the same in every micro-batch it is packed into (the layout-coupled step relies on it,
    ``step/scoring_pass.py``).
    """
    names = _check(samples)
    n_prompt = [_length(s.prompt) for s in samples]
    n_resp = [_length(s.response) for s in samples]
    for sample, p, r in zip(samples, n_prompt, n_resp, strict=True):
        _check_sample(sample, p, r)
    lengths = [p + r for p, r in zip(n_prompt, n_resp, strict=True)]
    padded = _padded_widths(lengths, cp_size, pad_multiple, pad_each)
    total = sum(padded)

    # The id row is written by one ``torch.cat`` of the samples' own tensors (views of the
    # step's buffers) and the padding, not by a slice assignment a piece: ~0.3 us a piece
    # inside one call against ~3.7 us a call, and the step packs thousands of micro-batches.
    # Each field is written a sample at a time into zeros (one cat a field, with the zero
    # pieces between responses, measured no faster).
    tokens = torch.empty(total, dtype=IDS, device=HOST)
    pieces: list[torch.Tensor] = []
    mask = torch.zeros(total, dtype=torch.bool, device=HOST)
    fields = {n: torch.zeros(total, dtype=samples[0].fields[n].dtype, device=HOST) for n in names}
    ends = []  # (first position after the sequence's last real token, end of its padding)
    runs = []
    start = 0
    for sample, p, r, width in zip(samples, n_prompt, n_resp, padded, strict=True):
        pieces += (_ids(sample.prompt), _ids(sample.response))
        if width > p + r:
            pieces.append(torch.zeros(width - p - r, dtype=IDS, device=HOST))
        response = slice(start + p - 1, start + p - 1 + r)  # label-aligned
        runs.append((start + p - 1, r))
        mask[response] = True
        for name in names:
            fields[name][response] = sample.fields[name]
        ends.append((start + p + r - 1, start + width))
        start += width
    torch.cat(pieces, out=tokens)
    labels = torch.empty(total, dtype=IDS, device=HOST)
    labels[:-1] = tokens[1:]
    for last, end in ends:  # a sequence's last position predicts nothing; padding neither
        labels[last:end] = 0  # (the row's last position is the last sequence's)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=HOST)
    cu_padded = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32, device=HOST)

    def split(x: torch.Tensor) -> torch.Tensor:
        return split_packed_for_cp(x, cu_padded, cp_size, cp_rank) if cp_size > 1 else x

    params = _packed_params(cu, cu_padded, max(padded))
    return MicroBatch(
        tokens=split(tokens)[None],
        position_ids=None,
        labels=split(labels)[None],
        response_mask=split(mask)[None],
        fields={n: split(v)[None] for n, v in fields.items()},
        seq_length=total,
        packed_seq_params=params,
        num_seqs=len(samples),
        response_runs=runs if cp_size == 1 else None,
    )


def pack_many(
    groups: Sequence[Sequence[Sample]],
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    pad_multiple: int = 1,
    pad_each: bool = False,
) -> list[MicroBatch]:
    """``[pack(group, ...) for group in groups]``, equal to it element for element, written a
    whole chunk at a time: each of the chunk's tensors (ids, labels, mask, one per field) is
    one ``torch.cat`` of the samples' own tensors and views of one zero buffer, and each
    micro-batch's are views of it (split over CP per micro-batch, as ``pack`` does).

    The step packs thousands of micro-batches of ~2 samples each, and ``pack``'s cost is
    torch's per-call overhead (a few microseconds a slice assignment, 10-20 a micro-batch),
    not the bytes (docs/benchmarks.md). A micro-batch's views keep its chunk's buffers alive:
    the callers hold a chunk's micro-batches together anyway (a scoring chunk, a mini-batch).
    Samples whose field dtypes differ from the first sample's are packed one micro-batch at a
    time (``pack`` casts to each micro-batch's first sample's dtype; a chunk-wide cat would
    promote instead).
    """
    if not groups:
        return []
    for group in groups:
        _check(group)
    samples = [s for group in groups for s in group]
    names = _check(samples)
    dtypes = {n: samples[0].fields[n].dtype for n in names}
    if any(s.fields[n].dtype != dtypes[n] for s in samples for n in names):
        return [
            pack(g, cp_size=cp_size, cp_rank=cp_rank, pad_multiple=pad_multiple, pad_each=pad_each)
            for g in groups
        ]
    chunk = _Chunk(groups, samples, cp_size, pad_multiple, pad_each)
    tensors = chunk.write(samples, dtypes)
    return [chunk.micro_batch(k, *tensors, cp_size, cp_rank) for k in range(len(groups))]


class _Chunk:
    """Where each sequence of a chunk of micro-batches sits (``pack_many``), and its writing."""

    def __init__(self, groups, samples, cp_size: int, pad_multiple: int, pad_each: bool):
        self.n_prompt = [_length(s.prompt) for s in samples]
        self.n_resp = [_length(s.response) for s in samples]
        for sample, p, r in zip(samples, self.n_prompt, self.n_resp, strict=True):
            _check_sample(sample, p, r)
        self.lengths = [p + r for p, r in zip(self.n_prompt, self.n_resp, strict=True)]
        self.rows, self.widths, first = [], [], 0  # rows: (first sample, last + 1), per group
        for group in groups:
            self.rows.append((first, first + len(group)))
            self.widths += _padded_widths(
                self.lengths[first : first + len(group)], cp_size, pad_multiple, pad_each
            )
            first += len(group)
        self.starts = [0, *itertools.accumulate(self.widths)]  # each sequence's first position
        self.total = self.starts[-1]

    def write(
        self, samples: Sequence[Sample], dtypes: dict[str, torch.dtype]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """The chunk's tokens, labels, response mask and fields, each by one ``cat``."""
        total, widest = self.total, max(self.widths)
        # Zeros to cut the padding and the gaps between responses from: a gap spans at most
        # the end of one sequence's width and the start of the next's.
        zero = {
            dtype: torch.zeros(2 * widest, dtype=dtype, device=HOST)
            for dtype in {IDS, torch.bool, *dtypes.values()}
        }
        ids: list[torch.Tensor] = []
        label_zeros: list[int] = []  # a sequence's last position, and its padding's last
        gaps: list[tuple[int, int]] = []  # zeros before each response, its length
        gap = 0
        for sample, p, r, width, start in zip(
            samples, self.n_prompt, self.n_resp, self.widths, self.starts, strict=False
        ):
            ids += (_ids(sample.prompt), _ids(sample.response))
            if width > p + r:
                ids.append(zero[IDS][: width - p - r])
                label_zeros.append(start + width - 1)
            label_zeros.append(start + p + r - 1)
            gaps.append((gap + p - 1, r))  # label-aligned: the response starts at p - 1
            gap = width - p - r + 1

        def cat(pieces: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            out = torch.cat(pieces, out=torch.empty(total, dtype=dtype, device=HOST))
            if out.numel() != total:  # cat resizes ``out`` rather than fail
                raise AssertionError(f"packed {out.numel()} positions for a chunk of {total}")
            return out

        def spread(values: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            """Each sample's response values at its label-aligned positions, zeros elsewhere."""
            pieces = []
            for (before, _), v in zip(gaps, values, strict=True):
                pieces += (zero[dtype][:before], v)
            pieces.append(zero[dtype][:gap])
            return cat(pieces, dtype)

        tokens = cat(ids, IDS)
        labels = torch.empty(total, dtype=IDS, device=HOST)
        labels[:-1] = tokens[1:]
        labels[torch.tensor(label_zeros, dtype=torch.long, device=HOST)] = 0
        true = torch.ones(max(self.n_resp), dtype=torch.bool, device=HOST)
        mask = spread([true[:r] for _, r in gaps], torch.bool)
        fields = {n: spread([s.fields[n] for s in samples], dtype) for n, dtype in dtypes.items()}
        return tokens, labels, mask, fields

    def micro_batch(
        self,
        k: int,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        mask: torch.Tensor,
        fields: dict[str, torch.Tensor],
        cp_size: int,
        cp_rank: int,
    ) -> MicroBatch:
        """Group ``k``'s micro-batch: views of the chunk's tensors (split over CP)."""
        first, last = self.rows[k]
        row_start, end = self.starts[first], self.starts[last]
        widths = self.widths[first:last]
        cu = torch.tensor(
            [0, *itertools.accumulate(self.lengths[first:last])], dtype=torch.int32, device=HOST
        )
        cu_padded = torch.tensor([0, *itertools.accumulate(widths)], dtype=torch.int32, device=HOST)
        row = (slice(row_start, end), cu_padded, cp_size, cp_rank)
        runs = None
        if cp_size == 1:
            runs = [
                (self.starts[j] - row_start + self.n_prompt[j] - 1, self.n_resp[j])
                for j in range(first, last)
            ]
        return MicroBatch(
            tokens=_row_of(tokens, *row),
            position_ids=None,
            labels=_row_of(labels, *row),
            response_mask=_row_of(mask, *row),
            fields={n: _row_of(v, *row) for n, v in fields.items()},
            seq_length=end - row_start,
            packed_seq_params=_packed_params(cu, cu_padded, max(widths)),
            num_seqs=last - first,
            response_runs=runs,
        )


def _row_of(
    chunk: torch.Tensor, span: slice, cu_padded: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """[1, t] one micro-batch's part of a chunk's tensor, this CP rank's under CP."""
    x = chunk[span]
    return (split_packed_for_cp(x, cu_padded, cp_size, cp_rank) if cp_size > 1 else x)[None]


def _packed_params(cu: torch.Tensor, cu_padded: torch.Tensor, longest: int) -> PackedSeqParams:
    """Megatron's THD convention: cu_seqlens count real tokens, *_padded give the layout; the
    RoPE table must be the longest padded sequence (not the whole row) to restart per sequence."""
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )


def packed_positions(mb: MicroBatch, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """[1, t] positions of a packed micro-batch of this CP rank (``pack(cp_size=..,
    cp_rank=..)``): 0, 1, ... within each sequence, 0 on its padding; what a model with
    position embeddings would be given (the step's models need none: ``MicroBatch.position_ids``)."""
    params = mb.packed_seq_params
    if params is None:
        raise ValueError("packed_positions needs a packed micro-batch (pack(), not pad())")
    cu_padded = params.cu_seqlens_q_padded
    lengths = params.cu_seqlens_q.diff().tolist()
    positions = torch.zeros(mb.seq_length, dtype=torch.long, device=HOST)
    for start, n in zip(cu_padded.tolist(), lengths, strict=False):
        torch.arange(n, out=positions[start : start + n], device=HOST)
    if cp_size > 1:
        positions = split_packed_for_cp(positions, cu_padded, cp_size, cp_rank)
    return positions[None]


def pad(
    samples: Sequence[Sample], *, cp_size: int = 1, cp_rank: int = 0, pad_multiple: int = 1
) -> MicroBatch:
    """Right-pad samples into rows [b, s] for this CP rank; s is a multiple of pad_multiple
    (times 2 * cp_size under CP)."""
    names = _check(samples)
    aligned = [_aligned(s) for s in samples]
    width = _round_up(max(a[0].numel() for a in aligned), _cp_multiple(cp_size) * pad_multiple)

    def rows(index: int, dtype, name: str | None = None) -> torch.Tensor:
        out = torch.zeros(len(aligned), width, dtype=dtype, device=HOST)
        for b, a in enumerate(aligned):
            part = a[index] if name is None else a[index][name]
            out[b, : part.numel()] = part
        return out

    def split(x: torch.Tensor) -> torch.Tensor:
        return split_for_cp(x, cp_size, cp_rank, dim=1) if cp_size > 1 else x

    positions = torch.arange(width, device=HOST).expand(len(aligned), width)
    return MicroBatch(
        tokens=split(rows(0, IDS)),
        position_ids=split(positions),
        labels=split(rows(1, IDS)),
        response_mask=split(rows(2, torch.bool)),
        fields={n: split(rows(3, aligned[0][3][n].dtype, n)) for n in names},
        seq_length=width,
        num_seqs=len(samples),
    )
