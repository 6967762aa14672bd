"""Tensor parallelism by heads, data-parallel training and distributed perplexity on 2 gloo
processes over 127.0.0.1 (issue 15). The reference for every figure is the same computation in
one process (the unsharded model, the single-process trainer, evaluate.perplexity)."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from distributed import free_port, loopback_env, run_ranks, values
from gpt2mha import GPT2, GPT2Config, KVCache
from gpt2mha import parallel

VERDICT = os.path.join(os.path.dirname(__file__), "data", "the-verdict.txt")
pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(config: GPT2Config, seed: int = 0) -> GPT2:
    """Random weights with LayerNorms and biases away from 1/0, so a shard that drops or
    doubles a bias or scale is seen."""
    model = GPT2(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("ln_f"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


class RecordingCache(KVCache):
    made = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        RecordingCache.made.append(self)


def tp_checks(rank, world, config_kwargs, greedy_steps):
    """Everything tensor-parallel on one rank: logits without/with past, with a KVCache, with a
    left-padded batch, greedy tokens, and the bytes of the parameters and of generate's cache."""
    import gpt2mha.generate as G

    config = GPT2Config(**config_kwargs)
    full = random_model(config)
    tp = parallel.shard_model(copy.deepcopy(full))
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, config.n_vocab, (2, 9), generator=gen)
    out = {}
    with torch.no_grad():
        ref, ref_present = full(idx)
        got, present = tp(idx)
        out["no_past"] = (got - ref).abs().max().item()
        heads = parallel.head_range(config.n_head, rank, world)
        out["present"] = (present - ref_present[:, :, :, heads.start:heads.stop]).abs().max().item()
        out["present_shape"] = tuple(present.shape)
        nxt = torch.randint(0, config.n_vocab, (2, 3), generator=gen)
        ref2 = full(nxt, past=ref_present).logits
        out["past"] = (tp(nxt, past=present).logits - ref2).abs().max().item()
        cache_full = KVCache(config.n_layer, 2, config.n_head, 16, config.head_dim)
        cache_tp = KVCache(config.n_layer, 2, tp.config.n_head, 16, tp.config.head_dim)
        full(idx, cache=cache_full), tp(idx, cache=cache_tp)
        out["cache"] = (tp(nxt, cache=cache_tp).logits - full(nxt, cache=cache_full).logits).abs().max().item()
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[0, :4] = 0                                         # row 0 left-padded by 4
        out["padded"] = (tp(idx, attention_mask=mask).logits - full(idx, attention_mask=mask).logits).abs().max().item()

    prompts = [[5, 17, 3], [9, 1, 22, 8, 4, 30]]                  # left-padded batch inside generate
    G.KVCache, RecordingCache.made = RecordingCache, []
    try:
        full_tokens = full.generate(prompts, greedy_steps, temperature=0)
        tp_tokens = tp.generate(prompts, greedy_steps, temperature=0)
        full_cache, tp_cache = RecordingCache.made
    finally:
        G.KVCache = KVCache
    out["greedy_equal"] = torch.equal(full_tokens, tp_tokens)
    out["tokens"] = tp_tokens.tolist()
    out["cache_bytes"] = (full_cache.k.nbytes + full_cache.v.nbytes, tp_cache.k.nbytes + tp_cache.v.nbytes)
    out["param_bytes"] = (dict((n, p.nbytes) for n, p in full.named_parameters()),
                          dict((n, p.nbytes) for n, p in tp.named_parameters()))
    return out


def check_tp_results(results, config: GPT2Config, world: int):
    per_rank = values(results)
    replicated = ("wte.", "wpe.", "ln_", "attn.c_proj.bias", "mlp.c_proj.bias")
    for rank, r in enumerate(per_rank):
        # logits equal the one-process model's (float32; only summation order differs)
        for key in ("no_past", "past", "cache", "padded", "present"):
            assert r[key] < 1e-5, (rank, key, r[key])
        assert r["present_shape"] == (2, config.n_layer, 2, config.n_head // world, 9, config.head_dim)
        assert r["greedy_equal"], rank
        # the KV cache generate allocates holds 1/N of the heads
        full_cache, tp_cache = r["cache_bytes"]
        assert tp_cache * world == full_cache
        # parameters: the block matrices and sharded biases are 1/N, the rest replicated (first principles)
        full_p, tp_p = r["param_bytes"]
        assert full_p.keys() == tp_p.keys()
        expect = sum(b if any(s in n for s in replicated) else b // world for n, b in full_p.items())
        assert sum(tp_p.values()) == expect
        for n, b in full_p.items():
            assert tp_p[n] == (b if any(s in n for s in replicated) else b // world), n
        sharded = sum(b for n, b in full_p.items() if not any(s in n for s in replicated))
        assert sum(full_p.values()) - sum(tp_p.values()) == sharded - sharded // world
    assert per_rank[0]["tokens"] == per_rank[1]["tokens"]


def test_tp2_equals_one_process_on_a_4_head_model(tmp_path):
    config = GPT2Config(n_vocab=64, n_ctx=64, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")
    results = run_ranks(tp_checks, 2, str(tmp_path), dataclasses.asdict(config), 50, timeout=150)
    check_tp_results(results, config, 2)


@pytest.mark.slow
def test_tp2_equals_one_process_on_the_124M_preset(tmp_path):
    """All 12 layers and 12 heads of GPT-2 small (random weights); 50 greedy steps."""
    config = GPT2Config.from_preset("124M", n_ctx=64)
    results = run_ranks(tp_checks, 2, str(tmp_path), dataclasses.asdict(config), 50, timeout=400)
    check_tp_results(results, config, 2)


def test_c_attn_shard_takes_q_k_and_v_of_its_heads():
    """Rank r's c_attn columns are q, k and v of heads [r·h/N, (r+1)·h/N), not a contiguous third."""
    n_embd, n_head, hd = 12, 6, 2
    cols = [parallel.qkv_columns(n_embd, n_head, r, 3).tolist() for r in range(3)]
    assert cols[0] == [0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26, 27]
    assert sorted(sum(cols, [])) == list(range(3 * n_embd))       # every column exactly once
    attn = GPT2(GPT2Config(n_vocab=8, n_ctx=8, n_embd=n_embd, n_head=n_head, n_layer=1)).h[0].attn
    x = torch.randn(1, 3, n_embd)
    q, k, v = attn.qkv(x)                                          # [1, 6, 3, 2] each
    shard = parallel.ShardedSelfAttention(attn, 1, 3)
    qs, ks, vs = shard.qkv(x)                                      # heads 2, 3
    for full, part in ((q, qs), (k, ks), (v, vs)):
        torch.testing.assert_close(part, full[:, 2:4], atol=1e-6, rtol=0)


def test_heads_not_divisible_by_world_size_is_refused_before_any_work():
    model = GPT2(GPT2Config(n_vocab=8, n_ctx=8, n_embd=12, n_head=6, n_layer=1))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"n_head=6 is not divisible by the tensor-parallel size tp=4"):
        parallel.shard_model(model, rank=0, world_size=4)
    assert not isinstance(model.config, parallel.ShardConfig)       # nothing changed
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
