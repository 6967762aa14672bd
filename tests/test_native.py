"""The forward in one C++ call (gpt2mha.inference.native, kernels/cached_forward.cpp) against the model's own
forward with a KVCache (the reference: the model is tested against transformers and
openai/gpt-2's formulas elsewhere; both run the same W4A8, W7A8 and int8 product kernels, so
what differs is LayerNorm, softmax and GELU in float32 summed in other orders)."""

import warnings
from unittest import mock

import pytest
import torch

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.inference import native
from gpt2mha.inference.native import NativeStep, native_step
from gpt2mha.inference.quant import gemv, set_activations
from gpt2mha.inference.quant.linear import QuantizedLinear

needs_kernel = pytest.mark.skipif(not gemv.available(), reason=f"the kernels are not loaded: {gemv.unavailable_reason()}")


def _model(seed=0, n_ctx=64, n_embd=64, n_head=4, n_layer=2, group_size=32, kind="per_block"):
    # kind: "per_block" (int4, W4A8, the int8 head), "per_block_head4" (the same with an int4 head), "per_row"
    torch.manual_seed(seed)
    cfg = GPT2Config(n_vocab=96, n_ctx=n_ctx, n_embd=n_embd, n_head=n_head, n_layer=n_layer, tokenizer="bytes")
    model = GPT2(cfg).eval()
    with torch.no_grad():                               # larger LayerNorm gains and biases than init's
        for name, p in model.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "per_row":
            return model.quantize("int8", method="rtn", activations="per_row")
        return model.quantize("int4", method="rtn", group_size=group_size, activations="per_block",
                              head="int4" if kind == "per_block_head4" else "int8")


def _prefilled(model, lengths, max_len=32, seed=1):
    """A cache whose row b holds lengths[b] tokens of a random prompt, prefilled by the model."""
    c = model.config
    torch.manual_seed(seed)
    cache = KVCache(c.n_layer, len(lengths), c.n_head, max_len, c.n_embd // c.n_head)
    with torch.inference_mode():
        for b, n in enumerate(lengths):
            model(torch.randint(0, c.n_vocab, (1, n)), cache=cache.row(b), last_only=True)
    return cache


def _clone(cache, rows=None):
    """A copy of cache (of its rows ``rows``), in storage of its own."""
    rows = range(cache.batch_size) if rows is None else rows
    L, _, h, T, hd = cache.k.shape
    copy = KVCache(L, len(rows), h, T, hd)
    for i, b in enumerate(rows):
        copy.load(i, cache, b)
    return copy


KINDS = pytest.mark.parametrize("kind", ["per_block", "per_block_head4", "per_row"])


@needs_kernel
@KINDS
def test_native_steps_match_the_models_own_steps_on_rows_of_different_lengths(kind):
    model = _model(kind=kind)
    step = NativeStep(model)
    lengths = [5, 1, 12]
    ours, ref = _prefilled(model, lengths), None
    ref = _clone(ours)
    torch.manual_seed(2)
    with torch.inference_mode():
        for _ in range(6):
            token = torch.randint(0, 96, (3, 1))
            want = model(token, cache=ref, last_only=True).logits[:, -1]
            got = step(token, ours)
            assert got.shape == want.shape == (3, 96) and got.dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
            assert ours.lengths == ref.lengths
        # every key and value each step wrote, where the model wrote its own
        for b, n in enumerate(ref.lengths):
            torch.testing.assert_close(ours.k[:, b, :, :n], ref.k[:, b, :, :n], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(ours.v[:, b, :, :n], ref.v[:, b, :, :n], rtol=1e-4, atol=1e-4)


@needs_kernel
@KINDS
@pytest.mark.parametrize("start", [0, 9])
def test_a_prompt_in_one_call_matches_the_models_prefill(start, kind):
    # per_row's prompts are W7A8 and per_block's W4A8, as their steps and the model's own layers'; the head W4A8
    # or exact int8 as at a step; start 9: over cached keys (S > T)
    model = _model(seed=7, kind=kind)
    step = NativeStep(model)
    assert step.prefill is step and step.prefill_from == 1
    T = 23 if kind == "per_row" else 33
    ours = _prefilled(model, [start], max_len=48) if start else KVCache(2, 1, 4, 48, 16)
    ref = _clone(ours)
    prompt = torch.randint(0, 96, (1, T))
    with torch.inference_mode():
        want = model(prompt, cache=ref, last_only=True).logits[:, -1]
        got = step(prompt, ours)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert ours.lengths == ref.lengths == [start + T]
    torch.testing.assert_close(ours.k, ref.k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.v, ref.v, rtol=1e-4, atol=1e-4)


@needs_kernel
@KINDS
def test_each_rows_native_result_is_its_own(kind):
    model = _model(seed=3, kind=kind)
    step = NativeStep(model)
    together = _prefilled(model, [7, 3, 7])
    token = torch.tensor([[4], [50], [9]])
    with torch.inference_mode():
        alone = [step(token[b:b + 1], _clone(together, [b])) for b in range(3)]
        batch = step(token, together)
    for b in range(3):
        assert torch.equal(batch[b], alone[b][0])      # the same bits: nothing a row computes reads another row


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_long_contexts_attend_on_the_threads_and_still_match(threads):
    # 4 heads of 64: from ~1024 keys the operator splits attention over (row, head) on the threads
    model = _model(seed=4, n_ctx=1200, n_embd=256, n_head=4, n_layer=1, group_size=64)
    cache = _prefilled(model, [1100], max_len=1200)
    ref = _clone(cache)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            token = torch.tensor([[17]])
            want = model(token, cache=ref, last_only=True).logits[:, -1]
            got = NativeStep(model)(token, cache)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@needs_kernel
@pytest.mark.parametrize("head", ["int8", "int4"])
def test_generate_decodes_int4_per_block_models_on_it_with_the_models_greedy_tokens(head):
    # the built-in model (trained: real margins between its top tokens), int4 per_block, its head
    # int8 (exact products) or int4 (W4A8, as the blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2.from_pretrained("shakespeare-byte").quantize("int4", method="rtn", activations="per_block",
                                                                   head=head)
    assert native.why_not(model) == ""
    idx = torch.tensor([list(b"ROMEO:\nWhat light"), list(b"To be, or not to ")])
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        out = model.generate(idx, 40, temperature=0)
    assert op.call_count == 2 + 39                       # each prompt (W4A8, as the steps), then the steps
    with mock.patch.object(native, "native_step", lambda m: None):
        want = model.generate(idx, 40, temperature=0)
    assert torch.equal(out, want)
    # prompts of different lengths: each prefilled alone into its row of the cache
    mask = torch.ones_like(idx)
    mask[1, :5] = 0
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        out = model.generate(idx, 12, temperature=0, attention_mask=mask)
    assert op.call_count == 2 + 11
    with mock.patch.object(native, "native_step", lambda m: None):
        assert torch.equal(out, model.generate(idx, 12, temperature=0, attention_mask=mask))
    long = torch.tensor([list(b"ROMEO:\nWhat light through yonder window breaks? It")])     # 51 tokens: on it too
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        model.generate(long, 4, temperature=0)
    assert op.call_count == 1 + 3


@needs_kernel
def test_generate_runs_int8_per_row_models_on_it_with_the_models_greedy_tokens():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPT2.from_pretrained("shakespeare-byte").quantize("int8", method="rtn", activations="per_row")
    idx = torch.tensor([list(b"KING HENRY:\nOnce more unto")])
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        out = model.generate(idx, 40, temperature=0)
    assert op.call_count == 40
    with mock.patch.object(native, "native_step", lambda m: None):
        assert torch.equal(out, model.generate(idx, 40, temperature=0))
    two = torch.cat([idx, torch.roll(idx, 3, 1)])
    mask = torch.ones_like(two)
    mask[0, :4] = 0                                      # prompts of 24 and 28 bytes: each prefilled alone
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        out = model.generate(two, 12, temperature=0, attention_mask=mask)
    assert op.call_count == 2 + 11
    with mock.patch.object(native, "native_step", lambda m: None):
        assert torch.equal(out, model.generate(two, 12, temperature=0, attention_mask=mask))


@needs_kernel
def test_models_it_does_not_fit_decode_as_before():
    model = _model(seed=5)
    assert isinstance(native_step(model), NativeStep)
    assert native_step(model) is native_step(model)                  # kept while nothing changes
    handle = model.h[0].mlp.register_forward_hook(lambda m, i, o: o)
    assert native_step(model) is None                                # hooks run in the model's forward only
    handle.remove()
    kept = native_step(model)
    with torch.no_grad():
        model.ln_f.bias.add_(1.0)                                    # written in place: made again
    fresh = native_step(model)
    assert fresh is not kept and torch.equal(fresh.ln_f[1], model.ln_f.bias)
    set_activations(model, "exact")
    assert native_step(model) is None                                # int4 with float32 activations
    with pytest.raises(ValueError, match="no native forward for this model: not a float32, bf16, fp16, int8 per_row or int4 per_block"):
        NativeStep(model)
    model.quantization["activations"] = "per_block"                  # the record says per_block, the layers do not
    assert native.why_not(model) == "its blocks are not all int4 with per_block activations or int8 with per_row ones"
    set_activations(model, "per_block")
    assert native.why_not(model) == ""
    set_activations(model, "exact")
    assert isinstance(native_step(GPT2(model.config).eval()), NativeStep)   # float32: float32 products
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = GPT2(model.config).eval().quantize("int8", method="rtn")
    assert native_step(exact) is None                                # int8's exact products: the model's forward
    per_row = _model(kind="per_row")
    assert isinstance(native_step(per_row), NativeStep)
    per_row.lm_head.activations = "exact"                            # a layer set alone
    with pytest.raises(ValueError, match="its head is not int8 with the blocks' activations"):
        NativeStep(per_row)
    head4 = _model(kind="per_block_head4")
    assert isinstance(native_step(head4), NativeStep)
    head4.lm_head.activations = "exact"                              # an int4 head with float32 activations
    assert native.why_not(head4) == "its int4 head does not take the blocks' per_block activations, or has a bias"
    assert native_step(head4) is None


@needs_kernel
def test_a_head_dim_the_kernels_cannot_take_runs_on_the_models_forward():
    # head_dim 12 (36 / 3): the operator wants multiples of 8; generate must fall back, not fail
    # (a break-it review found `RuntimeError: cached_forward: head_dim must be a multiple of 8`)
    model = _model(seed=12, n_embd=36, n_head=3, kind="per_row")
    assert native.why_not(model) == "head_dim=12 is not a multiple of 8 (the kernels' vectors)"
    assert native_step(model) is None
    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, 4, temperature=0)
    c = model.config
    cache = KVCache(c.n_layer, 1, c.n_head, 8, c.n_embd // c.n_head)
    with torch.inference_mode():                        # the model's own greedy steps
        ids = prompt
        logits = model(ids, cache=cache, last_only=True).logits[:, -1]
        for _ in range(4):
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
            logits = model(ids[:, -1:], cache=cache, last_only=True).logits[:, -1]
    assert torch.equal(out, ids)


@needs_kernel
def test_the_operator_names_what_does_not_fit():
    model = _model(seed=6)
    step = NativeStep(model)
    full = _prefilled(model, [4], max_len=4)
    with pytest.raises(RuntimeError, match="row 0 at position 4 with 1 new tokens: the cache holds T_max=4"):
        step(torch.tensor([[1]]), full)
    cache = _prefilled(model, [3], max_len=8)
    with pytest.raises(RuntimeError, match=r"token 96 of row 0 is not an id in \[0, n_vocab=96\)"):
        step(torch.tensor([[96]]), cache)
    two = _prefilled(model, [3, 5], max_len=16)
    with pytest.raises(RuntimeError, match="with T=2 new tokens every row must hold the same length"):
        step(torch.tensor([[1, 2], [3, 4]]), two)
    call = lambda layers: torch.ops.gpt2mha.cached_forward(torch.tensor([[1]]), step.wte, step.wpe, layers, *step.ln_f,
                                                           step.head, cache.k, cache.v, cache.lengths, 32, 1e-5)
    with pytest.raises(RuntimeError, match="layers must hold 16 tensors per layer"):
        call(step.layers[:-1])
    bad = list(step.layers)
    bad[2] = bad[2][:, :-1].contiguous()
    with pytest.raises(RuntimeError, match=r"attn.c_attn packed of layer 0 must be a contiguous Byte CPU tensor \[6, 16, 64\]"):
        call(bad)
    head4 = NativeStep(_model(seed=6, kind="per_block_head4"))
    head_call = lambda head: torch.ops.gpt2mha.cached_forward(
        torch.tensor([[1]]), head4.wte, head4.wpe, head4.layers, *head4.ln_f, head, cache.k, cache.v, cache.lengths,
        32, 1e-5)
    with pytest.raises(RuntimeError, match=r"head params must be a contiguous Float CPU tensor \[3, 2, 2, 32\]"):
        head_call([head4.head[0], head4.head[1][:, :1].contiguous(), head4.head[2]])
    per_row = NativeStep(_model(seed=6, kind="per_row"))                # per_row blocks, an int4 head
    with pytest.raises(RuntimeError, match="an int4 head \\(W4A8 packed uint8\\) needs the blocks' group_size > 0"):
        torch.ops.gpt2mha.cached_forward(torch.tensor([[1]]), per_row.wte, per_row.wpe, per_row.layers, *per_row.ln_f,
                                         head4.head, cache.k, cache.v, cache.lengths, 0, 1e-5)
    assert cache.lengths == [3] and two.lengths == [3, 5]           # nothing advanced


@needs_kernel
@pytest.mark.parametrize("kind,named,group_size", [("per_block", "w4a8", 32), ("per_row", "w7a8", 0)])
def test_the_operator_takes_the_kind_of_product_by_name(kind, named, group_size):
    # the step names its products' kind (the layer class's native_kind); an empty kind reads it
    # from group_size (> 0: W4A8, 0: per_row): the same logits either way, and a kind that does not
    # go with the group size, or no kind at all, is refused by name
    model = _model(seed=7, kind=kind)
    step = NativeStep(model)
    assert (step.kind, step.group_size) == (named, group_size)
    cache = _prefilled(model, [3, 5], max_len=16)

    def call(group_size, kind=None):
        rows = _clone(cache)
        more = () if kind is None else (kind,)
        return torch.ops.gpt2mha.cached_forward(torch.tensor([[1], [2]]), step.wte, step.wpe, step.layers, *step.ln_f,
                                                step.head, rows.k, rows.v, rows.lengths, group_size, step.eps, *more)

    with torch.inference_mode():
        want = model(torch.tensor([[1], [2]]), cache=_clone(cache), last_only=True).logits[:, -1]
        named_call, legacy = call(group_size, named), call(group_size)
    assert torch.equal(named_call, legacy)
    torch.testing.assert_close(named_call, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    with pytest.raises(RuntimeError, match="kind must be 'w4a8', 'w7a8', 'float32', 'bf16' or 'fp16'"):
        call(group_size, "int4")
    with pytest.raises(RuntimeError, match="kind 'w7a8' takes group_size=0"):
        call(32, "w7a8")
    with pytest.raises(RuntimeError, match="kind 'w4a8' needs the products' group_size > 0; got 0"):
        call(0, "w4a8")


@needs_kernel
def test_generate_takes_every_prompt_the_model_takes():
    # strided views and int32 ids reach the operator as the contiguous int64 it needs
    model = _model(seed=8, kind="per_row")
    torch.manual_seed(9)
    a = torch.randint(0, 96, (2, 12))
    want = model.generate(a[:, ::2].contiguous(), 6, temperature=0)
    with mock.patch.object(torch.ops.gpt2mha, "cached_forward", wraps=torch.ops.gpt2mha.cached_forward) as op:
        assert torch.equal(model.generate(a[:, ::2], 6, temperature=0), want)
        assert torch.equal(model.generate(a[:, ::2].int(), 6, temperature=0), want)
    assert op.call_count == 2 * (2 + 5)          # each call: each prompt prefilled alone, then 5 steps


@needs_kernel
def test_native_step_follows_the_model():
    model = _model(seed=10, kind="per_row")
    first = native_step(model)
    model.ln_f.bias.data = torch.randn_like(model.ln_f.bias)          # new storage, same Parameter
    second = native_step(model)
    assert second is not first and torch.equal(second.ln_f[1], model.ln_f.bias)
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.eps = 1e-3
    third = native_step(model)
    assert third is not None and third is not second and third.eps == pytest.approx(1e-3)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        assert native_step(model) is None                             # a hook on every module
    finally:
        handle.remove()
    assert native_step(model) is third
    cache = KVCache(2, 1, 2, 8, 32)                                   # 2 heads of 32: this model has 4 of 16
    with pytest.raises(ValueError, match="the cache is .n_layer=2, B, n_head=2, T_max, head_dim=32.; this model "
                                         "needs n_layer=2, n_head=4, head_dim=16"):
        third(torch.tensor([[1]]), cache)
    model.h = model.h[:1]                                             # blocks cut, config unchanged
    assert native_step(model) is None


@needs_kernel
def test_the_operator_refuses_what_it_cannot_read_or_write():
    model = _model(seed=11, kind="per_row")
    step = NativeStep(model)
    cache = _prefilled(model, [3], max_len=8)

    def call(tokens=torch.tensor([[1]]), head=None, k=None, v=None, lengths=None, eps=1e-5):
        return torch.ops.gpt2mha.cached_forward(tokens, step.wte, step.wpe, step.layers, *step.ln_f,
                                                step.head if head is None else head,
                                                cache.k if k is None else k, cache.v if v is None else v,
                                                cache.lengths if lengths is None else lengths, 0, eps)

    with pytest.raises(RuntimeError, match="head must be int8_gemv's weight"):
        call(head=step.head[:1])
    with pytest.raises(RuntimeError, match="the cache must have every size >= 1"):
        call(tokens=torch.zeros(0, 1, dtype=torch.long), k=cache.k[:, :0], v=cache.v[:, :0], lengths=[])
    with pytest.raises(RuntimeError, match="the cache must have every size >= 1"):
        call(k=cache.k[:0], v=cache.v[:0])
    with pytest.raises(RuntimeError, match="row 0 at position 9223372036854775806 with 2 new tokens"):
        call(tokens=torch.tensor([[1, 2]]), lengths=[2 ** 63 - 2])
    with pytest.raises(RuntimeError, match="k and v share memory"):
        call(v=cache.k)
    with pytest.raises(RuntimeError, match="must not require grad"):
        call(k=cache.k.clone().requires_grad_())
    with pytest.raises(RuntimeError, match="eps must be a positive number"):
        call(eps=float("nan"))
    assert cache.lengths == [3]
