"""How a weight is stored for speed: dense copies in the layout a kernel reads fastest, and
weight-only int8 / int4 quantization (issue 13).

Decoding one token at a time streams every weight once per step, so its speed is the bytes of
weights divided by the memory bandwidth. Two ways to read fewer or faster bytes live here:

* **Decode-time copies** of a dense weight (:func:`transposed_copy`, :class:`Snapshot`): the
  ``[out, in]`` copy a bf16/fp16 Conv1D multiplies by inside ``GPT2.decoding()``, and the
  float32 ``[n_embd, n_vocab]`` copy of the LM head. A copy is used only while the weight it was
  taken from is unchanged (:func:`current_copy`).
* **Weight-only quantization** (gpt-fast's ``int8``/``int4`` modes, llama.cpp's ``q8_0``/``q4_0``):
  weights stored as int8 with one scale per output channel (symmetric), or as int4 with a scale
  and a zero per group of ``group_size`` inputs (asymmetric), activations kept in floating
  point. The rounding and packing are ours (:func:`quantize_int8`, :func:`quantize_int4`); the
  matrix products are PyTorch's CPU kernels ``aten._weight_int8pack_mm`` and
  ``aten._weight_int4pack_mm_for_cpu`` (chosen by measurement over torchao,
  benchmarks/quant_kernels.py and RESULTS.md). :class:`QuantizedLinear` holds one quantized
  matrix; :func:`quantize_model` swaps every Conv1D of the blocks and the LM head for one.

Shapes: a Conv1D weight is ``[n_in, n_out]`` (``x @ W``); quantized weights are stored
``[out, in]`` (``N = out`` rows of ``K = in`` inputs), as the kernels read them.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

#: Schemes accepted by :meth:`gpt2mha.GPT2.quantize`.
SCHEMES = ("int8", "int4")
#: Group size used when none is given (int8 has one scale per output channel, no groups).
#: int4's 64 measured best on this CPU (RESULTS.md, "Quantized decode").
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 64}
#: Group sizes the int4 CPU kernel takes.
INT4_GROUP_SIZES = (32, 64, 128, 256)
#: Dtype of the activations handed to the kernels and of the stored scales: the int8/int4 CPU
#: kernels run 2-3x faster on bf16 than on float32 activations (RESULTS.md). The product is
#: converted back to the model's dtype; the bias and the residual stream stay in it.
KERNEL_DTYPE = torch.bfloat16
#: The LM head is int8 in both schemes: on the built-in model an int4 head (group 64) lowered
#: int4's top-1 agreement with float32 from 93.8% to 91.0% and raised its bits/byte by 0.0024,
#: for 0.45 ms/step less on 124M (RESULTS.md). A tied embedding then carries int8's ~1% error.
HEAD_SCHEME = "int8"
#: Robust relative error (:func:`error_row`) above which a tensor is reported as abnormal. A
#: Gaussian weight gives ~0.01 in int8 (per channel) and ~0.09 in int4 (group 64, asymmetric);
#: an outlier stretching a channel's or a group's range pushes it well past these limits.
ABNORMAL_ERROR = {"int8": 0.03, "int4": 0.20}


class QuantizationError(ValueError):
    """A quantized checkpoint or tensor that cannot be used as it is; the message names it."""


# ------------------------------------------------------------------ decode-time dense copies
def transposed_copy(w: torch.Tensor, dtype: torch.dtype | None = None, block: int = 256) -> torch.Tensor:
    """A new contiguous ``[C, R]`` copy of a 2-D ``w [R, C]`` (no grad), in ``dtype`` if given.

    Copied ``block`` rows of ``w`` at a time, a blocked transpose that keeps both sides in
    cache: ~110 ms for GPT-2's wte (50257×768) against 142 ms in float32 and 225 ms from bf16
    for ``w.t().contiguous()``, ~145 ms against ~210 ms for 124M's 48 bf16 block matrices.
    """
    w = w.detach()
    out = torch.empty(w.shape[1], w.shape[0], dtype=dtype or w.dtype, device=w.device)
    for i in range(0, w.shape[0], block):
        out[:, i:i + block].copy_(w[i:i + block].t())
    return out


class Snapshot(NamedTuple):
    """A copy derived from a weight, with what identifies the weight's contents at that time.

    ``source`` is the weight tensor itself and ``stamp`` its :func:`stamp`. In-place writes
    (optimizer steps, ``load_state_dict``, ``.copy_``) bump the version counter, and ``.half()``
    or ``.to()`` change the dtype or the data pointer, so a changed weight is noticed.
    Substituted weights are noticed as well: ``torch.func.functional_call`` and pruning or
    weight-norm hooks put another tensor in its place. Writes through ``.data`` bump nothing,
    and fused optimizers do not bump the counter either; neither can be seen.
    """
    copy: torch.Tensor
    source: torch.Tensor
    stamp: tuple


def stamp(w: torch.Tensor) -> tuple:
    """``(version, dtype, device, data_ptr)`` of ``w``; version is None for inference tensors."""
    return (None if w.is_inference() else w._version, w.dtype, w.device, w.data_ptr())


def snapshot(w: torch.Tensor, dtype: torch.dtype | None = None, block: int = 256) -> Snapshot:
    """A :class:`Snapshot` of ``w``'s :func:`transposed_copy`."""
    return Snapshot(transposed_copy(w, dtype, block), w, stamp(w))


def current_copy(kept: Snapshot | None, w) -> torch.Tensor | None:
    """``kept.copy`` if it was taken from ``w`` itself and ``w`` has not changed since, else None."""
    if kept is None or kept.source is not w or kept.stamp != stamp(w):
        return None
    return kept.copy


# ------------------------------------------------------------------ quantization math
def _round_scales_up(s: torch.Tensor) -> torch.Tensor:
    """``s`` (float32, > 0) in :data:`KERNEL_DTYPE`, rounded up so that ``w / scale`` stays in range."""
    low = s.to(KERNEL_DTYPE)
    return torch.where(low.float() < s, torch.nextafter(low, torch.full_like(low, math.inf)), low)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 quantization of ``w [N, K]`` (rows = output channels).

    ``scale[n] = max_k |w[n, k]| / 127`` (rounded up to :data:`KERNEL_DTYPE`; an all-zero row
    gets scale 1), ``q = round(w / scale)`` in ``[-127, 127]``, so ``|w − q·scale| ≤ scale / 2``.

    Returns:
        ``(q int8 [N, K], scales [N])`` in :data:`KERNEL_DTYPE`.

    Source: gpt-fast ``quantize.py`` (``dynamically_quantize_per_channel``), LLM.int8's
    absmax quantization.
    """
    w = w.detach().float().contiguous()
    amax = w.abs().amax(dim=1)
    scales = _round_scales_up(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``q [N, K] int8`` × ``scales [N]`` → float32 ``[N, K]``."""
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4 quantization of ``w [N, K]`` along K (the inputs).

    Each row's K inputs are cut into groups of ``group_size``; a group spanning ``[lo, hi]`` gets
    ``scale = (hi − lo) / 15`` and ``zero = lo + 8·scale`` (both rounded to
    :data:`KERNEL_DTYPE`), and ``q = round((w − zero) / scale) + 8`` in ``[0, 15]``: the
    dequantized value is ``(q − 8)·scale + zero``, PyTorch's int4pack convention.

    Returns:
        ``(q int32 [N, K] in 0..15, scale_zero [K / group_size, N, 2])``; scale_zero in
        :data:`KERNEL_DTYPE`, ``[..., 0]`` scales and ``[..., 1]`` zeros, the layout
        ``aten._weight_int4pack_mm_for_cpu`` reads.

    Source: gpt-fast ``quantize.py`` (``get_group_qparams``), torchao's float-zero affine scheme.
    """
    w = w.detach().float().contiguous()
    N, K = w.shape
    g = w.view(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = _round_scales_up(((hi - lo) / 15).clamp(min=1e-6)).float()     # [N, K/g]
    zero = (lo + 8 * scale).to(KERNEL_DTYPE).float()
    q = torch.round((g - zero[..., None]) / scale[..., None]) + 8
    q = q.clamp_(0, 15).to(torch.int32).view(N, K)
    scale_zero = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
    return q, scale_zero


def dequantize_int4(q: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``q [N, K]`` (0..15) with ``scale_zero [K / group_size, N, 2]`` → float32 ``[N, K]``."""
    N, K = q.shape
    sz = scale_zero.float().transpose(0, 1)                                 # [N, K/g, 2]
    g = q.view(N, K // group_size, group_size).float()
    return ((g - 8) * sz[..., :1] + sz[..., 1:]).view(N, K)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` values 0..15 → uint8 ``[N, K / 2]``: input ``2i`` in the low nibble, ``2i + 1``
    in the high one (the storage layout on disk; the kernel's own packing is CPU-specific)."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: uint8 ``[N, K / 2]`` → int32 ``[N, K]``."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1).to(torch.int32)


# ------------------------------------------------------------------ the quantized layer
def _pad_rows(n: int, multiple: int = 16) -> int:
    return -(-n // multiple) * multiple


class QuantizedLinear(nn.Module):
    """A dense layer with a weight-only quantized weight: ``y = x @ deq(W)ᵀ + b``.

    Args:
        n_in, n_out: input and output widths (K and N).
        scheme: ``"int8"`` (per-output-channel scales) or ``"int4"`` (per-group scale and zero).
        group_size: int4's group of inputs sharing a scale (must divide ``n_in``); None for int8.
        bias: whether the layer adds a float bias ``[n_out]``.

    Buffers (what the checkpoint stores): int8 ``weight`` int8 ``[n_out, n_in]`` and ``scales``
    ``[n_out]``; int4 ``weight`` uint8 ``[n_out, n_in / 2]`` (:func:`pack_int4`) and
    ``scale_zero [n_in / group_size, n_out, 2]``; scales in :data:`KERNEL_DTYPE` whatever the
    model's dtype. ``bias`` is a parameter without grad, in the model's dtype. For the int4
    kernel the weight is also kept in its CPU-specific packed layout (rows padded to a multiple
    of 16), rebuilt whenever the buffers are loaded.

    Forward: ``[..., n_in]`` → ``[..., n_out]`` in x's dtype. On CPU the activations go to the
    kernel in :data:`KERNEL_DTYPE` and its output comes back to x's dtype before the bias is
    added (float32 bias and residual stream for a float32 model); elsewhere the weight is
    dequantized for each call (correct, not fast).

    Raises:
        RuntimeError: in forward, if autograd would need a gradient through the layer
            (quantized weights are for inference; train the float model).
    """

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = True):
        super().__init__()
        check_scheme(scheme, group_size, n_in)
        self.n_in, self.n_out, self.scheme, self.group_size = n_in, n_out, scheme, group_size
        if scheme == "int8":
            self.register_buffer("weight", torch.zeros(n_out, n_in, dtype=torch.int8))
            self.register_buffer("scales", torch.ones(n_out, dtype=KERNEL_DTYPE))
        else:
            self.register_buffer("weight", torch.zeros(n_out, n_in // 2, dtype=torch.uint8))
            self.register_buffer("scale_zero", torch.ones(n_in // group_size, n_out, 2, dtype=KERNEL_DTYPE))
            self.register_buffer("packed", None, persistent=False)
        self.bias = nn.Parameter(torch.zeros(n_out), requires_grad=False) if bias else None

    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None, scheme: str,
                   group_size: int | None = None) -> "QuantizedLinear":
        """Quantize ``w [n_out, n_in]`` (and keep ``b [n_out]`` as it is) into a new layer."""
        n_out, n_in = w.shape
        layer = cls(n_in, n_out, scheme, group_size, bias=b is not None).to(w.device)
        with torch.no_grad():
            if scheme == "int8":
                layer.weight, layer.scales = quantize_int8(w)
            else:
                q, layer.scale_zero = quantize_int4(w, group_size)
                layer.weight = pack_int4(q)
                layer.repack()
            if b is not None:
                layer.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
        return layer

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[n_out, n_in]`` this layer multiplies by."""
        if self.scheme == "int8":
            return dequantize_int8(self.weight, self.scales)
        return dequantize_int4(unpack_int4(self.weight), self.scale_zero, self.group_size)

    def repack(self) -> None:
        """Rebuild the int4 kernel's packed weight from ``weight`` and ``scale_zero`` (CPU only)."""
        if self.scheme != "int4" or self.weight.device.type != "cpu" or self.weight.is_meta:
            self.packed = None
            return
        q = unpack_int4(self.weight)
        pad = _pad_rows(self.n_out) - self.n_out                         # the kernel needs N % 16 == 0
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(F.pad(q, (0, 0, 0, pad)), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"this layer's weight is quantized ({self.scheme}): autograd cannot flow through "
                               f"it; quantized models are for inference (train the float model, then quantize)")
        x2 = x.reshape(-1, self.n_in).to(KERNEL_DTYPE).contiguous()     # [M, K]
        if x.device.type != "cpu":
            y = F.linear(x2, self.dequantized().to(KERNEL_DTYPE))
        elif self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.weight, self.scales)
        else:
            pad = self.packed.shape[0] - self.n_out                    # rows padded to a multiple of 16
            scale_zero = F.pad(self.scale_zero, (0, 0, 0, pad)) if pad else self.scale_zero
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, scale_zero)
            y = y[:, :self.n_out]
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)

    def _apply(self, fn, recurse=True):
        """As any module (device moves, ``.to(dtype)``), except that the scales keep
        :data:`KERNEL_DTYPE`: ``.half()`` or ``.float()`` convert only the bias."""
        name = "scales" if self.scheme == "int8" else "scale_zero"
        scales = self._buffers.pop(name)
        super()._apply(fn, recurse)
        self._buffers[name] = fn(scales.view(torch.int16)).view(KERNEL_DTYPE)   # an int view: dtype kept
        if self.scheme == "int4" and (self.packed is None or self.packed.device != self.weight.device):
            self.repack()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"n_in={self.n_in}, n_out={self.n_out}, scheme={self.scheme}{g}, bias={self.bias is not None}"


def check_scheme(scheme, group_size, n_in: int | None = None) -> None:
    """Raises ValueError naming the argument for an unknown scheme or a group size the scheme
    or the kernel cannot use (int4: one of :data:`INT4_GROUP_SIZES` dividing ``n_in``)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme={scheme!r} is unknown; expected one of {SCHEMES}")
    if scheme == "int8":
        if group_size is not None:
            raise ValueError(f"group_size={group_size!r}: int8 has one scale per output channel, no groups; "
                             f"leave group_size as None")
        return
    if isinstance(group_size, bool) or group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}: int4 needs one of {INT4_GROUP_SIZES} (the CPU kernel's sizes)")
    if n_in is not None and n_in % group_size:
        raise ValueError(f"group_size={group_size} does not divide the layer's input width {n_in} "
                         f"(n_embd or 4·n_embd); choose one of {[g for g in INT4_GROUP_SIZES if n_in % g == 0]}")


# ------------------------------------------------------------------ the whole model
#: The four Conv1Ds of a block, by their path inside it.
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class QuantizationWarning(UserWarning):
    """A tensor whose quantization error is abnormal (:data:`ABNORMAL_ERROR`)."""


def head_weight(model) -> torch.Tensor:
    """The LM head's float weight ``[n_vocab, n_embd]``: ``GPT2.output_weight()`` (``wte.weight``
    when tied)."""
    return model.output_weight()


def error_row(name: str, w: torch.Tensor, layer: QuantizedLinear) -> dict:
    """Quantization error of one tensor.

    ``rel_error = rms(W − deq(W)) / rms(W)``, and ``robust_rel_error``, the same error over a
    robust spread of W, ``1.4826 · median |W|`` (σ for a Gaussian): an outlier channel inflates
    rms(W) as much as the error, so only the robust figure shows that it stretched the scales
    for every other weight of its rows or groups. ``abnormal`` when the robust figure exceeds
    :data:`ABNORMAL_ERROR`, or an error is not finite. Also ``max_abs_error``.
    """
    w = w.detach().float()
    err = layer.dequantized() - w
    rms_err = err.pow(2).mean().sqrt()
    rel = float(rms_err / w.pow(2).mean().sqrt().clamp(min=1e-30))
    robust = float(rms_err / (1.4826 * w.abs().median()).clamp(min=1e-30))
    return dict(name=name, shape=list(w.shape), scheme=layer.scheme, rel_error=rel, robust_rel_error=robust,
                max_abs_error=float(err.abs().max()), abnormal=not robust <= ABNORMAL_ERROR[layer.scheme])


def quantized_layers(model, scheme: str, group_size: int | None) -> dict[str, QuantizedLinear]:
    """Empty :class:`QuantizedLinear` layers for every block Conv1D and the head of ``model``
    (shapes only, to be filled by ``load_state_dict``), by module path."""
    c = model.config
    layers = {}
    for i in range(c.n_layer):
        for path, (n_in, n_out) in zip(BLOCK_LINEARS, ((c.n_embd, 3 * c.n_embd), (c.n_embd, c.n_embd),
                                                      (c.n_embd, 4 * c.n_embd), (4 * c.n_embd, c.n_embd))):
            layers[f"h.{i}.{path}"] = QuantizedLinear(n_in, n_out, scheme, group_size)
    layers["quantized_head"] = QuantizedLinear(c.n_embd, c.n_vocab, HEAD_SCHEME, bias=False)
    return layers


def install(model, layers: dict[str, nn.Module], scheme: str, group_size: int | None, tied: bool) -> None:
    """Put ``layers`` into ``model`` at their paths, record the scheme, freeze the rest."""
    for path, layer in layers.items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layer)
    if not tied and isinstance(getattr(model, "lm_head", None), nn.Module):
        model.lm_head = None                                      # the untied float head: quantized_head replaces it
    model.quantization = {"scheme": scheme, "group_size": group_size, "head": HEAD_SCHEME, "tied": tied}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


@torch.no_grad()
def quantize_model(model, scheme: str, group_size: int | None = None):
    """Weight-only quantize ``model`` in place: every block Conv1D (``c_attn``, ``attn.c_proj``,
    ``c_fc``, ``mlp.c_proj``) and the LM head become :class:`QuantizedLinear` layers.

    The LM head is quantized to int8 (:data:`HEAD_SCHEME`) from :func:`head_weight` into
    ``model.quantized_head``. When it is
    tied to ``wte``, ``wte`` is overwritten with the dequantized head, so the float embedding
    lookup and the head read the same numbers, and a checkpoint stores them once (quantized):
    the model reloads with identical logits. LayerNorms, biases and ``wpe`` stay float.

    Each tensor's error is measured (:func:`error_row`) into ``model.quantization_report``;
    tensors with an abnormal error (e.g. an outlier channel stretching a scale) are listed in a
    :class:`QuantizationWarning`.

    Args:
        model: a float :class:`~gpt2mha.model.GPT2` on the CPU (eval mode afterwards; no
            parameter requires grad).
        scheme: ``"int8"`` or ``"int4"``; group_size: int4's group (default
            :data:`DEFAULT_GROUP_SIZE`), None for int8.

    Returns:
        ``model``.

    Raises:
        ValueError: unknown scheme, a group size the scheme or n_embd does not allow, a model
            already quantized, or weights holding NaN/inf (named).
    """
    if getattr(model, "quantization", None):
        raise ValueError(f"this model is already quantized ({model.quantization['scheme']}); quantizing twice would "
                         f"round the rounded weights again: quantize the float model instead")
    if scheme in SCHEMES and group_size is None:
        group_size = DEFAULT_GROUP_SIZE[scheme]
    check_scheme(scheme, group_size, model.config.n_embd)
    sources = {f"h.{i}.{path}": model.get_submodule(f"h.{i}.{path}") for i in range(model.config.n_layer)
               for path in BLOCK_LINEARS}
    weights = {path: (m.weight.t(), m.bias) for path, m in sources.items()}      # [out, in]
    weights["quantized_head"] = (head_weight(model), None)
    bad = [path for path, (w, b) in weights.items()
           if not torch.isfinite(w).all() or (b is not None and not torch.isfinite(b).all())]
    if bad:
        raise ValueError(f"cannot quantize: {', '.join(bad)} hold NaN or inf values")
    layers, report = {}, []
    for path, (w, b) in weights.items():
        head = path == "quantized_head"
        layers[path] = QuantizedLinear.from_float(w, b, HEAD_SCHEME if head else scheme, None if head else group_size)
        report.append(error_row(path, w, layers[path]))
    tied = head_weight(model) is model.wte.weight
    install(model, layers, scheme, group_size, tied)
    if tied:
        model.wte.weight.copy_(layers["quantized_head"].dequantized())
    model.quantization_report = report
    abnormal = [r for r in report if r["abnormal"]]
    for r in abnormal:
        warnings.warn(f"{r['name']} {r['shape']}: abnormal {r['scheme']} quantization error ({r['robust_rel_error']:.3f} "
                      f"of the weights' robust spread, limit {ABNORMAL_ERROR[r['scheme']]}; an outlier channel or group "
                      f"stretching the scales?)", QuantizationWarning, stacklevel=3)
    return model


# ------------------------------------------------------------------ checkpoints
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
            model.wte.weight.copy_(model.quantized_head.dequantized())
    return model.to(dtype).eval()
