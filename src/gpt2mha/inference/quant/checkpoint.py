"""Quantized checkpoints: what ``save_pretrained`` writes for a quantized model, and the checks
that run before any tensor of one is loaded.

Format 2 stores the quantized head as ``lm_head.*`` (the module it is); format 1 (gpt2mha before
the package was split) stored it as ``quantized_head.*`` and is still read.
"""

from __future__ import annotations

import math

import torch

from ...io.checkpoints import QuantizedFormat, register_quantized_format
from .linear import DEFAULT_ACTIVATIONS, QuantizedLinear, check_head, check_scheme, layer_class
from .model import BLOCK_LINEARS, check_activations, head_group, install, quantized_layers, set_activations
from .schemes import HEAD_SCHEME, KERNEL_DTYPE, METHODS, QuantizationError
from .tables import HEAD_SCHEMES

#: The format of a quantized checkpoint, recorded in config.json's "gpt2mha.quantization".
FORMAT_VERSION = 2
#: Formats this version reads (1: the head stored as ``quantized_head.*``).
READABLE_FORMATS = (1, 2)


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
                 for name in m.quantized_buffers()}
    for k, v in model.state_dict().items():
        if k == "wte.weight" and q["tied"]:
            continue
        tensors[k] = v.detach().contiguous() if k in quantized else v.detach().to(dtype).contiguous()
    entry = {k: v for k, v in q.items() if k != "activations" or v != DEFAULT_ACTIVATIONS}   # readable by older versions
    return tensors, {**entry, "format": FORMAT_VERSION}


#: The fields of config.json's quantization entry and their JSON types ("method" may be absent:
#: checkpoints saved before GPTQ existed were rounded to nearest; "activations" is absent for
#: the default "exact").
ENTRY_FIELDS = {"scheme": "string", "group_size": "integer or null", "head": "string", "tied": "boolean",
                "format": "integer", "method": "string", "activations": "string"}
OPTIONAL_FIELDS = ("method", "activations")


def _json_type_ok(value, kind: str) -> bool:
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    integer = isinstance(value, int) and not isinstance(value, bool)
    return integer or (kind == "integer or null" and value is None)


def read_scheme(entry, source: str) -> tuple[str, int | None, bool, str]:
    """``(scheme, group_size, tied, head)`` from config.json's quantization entry.

    Every field is type-checked as JSON writes it (:data:`ENTRY_FIELDS`): ``"tied": "false"``
    (a string) or ``"group_size": 32.0`` is refused, never read as something else; an unknown
    field is refused too (a newer writer's checkpoint).

    Raises:
        QuantizationError: an entry this version cannot read (names the field and its value).
    """
    if not isinstance(entry, dict):
        raise QuantizationError(f"{source}: gpt2mha.quantization must be an object, got {entry!r}")
    problems = [f"{k}={entry[k]!r} must be a JSON {kind}" for k, kind in ENTRY_FIELDS.items()
                if k in entry and not _json_type_ok(entry[k], kind)]
    problems += [f"missing field {k!r} ({kind})" for k, kind in ENTRY_FIELDS.items()
                 if k not in entry and k not in OPTIONAL_FIELDS]
    problems += [f"unknown field {k!r}" for k in entry if k not in ENTRY_FIELDS]
    if problems:
        raise QuantizationError(f"{source}: gpt2mha.quantization: " + "; ".join(problems)
                                + f" (expected {', '.join(f'{k}: {v}' for k, v in ENTRY_FIELDS.items())})")
    if entry["format"] not in READABLE_FORMATS or entry["head"] not in HEAD_SCHEMES:
        raise QuantizationError(f"{source}: quantization format {entry['format']!r} with a {entry['head']!r} "
                                f"head; this gpt2mha reads formats {READABLE_FORMATS} with a head in {HEAD_SCHEMES}")
    try:
        check_head(entry["head"], entry["scheme"])              # first: its message names the head
        check_scheme(entry["scheme"], entry["group_size"])
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    if entry.get("method", "rtn") not in METHODS:
        raise QuantizationError(f"{source}: quantization method {entry.get('method')!r} is unknown; expected one of "
                                f"{METHODS}")
    try:
        check_activations(entry.get("activations", DEFAULT_ACTIVATIONS), entry["scheme"])
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    return entry["scheme"], entry["group_size"], entry["tied"], entry["head"]


def check_state(model, sd: dict[str, torch.Tensor], source: str, tied: bool) -> None:
    """Compare a quantized checkpoint's tensors with the (quantized, empty) ``model`` before
    anything is copied: names, shapes, exact dtypes of the quantized buffers, finite float
    tensors, scales that are finite and > 0, and scales and zeros small enough that no product
    the model computes can overflow (:func:`overflow_problems`).

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
    if not problems:
        problems = overflow_problems(sd, model.config, model.quantization["scheme"], group_size, tied,
                                     model.quantization["head"])
    if problems:
        raise QuantizationError(f"{source}: cannot load the quantized checkpoint:\n  " + "\n  ".join(problems))


#: The largest finite value of the kernels' products: bfloat16's (the int4 kernel's activations,
#: scales and output), a little below float32's (the int8 products and the float32 model).
KERNEL_MAX = torch.finfo(KERNEL_DTYPE).max
#: |GELU(t)| <= max(|t|, GELU_MIN): the tanh GELU's most negative value is about -0.170.
GELU_MIN = 0.17


def _row_norms(sd: dict, path: str, scheme: str, group_size: int | None, rows: int = 4096) -> torch.Tensor:
    """``‖deq(W)[n, :]‖₂`` of every output channel n of the quantized layer at ``path``, as
    float64 ``[N]`` (computed in float32, ``rows`` rows at a time: a bound needs no more
    precision; a dequantized value beyond float32 gives inf, which is beyond every limit too):
    the scheme's :meth:`~.linear.QuantizedLinear.row_norms`."""
    return layer_class(scheme).row_norms(sd, path, group_size, rows)


def overflow_problems(sd: dict[str, torch.Tensor], config, scheme: str, group_size: int | None,
                      tied: bool, head: str = HEAD_SCHEME) -> list[str]:
    """Whether any value the model computes can overflow with these scales and zeros, for any
    input: worst-case magnitudes in float64, from first principles, each compared with
    :data:`KERNEL_MAX`. Returns the problems, each naming the scale tensor that causes it.

    The bounds follow the pre-norm block, so they do not compound across blocks: a LayerNorm
    output ``u = γ ⊙ x̂ + β`` has ``‖x̂‖₂ ≤ √C``, so ``‖u‖₂ ≤ max|γ|·√C + ‖β‖₂``; a layer's
    output channel n is at most ``‖u‖₂ · ‖deq(W)[n]‖₂ + |b[n]|`` (Cauchy-Schwarz) -- the product
    the kernel computes; the scores of head h at most ``‖q_h‖·‖k_h‖ / √head_dim``; an attention
    context channel at most its value channel (a convex combination); ``|GELU(t)| ≤ max(|t|,
    0.17)``. The residual stream is at most ``max|wte| + max|wpe|`` plus every attention and MLP
    output bound, and LayerNorm squares its deviations from the mean (C of them, summed in
    float32): ``C · (2R)²`` must stay finite. Ordinary checkpoints sit tens of orders of
    magnitude below these limits; scales multiplied by 1e30 do not.
    """
    C, H = config.n_embd, config.n_head
    hd = C // H
    problems: list[str] = []
    gains: dict[str, float] = {}                # largest ‖deq(W)[n]‖₂ of each quantized layer

    def blame(paths) -> str:                    # of the layers a value passed through: the largest gain
        path = max(paths, key=lambda q: gains.get(q, 0.0))
        return f"{path}.{layer_class(head if path == 'lm_head' else scheme).scale_buffer}"

    def flag(paths, what: str, value: float) -> None:
        problems.append(f"{blame(paths)}: {what} can reach {value:.3g}, beyond the {KERNEL_MAX:.3g} the kernels' "
                        f"products hold (bfloat16/float32): scales or zeros out of any range a quantizer produces "
                        f"from working weights (corrupted, or multiplied by a constant?)")

    def ln(prefix) -> float:
        g, b = sd[prefix + ".weight"].double(), sd[prefix + ".bias"].double()
        return float(g.abs().max()) * math.sqrt(C) + float(b.norm())

    def linear(path, u_norm: float, upstream=()) -> torch.Tensor:
        norms = _row_norms(sd, path, *((head, head_group(head, group_size)) if path == "lm_head" else
                                       (scheme, group_size)))
        gains[path] = float(norms.max())
        bias = sd.get(path + ".bias")
        bound = u_norm * norms + (bias.double().abs() if bias is not None else 0.0)
        if not problems and not float(bound.max()) <= KERNEL_MAX:
            flag((path, *upstream), "its outputs (the kernel's product)", float(bound.max()))
        return bound

    head_norms = _row_norms(sd, "lm_head", head, head_group(head, group_size))
    gains["lm_head"] = float(head_norms.max())
    embed = float(sd["wte.weight"].double().abs().max()) if "wte.weight" in sd else 0.0
    if tied:                                    # wte is the dequantized head: each entry <= its row's norm
        embed = max(embed, gains["lm_head"])
    residual = [(("lm_head",) if tied else (), embed), ((), float(sd["wpe.weight"].double().abs().max()))]
    for i in range(config.n_layer):
        p = f"h.{i}."
        attn, proj, fc, mproj = (p + n for n in BLOCK_LINEARS)
        y = linear(attn, ln(p + "ln_1"))
        q, k, v = (t.view(H, hd).norm(dim=1) for t in y.split(C))
        scores = q * k / math.sqrt(hd)
        if not problems and not float(scores.max()) <= KERNEL_MAX:
            flag((attn,), "the attention scores q·kᵀ/√head_dim", float(scores.max()))
        z = linear(proj, float(v.norm()), (attn,))
        f = linear(fc, ln(p + "ln_2"))
        m = linear(mproj, float(f.clamp(min=GELU_MIN).norm()), (fc,))
        residual += [((proj, attn), float(z.max())), ((mproj, fc), float(m.max()))]
        if problems:
            return problems
        R = sum(r for _, r in residual)
        if not C * (2 * R) ** 2 <= KERNEL_MAX:
            paths, most = max(residual, key=lambda r: r[1])
            culprit = blame(paths) if paths else "wpe.weight" if most == residual[1][1] else "wte.weight"
            problems.append(f"{culprit}: the residual stream can reach {R:.3g} by block {i} (up to {most:.3g} "
                            f"through this tensor), so LayerNorm's sum of squared deviations ({C}·(2·{R:.3g})²) "
                            f"overflows float32: scales or zeros out of any range a quantizer produces from working "
                            f"weights (corrupted, or multiplied by a constant?)")
            return problems
    linear("lm_head", ln("ln_f"))
    return problems


def load_state(model, entry, sd: dict[str, torch.Tensor], source: str, dtype: torch.dtype):
    """Build a quantized model from a checkpoint: ``model`` is the float model on the meta
    device; every tensor is checked (:func:`check_state`) before any is copied, so a bad file
    never yields a half-loaded model.

    Returns:
        The quantized model on the CPU, float tensors in ``dtype``, in eval mode.

    Raises:
        QuantizationError: see :func:`read_scheme`, :func:`check_state`; or a float tensor (a
            tied wte: the dequantized head) that overflows ``dtype``.
    """
    scheme, group_size, tied, head = read_scheme(entry, source)
    if entry["format"] == 1:                    # format 1 named the quantized head quantized_head.*
        sd = {"lm_head." + k.removeprefix("quantized_head.") if k.startswith("quantized_head.") else k: v
              for k, v in sd.items()}
    try:
        check_scheme(scheme, group_size, model.config.n_embd)
    except ValueError as e:
        raise QuantizationError(f"{source}: {e}") from None
    with torch.device("meta"):
        install(model, quantized_layers(model, scheme, group_size, head), scheme, group_size, tied, head)
    check_state(model, sd, source, tied)
    model = model.to(dtype).to_empty(device="cpu")             # the scales keep KERNEL_DTYPE (QuantizedLinear._apply)
    quantized = {k for k, v in model.state_dict().items() if not v.is_floating_point() or
                 k.endswith((".scales", ".scale_zero"))}
    with torch.no_grad():
        model.load_state_dict(sd, strict=False)                 # each float tensor converted once, into dtype
        if tied:
            model.wte.weight.copy_(model.lm_head.dequantized())
    if dtype != torch.float32:                  # the float tensors (a tied wte: the dequantized head) in dtype
        overflow = [k for k, v in model.state_dict().items() if k not in quantized and v.is_floating_point()
                    and not bool(torch.isfinite(v).all())]
        if overflow:
            raise QuantizationError(f"{source}: values of {', '.join(overflow)} overflow {dtype}; load in float32")
    model.quantization["method"] = entry.get("method", "rtn")
    set_activations(model, entry.get("activations", DEFAULT_ACTIVATIONS))
    return model.eval()


def load_checkpoint(checkpoint, dtype: torch.dtype, model_cls):
    """The quantized model of a :class:`~gpt2mha.io.state_dicts.Checkpoint` the registry read
    (:func:`gpt2mha.io.checkpoints.read_quantized`): a ``model_cls`` built on the meta device,
    then :func:`load_state` with the checkpoint's ``quantization`` entry."""
    with torch.device("meta"):
        model = model_cls(checkpoint.config)
    return load_state(model, checkpoint.quantization, checkpoint.state_dict, checkpoint.source, dtype)


register_quantized_format(QuantizedFormat(load=load_checkpoint, save=state_to_save))
