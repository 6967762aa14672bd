"""Argument checks, written once and used at every boundary (the model's ``forward``,
``generate``, the serving scheduler, the CLI, the book's classes).

Each check raises ``ValueError`` naming the argument, the value and what was expected
(``n_embd=10 is not divisible by n_head=4``), before any work is done, so a bad input never
surfaces as a shape error from deep inside torch or as silent wrong output. Inside the model's
own loops nothing is checked again.
"""

from __future__ import annotations

import numbers
import operator

import torch


def as_int(value, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int (numpy and 0-d torch integers too).

    Raises:
        ValueError: a bool, a float (even 3.0) or anything not an integer, or below ``minimum``.
    """
    if isinstance(value, (bool, float)) or (isinstance(value, torch.Tensor) and value.is_floating_point()):
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}; got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be an integer >= {minimum}")
    return value


def positive_ints(**sizes) -> None:
    """Raises ValueError unless every keyword is a positive int (not a bool), naming the first that is not."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")


def divisible(n_embd: int, n_head: int, names: tuple[str, str] = ("n_embd", "n_head")) -> None:
    """Raises ValueError unless the width splits into heads: ``n_embd % n_head == 0``."""
    if n_embd % n_head:
        raise ValueError(f"{names[0]}={n_embd} is not divisible by {names[1]}={n_head}")


def dropout_p(**probs) -> None:
    """Raises ValueError unless every keyword is a number in ``[0, 1)``."""
    for name, value in probs.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
            raise ValueError(f"{name}={value!r} must be a number in [0, 1)")


def seed(value) -> int | None:
    """A generator seed: None, or an integer in ``[0, 2**63)``."""
    if value is None:
        return None
    value = as_int(value, "seed")
    if value >= 2**63:
        raise ValueError(f"seed={value} must be an integer in [0, 2**63)")
    return value


def bool_mask(mask: torch.Tensor | None, name: str = "attn_mask") -> torch.Tensor | None:
    """A mask given as bool, or as an integer/float tensor of 0/1 values, as a BoolTensor
    (True = may attend / real token), so a float 0/1 mask can never reach SDPA as an additive bias.

    Raises:
        ValueError: not a tensor, or a non-bool mask holding a value other than 0 and 1
            (naming ``name`` and the offending value).
    """
    if mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
        return mask
    if not isinstance(mask, torch.Tensor) or mask.is_complex():
        raise ValueError(f"{name} must be a bool tensor or a tensor of 0/1 values; got {type(mask).__name__}"
                         + (f" of dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else ""))
    bad = mask[(mask != 0) & (mask != 1)]
    if bad.numel():
        raise ValueError(f"{name} must be bool or hold only 0 (masked/pad) and 1 (attend/real) values; "
                         f"got the value {bad.flatten()[0].item()!r} (dtype {mask.dtype})")
    return mask != 0


def device(t: torch.Tensor, name: str, expected) -> None:
    """A tensor argument must be on the model's device (a CPU tensor for a CUDA model, or a
    ``meta`` tensor, would otherwise fail deep inside torch).

    Raises:
        ValueError: naming the argument, both devices and the fix.
    """
    if t.device != torch.device(expected):
        raise ValueError(f"{name} is on {t.device} but the model is on {expected}; move it with "
                         f"{name}.to({str(expected)!r})")


def token_ids(idx, n_vocab: int, name: str = "idx", on=None, one: str = "sequence") -> None:
    """Token ids ``[B, T]``: an int64/int32 tensor (on device ``on`` when given), B, T >= 1,
    every id in ``[0, n_vocab)``. ``one`` names a row in the hint for a 1-D tensor.

    Raises:
        ValueError: text or another type, a float/uint8/bool dtype, a rank other than 2, another
            device, an empty batch or sequence, or an id outside the vocabulary (naming it).
    """
    if not isinstance(idx, torch.Tensor):
        raise ValueError(f"{name} must be a tensor of token ids [B, T] (int64); got {type(idx).__name__}"
                         + ("; encode text first, e.g. get_tokenizer(model.config.tokenizer).encode(text)"
                            if isinstance(idx, str) else ""))
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold token ids as int64 (or int32); got dtype {idx.dtype}"
                         + (" (uint8 reads as bytes 0-255 but is not accepted as ids: use idx.long())"
                            if idx.dtype == torch.uint8 else ""))
    if idx.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(idx.shape)}; expected [B, T]"
                         + (f" (one {one}: {name}[None])" if idx.dim() == 1 else ""))
    if on is not None:
        device(idx, name, on)
    B, T = idx.shape
    if T == 0 or B == 0:
        raise ValueError(f"{name} has shape {(B, T)}; need at least one sequence and one token")
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n_vocab:
        raise ValueError(f"{name} contains token id {lo if lo < 0 else hi}, outside the vocabulary: expected token ids "
                         f"in [0, n_vocab={n_vocab})")


def like_idx(t, name: str, idx: torch.Tensor, shapes: tuple[tuple, ...], integer: bool) -> torch.Tensor:
    """A tensor argument that goes with ``idx``: one of ``shapes``, on idx's device, integer
    (``integer``) or bool/0-1 (otherwise).

    Raises:
        ValueError: not a tensor, another device, another shape, or the wrong kind of values.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor {list(shapes[0])} of "
                         + ("int64 positions" if integer else "1 (real) / 0 (pad)") + f"; got {type(t).__name__}")
    if integer and t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must hold positions as int64 (or int32); got dtype {t.dtype}"
                         + (" (use .long())" if t.dtype != torch.bool else ""))
    if tuple(t.shape) not in shapes:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected " + " or ".join(str(list(s)) for s in shapes))
    device(t, name, idx.device)
    return t if integer else bool_mask(t, name)


def past(past, batch: int | None, n_layer: int, n_head: int, head_dim: int, on=None) -> None:
    """OpenAI's ``past [B, n_layer, 2, n_head, P, head_dim]``, floating point, on device ``on``.

    Raises:
        ValueError: not a floating tensor, the wrong rank, or a size that does not match the
            model or the batch (naming it).
    """
    if not isinstance(past, torch.Tensor) or not past.is_floating_point():
        raise ValueError(f"past must be a floating-point tensor [B, n_layer, 2, n_head, P, head_dim]; got "
                         f"{past.dtype if isinstance(past, torch.Tensor) else type(past).__name__}")
    if past.dim() != 6:
        raise ValueError(f"past has shape {tuple(past.shape)}; expected [B, n_layer, 2, n_head, P, head_dim]")
    expected = (batch, n_layer, 2, n_head, None, head_dim)
    names = ("batch", "n_layer", "2 (k, v)", "n_head", "P", "head_dim")
    for label, e, s in zip(names, expected, past.shape):
        if e is not None and e != s:
            raise ValueError(f"past has shape {tuple(past.shape)}: {label} is {s}, expected {e} "
                             f"([B={batch}, n_layer={n_layer}, 2, n_head={n_head}, P, head_dim={head_dim}])")
    if on is not None:
        device(past, "past", on)


def layer_past(past, x: torch.Tensor, n_head: int, head_dim: int) -> None:
    """One layer's ``past [B, 2, n_head, P, head_dim]`` for input ``x [B, T, ·]``.

    Raises:
        ValueError: not floating point, or a size that does not match x or the module.
    """
    if not isinstance(past, torch.Tensor) or not past.is_floating_point():
        raise ValueError(f"past must be a floating-point tensor of cached keys/values; got "
                         f"{past.dtype if isinstance(past, torch.Tensor) else type(past).__name__}")
    expected = (x.shape[0], 2, n_head, None, head_dim)
    if past.dim() != 5 or any(e is not None and e != s for e, s in zip(expected, past.shape)):
        raise ValueError(f"past has shape {tuple(past.shape)}; expected "
                         f"[B={x.shape[0]}, 2, n_head={n_head}, P, head_dim={head_dim}]")


def flag(value, name: str) -> bool:
    """A True/False argument (not 1, "yes" or None).

    Raises:
        ValueError: naming it.
    """
    if value is not True and value is not False:
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def hidden(x, n_embd: int, name: str = "x") -> None:
    """Hidden states ``[B, T, n_embd]`` with T >= 1.

    Raises:
        ValueError: another rank, width or an empty sequence.
    """
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != n_embd or x.shape[1] == 0:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} has shape {shape}; expected [B, T, n_embd={n_embd}] with T >= 1")
