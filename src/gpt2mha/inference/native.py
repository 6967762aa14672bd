"""The forward in one C++ call, for quantized models on the CPU: int4 with per_block (W4A8)
activations, int8 with per_row (W7A8) activations; and for float32 models (float32 products of
the model's own weights, ``kernels/float_products.cpp``), bf16 models (bf16 products,
``kernels/bf16_products.cpp``) and fp16 models (float32 sums of the fp16 weights,
``kernels/float_products.cpp``).

:func:`~gpt2mha.inference.generate.generate` runs such a model (on the CPU, nothing hooked, the
kernels built) through ``torch.ops.gpt2mha.cached_forward`` (``kernels/cached_forward.cpp``): every decode
step, and each prompt's prefill too (int4 per_block prompts on the same W4A8 products as its
steps, as the model's own layers take them), the embedding, every block (LayerNorm, the four products,
attention over the row's own cached keys, GELU, the residual adds), ``ln_f`` and the head at
each row's last token, in one call.

Why: at batch 1 a 124M int4 step reads ~92 MB of weights, a few milliseconds at a CPU's memory
speed, and a step driven from Python or inductor's compiled code spends about a third as much
again outside its products (48 operator calls, the small ops between them, the wrapper), a
prompt likewise outside its products and attention; one C++ call leaves only their arithmetic
(docs/explanation/routes.md). The arithmetic is the model's: the same W4A8, W7A8 and int8 product
kernels the model's layers call, LayerNorm, GPT-2's GELU and the softmax in float32 with sums in
other orders: activations a last bit apart, which the products' 8-bit rounding of each activation
row now and then turns into one rounding step of a value, so most steps' logits agree with the
model's to ~1e-6 and a few differ by up to ~1e-2 relative (as the compiled step's do); greedy
tokens part from the model's only at near ties, and quality is the same (tests/test_native.py).

A float32 model's steps take the same route with float32 products (``conv1d_f32`` over each
Conv1D's ``[in, out]`` weight as the model holds it, ``linear_f32`` over the head's ``[n_vocab,
n_embd]``: no copies), each output summed in one fixed order, so a row's logits never depend on
the other rows or the threads (batch invariant, where the decode view's MKL products are not).
Nothing rounds activations there: logits agree with the model's own forward to ~1e-6 relative
(sums in another order) and greedy tokens are the model's but at exact near-ties. Its prompts
run on it too (the same products on every prompt row, GELU fused into ``c_fc``, gpt2mha's causal
attention kernel): on 512 tokens ``conv1d_f32`` outruns MKL's ``addmm``. Why: MKL's GEMV,
called from Python 49 times a step, reads 124M's 497 MB at about half the memory's speed
(docs/performance.md, a step's products against torch's GEMMs).

A bf16 model's steps likewise: its products on AVX-512 BF16's ``vdpbf16ps`` where the CPU has it
(the same adds on 8 float32 lanes where not), every value the model rounds to bf16 rounded at the
same points (each product's, LayerNorm's, GELU's and attention's output, each residual add, the
embedding sum), its KV cache in bf16; attention and the head in float32 as its own. Its logits
agree with its own forward but where a sum in another order rounds to the neighbouring bf16
value; batch invariant likewise.

A fp16 model's steps and prompts the same way at fp16's rounding points: its products are the
float32 products' sums over each fp16 weight converted exactly (F16C's ``vcvtph2ps``; no CPU here
multiplies fp16 natively), each output rounded to fp16 once, as torch's fp16 GEMM on the CPU
rounds its float32 sums; its KV cache in fp16. torch's own fp16 products on such a CPU run well
below float32's speed; on this route a fp16 step runs at about bf16's, reading as many bytes
(benchmarks/results/float_routes.json: the native route against the decode view).

Source: the loop of gpt-fast's ``decode_one_token`` and llama.cpp's graph for GPT-2, with the
arithmetic of openai/gpt-2's ``model.py`` (``block``, ``attn``, ``norm``, ``gelu``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..core.kv_cache import KVCache
from .fast import global_hooks, hooked
from . import huge_pages
from .quant import gemv
from ..core.attention import Conv1D
from ..core.model import LMHead
from .quant.linear import QuantizedLinear, record_class

#: the float kinds of :func:`_kind` (cached_forward's kinds of those models, kernels/cached_forward.cpp)
#: and their dtypes
FLOAT_DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _blocks(model: nn.Module) -> type | None:
    # the layer class the model's quantization record names, where it runs on the native forward
    cls = record_class(getattr(model, "quantization", None))
    return cls if cls is not None and cls.native_kind else None


def _kind(model: nn.Module) -> str:
    """The kind ``cached_forward`` takes for ``model``: its quantization record's layer class's
    (:attr:`~.quant.linear.QuantizedLinear.native_kind`: "w4a8", "w7a8"), "float32", "bf16",
    "fp16" (no quantization record, and weights of that dtype) or "" (no native forward)."""
    q = getattr(model, "quantization", None) or {}
    blocks = _blocks(model)
    if blocks is not None:
        return blocks.native_kind
    wte = getattr(getattr(model, "wte", None), "weight", None)
    if not q and isinstance(wte, torch.Tensor):
        return {dtype: kind for kind, dtype in FLOAT_DTYPES.items()}.get(wte.dtype, "")
    return ""


def why_not(model: nn.Module) -> str:
    """Why ``generate`` does not run ``model`` on the native forward ("" when it does, without
    ``compile``): not per_row/per_block/float32/bf16/fp16, the kernels not built, hooks attached
    (global ones too), not on the CPU, blocks cut or mixed, a head_dim that is not a multiple of 8."""
    if not _kind(model):
        return "not a float32, bf16, fp16, int8 per_row or int4 per_block model (model.quantization)"
    if not gemv.available():
        return f"the C++ kernels are not built ({gemv.unavailable_reason()})"
    if not all(hasattr(model, name) for name in ("wte", "wpe", "h", "ln_f", "lm_head", "config")):
        return "not a GPT2"
    kind = _kind(model)
    dtype = FLOAT_DTYPES.get(kind, torch.float32)
    if model.wte.weight.device.type != "cpu" or model.wte.weight.dtype != dtype:
        return f"the model is {model.wte.weight.dtype} on {model.wte.weight.device}, not {dtype} on the CPU"
    from .compiled import has_hooks
    if has_hooks(model):
        return "the model has hooks attached"
    if len(model.h) != model.config.n_layer:
        return f"it holds {len(model.h)} blocks where its config says n_layer={model.config.n_layer}"
    head_dim = model.config.n_embd // model.config.n_head
    if head_dim % 8:
        return f"head_dim={head_dim} is not a multiple of 8 (the kernels' vectors)"
    if kind in FLOAT_DTYPES:
        return _why_not_float(model, dtype)
    blocks = _blocks(model)
    groups = set()
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if not (isinstance(layer, blocks) and layer.bias is not None and layer.bias.dtype == torch.float32):
                return "its blocks are not all int4 with per_block activations or int8 with per_row ones"
            groups.add(layer.group_size)
        for norm in (block.ln_1, block.ln_2):
            if norm.weight is None or norm.bias is None:
                return "a LayerNorm has no weight or bias"
    head = model.lm_head
    if blocks.grouped and isinstance(head, QuantizedLinear) and head.scheme == blocks.scheme:   # in the blocks' groups
        if not isinstance(head, blocks) or head.bias is not None:
            return f"its {blocks.scheme} head does not take the blocks' {blocks.activations_mode} activations, or has a bias"
        groups.add(head.group_size)
    elif not (isinstance(head, QuantizedLinear) and (head.scheme, head.activations) in blocks.native_heads):
        return "its head is not int8 with the blocks' activations (int4 models: exact) or int4 per_block"
    eps = {m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}
    if len(groups) != 1 or len(eps) != 1:
        return "its layers differ in group size or LayerNorm epsilon"
    if any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers())):
        return "a tensor is not on the CPU"
    return ""


def _why_not_float(model: nn.Module, dtype: torch.dtype) -> str:
    # why_not's checks of a float32 or bf16 model's layers (the common ones are done)
    name = str(dtype).removeprefix("torch.")
    for block in model.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if not (type(layer) is Conv1D and layer.weight.dtype == dtype and layer.bias is not None
                    and layer.bias.dtype == dtype):
                return f"its blocks' layers are not all {name} Conv1Ds with biases"
        for norm in (block.ln_1, block.ln_2, model.ln_f):
            if norm.weight is None or norm.bias is None or norm.weight.dtype != dtype:
                return f"a LayerNorm has no weight or bias, or is not {name}"
    head = model.lm_head
    if not (isinstance(head, LMHead) and head.weight.dtype == dtype and head.weight.dim() == 2
            and model.wpe.weight.dtype == dtype):
        return f"its head or position embedding is not {name}"
    if len({m.eps for m in model.modules() if isinstance(m, nn.LayerNorm)}) != 1:
        return "its LayerNorms differ in epsilon"
    if any(t.device.type != "cpu" for t in (*model.parameters(), *model.buffers())):
        return "a tensor is not on the CPU"
    return ""


def _product(layer: nn.Module) -> list[torch.Tensor]:
    # the layer's tensors in cached_forward.cpp's layouts: a quantized layer's own (its class's
    # native_tensors), a float32, bf16 or fp16 Conv1D's or head's weight as it is
    if isinstance(layer, QuantizedLinear):
        return layer.native_tensors()
    return [layer.weight.detach().contiguous()]


class NativeStep:
    """``model``'s forward as one call of ``torch.ops.gpt2mha.cached_forward`` (see the module's
    docstring). Holds the model's tensors (no copies but those the kernels' layouts need: the
    int4 layers' W4A8 tiles and per_row's packed 7-bit weights, as the model's own layers keep
    them; a float32 model's weights as they are).

    Call with ``tokens [B, T]`` (int64; T > 1: a prompt, every row at the same length) and a :class:`KVCache` of ``B`` rows (each row's storage
    ``[n_head, T_max, head_dim]`` contiguous: a cache, or rows of one): row ``b``'s tokens go
    at its cache indices ``lengths[b] …`` (its positions; with ``T > 1`` every row at the same
    length); writes every layer's keys and values there, advances the cache, returns float32
    logits ``[B, n_vocab]`` of each row's last token.

    Raises:
        ValueError: ``model`` cannot run on it (:func:`native_step` says why).
        RuntimeError: from the operator, for a cache or tokens that do not fit (past ``T_max``
            or n_ctx, a token id past the vocabulary, rows of different lengths with ``T > 1``),
            naming them.
    """

    def __init__(self, model: nn.Module):
        why = why_not(model)
        if why:
            raise ValueError(f"no native forward for this model: {why}")
        # LayerNorms and biases as float32 (a bf16 model's: copies, exact; the kernels read them so)
        f32 = lambda t: t.detach().float()                     # noqa: E731
        layers = []
        for block in model.h:
            layers += [f32(block.ln_1.weight), f32(block.ln_1.bias)]
            for i, layer in enumerate((block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)):
                if i == 2:
                    layers += [f32(block.ln_2.weight), f32(block.ln_2.bias)]
                layers += [*_product(layer), f32(layer.bias)]
        self.layers = [t.detach() for t in layers]
        self.wte, self.wpe = model.wte.weight.detach(), model.wpe.weight.detach()
        self.ln_f = (f32(model.ln_f.weight), f32(model.ln_f.bias))
        head = model.lm_head
        bias = getattr(head, "bias", None)
        bias = torch.empty(0) if bias is None else bias.detach().float()
        self.head = [*_product(head), bias]
        c = model.config
        self.sizes = (len(model.h), c.n_head, c.n_embd // c.n_head)
        #: cached_forward's kind and the group size of its products (0: no groups)
        self.kind = _kind(model)
        self.group_size = 0 if self.kind in FLOAT_DTYPES else model.h[0].attn.c_attn.native_group_size()
        self.eps = float(model.ln_f.eps)
        # what the engine prefills prompts with: every prompt, on the products of the steps (per_row's
        # W7A8, per_block's W4A8, as the model's own layers take prompts), a float32 or bf16
        # model's like its steps (conv1d_f32 at 512 rows outran MKL's addmm, ~1.3x; a bf16
        # prompt's head on its own forward converted wte to float32 every prompt)
        self.prefill = self
        self.prefill_from = 1
        #: native_step's collapse of these weights into 2 MB pages (huge_pages.Collapse), if any
        self.huge_pages = None
        #: Engine.check_prefix_cache's measurement on this step: "" (a suffix's bits are a whole
        #: prompt's), why not, or None (not measured)
        self.prefix_cache_differs = None

    def __call__(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        L, _, h, _, hd = cache.k.shape
        if (L, h, hd) != self.sizes:
            raise ValueError(f"the cache is [n_layer={L}, B, n_head={h}, T_max, head_dim={hd}]; this model needs "
                             f"n_layer={self.sizes[0]}, n_head={self.sizes[1]}, head_dim={self.sizes[2]}")
        logits = torch.ops.gpt2mha.cached_forward(tokens.long().contiguous(), self.wte, self.wpe, self.layers,
                                                  *self.ln_f, self.head, cache.k, cache.v, cache.lengths,
                                                  self.group_size, self.eps, self.kind)
        cache.advance(tokens.shape[1])
        return logits


_steps: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, NativeStep]]" = weakref.WeakKeyDictionary()


def native_step(model: nn.Module) -> NativeStep | None:
    """``model``'s :class:`NativeStep`, or None where it has none (not a float32, int4 per_block or
    int8 per_row model, hooks attached, not float32 on the CPU, the kernels not built). Made on
    first use and kept while the model lives; made again when any parameter or buffer was
    replaced, written in place or given new data (``p.data = t``) since, or a LayerNorm's eps
    changed; made every call for a model holding tensors made in inference mode (they count no
    writes). A step made here starts collapsing the memory of the weights it reads into 2 MB
    pages, in a thread beside the decode (its ``huge_pages``: a :class:`huge_pages.Collapse`, or
    None; :mod:`gpt2mha.inference.huge_pages`)."""
    if not _kind(model) or not gemv.available():
        return None                                            # (asked every generate call: cheap first)
    from .compiled import model_signature
    sig = None if global_hooks() else model_signature(model, refuse=hooked)     # every call: hooks come and go
    if sig is None:
        return None
    kept = _steps.get(model)
    if kept is not None and kept[0] == sig:
        return kept[1]
    if why_not(model):
        return None
    step = NativeStep(model)
    # its weights into 2 MB pages, beside the decode (huge_pages' docstring says why)
    step.huge_pages = huge_pages.collapse_in_background([*step.layers, *step.head, step.wte, step.wpe])
    # a tensor made in inference mode counts no writes: such a model's step is made every call
    # (it holds copies: the int4 pairs in the kernel's layout)
    if not any(type(e) is tuple and e[1] == -1 for e in sig):
        _steps[model] = (sig, step)
    return step
