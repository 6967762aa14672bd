"""A NumPy-only reference of OpenAI's GPT-2 formulas: the test oracle, and a page to read.

Follows openai/gpt-2 ``src/model.py`` function by function, with NumPy in place
of TensorFlow: ``gelu``, ``norm``, ``split_states``/``merge_states``, ``conv1d``,
``attention_mask``, ``attn`` (with ``mask_attn_weights`` and ``multihead_attn``), ``mlp``,
``block`` and ``model`` (here :func:`gpt2_forward`). No torch import: this module shares no
code with the rest of gpt2mha, which is what makes it a useful oracle. Everything is
computed in float64.

Weights are GPT-2's Conv1D layout (``x @ w + b``, ``w [in, out]``) and names are those of a
gpt2mha / Hugging Face state dict (``wte.weight``, ``h.0.attn.c_attn.weight``, …, with or
without the ``transformer.`` prefix), as NumPy arrays.

Shapes: B = batch, T = new tokens, P = past tokens, S = P + T keys, C = n_embd,
h = n_head, hd = C // h, L = n_layer.
"""

from __future__ import annotations

import numpy as np


def gelu(x):
    """GPT-2's tanh approximation of GELU: ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def softmax(x, axis=-1):
    """Numerically stable softmax: subtract the row max, exponentiate, normalise."""
    x = x - np.max(x, axis=axis, keepdims=True)
    ex = np.exp(x)
    return ex / np.sum(ex, axis=axis, keepdims=True)


def norm(x, g, b, epsilon=1e-5):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * g + b`` (biased variance)."""
    u = np.mean(x, axis=-1, keepdims=True)
    s = np.mean(np.square(x - u), axis=-1, keepdims=True)
    return (x - u) / np.sqrt(s + epsilon) * g + b


def split_states(x, n):
    """Reshape the last axis into ``[n, m // n]``: ``[..., m]`` → ``[..., n, m // n]``."""
    *start, m = x.shape
    return x.reshape(*start, n, m // n)


def merge_states(x):
    """Smash the last two axes together: ``[..., a, b]`` → ``[..., a·b]``."""
    *start, a, b = x.shape
    return x.reshape(*start, a * b)


def split_heads(x, n_head):
    """``[B, T, C]`` → ``[B, h, T, hd]``: split_states, then move heads before the sequence axis."""
    return np.transpose(split_states(x, n_head), (0, 2, 1, 3))


def merge_heads(x):
    """``[B, h, T, hd]`` → ``[B, T, C]``; head i lands in columns ``i·hd … (i+1)·hd - 1``."""
    return merge_states(np.transpose(x, (0, 2, 1, 3)))


def conv1d(x, w, b):
    """GPT-2's "conv1d", a dense layer: ``x [..., in] @ w [in, out] + b [out]`` → ``[..., out]``."""
    return x @ w + b


def attention_mask(nd, ns, dtype=np.float64):
    """Causal mask ``m[i, j] = i >= j - ns + nd`` as ``[nd, ns]`` of 1s (may attend) and 0s.

    Aligned bottom-right: the ``nd`` queries are the last ``nd`` of the ``ns`` positions, so
    with a cache (ns > nd) every query sees all of the past plus its own prefix.
    """
    i = np.arange(nd)[:, None]
    j = np.arange(ns)
    return (i >= j - ns + nd).astype(dtype)


def mask_attn_weights(w):
    """Mask scores ``w [B, h, T, S]`` the official way: ``w·m - 1e10·(1 - m)``."""
    nd, ns = w.shape[-2:]
    m = attention_mask(nd, ns, dtype=w.dtype)
    return w * m - 1e10 * (1 - m)


def multihead_attn(q, k, v):
    """``q [B, h, T, hd]``, ``k, v [B, h, S, hd]`` → ``softmax(mask(q·kᵀ · rsqrt(hd))) · v`` ``[B, h, T, hd]``.

    The scale multiplies the scores (not q or k), as ``w * tf.rsqrt(v.shape[-1])`` does.
    """
    w = q @ np.swapaxes(k, -1, -2)                                   # [B, h, T, S]
    w = w * (1.0 / np.sqrt(v.shape[-1]))
    w = mask_attn_weights(w)
    w = softmax(w, axis=-1)
    return w @ v                                                     # [B, h, T, hd]


def attn(x, c_attn_w, c_attn_b, c_proj_w, c_proj_b, n_head, past=None):
    """GPT-2's attention sublayer.

    Args:
        x: ``[B, T, C_in]`` (ln_1's output; ``C_in = C`` in GPT-2).
        c_attn_w: ``[C_in, 3C]`` columns all q | all k | all v; c_attn_b: ``[3C]``.
        c_proj_w: ``[C, C]``; c_proj_b: ``[C]``.
        n_head: number of heads (must divide C).
        past: optional ``[B, 2, h, P, hd]`` keys/values of earlier tokens.

    Returns:
        ``(a [B, T, C], present [B, 2, h, T, hd])``; present holds the new tokens' keys and
        values only (stacked before the past is concatenated on the sequence axis).

    Raises:
        ValueError: C not divisible by n_head.
    """
    x = np.asarray(x, dtype=np.float64)
    C = c_attn_w.shape[-1] // 3
    if C % n_head:
        raise ValueError(f"n_embd={C} is not divisible by n_head={n_head}")
    c = conv1d(x, c_attn_w, c_attn_b)                                # [B, T, 3C]
    q, k, v = (split_heads(t, n_head) for t in np.split(c, 3, axis=-1))  # 3 × [B, h, T, hd]
    present = np.stack([k, v], axis=1)                               # [B, 2, h, T, hd]
    if past is not None:
        pk, pv = past[:, 0], past[:, 1]
        k = np.concatenate([pk, k], axis=-2)                         # [B, h, S, hd]
        v = np.concatenate([pv, v], axis=-2)
    a = merge_heads(multihead_attn(q, k, v))                         # [B, T, C]
    return conv1d(a, c_proj_w, c_proj_b), present


def mlp(x, c_fc_w, c_fc_b, c_proj_w, c_proj_b):
    """Feed-forward ``[B, T, C]`` → ``[B, T, C]``: ``conv1d(gelu(conv1d(x, c_fc)), c_proj)``."""
    return conv1d(gelu(conv1d(x, c_fc_w, c_fc_b)), c_proj_w, c_proj_b)


def block(x, p, prefix, n_head, past=None, epsilon=1e-5):
    """Pre-norm block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

    Args:
        x: ``[B, T, C]``; p: the parameter dict; prefix: e.g. ``"h.0."``.
        past: optional ``[B, 2, h, P, hd]`` for this layer.

    Returns:
        ``(x [B, T, C], present [B, 2, h, T, hd])``.
    """
    a, present = attn(norm(x, p[prefix + "ln_1.weight"], p[prefix + "ln_1.bias"], epsilon),
                      p[prefix + "attn.c_attn.weight"], p[prefix + "attn.c_attn.bias"],
                      p[prefix + "attn.c_proj.weight"], p[prefix + "attn.c_proj.bias"], n_head, past)
    x = x + a
    m = mlp(norm(x, p[prefix + "ln_2.weight"], p[prefix + "ln_2.bias"], epsilon),
            p[prefix + "mlp.c_fc.weight"], p[prefix + "mlp.c_fc.bias"],
            p[prefix + "mlp.c_proj.weight"], p[prefix + "mlp.c_proj.bias"])
    return x + m, present


def gpt2_forward(idx, params, n_head, past=None, epsilon=1e-5):
    """A whole GPT-2 forward pass (OpenAI's ``model``).

    Args:
        idx: token ids ``[B, T]``.
        params: ``{name: np.ndarray}`` in Conv1D layout (``wte.weight [n_vocab, C]``,
            ``wpe.weight [n_ctx, C]``, ``h.{i}.…``, ``ln_f.…``), ``transformer.`` prefix optional.
        n_head: heads per layer.
        past: optional ``[B, L, 2, h, P, hd]``; the new tokens sit at positions ``P … P+T-1``.

    Returns:
        ``(logits [B, T, n_vocab], present [B, L, 2, h, T, hd])``; the LM head is tied to wte
        (``logits = ln_f(h) @ wteᵀ``).
    """
    p = {k.removeprefix("transformer."): np.asarray(v, dtype=np.float64) for k, v in params.items()}
    idx = np.asarray(idx)
    n_layer = 1 + max(int(k.split(".")[1]) for k in p if k.startswith("h."))
    P = 0 if past is None else past.shape[-2]
    x = p["wte.weight"][idx] + p["wpe.weight"][np.arange(P, P + idx.shape[1])]  # [B, T, C]
    presents = []
    for i in range(n_layer):
        x, present = block(x, p, f"h.{i}.", n_head, None if past is None else np.asarray(past[:, i], np.float64),
                           epsilon)
        presents.append(present)
    x = norm(x, p["ln_f.weight"], p["ln_f.bias"], epsilon)
    return x @ p["wte.weight"].T, np.stack(presents, axis=1)        # [B, T, n_vocab], [B, L, 2, h, T, hd]
