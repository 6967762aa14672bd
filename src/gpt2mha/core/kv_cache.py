"""The preallocated (static) KV cache: one layout for every way the model is run.

OpenAI's interface passes ``past [B, n_layer, 2, h, P, head_dim]`` in and gets the new tokens'
``present`` back, which the caller concatenates: every step copies the whole past.
:class:`KVCache` instead allocates ``[B, h, T_max, head_dim]`` keys and values per layer once
and writes each step's keys/values in place (one indexed assignment, as in gpt-fast), so a
decode step costs only what it attends to.

Every row keeps its own tokens from cache index 0, at its own length: row ``b``'s token at
index ``j`` is its ``j``-th token, and a query at index ``i`` may read keys ``0 … i`` — the
causal rule of OpenAI's ``attention_mask`` written in cache indices. Rows of one batch may
hold different lengths (prompts of different lengths, sequences joining a running batch), and
no row's keys are shifted by its neighbours' lengths. OpenAI's ``past``/``present`` is this
cache built from ``past`` for one call (:meth:`KVCache.from_past`).

A forward over ``T`` new tokens is planned once (:meth:`KVCache.plan`, a :class:`CacheStep`:
where each row writes, how many keys every layer reads, which of them each query may see),
then each layer writes and reads with :meth:`KVCache.update`, then :meth:`KVCache.advance`.

The rows of a batch are attended one row a call (:attr:`CacheStep.groups`), each over exactly
its own keys: attention kernels sum over the keys they are given in an order that depends on
how many there are, so a row read with masked keys behind its own (a longer neighbour's span)
would round differently from the same row alone; and PyTorch's CPU attention splits one call's
(row, head) pairs over its threads in a way that changes a row's rounding with the rows beside
it, even rows of one length.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import checks


class CacheStep(NamedTuple):
    """How one forward of ``T`` new tokens uses a :class:`KVCache` (:meth:`KVCache.plan`).

    Attributes:
        start: the cache index every row writes its first new token at, when all rows hold the
            same length (then the keys' mask is OpenAI's ``attention_mask(T, span)``); None when
            lengths differ.
        pos: ``[B, T]`` int64 cache index of each new token (its position), or None with ``start``.
        span: keys every layer reads, indices ``0 … span-1``.
        mask: None (the bottom-right causal mask), or bool ``[B, 1, T, span]``: query ``(b, t)``
            may read key ``j`` iff ``j <= pos[b, t]``.
        rows: ``[B, 1]`` row indices for the per-row write, or None with ``start``.
        groups: for two or more rows and no fixed span: ``((rows, keys), …)``, one per row
            (a one-row ``slice``, in row order), each to be attended over its first ``keys``
            cache indices only, with OpenAI's bottom-right causal mask: exactly the keys and
            shapes that row would have in a batch of its own (batch invariance). None otherwise
            (one call over ``span`` keys with ``mask``).
    """

    start: int | None
    pos: torch.Tensor | None
    span: int
    mask: torch.Tensor | None
    rows: torch.Tensor | None = None
    groups: tuple[tuple[slice, int], ...] | None = None

    def positions(self, batch: int, n_new: int, device) -> torch.Tensor:
        """Position ids ``[B, T]`` (or ``[T]`` when every row starts together) of the new tokens."""
        if self.pos is not None:
            return self.pos
        return torch.arange(self.start, self.start + n_new, device=device)


class KVCache:
    """Static key/value cache for every layer, one row per sequence.

    Args:
        n_layer, batch_size, n_head, max_len, head_dim: sizes; ``max_len`` is ``T_max``.
        dtype, device: storage dtype/device (match the model's).

    Attributes:
        k, v: ``[n_layer, B, h, T_max, head_dim]`` storage (zeros at first, so keys never
            written are finite; written in place, never rebound).
        lengths: list of B ints: tokens each row holds (its next write index).

    Raises:
        ValueError: if any size is not positive.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        checks.positive_ints(n_layer=n_layer, batch_size=batch_size, n_head=n_head, max_len=max_len,
                             head_dim=head_dim)
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self._bind(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   [0] * batch_size)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        """An empty cache over the caller's storage ``k, v [n_layer, B, h, T_max, head_dim]``
        (used as it is, not copied; zeros, as a new cache's, unless every position a step reads
        is written first).

        Raises:
            ValueError: ``k`` and ``v`` differ in shape, dtype or device, are not 5-D, have a size
                that is not positive, or share memory (a write to one would change the other).
        """
        if k.dim() != 5 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"k and v must be two [n_layer, B, h, T_max, head_dim] tensors of one dtype and "
                             f"device; got {tuple(k.shape)} {k.dtype} {k.device} and {tuple(v.shape)} {v.dtype} {v.device}")
        checks.positive_ints(**dict(zip(("n_layer", "batch_size", "n_head", "max_len", "head_dim"), k.shape)))
        def span(t):                                            # the bytes t's elements lie in
            end = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
            return t.data_ptr(), t.data_ptr() + end * t.element_size()
        (k0, k1), (v0, v1) = span(k), span(v)
        if k0 < v1 and v0 < k1:
            raise ValueError("k and v share memory: a cache needs separate storage for keys and values")
        cache = cls.__new__(cls)
        cache._bind(k, v, [0] * k.shape[1])
        return cache

    def _bind(self, k: torch.Tensor, v: torch.Tensor, lengths: list[int], offset: int = 0) -> None:
        self.k, self.v = k, v
        self._lengths = lengths                                 # shared with the views of :meth:`rows`, :meth:`row`
        self._offset = offset                                   # this view's row 0 in ``_lengths``
        # per layer: views [B, h, T_max, head_dim]; by indexing, not unbind(), whose views refuse
        # in-place writes of tensors that require grad (a forward with past in grad mode)
        self.layers = [(k[i], v[i]) for i in range(k.shape[0])]

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds (its next write index), a new list of B ints."""
        return self._lengths[self._offset:self._offset + self.batch_size]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """``T_max``, the number of positions each row can hold."""
        return self.k.shape[3]

    @property
    def length(self) -> int:
        """Tokens held by the longest row (for equal rows: the past length ``P``)."""
        return max(self.lengths)

    def rows(self, n: int) -> "KVCache":
        """A cache over rows ``0 … n-1`` sharing this one's storage and lengths (no copy):
        what a forward over ``n`` sequences of a larger, slotted cache writes into."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"rows={n} must be in [1, batch_size={self.batch_size}]")
        view = KVCache.__new__(KVCache)
        view._bind(self.k[:, :n], self.v[:, :n], self._lengths, self._offset)
        return view

    def row(self, i: int) -> "KVCache":
        """A one-row cache over row ``i``, sharing this one's storage and length (no copy): what
        one sequence is prefilled into, alone, in place (a serving slot, a row of ``generate``)."""
        if not 0 <= i < self.batch_size:
            raise ValueError(f"row={i} is out of range [0, {self.batch_size})")
        view = KVCache.__new__(KVCache)
        view._bind(self.k[:, i:i + 1], self.v[:, i:i + 1], self._lengths, self._offset + i)
        return view

    def check(self, batch_size: int, n_new: int, n_layer: int, n_head: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> None:
        """Check that this cache fits a model and an input before anything is written.

        Args: the input's ``batch_size`` and ``n_new`` tokens; the model's ``n_layer``,
        ``n_head``, ``head_dim``, parameter ``dtype`` and ``device``.

        Raises:
            ValueError: naming the first size, dtype or device that differs (a 4-row cache for a
                1-row input would otherwise be broadcast into and overwritten), or too little free
                length for ``n_new`` more tokens.
        """
        L, B, h, _, hd = self.k.shape
        for name, have, want in (("batch size", B, batch_size), ("n_layer", L, n_layer),
                                 ("n_head", h, n_head), ("head_dim", hd, head_dim)):
            if have != want:
                raise ValueError(f"cache has {name}={have} but the {'input' if name == 'batch size' else 'model'} "
                                 f"has {want}; build it as KVCache(n_layer={n_layer}, batch_size={batch_size}, "
                                 f"n_head={n_head}, max_len=..., head_dim={head_dim})")
        if self.k.dtype != dtype:
            raise ValueError(f"cache dtype is {self.k.dtype} but the model's parameters are {dtype}; "
                             f"build the cache (or KVCache.from_past(..., dtype=...)) in {dtype}")
        if self.k.device != torch.device(device):
            raise ValueError(f"cache is on {self.k.device} but the model is on {device}")
        if self.length + n_new > self.max_len:
            raise ValueError(f"cache holds {self.length} of max_len={self.max_len} positions; "
                             f"{n_new} new tokens do not fit")

    def plan(self, n_new: int, *, span: int | None = None, per_row: bool = False) -> CacheStep:
        """Where ``n_new`` tokens per row go and what each layer reads (one :class:`CacheStep`
        for all layers). Rows of equal length write at one index and read OpenAI's causal mask;
        otherwise (or with ``per_row``) row ``b`` writes at ``lengths[b] …`` and reads its own
        keys only, through a mask.

        Args:
            span: keys every layer reads (default: the longest row's, ``max(lengths) + n_new``);
                a fixed span (e.g. ``max_len``) gives every step the same shapes, which a
                compiled decode step needs; the extra keys are masked.
            per_row: always plan per row (tensor positions and a mask), even for equal lengths.

        Raises:
            ValueError: a row would pass ``max_len``, or ``span`` is too short or too long.
        """
        lengths = self.lengths
        longest = max(lengths)
        if longest + n_new > self.max_len:
            raise ValueError(f"KVCache is full: {longest} cached + {n_new} new > max_len={self.max_len}")
        if span is not None and not longest + n_new <= span <= self.max_len:
            raise ValueError(f"span={span} must be in [{longest + n_new}, max_len={self.max_len}]")
        groups = None if span is not None or len(lengths) == 1 else tuple(
            (slice(b, b + 1), n + n_new) for b, n in enumerate(lengths))     # one attention call a row
        if min(lengths) == longest and span is None and not per_row:
            return CacheStep(longest, None, longest + n_new, None, groups=groups)
        device = self.k.device
        span = longest + n_new if span is None else span
        pos = torch.tensor(lengths, device=device)[:, None] + torch.arange(n_new, device=device)   # [B, T]
        mask = torch.arange(span, device=device) <= pos[:, :, None]                       # [B, T, span]
        return CacheStep(None, pos, span, mask[:, None], torch.arange(len(lengths), device=device)[:, None], groups)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: CacheStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``[B, h, T, head_dim]`` where ``step`` says; returns the
        layer's keys and values ``[B, h, span, head_dim]``: views, no copy, unless ``k`` or ``v``
        requires grad (a forward given ``past`` in grad mode). Then they are copies, since every
        layer writes into one storage and autograd refuses a saved tensor written since."""
        k_all, v_all = self.layers[layer]                      # [B, h, T_max, head_dim] each
        if step.start is not None:                             # one index for every row
            k_all.narrow(2, step.start, k.shape[2]).copy_(k)
            v_all.narrow(2, step.start, v.shape[2]).copy_(v)
        else:                                                  # row b at pos[b]: index_put
            k_all[step.rows, :, step.pos] = k.transpose(1, 2)  # [B, T, h, head_dim]
            v_all[step.rows, :, step.pos] = v.transpose(1, 2)
        k_all, v_all = k_all.narrow(2, 0, step.span), v_all.narrow(2, 0, step.span)   # (a compiled step's
        #                                                   span is symbolic: narrow keeps it so up to max_len)
        if k.requires_grad or v.requires_grad:                 # autograd saves what attention reads:
            return k_all.clone(), v_all.clone()                # a copy, which later layers' writes leave alone
        return k_all, v_all

    def advance(self, n: int) -> None:
        """Every row holds ``n`` more tokens (called by the model after all layers)."""
        for b in range(self._offset, self._offset + self.batch_size):
            self._lengths[b] += n

    def trim(self, lengths) -> None:
        """Set each row's length (``lengths [B]``, each at most its current one): a row padded on
        the right in a batched prefill keeps only its real tokens, and its next token is written
        over the first pad.

        Raises:
            ValueError: a length of the wrong count, negative, or beyond what the row holds.
        """
        new = [int(n) for n in lengths]
        if len(new) != self.batch_size or any(not 0 <= n <= have for n, have in zip(new, self.lengths)):
            raise ValueError(f"lengths={new} must give each of the {self.batch_size} rows a length in "
                             f"[0, its current {self.lengths}]")
        self._lengths[self._offset:self._offset + self.batch_size] = new

    def clear_unwritten(self, rows=None) -> None:
        """Zero each row's storage past its length (``rows``: those rows, default all): for a
        cache whose storage was not zeroed (or held a failed sequence's NaN keys) before a
        forward that reads masked keys (a fixed span, or one call over rows of several lengths),
        where a masked NaN key would still reach the result (0 · NaN)."""
        for row in range(self.batch_size) if rows is None else rows:
            n = self.lengths[row]
            self.k[:, row, :, n:].zero_()
            self.v[:, row, :, n:].zero_()

    def reset(self, row: int) -> None:
        """Empty row ``row`` (its storage is overwritten by the next tokens written there).

        Raises:
            ValueError: a row out of range.
        """
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row={row} is out of range [0, {self.batch_size})")
        self._lengths[self._offset + row] = 0

    def load(self, row: int, other: "KVCache", other_row: int = 0, start: int = 0) -> None:
        """Copy ``other``'s row ``other_row``, indices ``start … other.lengths[other_row]-1``, into
        row ``row`` at indices ``0 …`` (``start`` > 0 skips a left-padded row's pads).

        Raises:
            ValueError: a row out of range, or a cache of other sizes or too long.
        """
        if not 0 <= row < self.batch_size:
            raise ValueError(f"row={row} is out of range [0, {self.batch_size})")
        n = other.lengths[other_row] - start
        L, _, h, _, hd = other.k.shape
        if (L, h, hd) != (self.k.shape[0], self.k.shape[2], self.k.shape[4]) or not 0 <= n <= self.max_len:
            raise ValueError(f"cache of shape {tuple(other.k.shape)} holding {n + start} positions from {start} "
                             f"does not fit a row of [n_layer={self.k.shape[0]}, h={self.k.shape[2]}, "
                             f"T_max={self.max_len}, head_dim={self.k.shape[4]}]")
        self.k[:, row, :, :n] = other.k[:, other_row, :, start:start + n]
        self.v[:, row, :, :n] = other.v[:, other_row, :, start:start + n]
        self._lengths[self._offset + row] = n

    def to_past(self) -> torch.Tensor:
        """The filled part in OpenAI's layout ``[B, n_layer, 2, h, P, head_dim]`` (a copy).

        Raises:
            ValueError: rows of different lengths (``past`` has one P for all rows).
        """
        if min(self.lengths) != self.length:
            raise ValueError(f"rows hold different lengths {self.lengths}; OpenAI's past has one length")
        P = self.length
        return torch.stack([self.k[:, :, :, :P], self.v[:, :, :, :P]], dim=2).transpose(0, 1).contiguous()

    @classmethod
    def from_past(cls, past: torch.Tensor, max_len: int, dtype: torch.dtype | None = None) -> "KVCache":
        """Build a cache of capacity ``max_len`` holding ``past [B, n_layer, 2, h, P, head_dim]``.

        Args:
            dtype: the cache's dtype (the model's parameter dtype); default: ``past``'s own.

        Raises:
            ValueError: if ``past`` is not a floating 6-D tensor or ``P > max_len``.
        """
        if not isinstance(past, torch.Tensor) or not past.is_floating_point():
            raise ValueError(f"past must be a floating-point tensor; got "
                             f"{past.dtype if isinstance(past, torch.Tensor) else type(past).__name__}")
        if past.dim() != 6:
            raise ValueError(f"past has shape {tuple(past.shape)}; expected [B, n_layer, 2, h, P, head_dim]")
        B, L, two, h, P, hd = past.shape
        if two != 2 or P > max_len:
            raise ValueError(f"past has shape {tuple(past.shape)}; axis 2 must be 2 and P={P} <= max_len={max_len}")
        cache = cls(L, B, h, max_len, hd, dtype=dtype or past.dtype, device=past.device)
        cache.k[:, :, :, :P] = past[:, :, 0].transpose(0, 1)
        cache.v[:, :, :, :P] = past[:, :, 1].transpose(0, 1)
        cache._lengths[:] = [P] * B
        return cache

