"""What a new-user walkthrough and a break-it review found (issue 12): each silent wrong answer is
now a right answer or a clear error, each crash a clear error.

References: SDPA (PyTorch's fused kernel) for the explicit core, first principles (what a
0/1 mask, an integer id or a cache must mean), and the same call run alone or single-threaded.
"""


import numpy as np
import pytest
import torch

from gpt2mha import GPT2, CausalSelfAttention, KVCache
from test_robustness import small_model
from gpt2mha.core.attention import attend_explicit, attend_sdpa, attention_mask
from gpt2mha.inference.sampling import MIN_TEMPERATURE, row_seed, sample_next


MODEL = small_model()
IDX = torch.tensor([[5, 17, 42, 8, 3]])


# ------------------------------------------------------------------------- item 3: KVCache checks
def test_cache_that_does_not_fit_the_model_or_input_is_a_named_error():
    c = MODEL.config

    def cache(**kw):
        sizes = dict(n_layer=c.n_layer, batch_size=1, n_head=c.n_head, max_len=16, head_dim=c.head_dim)
        return KVCache(**{**sizes, **{k: v for k, v in kw.items() if k in sizes}}, dtype=kw.get("dtype", torch.float32))

    rows4 = cache(batch_size=4)
    with pytest.raises(ValueError, match="cache has batch size=4 but the input has 1"):
        MODEL(IDX, cache=rows4)
    assert rows4.k.abs().sum() == 0 and rows4.length == 0          # nothing was written into its rows
    with pytest.raises(ValueError, match="cache has n_layer=1 but the model has 2"):
        MODEL(IDX, cache=cache(n_layer=1))
    with pytest.raises(ValueError, match="cache has n_head=2 but the model has 4"):
        MODEL(IDX, cache=cache(n_head=2, head_dim=16))
    with pytest.raises(ValueError, match="cache has head_dim=4 but the model has 8"):
        MODEL(IDX, cache=cache(head_dim=4))
    with pytest.raises(ValueError, match="cache dtype is torch.float16 but the model's parameters are torch.float32"):
        MODEL(IDX, cache=cache(dtype=torch.float16))
    full = cache(max_len=6)
    MODEL(IDX, cache=full)
    with pytest.raises(ValueError, match="cache holds 5 of max_len=6 positions; 2 new tokens do not fit"):
        MODEL(IDX[:, :2], cache=full)
    # a half-precision past for a float32 model: caught when used, convertible on purpose
    past = MODEL(IDX).present
    with pytest.raises(ValueError, match="cache dtype is torch.float16"):
        MODEL(IDX[:, :1], cache=KVCache.from_past(past.half(), 8))
    ok = KVCache.from_past(past.half(), 8, dtype=torch.float32)
    torch.testing.assert_close(MODEL(IDX[:, :1], cache=ok).logits, MODEL(IDX[:, :1], past=past.half().float()).logits)
    with pytest.raises(ValueError, match="past must be a floating-point tensor"):
        KVCache.from_past(past.long(), 8)


# --------------------------------------------- item 4: one mask rule for both attention cores
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_causal_self_attention_reads_0_1_masks_the_same_in_both_cores(dtype):
    torch.manual_seed(0)
    attn = CausalSelfAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)
    causal = attention_mask(5, 5)
    ref = attn(x)[0]                                              # plain causal
    outs = []
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        with torch.no_grad():
            outs.append(attn(x, attn_mask=causal.to(dtype))[0])
    for out in outs:                                              # a 0/1 float mask is not an additive bias
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    bad = causal.float()
    bad[0, 0] = 0.5
    for impl in ("sdpa", "explicit"):
        attn.attn_impl = impl
        with pytest.raises(ValueError, match=r"attn_mask must be bool or hold only 0 .* got the value 0.5"):
            attn(x, attn_mask=bad)


# ----------------------------------------------------- item 5: generate's mask, the same rule
def test_generate_refuses_a_mask_that_is_not_0_1():
    idx = torch.tensor([[0, 5, 17], [3, 4, 5]])
    with pytest.raises(ValueError, match=r"attention_mask must be bool or hold only 0 .* got the value 0.5"):
        MODEL.generate(idx, 2, temperature=0, attention_mask=torch.tensor([[0.5, 1, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="attention_mask must be bool or hold only 0"):
        MODEL.generate(idx, 2, temperature=0, attention_mask=torch.tensor([[2, 1, 1], [1, 1, 1]]))
    # bool and float 0/1 masks mean the same as integer ones
    ref = MODEL.generate(idx, 3, temperature=0, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    for m in (torch.tensor([[False, True, True], [True, True, True]]), torch.tensor([[0.0, 1, 1], [1, 1, 1]])):
        assert torch.equal(MODEL.generate(idx, 3, temperature=0, attention_mask=m), ref)


# ------------------------------------------------------------------ item 6: non-floating past
def test_integer_or_bool_past_is_refused():
    past = MODEL(IDX).present
    for bad in (past.long(), past > 0):
        with pytest.raises(ValueError, match="past must be a floating-point tensor"):
            MODEL(IDX[:, :1], past=bad)
        with pytest.raises(ValueError, match="past must be a floating-point tensor"):
            MODEL.h[0].attn(torch.randn(1, 1, 32), past=bad[:, 0])


# ---------------------------------------------------------------------- item 7: ids as floats
def test_float_ids_in_lists_are_refused_and_integer_kinds_accepted():
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\]=1.7 is not a token id"):
        MODEL.generate([[1.7, 2.2]], 2, temperature=0)
    with pytest.raises(ValueError, match=r"prompts\[0\] holds torch.float32 values"):
        MODEL.generate([torch.tensor([1.0, 2.0])], 2, temperature=0)
    with pytest.raises(ValueError, match=r"idx must hold token ids as int64 \(or int32\); got dtype torch.float32"):
        MODEL.generate(torch.tensor([[1.0, 2.0]]), 2, temperature=0)
    ref = MODEL.generate([[5, 17, 42], [8, 3]], 3, temperature=0)
    for prompts in ([np.array([5, 17, 42]), np.array([8, 3])],
                    [torch.tensor([[5, 17, 42]]), torch.tensor([8, 3])],
                    [[np.int64(5), np.int32(17), 42], (8, 3)]):
        assert torch.equal(MODEL.generate(prompts, 3, temperature=0), ref)


# ------------------------------------------------- item 10: explicit core with very low scores
@pytest.mark.parametrize("scale", [1.0, 1e12])
def test_explicit_core_gives_masked_keys_zero_weight_for_any_finite_scores(scale):
    # every real score around -1e12: with OpenAI's -1e10 fill the masked keys would be the row's
    # maximum and take all the weight; SDPA gives them none. Reference: SDPA.
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 6, 8)
    v = torch.randn(1, 2, 6, 8)
    k = k * 0 - 1.0 if scale > 1 else k                           # q·k = -sum(q): one sign per query
    q = q.abs() * scale if scale > 1 else q                       # scores ≈ -1e12 for every key
    mask = attention_mask(4, 6)
    seen = []
    a = attend_explicit(q, k, v, mask, hook_pattern=lambda w: seen.append(w) or w)
    w = seen[0]
    assert (w[..., ~mask] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 4))
    torch.testing.assert_close(a, attend_sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------ temperature crashes
@pytest.mark.parametrize("temperature", [1e-45, 5e-324, 1e-30, MIN_TEMPERATURE])
def test_tiny_temperatures_sample_the_argmax_without_crashing(temperature):
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.9], [5.0, -1.0, 4.0, 0.0]])
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        assert sample_next(logits, temperature, generator=g).tolist() == [1, 0]
    out = MODEL.generate(IDX, 4, temperature=temperature, seed=0)
    assert torch.equal(out, MODEL.generate(IDX, 4, temperature=0))


def test_cli_tiny_temperature_is_greedy(capsys):
    from gpt2mha.cli import main
    assert main(["generate", "ab", "--max-new-tokens", "5", "--temperature", "1e-45"]) == 0
    tiny = capsys.readouterr().out
    assert main(["generate", "ab", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert tiny == capsys.readouterr().out


# ------------------------------------------------------------------------ what generate returns
def test_generate_returns_an_ordinary_tensor():
    out = MODEL.generate(IDX, 3, temperature=0)
    assert not out.is_inference()
    out[0, 0] = 1                                                 # editable in place
    emb = MODEL.wte(out)                                          # and usable in training
    emb.sum().backward()
    assert MODEL.wte.weight.grad is not None
    MODEL.zero_grad(set_to_none=True)


def test_generate_on_a_training_model_samples_with_dropout_off_and_restores_the_mode():
    model = small_model(embd_pdrop=0.3, attn_pdrop=0.3, resid_pdrop=0.3)
    ref = model.generate(IDX, 8, seed=3)                          # eval mode
    model.train()
    assert torch.equal(model.generate(IDX, 8, seed=3), ref)
    assert torch.equal(model.generate(IDX, 8, seed=3), ref)
    assert model.training and all(m.training for m in model.modules())


# --------------------------------------------------------------- seeded sampling, row by row
def test_seeded_sampling_of_a_batch_row_equals_that_prompt_alone():
    prompts = [[5, 17, 42], [8, 3], [60, 61, 62, 63]]
    out = MODEL.generate(prompts, 10, temperature=1.0, top_k=20, seed=7)
    for i, p in enumerate(prompts):
        alone = MODEL.generate([p], 10, temperature=1.0, top_k=20, seed=row_seed(7, i))
        assert out[i, -10:].tolist() == alone[0, -10:].tolist(), i
    assert row_seed(7, 0) == 7 and len({row_seed(7, i) for i in range(100)}) == 100


# ------------------------------------------------------------------------ clearer messages
def test_generate_argument_messages_say_what_is_wrong():
    with pytest.raises(ValueError, match="is text; generate takes token ids"):
        MODEL.generate("ROMEO:", 5)
    with pytest.raises(ValueError, match=r"idx has shape \(5,\); expected \[B, T\] \(one prompt: idx\[None\]\)"):
        MODEL.generate(IDX[0], 5)
    with pytest.raises(ValueError, match=r"got dtype torch.uint8"):
        MODEL.generate(IDX.to(torch.uint8), 5)
    with pytest.raises(ValueError, match=r"idx has shape \(1, 0\); an empty prompt cannot be continued"):
        MODEL.generate(IDX[:, :0], 5)
    with pytest.raises(ValueError, match=r"max_new_tokens=2.0 must be an integer >= 0; got float"):
        MODEL.generate(IDX, 2.0)
    # numpy integers are integers
    ref = MODEL.generate(IDX, 3, temperature=0.7, top_k=5, seed=1)
    assert torch.equal(MODEL.generate(IDX, np.int64(3), temperature=np.float32(0.7), top_k=np.int32(5),
                                      seed=np.int64(1)), ref)


# ------------------------------------------------------------------------------ the untied head
def test_untied_model_decodes_with_its_own_head():
    model = small_model(tie_word_embeddings=False)
    assert not torch.equal(model.lm_head.weight, model.wte.weight)
    with torch.no_grad():
        h = model.ln_f(model.h[1](model.h[0](model.wte(IDX) + model.wpe(torch.arange(5)))[0])[0])
        torch.testing.assert_close(model(IDX).logits, h @ model.lm_head.weight.T, atol=1e-5, rtol=1e-5)
    out = model.generate(IDX, 6, temperature=0)                   # cached decode (head copy) = no cache
    ids = IDX
    for _ in range(6):
        with torch.no_grad():
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ids)


# ------------------------------------------------------------------ the shared train/val split
def test_val_split_of_a_multibyte_file_is_scored_and_matches_the_trainers(tmp_path, capsys):
    from gpt2mha.cli import main, read_text
    from gpt2mha.train.train import split_bytes
    path = tmp_path / "e.txt"
    path.write_text("é" * 1001, encoding="utf-8")                  # 2002 bytes: the 90% cut (1801) is mid-character
    train, val = split_bytes(path.read_bytes())
    assert train.decode("utf-8") + val.decode("utf-8") == "é" * 1001   # both halves decode, nothing lost
    assert len(train) == 1802 and read_text(str(path), "val") == "é" * 100
    assert main(["perplexity", str(path), "--split", "val", "--json"]) == 0
    assert '"bytes": 200' in capsys.readouterr().out


def test_non_utf8_files_get_a_hint(tmp_path):
    from gpt2mha.cli import main, read_text
    from gpt2mha.core.model import GPT2Config
    from gpt2mha.train.train import TrainConfig, train
    path = tmp_path / "latin1.txt"
    path.write_bytes("café au lait, ".encode("latin-1") * 50)
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3: b'\\xe9'\); re-encode it first, e.g. iconv"):
        read_text(str(path))
    with pytest.raises(ValueError, match=r"--data .* is not UTF-8 text \(byte 3.*iconv"):
        train(str(path), str(tmp_path / "run"), GPT2Config.from_preset("tiny", n_ctx=8), TrainConfig(iters=1))


# ----------------------------------------------------------------------- checkpoint messages
def test_dtype_given_as_text_and_config_size_mismatch_summary(hf_checkpoint):
    import json
    import os
    from gpt2mha.io.checkpoints import CheckpointError
    _, path = hf_checkpoint
    assert GPT2.from_pretrained(path, dtype="bf16").wte.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype='bf17'; expected a floating torch dtype or one of"):
        GPT2.from_pretrained(path, dtype="bf17")
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "n_embd": 64}, open(cfg_path, "w"))
    with pytest.raises(CheckpointError) as e:
        GPT2.from_pretrained(path)
    first = str(e.value).splitlines()[0]
    assert "config.json says n_embd=64 but the weights have n_embd=48 (wte.weight [300, 48])" in first
    assert len(str(e.value).splitlines()) <= 12                    # not 28 shape lines


# ------------------------------------------------------------------------------ CLI messages
def test_cli_absurd_values_are_errors_not_tracebacks(tmp_path, capsys):
    from gpt2mha.cli import main
    afile = tmp_path / "afile"
    afile.write_text("mine")
    assert main(["heads", "ab", "--out", str(afile)]) == 2
    assert "is a file; expected a directory" in capsys.readouterr().err and afile.read_text() == "mine"
    assert main(["trace", "--batch", str(10**20)]) == 2
    assert "--batch=100000000000000000000 is too large for a trace" in capsys.readouterr().err
    assert main(["check", "gpt2mha.learn.book:MultiHeadAttention", "--seed", str(10**20)]) == 2
    assert "--seed=100000000000000000000 must be an integer in [0, 2**63)" in capsys.readouterr().err


def test_the_greedy_comparison_accepts_only_near_ties():
    # conftest.assert_same_greedy lets two paths part only where the reference's top logits tie
    from conftest import assert_same_greedy
    seq = MODEL.generate(IDX, 4, temperature=0)[0]
    assert_same_greedy(MODEL, seq, seq.clone(), 5)
    with torch.no_grad():
        logits = MODEL(seq[None, :5]).logits[0, -1]
    worst = seq.clone()
    worst[5] = int(logits.argmin())
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_same_greedy(MODEL, seq, worst, 5)
