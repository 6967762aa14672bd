"""Correct multi-head attention modules in several parameter layouts, written the way people write
them (test data for gpt2mha.check; each class must MATCH)."""

import torch
from torch import nn


class BookMultiHeadAttention(nn.Module):
    """The book's MultiHeadAttention (section 3.6.2), verbatim."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)
        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


class CausalAttention(nn.Module):
    """The book's single head (section 3.5)."""

    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        keys, queries, values = self.W_key(x), self.W_query(x), self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
        return attn_weights @ values


class BookWrapper(nn.Module):
    """The book's MultiHeadAttentionWrapper (listing 3.4)."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class HFStyleAttention(nn.Module):
    """q_proj/k_proj/v_proj/o_proj with biases, scaled q, F.scaled_dot_product_attention-free."""

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_states):
        b, t, _ = hidden_states.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2) * self.head_dim ** -0.5
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        w = q @ k.transpose(-1, -2)
        w = w.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        out = (w @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(out)


class FusedLinearAttention(nn.Module):
    """A fused qkv nn.Linear split into contiguous q | k | v blocks, SDPA core, returns (y, None)."""

    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.out_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).contiguous().view(b, t, c)), None


# ------------------------------------------------------------------ one correct module per cache convention
def _causal(q, k, v):
    """Softmax attention of T queries over S >= T keys, the queries being the last T positions
    (bottom-right aligned causal mask). q [b, h, T, hd], k/v [b, h, S, hd]."""
    T, S = q.shape[-2], k.shape[-2]
    hidden = torch.ones(T, S, dtype=torch.bool).triu(S - T + 1)
    w = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return w.masked_fill(hidden, float("-inf")).softmax(-1) @ v


class _HFBase(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx=0):
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx = num_heads, embed_dim // num_heads, layer_idx
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.o_proj = nn.Linear(embed_dim, embed_dim)

    def split(self, t):
        return t.view(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def merge(self, t):
        return self.o_proj(t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1))


class HFLegacyPastKeyValues(_HFBase):
    """transformers' legacy convention: ``past_key_values`` a (k, v) tuple, ``use_cache=True``
    returns the present (past and new keys/values together)."""

    def forward(self, hidden_states, past_key_values=None, use_cache=False):
        q, k, v = (self.split(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if past_key_values is not None:
            k, v = torch.cat([past_key_values[0], k], -2), torch.cat([past_key_values[1], v], -2)
        out = self.merge(_causal(q, k, v))
        return (out, (k, v)) if use_cache else (out, None)


class HFCacheObject(_HFBase):
    """transformers' Cache convention: ``past_key_values.update(k, v, layer_idx)`` stores the new
    keys/values in place and returns all of them; forward returns (output, attention weights)."""

    def forward(self, hidden_states, past_key_values=None, cache_position=None, **kwargs):
        q, k, v = (self.split(p(hidden_states)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx, {"cache_position": cache_position})
        return self.merge(_causal(q, k, v)), None


class InPlaceDictCache(_HFBase):
    """A dict ``kv_cache`` filled in place ({"k": ..., "v": ...}); forward returns the output only."""

    def forward(self, x, kv_cache=None):
        q, k, v = (self.split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if kv_cache is not None:
            if "k" in kv_cache:
                k, v = torch.cat([kv_cache["k"], k], -2), torch.cat([kv_cache["v"], v], -2)
            kv_cache["k"], kv_cache["v"] = k, v
        return self.merge(_causal(q, k, v))


class KVCache:
    """A preallocated cache (gpt-fast style): keys/values [b, h, max_seq_len, hd] and a fill count."""

    def __init__(self, max_batch_size, max_seq_len, n_heads, head_dim):
        self.k = torch.zeros(max_batch_size, n_heads, max_seq_len, head_dim)
        self.v = torch.zeros(max_batch_size, n_heads, max_seq_len, head_dim)
        self.length = 0

    def append(self, k, v):
        end = self.length + k.shape[-2]
        self.k[:, :, self.length:end], self.v[:, :, self.length:end] = k, v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class OwnCacheObject(_HFBase):
    """A ``cache: KVCache`` object of the file's own class, filled in place."""

    def forward(self, x, cache: "KVCache | None" = None):
        q, k, v = (self.split(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            k, v = cache.append(k, v)
        return self.merge(_causal(q, k, v))


class BookKVCache(nn.Module):
    """The book's KV-cache version of MultiHeadAttention (LLMs-from-scratch, ch04/03_kv-cache):
    ``use_cache=True`` keeps keys/values in the module (``cache_k``/``cache_v``) and a position
    pointer for the mask; forward returns the output only."""

    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.d_out, self.num_heads, self.head_dim = d_out, num_heads, d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1),
                             persistent=False)
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape
        keys_new = self.W_key(x).view(b, num_tokens, self.num_heads, self.head_dim)
        values_new = self.W_value(x).view(b, num_tokens, self.num_heads, self.head_dim)
        queries = self.W_query(x).view(b, num_tokens, self.num_heads, self.head_dim)
        if use_cache:
            if self.cache_k is None:
                self.cache_k, self.cache_v = keys_new, values_new
            else:
                self.cache_k = torch.cat([self.cache_k, keys_new], dim=1)
                self.cache_v = torch.cat([self.cache_v, values_new], dim=1)
            keys, values = self.cache_k, self.cache_v
        else:
            keys, values = keys_new, values_new
        keys, queries, values = keys.transpose(1, 2), queries.transpose(1, 2), values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        num_tokens_Q, num_tokens_K = queries.shape[-2], keys.shape[-2]
        if use_cache:
            mask_bool = self.mask.bool()[self.ptr_current_pos:self.ptr_current_pos + num_tokens_Q, :num_tokens_K]
            self.ptr_current_pos += num_tokens_Q
        else:
            mask_bool = self.mask.bool()[:num_tokens_Q, :num_tokens_K]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = self.dropout(torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1))
        context_vec = (attn_weights @ values).transpose(1, 2).contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0


class LlamaStartPos(nn.Module):
    """llama's convention: a cache preallocated in the module, written at ``start_pos`` (a
    required argument) on every call; no cache argument, no flag."""

    def __init__(self, d_model, n_heads, max_seq_len, max_batch_size=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, d_model, bias=False)
        self.wv = nn.Linear(d_model, d_model, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.cache_k = torch.zeros(max_batch_size, max_seq_len, n_heads, self.head_dim)
        self.cache_v = torch.zeros(max_batch_size, max_seq_len, n_heads, self.head_dim)

    def forward(self, x, start_pos: int):
        b, T, _ = x.shape
        q, k, v = (w(x).view(b, T, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        self.cache_k[:b, start_pos:start_pos + T] = k
        self.cache_v[:b, start_pos:start_pos + T] = v
        keys, values = self.cache_k[:b, :start_pos + T], self.cache_v[:b, :start_pos + T]
        out = _causal(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(b, T, -1))
