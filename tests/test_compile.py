"""The core traces whole under torch.compile: a decode step compiles with fullgraph=True (no graph
break: no host reads, locks or dispatch checks inside the model) and gives the eager logits."""

import pytest
import torch

from gpt2mha import GPT2, GPT2Config, KVCache


def decode_steps(model, step_fn, n=4):
    c = model.config
    torch.manual_seed(0)
    idx = torch.randint(0, c.n_vocab, (2, 5))
    cache = KVCache(c.n_layer, 2, c.n_head, c.n_ctx, c.head_dim)
    out = []
    with torch.no_grad():
        model(idx, cache=cache)
        tok = idx[:, -1:]
        for _ in range(n):
            step = cache.plan(1, span=c.n_ctx, per_row=True)      # the same shapes at every step
            logits = step_fn(tok, cache, step)
            out.append(logits)
            tok = logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(out, 1)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_decode_step_compiles_whole_and_matches_eager(backend):
    torch._dynamo.reset()
    model = GPT2(GPT2Config(n_vocab=64, n_ctx=16, n_embd=32, n_head=4, n_layer=2, tokenizer="bytes")).eval()

    def step(tok, cache, step):
        return model(tok, cache=cache, step=step, last_only=True).logits

    eager = decode_steps(model, step)
    compiled = decode_steps(model, torch.compile(step, fullgraph=True, backend=backend))
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
