"""Every operator of gpt2mha's kernel library under ``torch.library.opcheck``: its schema (which
arguments it writes), its fake (meta) implementation against the real output's shape, dtype and
strides, its autograd registration, and its tracing by AOT autograd with dynamic shapes, so that
it behaves inside ``torch.compile`` (then one compiled graph around each, checked against eager).
"""

import pytest
import torch

from gpt2mha import kernels
from gpt2mha.inference.quant import gemv
from gpt2mha.inference.quant.schemes import pack_int4, quantize_int4

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"the kernels are not loaded: {kernels.unavailable_reason()}")


def _int4(N, K, G, g):
    q, scale_zero = quantize_int4(torch.randn(N, K, generator=g) * 0.05, G)
    return pack_int4(q), scale_zero.transpose(0, 1).contiguous()


def _per_row(N, K, g):
    q7 = torch.randint(-63, 64, (N, K), dtype=torch.int8, generator=g)
    s = torch.rand(N, generator=g) * 0.01
    return gemv.pack_rows(q7), q7.sum(1, dtype=torch.int32), s, (q7.float() * s[:, None]).sum(1)


def _cases():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    w4, sz = _int4(20, 64, 32, g)
    b = torch.randn(20, generator=g)
    q, k, v = (torch.randn(2, 3, 9, 16, generator=g) for _ in range(3))
    return {
        "int8_gemv": (x, torch.randint(-127, 128, (20, 64), dtype=torch.int8, generator=g), torch.rand(20, generator=g), b),
        "int4_gemv": (x, w4, sz, 32, b),
        "int4_gemv_a8": (x, w4, sz, 32, None),
        "int4_pack_a8": (w4, sz, 32),
        "int4_a8_packed": (x, *torch.ops.gpt2mha.int4_pack_a8(w4, sz, 32), 32, 20, b),
        "int8_per_row": (x, *_per_row(20, 64, g), b, True),
        "causal_attention": (q[..., 2:, :], k, v),
        "causal_attention_bf16": (q[..., 2:, :], k, v),
        "conv1d_f32": (x, torch.randn(64, 20, generator=g), b, True),
        "linear_f32": (x, torch.randn(20, 64, generator=g), None),
        "conv1d_bf16": (x, torch.randn(64, 20, generator=g).bfloat16(), b, True),
        "linear_bf16": (x, torch.randn(20, 64, generator=g).bfloat16(), b),
        "conv1d_f16": (x, torch.randn(64, 20, generator=g).half(), b, True),
        "linear_f16": (x, torch.randn(20, 64, generator=g).half(), b),
    }


@pytest.mark.parametrize("name", ["conv1d_f16", "linear_f32", "int8_per_row", "causal_attention"])
def test_a_tensor_on_the_meta_device_beside_cpu_ones_is_refused_not_answered(name):
    # a meta argument sends the call to the fake implementation: it refuses (a break-it review found the
    # fakes returning an uninitialized CPU output there, where the CPU kernel would have named the argument)
    args = list(_cases()[name])
    args[1] = args[1].to("meta")
    with pytest.raises(RuntimeError, match=f"{name}: every tensor must be on one device \\(the CPU\\); got cpu, meta"):
        getattr(torch.ops.gpt2mha, name)(*args)


#: The operators that take no tensors: the CPU features and paths (kernels/dispatch.cpp).
DISPATCH = {"cpu_features", "allowed_cpu_features", "allow_cpu_features", "kernel_paths"}
#: The operators checked by a test below without a case in _cases.
ELSEWHERE = {"cached_forward", *DISPATCH}


def test_every_operator_of_the_library_is_checked_here_and_has_a_fake():
    # the operators the C++ sources define (m.def): a new one needs a case here and a fake
    import re
    from gpt2mha.kernels import build, fakes
    defined = {name for source in build.SOURCES if source.endswith(".cpp")
               for name in re.findall(r'm\.def\("(\w+)\(', (build.HERE / source).read_text())}
    assert {"int8_gemv", "causal_attention", "cached_forward"} <= defined
    unchecked = defined - set(_cases()) - ELSEWHERE
    assert not unchecked, f"operators without an opcheck case in tests/test_kernel_ops.py: {sorted(unchecked)}"
    takes_tensors = defined - DISPATCH
    assert takes_tensors <= set(fakes.FAKES), f"operators without a fake in kernels/fakes.py: " \
                                              f"{sorted(takes_tensors - set(fakes.FAKES))}"


@pytest.mark.parametrize("name", ["int8_gemv", "int4_gemv", "int4_gemv_a8", "int8_per_row", "causal_attention",
                                  "causal_attention_bf16", "conv1d_f32", "linear_f32", "conv1d_bf16", "linear_bf16",
                                  "conv1d_f16", "linear_f16"])
def test_each_operator_passes_opcheck(name):
    from gpt2mha.inference.dense import has_bf16_dot
    if name == "causal_attention_bf16" and not has_bf16_dot():
        pytest.skip("causal_attention_bf16 needs AVX-512 BF16 (its refusal elsewhere: tests/test_attention_bf16.py)")
    args = _cases()[name]
    torch.library.opcheck(getattr(torch.ops.gpt2mha, name).default, args)


def _native_model():
    import warnings
    from gpt2mha import GPT2, GPT2Config
    torch.manual_seed(1)
    model = GPT2(GPT2Config(n_vocab=96, n_ctx=32, n_embd=64, n_head=4, n_layer=2, tokenizer="bytes")).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.quantize("int4", method="rtn", group_size=32, activations="per_block")


def test_the_one_call_forward_passes_opcheck():
    # its schema says it writes k and v (Tensor(a!)): opcheck checks it writes nothing else
    from gpt2mha.core.kv_cache import KVCache
    from gpt2mha.inference.native import NativeStep
    model = _native_model()
    step = NativeStep(model)
    cache = KVCache(2, 2, 4, 16, 16)
    tokens = torch.tensor([[3, 5, 7], [2, 4, 6]])
    args = (tokens, step.wte, step.wpe, step.layers, *step.ln_f, step.head, cache.k, cache.v, [0, 0],
            step.group_size, step.eps)
    torch.library.opcheck(torch.ops.gpt2mha.cached_forward.default, args)


def test_the_dispatch_operators_pass_opcheck():
    # no tensors: AOT dispatch (which traces tensors, and takes no str arguments) does not apply
    from gpt2mha.kernels import dispatch
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    with dispatch.limited(None):
        for op, args in (("cpu_features", ()), ("allowed_cpu_features", ()), ("allow_cpu_features", (["avx512"],)),
                         ("kernel_paths", (["avx512", "avx512_vnni"],)), ("kernel_paths", (None,))):
            torch.library.opcheck(getattr(torch.ops.gpt2mha, op).default, args, test_utils=checks)


def test_compiled_graphs_around_the_operators_match_eager():
    cases = _cases()
    x, w, s, b = cases["int8_gemv"]

    def f(x):
        h = torch.ops.gpt2mha.int8_gemv(x * 2, w, s, b)
        return torch.ops.gpt2mha.int8_per_row(h[:, :16].repeat(1, 4), *cases["int8_per_row"][1:]) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))
    q, k, v = cases["causal_attention"]
    attend = torch.compile(lambda q: torch.ops.gpt2mha.causal_attention(q * 0.5, k, v), backend="aot_eager",
                           fullgraph=True)
    assert torch.equal(attend(q), torch.ops.gpt2mha.causal_attention(q * 0.5, k, v))
