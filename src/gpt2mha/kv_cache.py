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
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0)))  # per layer: views [B, h, T_max, head_dim]
        self.length = 0

    @property
    def max_len(self) -> int:
        """``T_max``, the number of positions the cache can hold."""
        return self.k.shape[3]

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
    def from_past(cls, past: torch.Tensor, max_len: int) -> "KVCache":
        """Build a cache of capacity ``max_len`` holding ``past [B, n_layer, 2, h, P, head_dim]``.

        Raises:
            ValueError: if ``past`` is not 6-D or ``P > max_len``.
        """
        if past.dim() != 6:
            raise ValueError(f"past has shape {tuple(past.shape)}; expected [B, n_layer, 2, h, P, head_dim]")
        B, L, two, h, P, hd = past.shape
        if two != 2 or P > max_len:
            raise ValueError(f"past has shape {tuple(past.shape)}; axis 2 must be 2 and P={P} <= max_len={max_len}")
        cache = cls(L, B, h, max_len, hd, dtype=past.dtype, device=past.device)
        cache.k[:, :, :, :P] = past[:, :, 0].transpose(0, 1)
        cache.v[:, :, :, :P] = past[:, :, 1].transpose(0, 1)
        cache.length = P
        return cache
