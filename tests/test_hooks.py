"""Capture points: reading and replacing activations inside the model.

References: the activations computed by hand from the model's own weights (first principles:
the residual stream is the sum of what the blocks add; the pattern is softmax(q·kᵀ/√d) under the
causal mask; hook_z, c_proj and hook_result add up to the sublayer's output).
"""

import math

import pytest
import torch

from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha.core.hooks import HookPoint, record
from gpt2mha.inference.compiled import has_hooks


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT2(GPT2Config(n_vocab=61, n_ctx=32, n_embd=24, n_head=3, n_layer=2, tokenizer="bytes")).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


def test_every_capture_point_is_named_by_its_path(model):
    points = {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}
    assert all(m.name == n for n, m in points.items())
    for name in ("hook_embed", "hook_pos_embed", "h.0.hook_resid_pre", "h.0.ln_1.hook_normalized",
                 "h.0.attn.hook_q", "h.0.attn.hook_k", "h.0.attn.hook_v", "h.0.attn.hook_attn_scores",
                 "h.0.attn.hook_pattern", "h.0.attn.hook_z", "h.0.attn.hook_result", "h.0.hook_attn_out",
                 "h.0.hook_resid_mid", "h.0.mlp.hook_pre", "h.0.mlp.hook_post", "h.0.hook_mlp_out",
                 "h.1.hook_resid_post", "ln_f.hook_normalized"):
        assert name in points


@torch.no_grad()
def test_recorded_activations_are_what_the_forward_computes(model):
    idx = torch.randint(0, 61, (2, 7))
    names = ["hook_embed", "hook_pos_embed", "h.0.hook_resid_pre", "h.0.attn.hook_q", "h.0.attn.hook_k",
             "h.0.attn.hook_pattern", "h.0.attn.hook_z", "h.0.hook_attn_out", "h.0.hook_resid_mid",
             "h.0.hook_mlp_out", "h.0.hook_resid_post", "h.1.hook_resid_pre"]
    logits = []
    acts = record(model, names, lambda: logits.append(model(idx).logits))
    assert torch.equal(acts["h.0.hook_resid_pre"], acts["hook_embed"] + acts["hook_pos_embed"])
    assert torch.equal(acts["h.0.hook_resid_mid"], acts["h.0.hook_resid_pre"] + acts["h.0.hook_attn_out"])
    assert torch.equal(acts["h.0.hook_resid_post"], acts["h.0.hook_resid_mid"] + acts["h.0.hook_mlp_out"])
    assert torch.equal(acts["h.1.hook_resid_pre"], acts["h.0.hook_resid_post"])
    q, k = acts["h.0.attn.hook_q"], acts["h.0.attn.hook_k"]          # [B, T, h, head_dim]
    assert q.shape == (2, 7, 3, 8)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(8)
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(acts["h.0.attn.hook_pattern"], scores.softmax(-1), atol=1e-6, rtol=1e-5)
    # a pattern hook runs the explicit core (SDPA has no pattern): the same math, float rounding apart
    torch.testing.assert_close(logits[0], model(idx).logits, atol=1e-5, rtol=1e-5)
    plain = [n for n in names if "pattern" not in n]
    again = []
    record(model, plain, lambda: again.append(model(idx).logits))
    assert torch.equal(again[0], model(idx).logits)                  # reading the rest changes nothing


@torch.no_grad()
def test_a_hook_that_returns_a_tensor_replaces_the_activation(model):
    idx = torch.randint(0, 61, (1, 6))
    clean = model(idx).logits
    handle = model.h[0].attn.hook_z.add_hook(lambda z, hook: z * 0)   # every head of layer 0 ablated
    try:
        ablated = model(idx).logits
        attn_out = record(model, ["h.0.hook_attn_out"], lambda: model(idx))["h.0.hook_attn_out"]
    finally:
        handle.remove()
    torch.testing.assert_close(attn_out, model.h[0].attn.c_proj.bias.expand_as(attn_out))
    assert not torch.allclose(ablated, clean)
    assert torch.equal(model(idx).logits, clean)                     # removed: back to the clean run


@torch.no_grad()
def test_head_results_add_up_to_the_sublayer_output(model):
    idx = torch.randint(0, 61, (2, 5))
    plain = record(model, ["h.1.hook_attn_out"], lambda: model(idx))["h.1.hook_attn_out"]
    acts = record(model, ["h.1.attn.hook_result", "h.1.hook_attn_out"], lambda: model(idx))
    assert acts["h.1.attn.hook_result"].shape == (2, 5, 3, 24)
    torch.testing.assert_close(acts["h.1.attn.hook_result"].sum(2) + model.h[1].attn.c_proj.bias, plain,
                               atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(acts["h.1.hook_attn_out"], plain, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_hooks_see_the_cached_decode_steps(model):
    idx = torch.randint(0, 61, (1, 9))
    c = model.config
    cache = KVCache(c.n_layer, 1, c.n_head, c.n_ctx, c.head_dim)
    model(idx[:, :8], cache=cache)
    step = record(model, ["h.1.attn.hook_pattern"], lambda: model(idx[:, 8:], cache=cache))["h.1.attn.hook_pattern"]
    full = record(model, ["h.1.attn.hook_pattern"], lambda: model(idx))["h.1.attn.hook_pattern"]
    assert step.shape == (1, 3, 1, 9)                                 # one query over all 9 keys
    torch.testing.assert_close(step[:, :, 0], full[:, :, 8], atol=1e-6, rtol=1e-5)


def test_record_names_a_point_that_does_not_exist(model):
    with pytest.raises(ValueError, match="h.0.attn.hook_qq"):
        record(model, ["h.0.attn.hook_qq"], lambda: None)


@torch.no_grad()
def test_record_can_stop_the_forward_early(model):
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        acts = record(model, ["h.0.hook_resid_pre"], lambda: model(torch.zeros(1, 3, dtype=torch.long)), stop=True)
    finally:
        handle.remove()
    assert acts["h.0.hook_resid_pre"].shape == (1, 3, 24) and calls == []


def test_transformer_lens_names_are_aliases_of_the_same_points():
    from gpt2mha.core.hooks import act_name, canonical_name, tl_name

    cases = {"blocks.3.attn.hook_q": "h.3.attn.hook_q", "blocks.0.hook_resid_pre": "h.0.hook_resid_pre",
             "blocks.1.ln2.hook_scale": "h.1.ln_2.hook_scale", "ln_final.hook_out": "ln_f.hook_normalized",
             "blocks.1.ln1.hook_normalized": "h.1.ln_1.hook_standardized", "hook_embed": "hook_embed",
             "blocks.10.mlp.hook_post": "h.10.mlp.hook_post"}
    for tl, ours in cases.items():
        assert canonical_name(tl) == ours and tl_name(ours) == tl and canonical_name(ours) == ours
    assert act_name("pattern", 0) == "h.0.attn.hook_pattern" and act_name("normalized") == "ln_f.hook_standardized"
    with pytest.raises(ValueError, match="'patern' is unknown"):
        act_name("patern", 0)
    with pytest.raises(ValueError, match="give its layer"):
        act_name("z")


@torch.no_grad()
def test_layernorm_scale_and_standardized_points_rebuild_the_norm(model):
    # first principles: LayerNorm(x) = (x - mean) / sqrt(var + eps) * weight + bias
    idx = torch.randint(0, 61, (2, 5))
    plain = model(idx).logits
    acts = record(model, ["blocks.0.hook_resid_pre", "blocks.0.ln1.hook_scale", "blocks.0.ln1.hook_normalized",
                          "blocks.0.ln1.hook_out"], lambda: model(idx))
    x = acts["blocks.0.hook_resid_pre"]
    scale = (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(acts["blocks.0.ln1.hook_scale"], scale, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(acts["blocks.0.ln1.hook_normalized"], (x - x.mean(-1, keepdim=True)) / scale,
                               atol=1e-5, rtol=1e-5)
    ln = model.h[0].ln_1
    torch.testing.assert_close(acts["blocks.0.ln1.hook_out"], torch.nn.functional.layer_norm(x, (24,), ln.weight, ln.bias),
                               atol=1e-5, rtol=1e-5)
    assert record(model, ["ln_final.hook_scale"], lambda: model(idx))["ln_final.hook_scale"].shape == (2, 5, 1)
    parts = model.run_with_hooks(idx, fwd_hooks=[(lambda n: n.endswith("hook_scale"), lambda x, hook: None)])
    torch.testing.assert_close(parts, plain, atol=1e-5, rtol=1e-5)           # the norm in parts: same logits


@torch.no_grad()
def test_run_with_hooks_and_the_hooks_context_remove_what_they_attach(model):
    from gpt2mha.core.hooks import hook_points

    idx = torch.randint(0, 61, (1, 6))
    clean = model(idx).logits
    zero = lambda z, hook: z * 0                                          # noqa: E731
    ablated = model.run_with_hooks(idx, fwd_hooks=[("blocks.0.attn.hook_z", zero)])
    with model.hooks([("h.0.attn.hook_z", zero)]):
        again = model(idx).logits
    torch.testing.assert_close(ablated, again)
    assert not torch.allclose(ablated, clean)
    assert not any(p.has_hooks() for p in hook_points(model).values())
    assert torch.equal(model(idx).logits, clean)
    seen = []
    model.run_with_hooks(idx, fwd_hooks=[(lambda name: name.startswith("blocks.1.attn.hook_"),
                                          lambda x, hook: seen.append(hook.tl_name))])
    assert sorted(seen) == sorted(f"blocks.1.attn.hook_{n}" for n in ("q", "k", "v", "attn_scores", "pattern", "z", "result"))
    with pytest.raises(ValueError, match="not a capture point"):
        model.run_with_hooks(idx, fwd_hooks=[("blocks.0.attn.hook_zz", zero)])
    with pytest.raises(ValueError, match="pairs"):
        model.run_with_hooks(idx, fwd_hooks=[zero])
    with pytest.raises(RuntimeError):
        with model.hooks([("blocks.0.attn.hook_z", zero)]):
            raise RuntimeError("user code failed")
    assert not any(p.has_hooks() for p in hook_points(model).values())   # removed on error too


@torch.no_grad()
def test_run_with_cache_on_kv_cache_prefill_and_decode_steps(model):
    # reference: the same tokens in one uncached forward (positions 0..8)
    idx = torch.randint(0, 61, (2, 9))
    c = model.config
    kv = KVCache(c.n_layer, 2, c.n_head, c.n_ctx, c.head_dim)
    _, full = model.run_with_cache(idx)
    _, pre = model.run_with_cache(idx[:, :7], cache=kv)
    steps = [model.run_with_cache(idx[:, t:t + 1], cache=kv)[1] for t in (7, 8)]
    for name in ("blocks.1.attn.hook_q", "blocks.0.hook_resid_post", "blocks.1.attn.hook_z", "hook_pos_embed"):
        torch.testing.assert_close(pre[name], full[name][:, :7], atol=1e-5, rtol=1e-5)
        for t, step in zip((7, 8), steps):
            torch.testing.assert_close(step[name], full[name][:, t:t + 1], atol=1e-5, rtol=1e-5)
    assert steps[1]["pattern", 1].shape == (2, 3, 1, 9)
    torch.testing.assert_close(steps[1]["pattern", 1][:, :, 0], full["pattern", 1][:, :, 8], atol=1e-6, rtol=1e-5)


def test_hooks_act_in_generate_prefill_and_decode(model):
    # reference: greedy decoding by full forwards (no KV cache) with the same head ablated
    idx = torch.randint(0, 61, (1, 5))
    hook = ("blocks.1.attn.hook_z", lambda z, h: torch.cat([z[:, :, :1] * 0, z[:, :, 1:]], dim=2))
    with model.hooks([hook]):
        out = model.generate(idx, 6, temperature=0)
    ref = idx
    with torch.no_grad():
        for _ in range(6):
            ref = torch.cat([ref, model.run_with_hooks(ref, fwd_hooks=[hook])[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ref)


@torch.no_grad()
@pytest.mark.parametrize("name", ["h.0.attn.hook_pattern", "h.0.attn.hook_attn_scores", "h.1.attn.hook_result",
                                  "h.0.ln_1.hook_scale", "h.0.ln_1.hook_standardized", "hook_pos_embed"])
def test_a_forward_pre_hook_reaches_every_capture_point_as_a_hook_does(model, name):
    """A pre-hook (``register_forward_pre_hook``) on a point the forward computes only while it is
    hooked (the explicit pattern and scores, the per-head results, LayerNorm's parts, the expanded
    positions) is called with the tensor, and a tensor it returns replaces the activation, as a
    forward hook's does (reference: the same edit made by a forward hook)."""
    idx = torch.randint(0, 61, (2, 6), generator=torch.Generator().manual_seed(3))
    point = dict(model.named_modules())[name]
    seen = []

    def pre(module, args):
        seen.append(args[0].shape)
        return (args[0] * 0.5,)

    handle = point.register_forward_pre_hook(pre)
    try:
        assert has_hooks(model)                     # what generate asks before it picks a route
        got = model(idx).logits
    finally:
        handle.remove()
    assert seen, f"the pre-hook on {name} was never called"
    handle = point.add_hook(lambda x, hook: x * 0.5)
    try:
        want = model(idx).logits
    finally:
        handle.remove()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(want, model(idx).logits)
