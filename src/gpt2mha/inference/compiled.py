"""A compiled decode step: one ``torch.compile`` of the whole single-token forward, as in
gpt-fast's ``decode_one_token``.

Inductor (torch's compiler) turns the step into generated C++ for this CPU: the per-layer small
ops (LayerNorm, GELU, residual adds, the cache write) fuse into a few loops, where the eager
path spends much of a batch-1 step outside its products: compiled, the step spends less there.

What each model gets (:func:`decode_view`):

* int8 (``quantize("int8")``, and the int8 LM head of int4 models): :class:`GemvInt8Linear`,
  gpt2mha's own int8 GEMV kernel (:mod:`.quant.gemv`, an opaque C++ operator in the step):
  float32 activations times the dequantized weight, converted in registers as the weight
  streams. Where that kernel cannot be built, :class:`WoqInt8Linear`: inductor's C++ GEMM
  template for weight-only int8 (``aten._weight_int8pack_mm``, lowered under ``freezing`` and
  ``max_autotune``) with **bf16 activations** (its contract), float32 accumulation, the
  product rounded to bf16 and the bias and residual stream kept in float32 (~2e-3 relative
  per product).
* int8 with ``activations="per_row"``: :class:`PerRowInt8Linear` (W7A8, FBGEMM's integer GEMM).
* int4 blocks: :class:`GemvInt4Linear`, gpt2mha's int4 GEMV kernel (float32 activations, the
  nibbles converted in registers) where it builds; else the eager decode view's bf16 kernel.
* float32 / bf16 / fp16: the eager decode view (:func:`~.fast.for_decoding`),
  compiled as it is (ATen's products, fused small ops).

The step compiles once for the whole loop: the cache is read up to the longest row's length,
rounded up to :data:`SPAN_STEP` positions (:func:`read_span`), with a per-row mask
(:meth:`~gpt2mha.core.kv_cache.KVCache.plan` with that ``span``), so rows of different
lengths share one attention call (no batch-invariance guarantee: masked keys change the
rounding). The span is the step's one dynamic size; the rest is static (which the C++ GEMM
templates are made for): each batch size and cache length compiles once, and ``generate``
rounds its cache up to a multiple of :data:`SPAN_MULTIPLE` positions (:func:`cache_len`) so
that calls of similar lengths share one. Compiling takes 10–60 s each time: inductor's on-disk
graph cache is turned off for these steps (:func:`options`).

Freezing makes the weights constants of the compiled code (the int8 template keeps its own
blocked copy), so a compiled step is only used while every parameter and buffer of the model
is the very tensor, unwritten, that it was compiled from (:func:`compiled_decoder` checks and
compiles again otherwise). Forward hooks would not run inside it: a model with hooks attached
is refused (:func:`compiled_decoder`).
"""

from __future__ import annotations

import copy
import itertools
import types
import weakref

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch import nn

from ..core.attention import CausalSelfAttention
from ..core.kv_cache import KVCache
from .fast import for_decoding, global_hooks, hooked, invariant_by_default, swap_modules
from .quant import gemv
from .quant.linear import DEFAULT_ACTIVATIONS, QuantizedLinear, int8_kernel, record_class


#: Cache lengths of a compiled decode are multiples of this (:func:`cache_len`).
SPAN_MULTIPLE = 64
#: Largest batch whose W7A8 products a compiled step runs on gpt2mha's kernel
#: (``torch.ops.gpt2mha.int8_per_row``) rather than FBGEMM's GEMM or ``torch._int_mm`` (the
#: same exact integer sums, bitwise equal), on CPUs without AVX-512 VNNI: over the 49 products
#: of 124M on an AVX2 CPU the kernel is faster than FBGEMM's GEMM up to 4 rows and slower at 8.
GEMV_ROWS = 4
#: The same on AVX-512 VNNI CPUs: over the 49 products of 124M and the head the kernel is
#: faster than ``torch._int_mm`` at every row count up to 16.
GEMV_ROWS_VNNI = 16
#: A compiled step reads the cached keys up to the longest row's, rounded up to a multiple of this.
SPAN_STEP = 16


def cache_len(needed: int, n_ctx: int) -> int:
    """The KV cache length a compiled decode of ``needed`` positions uses: ``needed`` rounded up
    to a multiple of :data:`SPAN_MULTIPLE`, at most ``n_ctx``."""
    return min(n_ctx, -(-needed // SPAN_MULTIPLE) * SPAN_MULTIPLE)


def read_span(needed: int, max_len: int) -> int:
    """The cache positions a compiled step reads when its rows need ``needed``: ``needed``
    rounded up to a multiple of :data:`SPAN_STEP`, and short of ``max_len`` whenever ``needed``
    is. The span is a dynamic size of the compiled step (one compile for all of them), but a
    span of the whole cache makes its keys a contiguous tensor, which the compiled code
    specializes on: a second compile. ``generate`` never needs it (its last token is never fed
    back, so its steps need at most ``max_len - 1``) unless a sliding window fills the cache."""
    if needed >= max_len:
        return max_len
    return min(max_len - 1, -(-needed // SPAN_STEP) * SPAN_STEP)


class WoqInt8Linear(nn.Module):
    """An int8 :class:`~gpt2mha.inference.quant.linear.QuantizedLinear` for the compiled step:
    ``y = bf16(x) @ (q · s)ᵀ + b`` through ``aten._weight_int8pack_mm`` (int8 ``q [N, K]``,
    bf16 ``s [N]``, float32 accumulation, a bf16 product), which inductor lowers to its C++
    weight-only-int8 GEMM template.

    Shares the layer's int8 weight (no copy); the scales are already bf16
    (:data:`~gpt2mha.inference.quant.schemes.KERNEL_DTYPE`). Forward ``[..., K]`` →
    ``[..., N]`` in the dtype the layer itself returns (float32 logits for the head).
    """

    def __init__(self, layer: QuantizedLinear):
        super().__init__()
        if layer.grouped:                                   # one scale per output row, not groups
            raise ValueError(f"WoqInt8Linear takes an int8 layer; got scheme={layer.scheme!r}")
        self.n_in, self.n_out, self.out_dtype = layer.n_in, layer.n_out, layer.out_dtype
        self.weight = nn.Parameter(layer.weight, requires_grad=False)            # the same storage
        self.scales = nn.Parameter(layer.scales.to(torch.bfloat16), requires_grad=False)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(x2, self.weight, self.scales).to(self.out_dtype(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)


class GemvInt8Linear(nn.Module):
    """An int8 :class:`~gpt2mha.inference.quant.linear.QuantizedLinear` for the compiled step on
    our own kernel (:mod:`~gpt2mha.inference.quant.gemv`, where it builds): ``y = x @ (q · s)ᵀ + b``
    with **float32 activations**, each int8 weight converted to float32 in registers, float32
    accumulation: the float32 product with the dequantized weight (~1e-6 relative, summation
    order), not :class:`WoqInt8Linear`'s bf16 activations (~2e-3). An opaque C++ operator inside
    the step (``torch.ops.gpt2mha.int8_gemv``); a row's result does not depend on the other rows.

    Shares the layer's int8 weight and bias (no copy); keeps a float32 copy of the scales. Forward ``[..., K]`` → ``[..., N]`` in the
    dtype the layer itself returns; the bias is added in float32 inside the kernel for float32
    outputs, after the product is rounded to the model's dtype otherwise (as the eager layer).
    """

    def __init__(self, layer: QuantizedLinear):
        super().__init__()
        if layer.grouped:                                   # one scale per output row, not groups
            raise ValueError(f"GemvInt8Linear takes an int8 layer; got scheme={layer.scheme!r}")
        self.n_in, self.n_out, self.out_dtype = layer.n_in, layer.n_out, layer.out_dtype
        self.weight = nn.Parameter(layer.weight.contiguous(), requires_grad=False)   # the same storage
        self.scales = nn.Parameter(layer.scales.float(), requires_grad=False)
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in).float()
        out = self.out_dtype(x.dtype)
        fused = self.bias is not None and out == torch.float32 and self.bias.dtype == torch.float32
        y = torch.ops.gpt2mha.int8_gemv(x2, self.weight, self.scales, self.bias if fused else None).to(out)
        if self.bias is not None and not fused:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)


class GemvInt4Linear(nn.Module):
    """An int4 :class:`~gpt2mha.inference.quant.linear.QuantizedLinear` for the compiled step on
    our own kernel (``torch.ops.gpt2mha.int4_gemv``, :func:`~gpt2mha.inference.quant.gemv.int4_gemv`):
    ``y = x @ deq(W)ᵀ + b`` with **float32 activations**, each nibble converted to float32 in
    registers, ``deq(W) = (q − 8)·s + z`` per group: the float32 product with the dequantized
    weight, where the eager int4 kernel takes bf16 activations (slow on CPUs without native
    bf16). A row's result does not depend on the other rows.

    With ``a8=True`` (what a :class:`~gpt2mha.inference.quant.int4_linear.W4A8Linear`, the
    layer's ``activations="per_block"``, hands the step), the kernel's W4A8 product instead
    (``torch.ops.gpt2mha.int4_a8_packed`` on the layer's packed copy,
    :meth:`~gpt2mha.inference.quant.int4_linear.Int4Linear.a8_packed`: each activation row
    rounded to 8 bits per group), the layer's own product.

    Shares the layer's packed nibbles ``[N, K/2]`` and bias; keeps the (scale, zero) pairs as
    bfloat16 ``[N, K/g, 2]`` (:meth:`~gpt2mha.inference.quant.linear.QuantizedLinear.gemv_scales`).
    Forward ``[..., K]`` → ``[..., N]`` in the dtype the layer itself returns.
    """

    def __init__(self, layer: QuantizedLinear, a8: bool = False):
        super().__init__()
        if not layer.grouped:                               # a scale and a zero per group of inputs
            raise ValueError(f"GemvInt4Linear takes an int4 layer; got scheme={layer.scheme!r}")
        self.n_in, self.n_out, self.out_dtype, self.group_size = layer.n_in, layer.n_out, layer.out_dtype, layer.group_size
        self.weight = nn.Parameter(layer.weight.contiguous(), requires_grad=False)   # the same storage
        self.scale_zero = nn.Parameter(layer.gemv_scales(), requires_grad=False)
        self.bias = layer.bias
        self.per_block = a8
        if self.per_block:
            packed, params = layer.a8_packed()
            self.a8 = nn.Parameter(packed, requires_grad=False)
            self.a8_params = nn.Parameter(params, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in).float()
        out = self.out_dtype(x.dtype)
        fused = self.bias is not None and out == torch.float32 and self.bias.dtype == torch.float32
        b = self.bias if fused else None
        if self.per_block:
            y = torch.ops.gpt2mha.int4_a8_packed(x2.contiguous(), self.a8, self.a8_params, self.group_size, self.n_out, b)
        else:
            y = torch.ops.gpt2mha.int4_gemv(x2, self.weight, self.scale_zero, self.group_size, b)
        y = y.to(out)
        if self.bias is not None and not fused:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)


#: FBGEMM's packed 7-bit weights of the live :class:`PerRowInt8Linear` layers, by key (the
#: operator below takes the key: a packed weight is a TorchScript object, which dynamo does not trace).
_FBGEMM_PACKED: dict[int, object] = {}
_keys = itertools.count()


def _fbgemm_rows(u: torch.Tensor, key: int, n_out: int) -> torch.Tensor:
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 128, _FBGEMM_PACKED[key])


# A plain operator with a CPU kernel, not torch.library.custom_op: its wrapper (autograd and
# schema checks) costs ~20 us a call, ~1 ms a step over 124M's 49 products (measured).
_lib = torch.library.Library("gpt2mha", "FRAGMENT")
_lib.define("fbgemm_rows(Tensor u, int key, int n_out) -> Tensor")
_lib.impl("fbgemm_rows", _fbgemm_rows, "CPU")


@torch.library.register_fake("gpt2mha::fbgemm_rows", lib=_lib)
def _(u: torch.Tensor, key: int, n_out: int) -> torch.Tensor:
    return u.new_empty(u.shape[0], n_out)


def fbgemm_rows(u: torch.Tensor, key: int, n_out: int) -> torch.Tensor:
    """``(u + 128) @ q7ᵀ · scales7`` → float32 ``[M, n_out]`` for float32 ``u [M, K]`` holding
    integers in ``[-128, 127]``, by FBGEMM's uint8 × int8 GEMM over the packed weight
    ``_FBGEMM_PACKED[key]`` (exact int32 sums: :func:`~.quant.int8_products.int8_matmul_per_row`): the
    operator ``torch.ops.gpt2mha.fbgemm_rows``, an opaque call inside the compiled step; the row
    rounding before it and the rescale after it are ordinary ops that inductor fuses with their
    neighbours."""
    return torch.ops.gpt2mha.fbgemm_rows(u, key, n_out)


class PerRowInt8Linear(nn.Module):
    """An int8 :class:`~gpt2mha.inference.quant.linear.QuantizedLinear` with
    ``activations="per_row"`` for the compiled step: the same W7A8 product as the eager layer
    (:func:`~gpt2mha.inference.quant.int8_products.int8_matmul_per_row`: each activation row rounded to
    8 bits with its own scale and zero point, 7-bit weights), written as ops inductor fuses
    (the row's min/max, the rounding, the rescale and the bias) around one integer GEMM:
    FBGEMM's (:func:`fbgemm_rows`, CPUs without VNNI/AMX) or ``torch._int_mm``, which inductor
    lowers itself; up to :data:`GEMV_ROWS` rows (:data:`GEMV_ROWS_VNNI` on AVX-512 VNNI CPUs),
    where it builds, the whole layer in gpt2mha's ``torch.ops.gpt2mha.int8_per_row`` instead
    (the same rounding and rescale, the product on weights packed for it,
    :func:`~.quant.gemv.pack_rows`; ``vpmaddubsw`` or VNNI's ``vpdpbusd``: the same exact
    integer sums). A row's result does not depend on the other rows.

    Forward ``[..., K]`` → ``[..., N]`` in the dtype the layer itself returns. Rows holding NaN
    or ±inf give non-finite rows (the eager layer gives NaN rows).
    """

    def __init__(self, layer: QuantizedLinear):
        super().__init__()
        if layer.grouped or layer.activations_mode == DEFAULT_ACTIVATIONS:
            raise ValueError(f"PerRowInt8Linear takes an int8 layer with activations='per_row'; got "
                             f"scheme={layer.scheme!r}, activations={layer.activations!r}")
        self.n_in, self.n_out, self.out_dtype = layer.n_in, layer.n_out, layer.out_dtype
        self.kernel = int8_kernel()
        q7, scales7, packed, wsum = layer.per_row_weights()
        self.wsum = nn.Parameter(wsum, requires_grad=False)
        self.bias = layer.bias
        self.gemv = gemv.available()
        if self.gemv:                    # decode sizes on gpt2mha's kernel (maddubs or VNNI: FBGEMM's sums)
            q7p, qsum, scales7p, wsum_p = layer.per_row_packed()
            self.q7p = nn.Parameter(q7p, requires_grad=False)
            self.qsum = nn.Parameter(qsum, requires_grad=False)
            self.scales7p = nn.Parameter(scales7p, requires_grad=False)
            self.wsum_p = nn.Parameter(wsum_p, requires_grad=False)
            self.gemv_rows = GEMV_ROWS_VNNI if gemv.vnni() else GEMV_ROWS
        if self.kernel == "fbgemm":
            self.key = next(_keys)
            _FBGEMM_PACKED[self.key] = packed
            weakref.finalize(self, _FBGEMM_PACKED.pop, self.key, None)
        else:
            self.q7t = nn.Parameter(q7.t(), requires_grad=False)                 # [K, N] int8
            self.scales7 = nn.Parameter(scales7, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.n_in).float()
        if self.gemv and x2.shape[0] <= self.gemv_rows:
            # the rounding, product and rescale in one call: its output is a tensor inductor
            # cannot fold into the next op (written as graph ops, the rescale of c_attn's output
            # was recomputed for every cached key inside the attention kernel)
            y = torch.ops.gpt2mha.int8_per_row(x2, self.q7p, self.qsum, self.scales7p, self.wsum_p,
                                               None if self.bias is None else self.bias.float())
            return y.to(self.out_dtype(x.dtype)).view(*x.shape[:-1], self.n_out)
        lo = x2.amin(-1, keepdim=True)
        a = (x2.amax(-1, keepdim=True) - lo) / 255
        u = ((x2 - lo) / a.clamp(min=1e-30)).round() - 128                       # integers in [-128, 127]
        if self.kernel == "fbgemm":
            y = fbgemm_rows(u, self.key, self.n_out)
        else:
            y = torch._int_mm(u.to(torch.int8), self.q7t).float() * self.scales7
        y = (y * a + (a * 128 + lo) * self.wsum).to(self.out_dtype(x.dtype))     # x = a·(u + 128) + lo
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.n_out)


def decode_view(model: nn.Module, batch_invariant: bool | None = None) -> nn.Module:
    """``model``'s decode view (:func:`~.fast.for_decoding`) as the compiled step runs it (a
    view: ``model`` is not changed): every int8 quantized layer swapped for a
    :class:`GemvInt8Linear` (:class:`PerRowInt8Linear` with ``activations="per_row"``;
    :class:`WoqInt8Linear` where the GEMV kernel does not build), every int4 one for a
    :class:`GemvInt4Linear` where it does, and attention on the explicit core (``attn_impl="explicit"``,
    OpenAI's formula), which inductor fuses into the step, where the fused SDPA kernel is an
    opaque call costing ~0.15 ms per layer at one token (profiled on 124M)."""
    def replace(path: str, m: nn.Module) -> nn.Module | None:
        if hooked(m):
            return None
        if isinstance(m, QuantizedLinear) and m.weight.device.type == "cpu":
            return m.compiled_layer()                           # what the layer's class hands the step
        if isinstance(m, CausalSelfAttention):
            new = copy.copy(m)                                  # shallow: parameters shared
            new._modules = {name: replace(f"{path}.{name}", child) or child for name, child in m._modules.items()}
            new.attn_impl = "explicit"
            return new
        return None
    with torch.no_grad():
        return for_decoding(swap_modules(model, replace), batch_invariant=batch_invariant)


def has_hooks(model: nn.Module) -> bool:
    """Whether any module of ``model`` has forward hooks or pre-hooks (capture points included),
    or hooks are registered for every module (:func:`~.fast.global_hooks`)."""
    return global_hooks() or any(hooked(m) for m in model.modules())


class _Step(nn.Module):
    """One decode step of ``view`` as a module (what is compiled): logits ``[B, 1, n_vocab]``."""

    def __init__(self, view: nn.Module):
        super().__init__()
        self.view = view

    def forward(self, token: torch.Tensor, cache: KVCache, step) -> torch.Tensor:
        step = step._replace(span=step.mask.shape[-1])          # symbolic: one compiled step for every span
        return self.view(token, cache=cache, step=step, last_only=True, validate=False).logits


class _Unadvanced(KVCache):
    """A cache over another's storage and lengths whose :meth:`advance` does nothing: the step
    is compiled without reading the lengths (which change every step and would recompile it);
    :meth:`CompiledDecoder.__call__` advances the real cache after the step."""

    @classmethod
    def over(cls, cache: KVCache) -> "_Unadvanced":
        view = cls.__new__(cls)
        view._bind(cache.k, cache.v, cache._lengths, cache._offset)
        return view

    def advance(self, n: int) -> None:
        pass


def model_signature(model: nn.Module, refuse=None) -> tuple | None:
    """What a compiled step or a native forward built for ``model`` depends on, as a comparable
    tuple (None where ``refuse`` says a module cannot be captured); a changed signature means
    rebuilding."""
    # the tensors (which object, its writes, its storage: `p.data = t` keeps the object and the
    # count), how each int8 layer treats its activations (set_activations changes the view) and
    # each LayerNorm's eps; one walk over the modules (generate asks it every call); None where
    # refuse(module). An inference-mode tensor counts no writes: its entry's count is -1.
    sig = []
    for m in model.modules():
        if refuse is not None and refuse(m):
            return None
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                sig.append((id(t), t._version if not t.is_inference() else -1, t.data_ptr()))
        if isinstance(m, QuantizedLinear):
            sig.append(m.activations)
        elif isinstance(m, nn.LayerNorm):
            sig.append(m.eps)
    return tuple(sig)


def options(model: nn.Module) -> dict:
    """Inductor options for ``model``'s step: freezing (weights as constants), inductor's on-disk
    graph cache off (it handed a compiled step holding one 124M model's frozen weights to
    another model of the same shapes: measured, tests/test_compiled.py), and for an int8
    model max-autotune over inductor's C++ GEMM templates only (max-autotune times its
    candidates on weights hot in cache, where ATen's eager kernel looks faster than it is when
    the weights stream from memory); for a per_row model on
    ``torch._int_mm`` (VNNI CPUs), no freezing (it broke that step)."""
    opts = {"freezing": True, "fx_graph_cache": False}
    blocks = record_class(getattr(model, "quantization", None))
    if blocks is not None:                          # the blocks' class: int8's template without our kernel
        opts.update(blocks.model_compile_options())
    for m in model.modules():                       # each layer's (a layer may be set alone: its int8 head, say)
        if isinstance(m, QuantizedLinear):
            opts.update(m.compile_options())
    return opts


class CompiledDecoder:
    """A compiled decode step for ``model`` (see the module's docstring).

    Call with ``token [B, 1]`` (int64) and a :class:`KVCache` of ``B`` rows: writes the token's
    keys/values, advances the cache, returns float32 logits ``[B, n_vocab]``. Run under
    ``torch.inference_mode()`` or ``no_grad`` (freezing needs gradients off).

    Raises:
        RuntimeError: when called with gradients enabled.
    """

    def __init__(self, model: nn.Module, batch_invariant: bool | None = None):
        self.batch_invariant = batch_invariant
        self.signature = model_signature(model)
        self.options = options(model)
        self.step = _Step(decode_view(model, batch_invariant)).eval()
        # dynamo keeps compiled code per code object and, with the module guards dropped below,
        # would hand one decoder's code (its frozen weights) to another: each decoder traces its
        # own copy of forward's code, whose compiled entries live and die with it
        forward = _Step.forward
        self.step.forward = types.MethodType(
            types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__), self.step)
        # no guards on the modules: the view is private to this decoder, and compiled_decoder
        # checks the model's tensors itself (guards on every module cost ~0.7 ms a step on 124M)
        self.compiled = torch.compile(self.step, fullgraph=True, dynamic=False,
                                      options={**self.options,
                                               "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def __call__(self, token: torch.Tensor, cache: KVCache) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("a compiled decode step runs without gradients: call it under torch.inference_mode()")
        plan = cache.plan(1, span=read_span(max(cache.lengths) + 1, cache.max_len), per_row=True)
        if plan.span > 1:                                        # sizes 0 and 1 are always specialized
            torch._dynamo.maybe_mark_dynamic(plan.mask, 3)
        read = {k: v for k, v in self.options.items() if k in ("freezing", "fx_graph_cache")}
        with torch._inductor.config.patch(read), \
                torch._functorch.config.patch(enable_autograd_cache=False):    # read while dynamo traces
            logits = self.compiled(token, _Unadvanced.over(cache), plan._replace(span=0))
        cache.advance(1)
        return logits[:, -1]


_decoders: "weakref.WeakKeyDictionary[nn.Module, CompiledDecoder]" = weakref.WeakKeyDictionary()


def compiled_decoder(model: nn.Module, batch_invariant: bool | None = None) -> CompiledDecoder:
    """The :class:`CompiledDecoder` of ``model``, made on first use and kept while the model
    lives; made again when any parameter or buffer was replaced or written in place since, or
    for another ``batch_invariant`` (:func:`~.fast.for_decoding`'s; None: its default).

    Raises:
        ValueError: the model has forward hooks (they would not run inside compiled code), is
            not on the CPU, or is sharded over processes (tensor parallel).
    """
    from .parallel import tp_group
    if tp_group(model)[0]:
        raise ValueError("compile=True does not take a tensor-parallel model (its products are collectives); "
                         "decode it without compile")
    if has_hooks(model):
        raise ValueError("compile=True: the model has forward hooks attached, which a compiled step would skip; "
                         "remove them (model.reset_hooks()) or decode without compile")
    device = model.wte.weight.device
    if device.type != "cpu":
        raise ValueError(f"compile=True is for CPU models (inductor's C++ backend); the model is on {device}")
    if batch_invariant is None:
        batch_invariant = invariant_by_default(model)
    dec = _decoders.get(model)
    if dec is None or dec.signature != model_signature(model) or dec.batch_invariant != batch_invariant:
        dec = _decoders[model] = CompiledDecoder(model, batch_invariant)
    return dec
