"""Prompts as :func:`~gpt2mha.inference.generate.generate` and the scheduler take them: token
lists, tensors or arrays checked into lists of Python ints (:func:`as_prompts`), laid out
left-padded in a batch (:func:`left_pad`) and read back without the padding
(:func:`strip_padding`, :func:`decode_rows`), and checked against the context
(:func:`check_fits`)."""

from __future__ import annotations

import torch

from ..core import checks


def as_prompts(idx) -> list[list[int]]:
    """Prompts given as a list of token lists, 1-D tensors, ``[1, T]`` tensors or numpy arrays →
    lists of Python ints.

    Raises:
        ValueError: naming the prompt and the value when an id is not an integer (``1.7``
            would otherwise be truncated to 1 silently) or a prompt is not 1-D.
    """
    prompts = []
    for i, p in enumerate(idx):
        if isinstance(p, torch.Tensor) or hasattr(p, "__array__"):
            t = torch.as_tensor(p)
            if t.dim() == 2 and t.shape[0] == 1:
                t = t[0]
            if t.dim() != 1:
                raise ValueError(f"prompts[{i}] has shape {tuple(t.shape)}; expected a 1-D (or [1, T]) list of token ids")
            if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
                raise ValueError(f"prompts[{i}] holds {t.dtype} values; token ids must be integers")
            prompts.append(t.tolist())
            continue
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise ValueError(f"prompts[{i}]={p!r} is not a list of token ids (encode text with the tokenizer first)")
        ids = []
        for j, v in enumerate(p):
            try:
                ids.append(checks.as_int(v, f"prompts[{i}][{j}]"))
            except ValueError:
                raise ValueError(f"prompts[{i}][{j}]={v!r} is not a token id; ids must be integers >= 0") from None
        prompts.append(ids)
    return prompts


def left_pad(prompts: list[list[int]], pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists of different lengths into a batch.

    Returns:
        ``idx [B, T_max]`` (int64) with ``pad_token_id`` on the left of shorter rows and
        ``attention_mask [B, T_max]`` (1 real, 0 pad), so every row's last token is at the end.

    Raises:
        ValueError: no prompts, or an empty prompt (naming its index).
    """
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        idx[i, T - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, T - len(p):] = 1
    return idx, mask


def strip_padding(out: torch.Tensor, prompts=None, *, attention_mask: torch.Tensor | None = None,
                  new_only: bool = False, eos_token_id: int | None = None) -> list[list[int]]:
    """Each row of a batch :func:`generate` returned, as a list of token ids without its left
    padding: the prompt followed by the new tokens (or, with ``new_only``, the new tokens alone).

    The pad id (0) is also a real token (the NUL byte, GPT-2's ``!``), so pads cannot be told
    from tokens by value: say where each prompt starts with the prompts themselves or the mask.

    Args:
        out: ``[B, T + N]`` ids from ``generate`` (T the padded prompt width, N new tokens).
        prompts: the prompts given to ``generate`` (token lists, tensors, arrays), for their
            lengths; row i's prompt is its last ``len(prompts[i])`` columns of the first T.
        attention_mask: instead of ``prompts``, ``[B, T]`` of 1 (real) / 0 (pad) over the
            prompt columns, as :func:`left_pad` returns it. Neither: no padding, T unknown
            (then ``new_only`` is an error).
        new_only: return only the N new tokens of each row.
        eos_token_id: cut each row after the first of its new tokens equal to it (a finished
            row repeats it), keeping that one.

    Returns:
        ``B`` lists of Python ints.

    Raises:
        ValueError: both or (with ``new_only``) neither of prompts / attention_mask, a count
            or shape that does not fit ``out``.
    """
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError(f"out must be the [B, T + N] ids generate returned; got "
                         f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
    if prompts is not None and attention_mask is not None:
        raise ValueError("pass prompts or attention_mask, not both")
    B, total = out.shape
    if prompts is not None:
        lengths = [len(p) for p in as_prompts(prompts)]
        if len(lengths) != B:
            raise ValueError(f"prompts has {len(lengths)} prompts for {B} rows of out")
        T = max(lengths)
        starts = [T - n for n in lengths]
    elif attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or \
                attention_mask.shape[0] != B or attention_mask.shape[1] > total:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask has shape {shape}; expected [B={B}, T_mask <= {total}] over the "
                             f"prompt columns")
        T = attention_mask.shape[1]
        keep = checks.bool_mask(attention_mask, "attention_mask").cpu()
        starts = None
    elif new_only:
        raise ValueError("new_only needs prompts or attention_mask, to know where each prompt ends")
    else:
        T, starts = total, [0] * B
    if T > total:
        raise ValueError(f"the prompts are {T} tokens wide but out has {total} columns")
    ids = out.tolist()
    rows = []
    for i, row in enumerate(ids):
        new = row[T:]
        if eos_token_id is not None and eos_token_id in new:
            new = new[:new.index(eos_token_id) + 1]
        if new_only:
            rows.append(new)
        elif starts is not None:
            rows.append(row[starts[i]:T] + new)
        else:
            rows.append([t for t, k in zip(row[:T], keep[i].tolist()) if k] + new)
    return rows


def decode_rows(tokenizer, ids, attention_mask=None, eos_token_id: int | None = None) -> list[str]:
    """Text of each row of ``ids [B, T]`` (e.g. ``generate``'s output) without its left padding.

    Args:
        ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T_mask]`` with ``T_mask <= T``, 1 for real tokens and 0 for pads
            over the first ``T_mask`` columns (the padded prompts, as :func:`left_pad`
            returns it); the columns after it (generated tokens) are all real. None: no padding.
        eos_token_id: end each row at the first generated token equal to it (kept).

    Raises:
        ValueError: ``attention_mask`` rows or columns that do not fit ``ids``
            (:func:`strip_padding`).
    """
    return [tokenizer.decode(row) for row in strip_padding(ids, attention_mask=attention_mask,
                                                           eos_token_id=eos_token_id)]


def prompt_batch(idx, attention_mask, n_vocab: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompts of :func:`generate` as one checked batch ``(idx [B, T], mask [B, T] or None)``:
    a list of prompts is left-padded (:func:`left_pad`), a tensor is checked with its mask.

    Raises:
        ValueError: text instead of ids, ids that are not integers or outside the vocabulary,
            an empty prompt, a mask given with lists, a mask of the wrong shape or with values
            other than 0/1, or a row that ends in padding.
    """
    if isinstance(idx, str):
        raise ValueError(f"idx={idx[:40]!r} is text; generate takes token ids: encode it first, e.g. "
                         f"torch.tensor([get_tokenizer(model.config.tokenizer).encode(text)])")
    if isinstance(idx, (list, tuple)):
        if attention_mask is not None:
            raise ValueError("attention_mask is built from the lists; pass it only with a padded tensor")
        idx, attention_mask = left_pad(as_prompts(idx))
        idx, attention_mask = idx.to(device), attention_mask.to(device)
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"idx must be a [B, T] tensor of token ids or a list of prompts; got {type(idx).__name__}")
    if idx.dim() == 2 and 0 in idx.shape:
        raise ValueError(f"idx has shape {tuple(idx.shape)}; an empty prompt cannot be continued")
    checks.token_ids(idx, n_vocab, on=device, one="prompt")
    if attention_mask is None:
        return idx, None
    mask = checks.like_idx(attention_mask, "attention_mask", idx, (tuple(idx.shape),), integer=False)
    if not bool(mask[:, -1].all()):
        rows = torch.nonzero(~mask[:, -1]).flatten().tolist()
        raise ValueError(f"attention_mask: rows {rows} end in padding; generation needs left padding "
                         f"(pads first, every row's last token real)")
    return idx, mask.long()


def check_fits(T: int, max_new_tokens: int, n_ctx: int, sliding_window: bool = False) -> None:
    """Raises ValueError (naming the sizes and the ways out) when a prompt of ``T`` tokens and
    ``max_new_tokens`` more do not fit in ``n_ctx`` positions without ``sliding_window``."""
    if T + max_new_tokens > n_ctx and not sliding_window:
        raise ValueError(f"prompt of {T} tokens + max_new_tokens={max_new_tokens} = {T + max_new_tokens} > "
                         f"n_ctx={n_ctx}; shorten the prompt, lower max_new_tokens, or use sliding_window=True "
                         f"(CLI: --sliding-window)")
