"""Exact prefix caching: a prompt that starts with token blocks an earlier prompt computed takes
their keys and values from a store instead of computing them again, and only its suffix is
prefilled (against those keys), with the same bits as a whole-prompt prefill.

The store is keyed by blocks of :data:`BLOCK` tokens, vLLM-style: a block's key is its parent
block's id and its own tokens (a tuple, compared by equality: no hash can collide), so a chain of
keys names a prefix exactly. Block hashes fit this engine's KV cache better than SGLang's radix
tree: every slot's row holds its sequence contiguously from cache index 0 (no pages to share), so
a hit is a copy of whole blocks into the slot's row, and a flat ``{key: block}`` map with an LRU
order is all the lookup needs. Blocks are copies: a sequence cancelled or finished while its
blocks are in the store changes nothing there.

Exactness: the suffix's rows must get the bits they get in a whole-prompt prefill. That holds
where every product and the attention give a prompt row the bits it has alone, whatever the
prompt's length and offset: the native forward's float32, fp16, int8 per_row and int4 per_block
kinds, and bf16 on CPUs with AVX-512 BF16 (without it a bf16 prompt of 32 rows or more takes
oneDNN's GEMM, which blocks rows by the prompt's length). A suffix of one token would run as a
decode step (another attention and product path), so at least :data:`MIN_SUFFIX` tokens are
always prefilled. The decode view's products are not row-alone over prompts (MKL's float32 GEMM
and the int8/int4 dequantized products block rows by count), nor is the compiled step batch
invariant: there the cache is off (:func:`why_inexact`). docs/explanation/prefix-caching.md has
the measurements.

Scored prompts (``echo`` with ``logprobs``) keep their blocks under a root of their own
(:meth:`PrefixCache.root`): computed by the scoring forward
(:class:`~gpt2mha.inference.scoring.Scorer`), with each position's hidden state and the
entries of the block's tokens (:class:`Block`). :meth:`PrefixCache.bind` empties the store
when what computes its blocks changes (the model's weights, the route, the cache's dtype).

Source: vLLM's automatic prefix caching (block hashes chained by parent, LRU eviction of free
blocks); SGLang's RadixAttention for the alternative.
"""

from __future__ import annotations

import collections
import itertools

import torch

#: Tokens a block holds (vLLM's default block size).
BLOCK = 16
#: Tokens of a prompt always prefilled (a one-token suffix would run the decode step's path).
MIN_SUFFIX = 2
#: The default budget's share of the memory available at start, and its ceiling in MiB.
DEFAULT_SHARE, DEFAULT_CEILING_MB = 0.1, 1024


def default_budget_mb() -> int:
    """The default budget: a tenth of the memory available now (``MemAvailable`` of
    ``/proc/meminfo``), at most :data:`DEFAULT_CEILING_MB` MiB (64 MiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 64
    return max(1, min(DEFAULT_CEILING_MB, int(kb / 1024 * DEFAULT_SHARE)))


def why_inexact(decoder) -> str:
    """Why a suffix prefilled on ``decoder`` against cached keys may not have the bits of a
    whole-prompt prefill ("" where it has them: the native forward's kinds above)."""
    from .decoders import NATIVE
    from .dense import has_bf16_dot
    if decoder.name != NATIVE:
        return (f"the {decoder.name}'s prompt products block rows by the prompt's length (a suffix's rows "
                "would differ from a whole prompt's in the last bits)")
    if decoder.native.prefill is None or decoder.native.prefill_from > MIN_SUFFIX:
        return "the native forward does not run every prompt (short ones take the model's own products)"
    if decoder.native.kind == "bf16" and not has_bf16_dot():
        return "a bf16 prompt of 32 rows or more takes oneDNN's GEMM on CPUs without AVX-512 BF16 (rows blocked by count)"
    return ""


class Block:
    """One stored block: its ``id`` (a child's key names it as its parent), its keys and values
    ``k``, ``v`` ``[n_layer, n_head, BLOCK, head_dim]`` and, for a scored prompt's block
    (:meth:`PrefixCache.load` with a scoring root), ``hidden`` ``[BLOCK, n_embd]``: each
    position's final hidden state (``ln_f``'s output), and ``rows``: ``{k: entries}``, the
    :meth:`~gpt2mha.inference.engine.Engine.score` entries of the block's own tokens (the
    log-probability of each after the tokens before it and the k most probable ids there; None
    for a prompt's first token), kept per k asked."""

    __slots__ = ("id", "k", "v", "hidden", "rows", "nbytes")

    def __init__(self, id_: int, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None = None):
        self.id, self.k, self.v, self.hidden, self.rows = id_, k, v, hidden, {}
        self.nbytes = sum(t.numel() * t.element_size() for t in (k, v, *(() if hidden is None else (hidden,))))


#: Bytes a stored score entry is counted as (a float and k (id, float) pairs as Python objects).
ENTRY_BYTES = 64


class PrefixCache:
    """Blocks of keys and values by exact prefix, least recently used evicted past a budget.

    A block's key is ``(parent, tokens)``: the id of the block before it, or for a prompt's
    first block the root of its kind of computation (0: a prefill; :meth:`root` gives others,
    the scoring forward's), and its 16 tokens. Every block was computed by one model in one
    state: :meth:`bind` empties the store when the engine's model, route or cache dtype differ
    from those its blocks were computed by (a weight edited in place, ``model.quantize``,
    another dtype).

    Args:
        budget_mb: the most MiB the stored blocks take (each block ``2 · n_layer · BLOCK · n_embd``
            values of the cache's dtype, a scored block also its ``BLOCK · n_embd`` hidden
            states and its entries); > 0.

    Attributes:
        queries: prompt tokens looked up (vLLM's ``prefix_cache_queries``).
        hits: of those, tokens served from the store (``prefix_cache_hits``).
        evictions: blocks evicted.
        flushes: times :meth:`bind` emptied the store.

    Raises:
        ValueError: a budget that is not a positive number.
    """

    def __init__(self, budget_mb: float):
        if isinstance(budget_mb, bool) or not isinstance(budget_mb, (int, float)) or not budget_mb > 0:
            raise ValueError(f"budget_mb={budget_mb!r} must be a positive number of MiB")
        self.budget = int(budget_mb * 2**20)
        self.used = 0
        self.blocks: collections.OrderedDict[tuple, Block] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._roots: dict = {}
        self.owner = None
        self.queries = self.hits = self.evictions = self.flushes = 0

    def root(self, name) -> int:
        """The parent id of the first blocks of prompts computed as ``name`` (any hashable; a
        new negative id the first time): chains of another computation than a prefill's (0)."""
        return self._roots.setdefault(name, -1 - len(self._roots))

    def bind(self, owner) -> None:
        """Say what computes the blocks now (a comparable value: the engine's model signature,
        route and cache dtype); if it is not what computed the stored ones, empty the store."""
        if owner != self.owner:
            if self.blocks:
                self.blocks.clear()
                self.used = 0
                self.flushes += 1
            self.owner = owner

    def _keys(self, prompt: list[int], root: int):
        # (key, start, block or None) of each whole block of prompt, while the chain is in the store
        parent = root
        for start in range(0, len(prompt) - BLOCK + 1, BLOCK):
            key = (parent, tuple(prompt[start:start + BLOCK]))
            found = self.blocks.get(key)
            yield key, start, found
            if found is None:
                return
            parent = found.id

    def load(self, prompt: list[int], cache, root: int = 0, keep: int = MIN_SUFFIX) -> list[Block]:
        """Copy the longest stored prefix of ``prompt`` (whole blocks of the chain from ``root``,
        leaving at least ``keep`` tokens to compute) into the one-row ``cache`` (empty: a
        ``KVCache.row``) from index 0, advance it, and count the query. Returns the blocks
        loaded (``len · BLOCK`` tokens; none: [])."""
        usable = (len(prompt) - keep) // BLOCK
        found = []
        for key, start, block in self._keys(prompt, root):
            if block is None or len(found) == usable:
                break
            found.append((key, block))
        self.queries += len(prompt)
        if not found:
            return []
        for i, (_, block) in enumerate(found):                  # each [n_layer, n_head, BLOCK, head_dim]
            cache.k[:, 0, :, i * BLOCK:(i + 1) * BLOCK] = block.k
            cache.v[:, 0, :, i * BLOCK:(i + 1) * BLOCK] = block.v
        n = len(found) * BLOCK
        cache.advance(n)
        for key, _ in reversed(found):                          # parents stay more recent than children
            self.blocks.move_to_end(key)
        self.hits += n
        return [block for _, block in found]

    def store(self, prompt: list[int], cache, root: int = 0, hidden: torch.Tensor | None = None,
              rows: tuple[int, list] | None = None) -> None:
        """Keep the whole blocks of ``prompt`` (computed in the one-row ``cache``) that the store
        lacks, then evict the least recently used blocks past the budget. A scored prompt's
        blocks (``root`` a scoring root) also keep ``hidden[start:start + BLOCK]`` (``hidden``
        ``[T, n_embd]``: every position's) and, with ``rows = (k, entries)`` (one entry per
        token of the prompt), their tokens' entries for k (added to stored blocks lacking them)."""
        parent, new = root, []
        for start in range(0, min(len(prompt), cache.lengths[0]) - BLOCK + 1, BLOCK):
            key = (parent, tuple(prompt[start:start + BLOCK]))
            block = self.blocks.get(key)
            if block is None:
                k = cache.k[:, 0, :, start:start + BLOCK].clone()
                v = cache.v[:, 0, :, start:start + BLOCK].clone()
                h = None if hidden is None else hidden[start:start + BLOCK].clone()
                block = self.blocks[key] = Block(next(self._ids), k, v, h)
                self.used += block.nbytes
            if rows is not None and rows[0] not in block.rows:
                block.rows[rows[0]] = rows[1][start:start + BLOCK]
                more = BLOCK * (rows[0] + 2) * ENTRY_BYTES
                block.nbytes += more
                self.used += more
            new.append(key)
            parent = block.id
        for key in reversed(new):
            self.blocks.move_to_end(key)
        while self.used > self.budget and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.used -= block.nbytes
            self.evictions += 1

    def stats(self) -> dict:
        """``{"queries", "hits", "blocks", "used_mb", "evictions", "flushes"}`` now."""
        return {"queries": self.queries, "hits": self.hits, "blocks": len(self.blocks),
                "used_mb": round(self.used / 2**20, 3), "evictions": self.evictions, "flushes": self.flushes}
