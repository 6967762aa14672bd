"""The quantized dense layer: :class:`QuantizedLinear`, the base of one class per weight scheme
and activation treatment, and the registry that maps ``(scheme, activations)`` to those classes.

Each scheme lives in a file of its own that registers its classes (:func:`register`,
:func:`register_head`): :mod:`.int8_linear` (:class:`~.int8_linear.Int8Linear`, exact;
:class:`~.int8_linear.W7A8Linear`, ``per_row``; :class:`~.int8_linear.AutoInt8Linear`,
``auto``) and :mod:`.int4_linear` (:class:`~.int4_linear.Int4Linear`, exact;
:class:`~.int4_linear.W4A8Linear`, ``per_block``). Each class owns its product
(:meth:`QuantizedLinear._product`), the tensors it hands the native forward
(:meth:`~QuantizedLinear.native_tensors`) and the layer it hands the compiled step
(:meth:`~QuantizedLinear.compiled_layer`); the scheme's base class owns its buffers, its rounding
and what a checkpoint of it must hold. Setting :attr:`QuantizedLinear.activations` converts a
layer to the class of the new treatment in place (the same module, its buffers untouched).

``QuantizedLinear(n_in, n_out, scheme, group_size)`` and ``QuantizedLinear.from_float(w, b,
scheme, group_size)`` give the scheme's exact class; :class:`QuantizedHead` likewise gives its
head class (float32 logits). The int8 products are re-exported here by name
(:mod:`.int8_products`). The per-scheme tables (:data:`SCHEME_ACTIVATIONS`,
:data:`DEFAULT_GROUP_SIZE`, :data:`DEQUANTIZE_FROM_ROWS`, …) fill as the classes register;
:mod:`.tables` makes those of every scheme (``SCHEMES``, ``ACTIVATIONS``) once all have.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from . import gemv
# The int8 products, importable from here by name (the int8 layers look them up in
# :mod:`.int8_linear`: benchmarks swap ``int8_linear.int8_matmul`` for a variant).
from .int8_products import (INT8_KERNEL_ENV, INT8_KERNELS, MAX_PIECES, PIECE_LEVELS, WIDE_ROW,  # noqa: F401
                            fbgemm_available, fbgemm_pack, int8_kernel, int8_matmul, int8_matmul_per_row,
                            pieces_for, split_activations, weight_7bit)
from .schemes import KERNEL_DTYPE

#: Largest number of float32 weights dequantized at once (16 MiB: a whole block matrix of GPT-2
#: 124M or medium): a larger weight (the LM head, the MLP of GPT-2 large and XL) is dequantized
#: and multiplied in slices of output channels, so each thread's scratch (:func:`_scratch`)
#: stays this small.
DEQUANTIZE_CHUNK = 1 << 22
#: How a layer treats its activations when none is asked (:attr:`QuantizedLinear.activations`):
#: every scheme's first class, the one that never rounds them.
DEFAULT_ACTIVATIONS = "exact"


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements on ``device``, kept per thread and
    reused by every layer (the dequantized weights of :meth:`QuantizedLinear.dequantized_product`):
    no fresh allocation, and so no page faults, per product. Made outside inference mode so that
    it can be written in place in and out of it."""
    store = _SCRATCH.__dict__
    buf = store.get(device)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
        store[device] = buf
    return buf[:numel]


_SCRATCH = threading.local()


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place write counter (-1 for inference tensors, which have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def pad_rows(n: int, multiple: int = 16) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


# ------------------------------------------------------------------ the registry
#: The layer class of each ``(scheme, activations)``, in the order the schemes register them.
_LAYERS: dict[tuple[str, str], type] = {}
#: The head class (:class:`QuantizedHead`) of each layer class.
_HEADS: dict[type, type] = {}
#: The activation treatments each scheme's layers take (its classes' ``activations_mode``, the
#: first its default), filled as the schemes register them: ``int8``: exact, per_row, auto;
#: ``int4``: exact, per_block.
SCHEME_ACTIVATIONS: dict[str, tuple[str, ...]] = {}
#: Group size used when none is given, per scheme (:attr:`QuantizedLinear.default_group_size`).
DEFAULT_GROUP_SIZE: dict[str, int | None] = {}
#: Robust relative error above which a tensor is reported as abnormal, per scheme
#: (:attr:`QuantizedLinear.abnormal_error`).
ABNORMAL_ERROR: dict[str, float] = {}
#: Input rows from which a CPU without VNNI/AMX multiplies by the dequantized weight, per
#: scheme (:meth:`QuantizedLinear.dequantize_for` reads it here: benchmarks/quant_prefill.py
#: changes it to force a route; each scheme's ``dequantize_from_rows`` says what was measured).
DEQUANTIZE_FROM_ROWS: dict[str, int] = {}


def register(cls: type) -> type:
    """Class decorator: ``cls`` (a :class:`QuantizedLinear` with ``scheme`` and
    ``activations_mode`` set) serves that pair. A scheme registers its default
    (:data:`DEFAULT_ACTIVATIONS`) class first.

    Raises:
        ValueError: the pair is taken, or a scheme's first class is not its default one.
    """
    key = (cls.scheme, cls.activations_mode)
    if key in _LAYERS:
        raise ValueError(f"{cls.__name__}: {key} is served by {_LAYERS[key].__name__} already")
    if cls.scheme not in SCHEME_ACTIVATIONS and cls.activations_mode != DEFAULT_ACTIVATIONS:
        raise ValueError(f"{cls.__name__}: register {cls.scheme}'s {DEFAULT_ACTIVATIONS!r} class first")
    _LAYERS[key] = cls
    if cls.scheme not in SCHEME_ACTIVATIONS:                  # the scheme's tables, from its default class
        DEFAULT_GROUP_SIZE[cls.scheme] = cls.default_group_size
        ABNORMAL_ERROR[cls.scheme] = cls.abnormal_error
        DEQUANTIZE_FROM_ROWS[cls.scheme] = cls.dequantize_from_rows
    SCHEME_ACTIVATIONS[cls.scheme] = SCHEME_ACTIVATIONS.get(cls.scheme, ()) + (cls.activations_mode,)
    return cls


def register_head(cls: type) -> type:
    """Class decorator: ``cls`` (a subclass of :class:`QuantizedHead` and of one registered
    layer class) is that class's LM head."""
    layer = next(c for c in cls.__mro__[1:] if c in _LAYERS.values())
    _HEADS[layer] = cls
    return cls


def layer_class(scheme: str, activations: str = DEFAULT_ACTIVATIONS, head: bool = False) -> type:
    """The class of ``scheme``'s layers with ``activations`` (its :class:`QuantizedHead` class
    with ``head=True``).

    Raises:
        ValueError: an unknown scheme, or activations the scheme does not take (named).
    """
    schemes = tuple(SCHEME_ACTIVATIONS)
    if scheme not in schemes:
        raise ValueError(f"scheme={scheme!r} is unknown; expected one of {schemes}")
    if activations not in SCHEME_ACTIVATIONS[scheme]:
        raise ValueError(f"activations={activations!r}: an {scheme} layer takes one of {SCHEME_ACTIVATIONS[scheme]}")
    cls = _LAYERS[scheme, activations]
    return _HEADS[cls] if head else cls


def record_class(quantization) -> type | None:
    """The class of the block layers a model's quantization record (``model.quantization``:
    ``"scheme"``, ``"activations"``) names; None for a float model's (None or empty) or a record
    this version does not know."""
    if not quantization:
        return None
    try:
        return layer_class(quantization.get("scheme"), quantization.get("activations", DEFAULT_ACTIVATIONS))
    except (ValueError, TypeError):
        return None


def check_scheme(scheme, group_size, n_in: int | None = None) -> None:
    """Raises ValueError naming the argument for an unknown scheme or a group size the scheme
    or its kernel cannot use (int8: None; int4: one of
    :data:`~.schemes.INT4_GROUP_SIZES` dividing ``n_in``)."""
    layer_class(scheme).check_group_size(group_size, n_in)


def check_head(head, scheme) -> None:
    """Raises ValueError naming the argument for a head scheme that is unknown or does not go with
    the blocks' ``scheme`` (a head in groups takes the blocks' group size: int4 blocks)."""
    from .schemes import HEAD_SCHEME
    heads = tuple(SCHEME_ACTIVATIONS)
    if head not in heads:
        raise ValueError(f"head={head!r} is unknown; expected one of {heads}")
    if layer_class(head).grouped and scheme != head:
        raise ValueError(f"head={head!r} needs scheme={head!r} (the head takes the blocks' group_size); got "
                         f"scheme={scheme!r}: use head={HEAD_SCHEME!r}")


# ------------------------------------------------------------------ the quantized layer
class QuantizedLinear(nn.Module):
    """A dense layer with a weight-only quantized weight: ``y = x @ deq(W)ᵀ + b``; the base of
    the scheme classes (``QuantizedLinear(...)`` and :meth:`from_float` give the scheme's
    class for :data:`DEFAULT_ACTIVATIONS`).

    Args:
        n_in, n_out: input and output widths (K and N).
        scheme: ``"int8"`` (per-output-channel scales) or ``"int4"`` (per-group scale and zero).
        group_size: int4's group of inputs sharing a scale (must divide ``n_in``); None for int8.
        bias: whether the layer adds a float bias ``[n_out]``.

    Buffers (what the checkpoint stores, the scheme's): int8 ``weight`` int8 ``[n_out, n_in]``
    and ``scales`` ``[n_out]``; int4 ``weight`` uint8 ``[n_out, n_in / 2]``
    (:func:`~.schemes.pack_int4`) and ``scale_zero [n_in / group_size, n_out, 2]``; scales in
    :data:`~.schemes.KERNEL_DTYPE` whatever the model's dtype. ``bias`` is a parameter without
    grad, in the model's dtype.

    Forward: ``[..., n_in]`` → ``[..., n_out]`` in x's dtype. On the CPU the class's product
    (:meth:`_product`, see each class); elsewhere the weight is dequantized for each call
    (:data:`~.schemes.KERNEL_DTYPE` products: correct, not fast). The product comes back to x's
    dtype before the bias is added (float32 bias and residual stream for a float32 model); the
    kernels that take the bias add a float32 bias to a float32 output themselves.

    Raises:
        ValueError: a scheme or group size :func:`check_scheme` refuses, or a scheme that is
            not the class's.
        RuntimeError: in forward, if autograd would need a gradient through the layer
            (quantized weights are for inference; train the float model).
    """

    #: The weight scheme of the class's layers (None: the base, not a scheme).
    scheme: str | None = None
    #: How the class's products treat the activations (:attr:`activations`).
    activations_mode: str = DEFAULT_ACTIVATIONS
    #: The buffer holding the scales (kept in :data:`~.schemes.KERNEL_DTYPE` by ``.to(dtype)``).
    scale_buffer = "scales"
    #: Whether the scheme's weights come in groups of ``group_size`` inputs (an LM head in that
    #: scheme takes the blocks' group size).
    grouped = False
    #: The group size :meth:`GPT2.quantize <gpt2mha.GPT2.quantize>` uses when none is given.
    default_group_size: int | None = None
    #: Robust relative error (:func:`~.model.error_row`) above which a tensor is reported as abnormal.
    abnormal_error = 0.0
    #: Input rows from which a CPU without VNNI/AMX multiplies by the dequantized weight
    #: (:meth:`dequantize_for`, through :data:`DEQUANTIZE_FROM_ROWS`).
    dequantize_from_rows = 0
    #: The kind of product ``cached_forward`` (:mod:`~gpt2mha.inference.native`) runs for blocks of
    #: this class ("w4a8", "w7a8"), None where they do not run there.
    native_kind: str | None = None
    #: ``(scheme, activations)`` of the LM heads the native forward takes with blocks of this class.
    native_heads: tuple[tuple[str, str], ...] = ()

    def __new__(cls, *args, **kwargs):
        # QuantizedLinear(n_in, n_out, scheme, ...) and QuantizedHead(...): the scheme's class
        if cls.scheme is None and (len(args) > 2 or "scheme" in kwargs):
            scheme = args[2] if len(args) > 2 else kwargs["scheme"]
            cls = layer_class(scheme, head=issubclass(cls, QuantizedHead))
        return super().__new__(cls)

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = True):
        super().__init__()
        check_scheme(scheme, group_size, n_in)
        if scheme != self.scheme:
            raise ValueError(f"scheme={scheme!r}: {type(self).__name__} holds {self.scheme} weights")
        self.n_in, self.n_out, self.group_size = n_in, n_out, group_size
        self._make_buffers()
        self.bias = nn.Parameter(torch.zeros(n_out), requires_grad=False) if bias else None

    # --- what each scheme defines
    def _make_buffers(self) -> None:
        """Register the scheme's buffers (zeros, shapes from ``n_in``, ``n_out``, ``group_size``)."""
        raise NotImplementedError

    @classmethod
    def check_group_size(cls, group_size, n_in: int | None) -> None:
        """Raises ValueError naming ``group_size`` where the scheme cannot use it (for a layer of
        ``n_in`` inputs when given)."""
        raise NotImplementedError

    def set_weight(self, w: torch.Tensor, hessian: torch.Tensor | None = None) -> None:
        """Round ``w [n_out, n_in]`` into the buffers: to nearest, or by :func:`~.gptq.gptq`
        when the inputs' ``hessian [n_in, n_in]`` is given."""
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``[n_out, n_in]`` this layer multiplies by."""
        raise NotImplementedError

    def _product(self, x2: torch.Tensor, tokens: int, bias: torch.Tensor | None,
                 gelu: bool) -> tuple[torch.Tensor, bool, bool]:
        """The CPU product of ``x2 [M, n_in]`` (``tokens`` per sequence, never the batch):
        ``(y [M, n_out], whether it added bias, whether it applied GELU)``. ``bias``: the float32
        bias a kernel may add itself (None where the forward adds it); ``gelu``: whether the
        product may apply GPT-2's GELU itself (float32 out)."""
        raise NotImplementedError

    @classmethod
    def row_norms(cls, sd: dict, path: str, group_size: int | None, rows: int = 4096) -> torch.Tensor:
        """``‖deq(W)[n, :]‖₂`` of every output channel n of the layer stored at ``path`` of the
        state dict ``sd``, float64 ``[N]`` (:func:`~.checkpoint.overflow_problems`)."""
        raise NotImplementedError

    # --- the treatment of the activations
    @property
    def activations(self) -> str:
        """How this layer's products treat the activations: its class's ``activations_mode``,
        one of :data:`SCHEME_ACTIVATIONS` of its scheme (each class says what its products do).
        Setting it converts the layer in place to the scheme's class for the new value
        (:func:`layer_class`; a head stays a head): the same module and buffers.

        Raises:
            ValueError: (on setting) a value this layer's scheme does not take.
        """
        return self.activations_mode

    @activations.setter
    def activations(self, value: str) -> None:
        self.__class__ = layer_class(self.scheme, value, head=isinstance(self, QuantizedHead))

    @property
    def fuses_gelu(self) -> bool:
        """Whether :meth:`forward` with ``gelu=True`` may fuse the activation into the product."""
        return False

    @classmethod
    def from_float(cls, w: torch.Tensor, b: torch.Tensor | None, scheme: str,
                   group_size: int | None = None, hessian: torch.Tensor | None = None) -> "QuantizedLinear":
        """Quantize ``w [n_out, n_in]`` (and keep ``b [n_out]`` as it is) into a new layer of
        ``scheme``'s class: rounded to nearest, or by :func:`~.gptq.gptq` when the inputs'
        ``hessian [n_in, n_in]`` is given."""
        n_out, n_in = w.shape
        layer = cls(n_in, n_out, scheme, group_size, bias=b is not None).to(w.device)
        with torch.no_grad():
            layer.set_weight(w, hessian)
            if b is not None:
                layer.bias = nn.Parameter(b.detach().clone(), requires_grad=False)
        return layer

    def repack(self) -> None:
        """Rebuild any copy of the weight the scheme keeps in a kernel's layout (the buffers
        were loaded or moved); nothing by default."""

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``x [..., n_in]`` → ``[..., n_out]`` (see the class); ``gelu``: GPT-2's GELU applied
        to the result (an MLP's ``c_fc`` with its activation,
        :class:`~gpt2mha.inference.fast.GeluFusedMLP`): inside the product where the class's
        kernel applies it (float32 out), else ``F.gelu(approximate="tanh")`` after."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"this layer's weight is quantized ({self.scheme}): autograd cannot flow through "
                               f"it; quantized models are for inference (train the float model, then quantize)")
        x2 = x.reshape(-1, self.n_in)                                  # [M, K]
        tokens = x.shape[-2] if x.dim() > 2 else x2.shape[0]            # tokens per sequence
        # gpt2mha's operators add a float32 bias to a float32 output themselves (one pass less)
        bias = self.bias if self.bias is not None and self.bias.dtype == torch.float32 \
            and self.out_dtype(x.dtype) == torch.float32 else None
        if x.device.type != "cpu":
            y, added, in_op = F.linear(x2.to(KERNEL_DTYPE), self.dequantized().to(KERNEL_DTYPE)), False, False
        else:
            in_op = gelu and x.dtype == torch.float32 and (self.bias is None or bias is not None)
            y, added, in_op = self._product(x2, tokens, bias, in_op)
        y = y.to(self.out_dtype(x.dtype))
        if self.bias is not None and not added:
            y = y + self.bias
        if gelu and not in_op:
            y = F.gelu(y, approximate="tanh")
        return y.view(*x.shape[:-1], self.n_out)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the output for inputs in ``dtype``: the same."""
        return dtype

    def dequantize_for(self, rows: int) -> bool:
        """Whether a product over ``rows`` input rows runs as a float32 GEMM over the
        dequantized weight (:meth:`dequantized_product`) rather than the quantized kernel: on
        CPUs whose int8 kernel is FBGEMM (no VNNI/AMX, :func:`int8_kernel`) from the scheme's
        :data:`DEQUANTIZE_FROM_ROWS` rows on, where the float32 GEMM outruns the two integer
        pieces (int8) and the bf16 int4 kernel (int4) in prefill (``python
        benchmarks/quant_prefill.py kernels`` measures them). Products with ``activations="per_row"`` never do (faster still), and
        with ``"auto"`` run W7A8 there instead.

        The forward counts the tokens of one sequence (``x.shape[-2]`` of ``[B, T, n_in]``;
        all rows of a 2-D input), never the batch: a decode step over 100 sequences
        (``[100, 1, n_in]``) takes the quantized kernel as each sequence alone does, so a row's
        result does not depend on how many rows share the call (batch invariance)."""
        return rows >= DEQUANTIZE_FROM_ROWS[self.scheme] and int8_kernel() == "fbgemm"

    def bf16_output_for(self, rows: int) -> bool:
        """Whether a product over ``rows`` rows would take a kernel whose output is rounded to
        bf16 (:class:`QuantizedHead` dequantizes there instead); none by default."""
        return False

    def dequantized_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, n_in] @ deq(W)ᵀ`` → float32 ``[M, n_out]`` (no bias) by float32 GEMMs over
        the weight dequantized into a reused per-thread scratch (:func:`_scratch`), at most
        :data:`DEQUANTIZE_CHUNK` weights at a time (slices of output channels; each scheme's
        :meth:`_dequantized_chunk` says how it fills one)."""
        N, K = self.n_out, self.n_in
        step = max(1, min(N, DEQUANTIZE_CHUNK // K))
        prep = self._dequantize_prep(x, min(N, step))
        outs = []
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            w = _scratch((n1 - n0) * K, x.device).view(n1 - n0, K)
            outs.append(self._dequantized_chunk(x, prep, n0, n1, w))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _dequantize_prep(self, x: torch.Tensor, rows: int):
        """What every chunk of :meth:`dequantized_product` over ``x`` shares (chunks of at most
        ``rows`` output channels); None by default."""
        return None

    def _dequantized_chunk(self, x: torch.Tensor, prep, n0: int, n1: int, w: torch.Tensor) -> torch.Tensor:
        """``x @ deq(W)[n0:n1]ᵀ`` (float32 ``[M, n1 − n0]``), the weight dequantized into the
        scratch ``w [n1 − n0, n_in]``."""
        raise NotImplementedError

    # --- weights in the kernels' layouts, made on first use
    def _cached(self, slot: str, tensors: tuple, make, extra: tuple = (), always: bool = False):
        """``make()`` (run outside inference mode, without grad), kept under ``slot`` and made
        again whenever one of ``tensors`` is another tensor, was written in place or got new
        data (``p.data = t``), or ``extra`` changed; every call with ``always``. Not part of the
        state dict, nor of pickles and copies (:meth:`__getstate__`)."""
        key = (*tensors, *(_version(t) for t in tensors), *(t.data_ptr() for t in tensors), *extra)
        n = len(tensors)
        derived = self.__dict__.setdefault("_derived", {})
        cached = derived.get(slot)
        if cached is None or always or any(a is not b for a, b in zip(cached[0][:n], key[:n])) \
                or cached[0][n:] != key[n:]:
            with torch.inference_mode(False), torch.no_grad():
                cached = (key, make())
            derived[slot] = cached
        return cached[1]

    def gemv_scales(self) -> torch.Tensor:
        """The scales in the GEMV kernel's layout (:mod:`.gemv`; each scheme's
        :meth:`_gemv_layout`). Made on first use and again whenever the buffer is another tensor
        or was written in place (made at every call for an inference-mode tensor, which counts
        no writes)."""
        scales = getattr(self, self.scale_buffer)
        if scales.is_inference():                # no version counter: a write in place would go unseen
            return self._gemv_layout(scales)
        key = (scales, _version(scales), scales.data_ptr())
        derived = self.__dict__.setdefault("_derived", {})
        cached = derived.get("gemv")
        if cached is None or cached[0][0] is not key[0] or cached[0][1:] != key[1:]:
            cached = (key, self._gemv_layout(scales))
            derived["gemv"] = cached
        return cached[1]

    def _gemv_layout(self, scales: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- what the native forward and the compiled step get
    def native_tensors(self) -> list[torch.Tensor]:
        """The layer's tensors in ``kernels/cached_forward.cpp``'s layout (before its bias)."""
        raise NotImplementedError(f"{type(self).__name__} does not run on the native forward")

    def native_group_size(self) -> int:
        """The group size of this layer's products on ``cached_forward`` (0: no groups)."""
        return 0

    def compiled_layer(self) -> nn.Module | None:
        """The module the compiled decode step (:func:`~gpt2mha.inference.compiled.decode_view`)
        runs in place of this CPU layer; None: the layer itself."""
        return None

    @classmethod
    def model_compile_options(cls) -> dict:
        """Inductor options for the compiled step of a model whose blocks are of this class."""
        return {}

    def compile_options(self) -> dict:
        """Inductor options the compiled step of a model holding this layer needs."""
        return {}

    def quantized_buffers(self) -> tuple[str, ...]:
        """The names of the buffers a checkpoint stores as they are (not in the model's dtype)."""
        return ("weight", self.scale_buffer)

    # --- module plumbing
    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state.pop("_derived", None)
        return state

    def _apply(self, fn, recurse=True):
        """As any module (device moves, ``.to(dtype)``), except that the scales keep
        :data:`~.schemes.KERNEL_DTYPE`: ``.half()`` or ``.float()`` convert only the bias."""
        scales = self._buffers.pop(self.scale_buffer)
        super()._apply(fn, recurse)
        self._buffers[self.scale_buffer] = fn(scales.view(torch.int16)).view(KERNEL_DTYPE)   # an int view: dtype kept
        self._moved()
        return self

    def _moved(self) -> None:
        """After :meth:`_apply`: rebuild what the scheme keeps on the weight's device."""

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self.repack()

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        a = f", activations={self.activations}" if self.activations != DEFAULT_ACTIVATIONS else ""
        return f"n_in={self.n_in}, n_out={self.n_out}, scheme={self.scheme}{g}, bias={self.bias is not None}{a}"


class QuantizedHead(QuantizedLinear):
    """A quantized LM head: a :class:`QuantizedLinear` without bias whose logits come out in
    float32 (float64 for float64 inputs), as the float model's
    :class:`~gpt2mha.core.model.LMHead` gives them. ``QuantizedHead(...)`` and
    :meth:`from_float` give the scheme's head class (:func:`register_head`)."""

    def __init__(self, n_in: int, n_out: int, scheme: str, group_size: int | None = None, bias: bool = False):
        super().__init__(n_in, n_out, scheme, group_size, bias=False)

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.promote_types(dtype, torch.float32)

    def dequantize_for(self, rows: int) -> bool:
        """As :meth:`QuantizedLinear.dequantize_for`; also wherever the layer would take a kernel
        whose output is rounded to bf16 (:meth:`~QuantizedLinear.bf16_output_for`: torch's int4
        kernel, whose bf16 *output* rounding left ~78 distinct logits of 256 per row and ties
        for the top token): the float32 product of the dequantized weight keeps logits float32
        as the float head's."""
        return self.bf16_output_for(rows) or super().dequantize_for(rows)
