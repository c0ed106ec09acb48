"""Per-step attention metadata for the token-major paged attention.

The model runner lays every scheduled token of a step out as its own row, so attention sees
``T`` rows. This module turns vLLM's per-request view of the step (query lengths, context lengths,
block tables) into the index arrays the attention needs: each token's position and KV slot, the
rows of single-token (decode) sequences, which are attended as one batch, and the row range of
each multi-token (prefill chunk) sequence, which gets one attention call of its own.

All index arithmetic is vectorised numpy, done once per step; the results are handed to MLX once.
Key gather indices depend on the layer's sliding window and KV head count; they are derived on
the first layer that asks for a combination and reused by the others (:meth:`AttentionMetadata.
decode_view`, :meth:`AttentionMetadata.prefill_view`). Sliding-window layers read only the keys
their window can reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

Window = int | None
#: chunked local attention: a query sees only keys of its own chunk of this many positions
Chunk = int | None


@dataclass(frozen=True)
class DecodeKeys:
    """How the decode batch reads its keys, for one window setting and KV head count.

    Attributes:
        rows: int32 ``[Bd, Hkv, S]``: rows of the pool viewed as ``[slots * Hkv, D]``
            (``slot * Hkv + head``), so one gather yields keys in SDPA's ``[Bd, Hkv, S, D]``
            layout. Sequence i's visible keys come first, in position order; the padding after
            them repeats its first visible key's row, so padding only ever reads written,
            finite memory (a NaN in never-written memory would survive a zero softmax weight).
        mask: bool ``[Bd, 1, 1, S]``: True for visible keys; ``None`` when all are.
    """

    rows: mx.array
    mask: mx.array | None


@dataclass(frozen=True)
class PrefillKeys:
    """How one prefill chunk reads its keys, for one window setting and KV head count.

    Attributes:
        rows: int32 ``[1, Hkv, S]``: pool rows (``slot * Hkv + head``) of the keys at positions
            ``first_key ... seq_len - 1``, all written by this or earlier steps.
        first_key: position of the first key read (keys before it are outside every window).
        mask: ``"causal"`` (lower-right aligned: the chunk's last query sees the last key) or
            bool ``[L, S]`` when a sliding window cuts into the keys.
    """

    rows: mx.array
    first_key: int
    mask: mx.array | str


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence with more than one query token this step.

    Attributes:
        start: first token row of the chunk; its rows are ``start ... start + length - 1``.
        length: L, query tokens of the chunk.
        seq_len: context length after this step (prefix already in the pool plus the chunk).
        block_table: int32 numpy ``[max_blocks]``, the sequence's block table row.
    """

    start: int
    length: int
    seq_len: int
    block_table: np.ndarray


@dataclass(frozen=True)
class GpuPlan:
    """How the paged GPU kernel (:mod:`vllm_unified.kv.gpu.paged`) attends a step that
    is not pure decode, for one tile size (made once per step, shared by all layers).

    Attributes:
        tables: int32 ``[B, max_blocks]`` block tables (a view of one host-made array with
            ``tiles``: one transfer), or None when no row goes to the kernel.
        tiles: int32 ``[NT, 4]`` (:func:`build_tiles`), or None when no row goes to the kernel.
        sdpa: indices into ``prefills`` of the chunks MLX's SDPA attends instead of the kernel
            (over their fresh keys, or over keys gathered from the pool); empty when the kernel
            takes every row.
        segments: ``(start, stop, chunk)`` row ranges in token order covering every row:
            ``chunk`` is the index of a chunk in ``sdpa``, or None for rows of the kernel's
            output.
    """

    tables: mx.array | None
    tiles: mx.array | None
    sdpa: tuple[int, ...]
    segments: tuple[tuple[int, int, int | None], ...]


def build_tiles(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, include: np.ndarray, rows: int
) -> np.ndarray:
    """The paged GPU kernel's tiles: each included sequence's rows cut into runs of at most
    ``rows`` consecutive rows, longest first.

    Args:
        query_start_loc: int ``[B + 1]``: sequence i's rows are
            ``query_start_loc[i] ... query_start_loc[i + 1] - 1``.
        seq_lens: int ``[B]``: each sequence's context length after the step (its last row
            sees that many keys; the row before it one fewer, and so on).
        include: bool ``[B]``: the sequences whose rows the kernel attends.
        rows: the most rows of a tile (>= 1).

    Returns:
        int32 ``[NT, 4]``: per tile its first row, its number of rows, its sequence and the
        number of keys its last row sees (its position + 1), ordered by that number
        descending (ties in row order). Rows of sequences not included are in no tile.

    Raises:
        ValueError: ``rows < 1`` or mismatched lengths.
    """
    if rows < 1:
        raise ValueError(f"rows per tile must be >= 1, got {rows}")
    starts = np.asarray(query_start_loc, np.int64)
    slens = np.asarray(seq_lens, np.int64)
    keep = np.asarray(include, bool)
    if starts.ndim != 1 or len(starts) != len(slens) + 1 or keep.shape != slens.shape:
        raise ValueError(f"query_start_loc {starts.shape}, seq_lens {slens.shape} and "
                         f"include {keep.shape} do not describe the same sequences")
    qlens = np.diff(starts)
    seqs = np.flatnonzero(keep & (qlens > 0))
    counts = -(-qlens[seqs] // rows)
    total = int(counts.sum())
    seq = np.repeat(seqs, counts)
    first_tile = np.repeat(np.cumsum(counts) - counts, counts)
    k = np.arange(total) - first_tile  # tile's index inside its sequence
    nrows = np.minimum(rows, qlens[seq] - k * rows)
    row0 = starts[seq] + k * rows
    last_len = slens[seq] - qlens[seq] + k * rows + nrows
    tiles = np.stack([row0, nrows, seq, last_len], axis=1)
    order = np.argsort(-last_len, kind="stable")
    return tiles[order].astype(np.int32)


@dataclass
class AttentionMetadata:
    """Everything the attention layers need for one step, built ONCE per step (not per layer).

    Build it with :func:`build_attention_metadata`. Rows of a step are ordered as the sequences
    are (each sequence's query tokens contiguous); ``T`` is the number of rows.

    Attributes:
        num_tokens: T.
        positions: int32 ``[T]``: position of each token inside its sequence (the RoPE offset).
        slot_mapping: int32 ``[T]``: pool slot (``block_id * block_size + offset``) each token's
            K/V is written to.
        block_size: tokens per KV block.
        query_start_loc: int32 numpy ``[B + 1]``: row where each sequence's tokens start (the
            last entry is T); ``query_start_loc[1:] - 1`` are the rows of each sequence's last
            token.
        decode_rows: rows of the single-token sequences, as a ``slice`` when contiguous (a view,
            no gather) or an int32 ``[Bd]`` array; ``None`` when there are none.
        decode_seq_lens: int32 numpy ``[Bd]``: context lengths of the decode sequences.
        decode_block_tables: int32 numpy ``[Bd, max_blocks]``: their block tables.
        prefills: the multi-token sequences, in row order.
        output_order: int32 ``[T]``: rows of the concatenated per-group outputs (decode batch
            first, then the prefill chunks) in token order; ``None`` when concatenation already
            is token order.
        decode_tables, decode_lens: the decode rows' block tables (int32 ``[Bd, max_blocks]``)
            and context lengths (int32 ``[Bd]``) as MLX arrays, for kernels that read the pool
            through the block tables; made on first use (:meth:`decode_tables_lens`), or given
            as the traced inputs of a compiled step (whose numpy fields are then None).
        host_positions, host_slot_mapping: int32 numpy ``[T]``, the host copies of
            ``positions`` and ``slot_mapping`` (a compiled step packs them with its other
            per-step inputs into one array).
        block_tables: int32 numpy ``[B, max_blocks]``: every scheduled sequence's block table.
        host_seq_of_row: int32 numpy ``[T]``: the sequence (row of ``block_tables``) of each
            token row.
        host_seq_lens: int32 numpy ``[B]``: every scheduled sequence's context length after
            the step.
    """

    num_tokens: int
    positions: mx.array
    slot_mapping: mx.array
    block_size: int
    query_start_loc: np.ndarray
    decode_rows: slice | mx.array | None
    decode_seq_lens: np.ndarray | None
    decode_block_tables: np.ndarray | None
    prefills: tuple[PrefillChunk, ...]
    output_order: mx.array | None
    decode_tables: mx.array | None = None
    decode_lens: mx.array | None = None
    host_positions: np.ndarray | None = field(default=None, repr=False)
    host_slot_mapping: np.ndarray | None = field(default=None, repr=False)
    block_tables: np.ndarray | None = field(default=None, repr=False)
    host_seq_of_row: np.ndarray | None = field(default=None, repr=False)
    host_seq_lens: np.ndarray | None = field(default=None, repr=False)
    _row_kernel_inputs: tuple[mx.array, mx.array, mx.array] | None = field(
        default=None, repr=False)
    _decode_views: dict[tuple[Window, int, Chunk], DecodeKeys] = field(default_factory=dict,
                                                                       repr=False)
    _prefill_views: dict[tuple[int, Window, int, Chunk], PrefillKeys] = field(
        default_factory=dict, repr=False
    )
    _gpu_plans: dict[tuple[int, bool, int], GpuPlan] = field(default_factory=dict, repr=False)
    _fresh_masks: dict[tuple[int, Window, Chunk], mx.array | str] = field(
        default_factory=dict, repr=False)
    _fresh_rows: dict[int, tuple[mx.array, mx.array] | None] = field(default_factory=dict,
                                                                     repr=False)

    @property
    def is_pure_decode(self) -> bool:
        """Every row of the step is a decode row (one query token per sequence), in order: the
        project's one definition of a pure-decode step."""
        return (self.decode_rows is not None and not self.prefills
                and self.output_order is None and self.num_tokens > 0)

    def decode_view(self, window: Window, kv_heads: int, chunk: Chunk = None) -> DecodeKeys:
        """Keys of the decode batch for a layer with this sliding window (``None``: full) and
        attention chunk (``None``: none).

        Computed on first use per (window, kv_heads, chunk) and cached, so all layers of a step
        share it. Raises ValueError if there are no decode sequences.
        """
        if self.decode_rows is None:
            raise ValueError("this step has no decode sequences")
        if self.decode_seq_lens is None:
            raise ValueError("decode key rows need the host-side block tables, which a "
                             "compiled step does not have")
        key = (window, kv_heads, chunk)
        view = self._decode_views.get(key)
        if view is None:
            view = _decode_keys(self.decode_seq_lens, self.decode_block_tables, self.block_size,
                                window, kv_heads, chunk)
            self._decode_views[key] = view
        return view

    def decode_tables_lens(self) -> tuple[mx.array, mx.array]:
        """``(decode_tables, decode_lens)`` as MLX arrays, made once per step (all layers
        share them). Raises ValueError if there are no decode sequences."""
        if self.decode_rows is None:
            raise ValueError("this step has no decode sequences")
        if self.decode_tables is None:
            self.decode_tables = mx.array(np.ascontiguousarray(self.decode_block_tables,
                                                               np.int32))
            self.decode_lens = mx.array(self.decode_seq_lens.astype(np.int32))
        return self.decode_tables, self.decode_lens

    def row_tables_seqs_lens(self) -> tuple[mx.array, mx.array, mx.array]:
        """Inputs of kernels that attend every token row through the block tables: int32
        ``block_tables`` ``[B, max_blocks]``, each row's sequence ``[T]`` and the number of
        keys it sees ``[T]`` (its position + 1: causal). Made once per step.

        A compiled pure-decode step's metadata (no host-side fields; ``decode_tables`` and
        ``decode_lens`` are traced inputs) gives those two and ``arange(T)``: decode row r is
        sequence r.

        Raises ValueError when neither the host-side fields nor a pure-decode step's traced
        tables are there.
        """
        if self._row_kernel_inputs is None and self._traced_pure_decode():
            self._row_kernel_inputs = (self.decode_tables,
                                       mx.arange(self.num_tokens, dtype=mx.int32),
                                       self.decode_lens)
        if self._row_kernel_inputs is None:
            if self.block_tables is None or self.host_seq_of_row is None \
                    or self.host_positions is None:
                raise ValueError("row kernels need the host-side block tables and positions")
            self._row_kernel_inputs = (
                mx.array(np.ascontiguousarray(self.block_tables, np.int32)),
                mx.array(self.host_seq_of_row.astype(np.int32)),
                mx.array(self.host_positions.astype(np.int32) + 1),
            )
        return self._row_kernel_inputs

    def _traced_pure_decode(self) -> bool:
        """Whether this is a compiled pure-decode step's metadata: one decode row per
        sequence in order, the tables and lengths given as arrays, no host-side tables."""
        return (self.block_tables is None and self.decode_tables is not None
                and self.decode_lens is not None and not self.prefills
                and self.decode_rows == slice(0, self.num_tokens))

    def fresh_key_rows(self, max_short: int) -> tuple[mx.array, mx.array] | None:
        """Which keys each row reads from this step's own (unquantized) K/V, the way vLLM's
        TurboQuant backend attends prefill chunks (``turboquant_attn.py``
        ``_prefill_attention``): a chunk that starts its sequence (``length == seq_len``) or
        is longer than ``max_short`` tokens attends its own tokens unquantized (and earlier
        ones from the cache); decode rows and chunks of at most ``max_short`` tokens after
        cached context read everything from the cache.

        Returns:
            ``(raw_from, raw_row0)``, int32 ``[T]``: row r reads keys at positions
            ``>= raw_from[r]`` from the step's K/V, the one at ``raw_from[r]`` in row
            ``raw_row0[r]`` (the chunk's first row) and the rest after it; ``raw_from`` is
            the row's own key count (nothing fresh) elsewhere. None when no row reads fresh
            keys. Cached per step.
        """
        if max_short not in self._fresh_rows:
            chunks = [c for c in self.prefills if c.length == c.seq_len or c.length > max_short]
            out = None
            if chunks:
                if self.host_positions is None:
                    raise ValueError("fresh key rows need the host-side positions")
                raw_from = self.host_positions.astype(np.int32) + 1
                raw_row0 = np.zeros(self.num_tokens, np.int32)
                for c in chunks:
                    rows = slice(c.start, c.start + c.length)
                    raw_from[rows] = c.seq_len - c.length
                    raw_row0[rows] = c.start
                out = (mx.array(raw_from), mx.array(raw_row0))
            self._fresh_rows[max_short] = out
        return self._fresh_rows[max_short]

    def gpu_plan(self, rows: int, route_fresh: bool, max_chunk: int) -> GpuPlan:
        """The paged GPU kernel's plan for this step with tiles of at most ``rows`` rows.
        Left to MLX's SDPA: with ``route_fresh``, prefill chunks with no context before them
        (``seq_len == length``, attended over their fresh keys); any other chunk of more than
        ``max_chunk`` rows (over keys gathered from the pool). Made once per argument set.

        Raises ValueError when the host-side fields are missing (a compiled step's metadata).
        """
        key = (rows, route_fresh, max_chunk)
        plan = self._gpu_plans.get(key)
        if plan is None:
            plan = self._make_gpu_plan(rows, route_fresh, max_chunk)
            self._gpu_plans[key] = plan
        return plan

    def _make_gpu_plan(self, rows: int, route_fresh: bool, max_chunk: int) -> GpuPlan:
        if self.block_tables is None or self.host_seq_lens is None:
            raise ValueError("the paged GPU kernel's tiles need the host-side block tables "
                             "and lengths, which a compiled step does not have")
        qlens = np.diff(self.query_start_loc.astype(np.int64))
        to_sdpa = (qlens > 1) & ((qlens > max_chunk)
                                 | (route_fresh & (self.host_seq_lens == qlens)))
        sdpa = tuple(i for i, p in enumerate(self.prefills)
                     if p.length > max_chunk or (route_fresh and p.seq_len == p.length))
        tiles = build_tiles(self.query_start_loc, self.host_seq_lens, ~to_sdpa, rows)
        tables = tile_array = None
        if len(tiles):
            packed = mx.array(np.concatenate([
                np.ascontiguousarray(self.block_tables, np.int32).reshape(-1),
                tiles.reshape(-1)]))
            size = self.block_tables.size
            tables = packed[:size].reshape(self.block_tables.shape)
            tile_array = packed[size:].reshape(tiles.shape)
        segments: list[tuple[int, int, int | None]] = []
        row = 0
        for i in sdpa:
            chunk = self.prefills[i]
            if chunk.start > row:
                segments.append((row, chunk.start, None))
            segments.append((chunk.start, chunk.start + chunk.length, i))
            row = chunk.start + chunk.length
        if row < self.num_tokens:
            segments.append((row, self.num_tokens, None))
        return GpuPlan(tables, tile_array, sdpa, tuple(segments))

    def fresh_mask(self, index: int, window: Window, chunk: Chunk = None) -> mx.array | str:
        """SDPA's mask for prefill chunk ``index`` attending to its own ``L`` keys only (no
        context before it): ``"causal"``, or bool ``[L, L]`` when a sliding window or an
        attention chunk cuts into them (query i sees keys ``i - window < j <= i`` with
        ``j // chunk == i // chunk``). Cached per (index, window, chunk)."""
        key = (index, window, chunk)
        mask = self._fresh_masks.get(key)
        if mask is None:
            length = self.prefills[index].length
            mask = "causal"
            if (window is not None and window < length) or (chunk is not None
                                                             and chunk < length):
                pos = np.arange(length)
                mask = mx.array((pos[None, :] <= pos[:, None])
                                & (pos[None, :] >= _first_visible(pos + 1, window, chunk)[:, None]))
            self._fresh_masks[key] = mask
        return mask

    def prefill_view(self, index: int, window: Window, kv_heads: int,
                     chunk: Chunk = None) -> PrefillKeys:
        """Keys of prefill chunk ``index`` for a layer with this sliding window and attention
        chunk (cached)."""
        key = (index, window, kv_heads, chunk)
        view = self._prefill_views.get(key)
        if view is None:
            view = _prefill_keys(self.prefills[index], self.block_size, window, kv_heads, chunk)
            self._prefill_views[key] = view
        return view


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: np.ndarray,
    block_size: int,
) -> AttentionMetadata:
    """Build the metadata of one step.

    Args:
        query_lens: ``query_lens[i]`` tokens of sequence i are scheduled this step; rows are
            contiguous per sequence, sequences in order. A length of 0 is allowed (no rows).
        seq_lens: ``seq_lens[i]`` is sequence i's context length AFTER this step, so its query
            tokens sit at positions ``seq_lens[i] - query_lens[i] ... seq_lens[i] - 1``.
        block_tables: int ``[B', max_blocks]`` numpy with ``B' >= B``; row i lists sequence i's
            block ids in order (padding past the blocks it owns is ignored); extra rows (a
            persistent batch's spare capacity) are ignored.
        block_size: tokens per KV block.

    Returns:
        The step's :class:`AttentionMetadata`; all MLX index arrays are int32.

    Raises:
        ValueError: on mismatched lengths, negative query lengths, a query longer than its
            context, a non-positive block size, or a block table too narrow for a context.
    """
    qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
    slens = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
    tables = np.asarray(block_tables)
    _validate(qlens, slens, tables, block_size)
    tables = tables[: len(qlens)].astype(np.int32, copy=False)

    starts = np.zeros(len(qlens) + 1, dtype=np.int64)
    np.cumsum(qlens, out=starts[1:])
    num_tokens = int(starts[-1])

    # Per token: its sequence, then its position inside that sequence.
    seq_of_row = np.repeat(np.arange(len(qlens)), qlens)
    positions = np.arange(num_tokens) - starts[:-1][seq_of_row] + (slens - qlens)[seq_of_row]
    blocks = tables[seq_of_row, positions // block_size].astype(np.int64)
    slots = (blocks * block_size + positions % block_size).astype(np.int32)
    positions = positions.astype(np.int32)

    decode = np.flatnonzero(qlens == 1)
    decode_rows = starts[decode]
    prefills = tuple(
        PrefillChunk(int(starts[i]), int(qlens[i]), int(slens[i]), tables[i])
        for i in np.flatnonzero(qlens > 1)
    )
    return AttentionMetadata(
        num_tokens=num_tokens,
        positions=mx.array(positions),
        slot_mapping=mx.array(slots),
        host_positions=positions,
        host_slot_mapping=slots,
        block_tables=tables,
        host_seq_of_row=seq_of_row.astype(np.int32),
        host_seq_lens=slens.astype(np.int32),
        block_size=block_size,
        query_start_loc=starts.astype(np.int32),
        decode_rows=_as_rows(decode_rows),
        decode_seq_lens=slens[decode].astype(np.int32),
        decode_block_tables=tables[decode],
        prefills=prefills,
        output_order=_output_order(decode_rows, prefills, num_tokens),
    )


def _validate(qlens: np.ndarray, slens: np.ndarray, tables: np.ndarray, block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if len(qlens) != len(slens):
        raise ValueError(f"{len(qlens)} query lengths but {len(slens)} sequence lengths")
    if tables.ndim != 2 or tables.shape[0] < len(qlens):
        raise ValueError(
            f"block_tables must be [>= {len(qlens)}, max_blocks], got shape {tables.shape}"
        )
    if (qlens < 0).any():
        raise ValueError("query lengths must be >= 0")
    if (qlens > slens).any():
        raise ValueError("a query is longer than its sequence's context")
    needed = -(-slens // block_size)
    if len(needed) and int(needed.max()) > tables.shape[1]:
        raise ValueError(
            f"a context of {int(slens.max())} tokens needs {int(needed.max())} blocks; "
            f"block_tables has {tables.shape[1]} columns"
        )


def _as_rows(rows: np.ndarray) -> slice | mx.array | None:
    """Rows as a slice when contiguous (slicing is a view; a gather would copy)."""
    if len(rows) == 0:
        return None
    if rows[-1] - rows[0] == len(rows) - 1:
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return mx.array(rows.astype(np.int32))


def _output_order(
    decode_rows: np.ndarray, prefills: tuple[PrefillChunk, ...], num_tokens: int
) -> mx.array | None:
    """Inverse permutation from [decode batch, chunk 0, chunk 1, ...] outputs to token order."""
    concat_rows = np.concatenate(
        [decode_rows] + [np.arange(p.start, p.start + p.length) for p in prefills]
    ).astype(np.int64)
    if np.array_equal(concat_rows, np.arange(num_tokens)):
        return None
    order = np.empty(num_tokens, dtype=np.int32)
    order[concat_rows] = np.arange(num_tokens, dtype=np.int32)
    return mx.array(order)


def _first_visible(seq_lens: np.ndarray, window: Window, chunk: Chunk = None) -> np.ndarray:
    """First key position visible to the query at ``seq_len - 1``: key > pos - window, and
    in the query's attention chunk (key // chunk == pos // chunk)."""
    first = np.zeros_like(seq_lens) if window is None else np.maximum(seq_lens - window, 0)
    if chunk is not None:
        first = np.maximum(first, (seq_lens - 1) // chunk * chunk)
    return first


def _pool_rows(
    tables: np.ndarray, positions: np.ndarray, block_size: int, kv_heads: int
) -> np.ndarray:
    """``[..., S]`` positions -> int32 ``[..., Hkv, S]`` pool rows through ``[..., max_blocks]``."""
    blocks = np.take_along_axis(tables, positions // block_size, axis=-1).astype(np.int64)
    slots = blocks * block_size + positions % block_size
    rows = slots[..., None, :] * kv_heads + np.arange(kv_heads)[:, None]
    return rows.astype(np.int32)


def _decode_keys(
    seq_lens: np.ndarray, tables: np.ndarray, block_size: int, window: Window, kv_heads: int,
    chunk: Chunk = None,
) -> DecodeKeys:
    # Sequence i reads its visible keys first_i ... seq_len_i - 1, left-aligned; the batch is
    # as wide as the widest. Padding re-reads position first_i, which is written.
    first = _first_visible(seq_lens.astype(np.int64), window, chunk)
    count = seq_lens - first
    num_keys = int(count.max())
    offsets = np.arange(num_keys)
    visible = offsets[None, :] < count[:, None]
    positions = first[:, None] + np.where(visible, offsets[None, :], 0)
    return DecodeKeys(
        rows=mx.array(_pool_rows(tables, positions, block_size, kv_heads)),
        mask=None if visible.all() else mx.array(visible[:, None, None, :]),
    )


def _prefill_keys(
    chunk: PrefillChunk, block_size: int, window: Window, kv_heads: int,
    attention_chunk: Chunk = None,
) -> PrefillKeys:
    # Keys before the first query's window (or attention chunk) can never be seen: skip them.
    prefix = chunk.seq_len - chunk.length
    first_key = int(_first_visible(np.int64(prefix + 1), window, attention_chunk))
    positions = np.arange(first_key, chunk.seq_len)
    mask: mx.array | str = "causal"
    crosses = (attention_chunk is not None
               and prefix // attention_chunk != (chunk.seq_len - 1) // attention_chunk)
    if (window is not None and window < chunk.seq_len) or crosses:
        q_pos = np.arange(prefix, chunk.seq_len)
        first = _first_visible(q_pos + 1, window, attention_chunk)[:, None]
        mask = mx.array((positions[None, :] <= q_pos[:, None]) & (positions[None, :] >= first))
    rows = _pool_rows(chunk.block_table, positions, block_size, kv_heads)
    return PrefillKeys(rows=mx.array(rows[None]), first_key=first_key, mask=mask)
