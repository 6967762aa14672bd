"""Quantized checkpoints: what ``save_pretrained`` writes for a quantized model, and the checks
that run before any tensor of one is loaded.
"""

from __future__ import annotations

import torch

#: The format of a quantized checkpoint, recorded in config.json's "gpt2mha.quantization".
FORMAT_VERSION = 1


def state_to_save(model, dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], dict]:
    """A quantized model's tensors for ``model.safetensors`` and its ``config.json`` entry.

    The quantized buffers are stored as they are (int8 / uint8 nibbles / bf16 scales), the
    float tensors (LayerNorms, biases, wpe, an untied wte) in ``dtype``. A tied ``wte`` is not
    stored: it is the dequantized head, rebuilt on load.

    Returns:
        ``(tensors by state-dict name, {"scheme", "group_size", "head", "tied", "format"})``.
    """
    q = model.quantization
    tensors = {}
    quantized = {f"{path}.{name}" for path, m in model.named_modules() if isinstance(m, QuantizedLinear)
                 for name in ("weight", "scales", "scale_zero")}
    for k, v in model.state_dict().items():
        if k == "wte.weight" and q["tied"]:
            continue
        tensors[k] = v.detach().contiguous() if k in quantized else v.detach().to(dtype).contiguous()
    return tensors, {**q, "format": FORMAT_VERSION}


def read_scheme(entry, source: str) -> tuple[str, int | None, bool]:
    """``(scheme, group_size, tied)`` from config.json's quantization entry.

    Raises:
        QuantizationError: an entry this version cannot read (names the field).
    """
    if not isinstance(entry, dict):
        raise QuantizationError(f"{source}: gpt2mha.quantization must be an object, got {entry!r}")
    if entry.get("format") != FORMAT_VERSION or entry.get("head") != HEAD_SCHEME:
        raise QuantizationError(f"{source}: quantization format {entry.get('format')!r} with a {entry.get('head')!r} "
                                f"head; this gpt2mha reads format {FORMAT_VERSION} with an {HEAD_SCHEME} head")
    try:
        check_scheme(entry.get("scheme"), entry.get("group_size"))
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    if entry.get("method", "rtn") not in METHODS:
        raise QuantizationError(f"{source}: quantization method {entry.get('method')!r} is unknown; expected one of "
                                f"{METHODS}")
    return entry["scheme"], entry["group_size"], bool(entry.get("tied", True))


def check_state(model, sd: dict[str, torch.Tensor], source: str, tied: bool) -> None:
    """Compare a quantized checkpoint's tensors with the (quantized, empty) ``model`` before
    anything is copied: names, shapes, exact dtypes of the quantized buffers, finite float
    tensors, and scales that are finite and > 0.

    Raises:
        QuantizationError: listing every problem, e.g. ``h.0.mlp.c_fc.scales: corrupted scale
            tensor: 3 values are NaN, inf or <= 0`` or ``h.0.attn.c_attn.scale_zero has shape
            [24, 576, 2]: group size 32, but config.json says group_size=64``.
    """
    expected = {k: v for k, v in model.state_dict().items() if not (tied and k == "wte.weight")}
    problems = [f"missing tensor {k} {list(v.shape)}" for k, v in expected.items() if k not in sd]
    problems += [f"unexpected tensor {k} {list(v.shape)}" for k, v in sd.items() if k not in expected]
    group_size = model.quantization["group_size"]
    for k, t in sd.items():
        if k not in expected:
            continue
        e = expected[k]
        if k.endswith(".scale_zero") and t.dim() == 3 and t.shape[1:] == e.shape[1:] and t.shape != e.shape:
            n_in = e.shape[0] * group_size
            problems.append(f"{k} has shape {list(t.shape)}: group size {n_in / t.shape[0]:g}, but config.json says "
                            f"group_size={group_size} (mismatched group size)")
        elif t.shape != e.shape:
            problems.append(f"{k}: checkpoint shape {list(t.shape)} != model shape {list(e.shape)}")
        elif k.endswith((".scales", ".scale_zero")) or not e.is_floating_point():
            if t.dtype != e.dtype:
                problems.append(f"{k}: dtype {t.dtype}, expected {e.dtype}")
            elif k.endswith(".scales") and not ((t > 0) & torch.isfinite(t)).all():
                bad = int((~((t > 0) & torch.isfinite(t))).sum())
                problems.append(f"{k}: corrupted scale tensor: {bad} value(s) are NaN, inf or <= 0")
            elif k.endswith(".scale_zero") and not (torch.isfinite(t).all() and (t[..., 0] > 0).all()):
                bad = int((~torch.isfinite(t)).any(-1).sum() + (t[..., 0] <= 0).sum())
                problems.append(f"{k}: corrupted scale tensor: {bad} scale/zero pair(s) are NaN, inf or have scale <= 0")
        elif not t.is_floating_point():
            problems.append(f"{k}: dtype {t.dtype} is not a floating-point type")
        elif not torch.isfinite(t).all():
            problems.append(f"{k}: contains NaN or inf values")
    if problems:
        raise QuantizationError(f"{source}: cannot load the quantized checkpoint:\n  " + "\n  ".join(problems))


def load_state(model, entry, sd: dict[str, torch.Tensor], source: str, dtype: torch.dtype):
    """Build a quantized model from a checkpoint: ``model`` is the float model on the meta
    device; every tensor is checked (:func:`check_state`) before any is copied, so a bad file
    never yields a half-loaded model.

    Returns:
        The quantized model on the CPU, float tensors in ``dtype``, in eval mode.

    Raises:
        QuantizationError: see :func:`read_scheme`, :func:`check_state`.
    """
    scheme, group_size, tied = read_scheme(entry, source)
    try:
        check_scheme(scheme, group_size, model.config.n_embd)
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    with torch.device("meta"):
        install(model, quantized_layers(model, scheme, group_size), scheme, group_size, tied)
    check_state(model, sd, source, tied)
    model = model.to_empty(device="cpu")
    quantized = {k for k, v in model.state_dict().items() if not v.is_floating_point() or
                 k.endswith((".scales", ".scale_zero"))}
    with torch.no_grad():
        model.load_state_dict({k: v if k in quantized else v.to(torch.float32) for k, v in sd.items()}, strict=False)
        if tied:
            model.wte.weight.copy_(model.lm_head.dequantized())
    model.quantization["method"] = entry.get("method", "rtn")
    return model.to(dtype).eval()
