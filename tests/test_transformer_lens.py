"""gpt2mha's activation cache, ablation, patching and logit lens against TransformerLens.

Reference: TransformerLens 4.3's ``TransformerBridge`` booted (offline) on the Hugging Face
GPT2LMHeadModel that transformers loads from gpt2mha's ``save_pretrained`` directory: the same
random 2-layer weights, no LayerNorm folding or centring (the bridge's default), eager attention.
Every TransformerLens hook name is looked up in gpt2mha's cache by that same name.
"""

import pytest
import torch

tl = pytest.importorskip("transformer_lens")
transformers = pytest.importorskip("transformers")

from gpt2mha import GPT2, GPT2Config                              # noqa: E402
from gpt2mha.learn import interventions as iv                     # noqa: E402

V, L, H, D = 53, 2, 3, 24
TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    ours = GPT2(GPT2Config(n_vocab=V, n_ctx=32, n_embd=D, n_head=H, n_layer=L, tokenizer="bytes")).eval()
    with torch.no_grad():
        for p in ours.parameters():                              # biases, LayerNorms away from 0/1
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp("tiny")
    ours.save_pretrained(str(path))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(path), attn_implementation="eager").eval()
    from transformer_lens.model_bridge import TransformerBridge
    bridge = TransformerBridge.boot_transformers(str(path), hf_model=hf, device="cpu")
    bridge.eval()
    return ours, bridge


@pytest.fixture(scope="module")
def tokens():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (2, 7), generator=gen)


def tl_names():
    ln = ("hook_scale", "hook_normalized", "hook_out")
    names = ["hook_embed", "hook_pos_embed", *(f"ln_final.{n}" for n in ln)]
    for l in range(L):
        names += [f"blocks.{l}.{n}" for n in (
            "hook_resid_pre", *(f"ln1.{n}" for n in ln), "attn.hook_q", "attn.hook_k", "attn.hook_v",
            "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_attn_out", "hook_resid_mid",
            *(f"ln2.{n}" for n in ln), "mlp.hook_pre", "mlp.hook_post", "hook_mlp_out", "hook_resid_post")]
    return names


@torch.no_grad()
def test_every_hook_name_caches_transformer_lens_values(models, tokens):
    ours, bridge = models
    tl_logits, tl_cache = bridge.run_with_cache(tokens)
    logits, cache = ours.run_with_cache(tokens)
    torch.testing.assert_close(logits, tl_logits, **TOL)
    for name in tl_names():
        a, b = cache[name], tl_cache[name]
        assert a.shape == b.shape, name
        if name.endswith("hook_attn_scores"):                     # masked keys: our lowest float vs TL's -inf
            causal = torch.ones(7, 7, dtype=torch.bool).tril()
            torch.testing.assert_close(a[..., causal], b[..., causal], **TOL, msg=name)
            assert (a[..., ~causal] < -1e30).all() and (b[..., ~causal] < -1e30).all()
        else:
            torch.testing.assert_close(a, b, **TOL, msg=name)


@torch.no_grad()
def test_opt_in_head_results_equal_transformer_lens(models, tokens):
    ours, bridge = models
    bridge.set_use_attn_result(True)
    try:
        _, tl_cache = bridge.run_with_cache(tokens)
        tl_stack, tl_labels = tl_cache.stack_head_results(return_labels=True, apply_ln=True)
    finally:
        bridge.set_use_attn_result(False)
    _, cache = ours.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_result", "hook_z", "hook_resid_post",
                                                                             "hook_resid_pre", "hook_embed")))
    for l in range(L):
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_result"], tl_cache[f"blocks.{l}.attn.hook_result"], **TOL)
    stack, labels = cache.stack_head_results(return_labels=True, apply_ln=True)
    assert labels == tl_labels
    torch.testing.assert_close(stack, tl_stack, **TOL)
    _, z_only = ours.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_z", "hook_resid_post")))
    torch.testing.assert_close(z_only.stack_head_results(apply_ln=True), tl_stack, **TOL)   # computed from hook_z
    # direct logit attribution: TL's stack through the final LayerNorm's weight and the unembedding
    answer = 5
    direction = bridge.W_U[:, answer] * bridge.ln_final.weight
    expected = (tl_stack[:, :, -1] * direction).sum(-1).T.reshape(2, L, H)
    torch.testing.assert_close(iv.direct_logit_attribution(ours, cache, answer), expected, **TOL)


@torch.no_grad()
def test_head_ablation_equals_transformer_lens(models, tokens):
    ours, bridge = models
    for heads, mean in (([(0, 1)], False), ([(0, 2), (1, 0)], False), ([(1, 1)], True)):
        def tl_hook(z, hook, heads=heads, mean=mean):
            z = z.clone()
            for l, h in heads:
                if hook.layer() == l:
                    z[:, :, h] = z[:, :, h].mean(dim=(0, 1)) if mean else 0
            return z
        expected = bridge.run_with_hooks(tokens, fwd_hooks=[(f"blocks.{l}.attn.hook_z", tl_hook) for l in {l for l, _ in heads}])
        torch.testing.assert_close(iv.ablate_heads(ours, tokens, heads, mean=mean), expected, **TOL)


@torch.no_grad()
def test_patching_metrics_equal_transformer_lens(models, tokens):
    from transformer_lens import patching

    ours, bridge = models
    clean, corrupt = tokens[:1, :4], tokens[1:, :4]                 # 4 tokens: TransformerLens runs one forward per patch
    metric = iv.logit_diff(3, 7)
    _, tl_clean = bridge.run_with_cache(clean)
    cases = (("z", False, patching.get_act_patch_attn_head_out_all_pos),
             ("z", True, patching.get_act_patch_attn_head_out_by_pos),
             ("resid_pre", True, patching.get_act_patch_resid_pre),
             ("pattern", False, patching.get_act_patch_attn_head_pattern_all_pos),
             ("v", False, patching.get_act_patch_attn_head_v_all_pos))
    for hook, per_position, tl_fn in cases:
        expected = tl_fn(bridge, corrupt, tl_clean, metric)
        got = iv.patch(ours, clean, corrupt, hook, metric, per_position=per_position, batch_size=5)
        assert got.values.shape == expected.shape, hook
        torch.testing.assert_close(got.values, expected.float(), **TOL, msg=hook)


@torch.no_grad()
def test_logit_lens_equals_accumulated_resid_decoded(models, tokens):
    ours, bridge = models
    _, tl_cache = bridge.run_with_cache(tokens)
    tl_stack, tl_labels = tl_cache.accumulated_resid(apply_ln=True, return_labels=True)
    expected = tl_stack @ bridge.W_U + bridge.b_U                   # GPT-2 has no head bias: b_U is zeros
    _, cache = ours.run_with_cache(tokens)
    stack, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == tl_labels
    torch.testing.assert_close(stack, tl_stack, **TOL)
    torch.testing.assert_close(iv.lens_logits(ours, cache), expected, **TOL)
    lens = iv.logit_lens(ours, tokens, top_k=3)
    torch.testing.assert_close(lens.probs, expected.softmax(-1).topk(3, dim=-1).values, **TOL)


@torch.no_grad()
def test_head_roles_and_induction_scores_equal_those_from_transformer_lens_patterns(models):
    from gpt2mha.learn.heads import induction_from_maps, induction_scores, repeated_random_tokens, role_scores

    ours, bridge = models
    idx = repeated_random_tokens(ours.config, n=6, batch=2)
    _, tl_cache = bridge.run_with_cache(idx)
    tl_maps = torch.stack([tl_cache[f"blocks.{l}.attn.hook_pattern"] for l in range(L)])
    raw, relative = induction_scores(ours, n=6, batch=2)
    expected_raw, expected_relative = induction_from_maps(tl_maps)
    torch.testing.assert_close(raw, expected_raw, **TOL)
    torch.testing.assert_close(relative, expected_relative, **TOL)
    from gpt2mha.learn.heads import attention_maps
    for key, value in role_scores(attention_maps(ours, idx)).items():
        torch.testing.assert_close(value, role_scores(tl_maps)[key], **TOL, msg=key)
