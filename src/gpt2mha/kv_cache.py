"""Preallocated (static) KV cache and its conversion to and from OpenAI's ``past`` layout.

The official interface passes ``past [B, n_layer, 2, h, P, head_dim]`` in and gets the new
tokens' ``present`` back, which the caller concatenates: every step copies the whole past.
:class:`KVCache` instead allocates ``[B, h, T_max, head_dim]`` keys and values per layer once
and writes each step's keys/values in place at the current positions (one indexed
assignment, as in gpt-fast), so a decode step costs only what it attends to.
"""

from __future__ import annotations

import torch


class KVCache:
    """Static key/value cache for every layer.

    Args:
        n_layer, batch_size, n_head, max_len, head_dim: sizes; ``max_len`` is ``T_max``.
        dtype, device: storage dtype/device (match the model's).

    Attributes:
        k, v: ``[n_layer, B, h, T_max, head_dim]`` storage (written in place; never rebound).
        layers: per layer, the views ``(k[layer], v[layer])`` that :meth:`update` writes.
        length: number of positions filled so far (the past length ``P``).

    Raises:
        ValueError: if any size is not positive.
    """

    def __init__(self, n_layer: int, batch_size: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        sizes = dict(n_layer=n_layer, batch_size=batch_size, n_head=n_head, max_len=max_len, head_dim=head_dim)
        bad = {k: s for k, s in sizes.items() if s <= 0}
        if bad:
            raise ValueError(f"KVCache sizes must be positive, got {bad}")
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.k[i], self.v[i]) for i in range(n_layer)]  # per layer: views [B, h, T_max, head_dim]
        self.length = 0

    @property
    def max_len(self) -> int:
        """``T_max``, the number of positions the cache can hold."""
        return self.k.shape[3]

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

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new keys/values ``[B, h, T, head_dim]`` at positions ``length … length+T-1``.

        Returns the layer's keys and values up to the new end, ``[B, h, length + T, head_dim]``
        (views, no copy). :meth:`advance` moves ``length`` on once every layer is written.

        Raises:
            ValueError: if the new tokens do not fit in ``max_len``.
        """
        start, T = self.length, k.shape[2]
        if start + T > self.max_len:
            raise ValueError(f"KVCache is full: {start} cached + {T} new > max_len={self.max_len}")
        k_all, v_all = self.layers[layer]                      # [B, h, T_max, head_dim] each
        k_all.narrow(2, start, T).copy_(k)                     # one in-place write per tensor
        v_all.narrow(2, start, T).copy_(v)
        return k_all.narrow(2, 0, start + T), v_all.narrow(2, 0, start + T)

    def advance(self, n: int) -> None:
        """Mark ``n`` more positions as filled (called by the model after all layers)."""
        self.length += n

    def to_past(self) -> torch.Tensor:
        """The filled part in OpenAI's layout ``[B, n_layer, 2, h, P, head_dim]`` (a copy)."""
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
        cache.length = P
        return cache


class SlotCache:
    """Static key/value cache with one slot per running sequence, each at its own length.

    The cache of a continuous-batching scheduler (:mod:`gpt2mha.scheduler`): a sequence is
    prefilled on its own, its keys/values are copied into a free slot (:meth:`load`), and then
    every decode step feeds one new token for each of the rows ``0 … rows-1`` at once
    (:meth:`begin` then the model's ``step``). Row ``b`` writes its new key/value at its own
    position ``lengths[b]`` and reads only its keys ``0 … lengths[b]`` (the key mask that
    :meth:`begin` returns), so every row attends exactly as it would alone; a free slot inside
    the rows is computed but masked to one key and never read. The same interface as
    :class:`KVCache` (``update``, ``advance``, ``length``), so ``GPT2.step`` runs over it.

    Args:
        n_layer, n_slots, n_head, max_len, head_dim: sizes; ``max_len`` is ``T_max`` (n_ctx).
        dtype, device: storage dtype/device (match the model's).

    Attributes:
        k, v: ``[n_layer, n_slots, h, T_max, head_dim]`` storage (zeros at first, so keys never
            read are finite).
        lengths: per slot, the number of positions filled (host ints; 0 for a free slot).

    Raises:
        ValueError: if any size is not positive.
    """

    def __init__(self, n_layer: int, n_slots: int, n_head: int, max_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
        sizes = dict(n_layer=n_layer, n_slots=n_slots, n_head=n_head, max_len=max_len, head_dim=head_dim)
        bad = {k: s for k, s in sizes.items() if s <= 0}
        if bad:
            raise ValueError(f"SlotCache sizes must be positive, got {bad}")
        shape = (n_layer, n_slots, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per layer: [n_slots, h, T_max, head_dim]
        self.lengths = [0] * n_slots
        self.active = [False] * n_slots
        self._rows = 0
        self._row_index = self._pos = None
        self._span = 0

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """``T_max``, the positions each slot can hold."""
        return self.k.shape[3]

    @property
    def length(self) -> int:
        """Past length of the longest row in the current step (what ``GPT2.step`` calls the past)."""
        return self._span - 1 if self._rows else 0

    def load(self, slot: int, cache: KVCache, row: int = 0, start: int = 0) -> None:
        """Copy row ``row`` of a prefilled :class:`KVCache`, positions ``start … cache.length-1``
        (``start`` > 0 skips a left-padded row's pads), into ``slot`` at positions ``0 …``.

        Raises:
            ValueError: a slot out of range or in use, or a cache of other sizes or too long.
        """
        if not 0 <= slot < self.n_slots or self.active[slot]:
            raise ValueError(f"slot={slot} is out of range [0, {self.n_slots}) or in use")
        P = cache.length - start
        L, _, h, _, hd = cache.k.shape
        if (L, h, hd) != (self.k.shape[0], self.k.shape[2], self.k.shape[4]) or not 0 <= P <= self.max_len:
            raise ValueError(f"cache of shape {tuple(cache.k.shape)} holding {cache.length} positions from {start} "
                             f"does not fit a slot of [n_layer={self.k.shape[0]}, h={self.k.shape[2]}, "
                             f"T_max={self.max_len}, head_dim={self.k.shape[4]}]")
        self.k[:, slot, :, :P] = cache.k[:, row, :, start:start + P]
        self.v[:, slot, :, :P] = cache.v[:, row, :, start:start + P]
        self.lengths[slot] = P
        self.active[slot] = True

    def release(self, slot: int) -> None:
        """Free ``slot`` at once (its storage is overwritten by the next :meth:`load`)."""
        self.lengths[slot] = 0
        self.active[slot] = False

    def begin(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a decode step over slots ``0 … rows-1`` (one new token each).

        Returns:
            ``position_ids [rows, 1]`` (int64, each row's own length) and the key mask
            ``[rows, 1, 1, S]`` (bool, S = longest length + 1): row ``b`` reads keys
            ``0 … lengths[b]``, the last being the key it writes in this step.

        Raises:
            ValueError: a row's slot is full (its length is already ``max_len``).
        """
        lengths = self.lengths[:rows]
        if max(lengths) >= self.max_len:
            raise ValueError(f"SlotCache is full: a slot holds {max(lengths)} positions = max_len={self.max_len}")
        device = self.k.device
        self._rows, self._span = rows, max(lengths) + 1
        self._pos = torch.tensor(lengths, dtype=torch.long, device=device)            # [rows]
        self._row_index = torch.arange(rows, device=device)
        mask = torch.arange(self._span, device=device) <= self._pos[:, None]          # [rows, S]
        return self._pos[:, None], mask[:, None, None, :]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's keys/values ``[rows, h, 1, head_dim]``, row ``b`` at position ``lengths[b]``.

        Returns the layer's keys and values ``[rows, h, S, head_dim]`` (views, no copy).
        """
        k_all, v_all = self.layers[layer]                      # [n_slots, h, T_max, head_dim]
        k_all[self._row_index, :, self._pos] = k[:, :, 0]      # index_put: [rows, h, head_dim]
        v_all[self._row_index, :, self._pos] = v[:, :, 0]
        return k_all[:self._rows, :, :self._span], v_all[:self._rows, :, :self._span]

    def advance(self, n: int) -> None:
        """After a step: every active row among the step's rows holds ``n`` more positions."""
        for b in range(self._rows):
            if self.active[b]:
                self.lengths[b] += n
        self._rows = 0
