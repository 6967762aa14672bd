"""The model, its KV cache and ``generate()`` on a CUDA device (skipped without one: CI has none;
run on a GPU machine with ``python -m pytest tests/test_cuda.py``).

References: Hugging Face transformers' GPT2LMHeadModel on the same weights and device, and the
same model on the CPU (float32, TF32 off, so both devices compute float32 products). Greedy
continuations are compared with :func:`conftest.assert_same_greedy`: equal tokens, except after a
near-tie of the CPU model's logits."""

import pytest
import torch

from conftest import ROBUST, assert_same_greedy, hf_random_gpt2, small_model
from gpt2mha import GPT2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32():
    """float32 matmuls in float32 (not TF32's 10-bit mantissas) for the duration of a test."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def test_checkpoint_on_cuda_equals_transformers_on_cuda(tmp_path):
    """A transformers checkpoint loaded by gpt2mha and moved to the GPU gives transformers' own
    logits there (padded batch included), and its cached decode equals its uncached forward."""
    hf = hf_random_gpt2()
    hf.save_pretrained(tmp_path / "hf")
    ours = GPT2.from_pretrained(str(tmp_path / "hf")).to(CUDA).eval()
    hf = hf.to(CUDA)
    idx = torch.randint(0, 300, (3, 11), device=CUDA)
    with torch.no_grad():
        ref = hf(idx).logits
        got = ours(idx).logits
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # prefill 7 tokens, then decode 4 one at a time from the cache: the same logits as one forward
    with torch.no_grad():
        out = ours(idx[:, :7])
        past, steps = out.present, [out.logits]
        for t in range(7, 11):
            out = ours(idx[:, t:t + 1], past=past)
            past = torch.cat([past, out.present], dim=-2)      # present: the new part (OpenAI's past)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-4, rtol=1e-4)


def test_generate_on_cuda_equals_the_cpu():
    """Greedy ``model.generate`` on the GPU, a left-padded batch of two lengths, continues each
    prompt as the CPU model does (reference: the CPU model, uncached, at any divergence)."""
    cpu = small_model(**ROBUST)
    gpu = small_model(**ROBUST).to(CUDA)
    prompts = [[5, 17, 42, 8, 3, 9, 11], [60, 2, 33]]
    for p in prompts:
        a = cpu.generate(torch.tensor([p]), 20, temperature=0)[0]
        b = gpu.generate(torch.tensor([p], device=CUDA), 20, temperature=0)[0].cpu()
        assert_same_greedy(cpu, a, b, len(p))
    # the batch, left-padded, on the GPU: each row as its prompt alone on the GPU
    from gpt2mha.inference.generate import left_pad, strip_padding

    idx, mask = left_pad(prompts)
    out = gpu.generate(idx.to(CUDA), 20, temperature=0, attention_mask=mask.to(CUDA))
    assert out.device.type == "cuda"
    rows = strip_padding(out.cpu(), prompts)
    for p, row in zip(prompts, rows):
        alone = gpu.generate(torch.tensor([p], device=CUDA), 20, temperature=0)[0].cpu()
        assert_same_greedy(cpu, row, alone, len(p))


def test_seeded_sampling_on_cuda_is_reproducible_per_row():
    """Sampling on the GPU with a seed: the same seed gives the same tokens, another seed other
    tokens, and row i of a batch samples as its prompt alone with row i's seed (the per-row
    generators live on the model's device)."""
    from gpt2mha.inference.sampling import row_seed

    model = small_model(**ROBUST).to(CUDA)
    idx = torch.tensor([[5, 17, 42], [60, 2, 33]], device=CUDA)
    a = model.generate(idx, 24, temperature=1.5, seed=7)
    b = model.generate(idx, 24, temperature=1.5, seed=7)
    c = model.generate(idx, 24, temperature=1.5, seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, 3:], c[:, 3:])
    row1 = model.generate(idx[1:], 24, temperature=1.5, seed=row_seed(7, 1))
    assert torch.equal(a[1], row1[0])


def test_bf16_model_on_cuda_is_close_to_float32():
    """A bf16 copy of the model on the GPU: logits within bf16's rounding of the float32 model's
    (reference: the float32 model on the same device), and its cache in bf16."""
    model = small_model(**ROBUST).to(CUDA)
    half = small_model(**ROBUST).to(CUDA, torch.bfloat16)
    idx = torch.randint(0, 97, (2, 9), device=CUDA)
    with torch.no_grad():
        ref = model(idx).logits
        out = half(idx)
    assert out.present.dtype == torch.bfloat16
    torch.testing.assert_close(out.logits.float(), ref, atol=3e-2, rtol=3e-2)
    assert (out.logits.float() - ref).abs().max() > 0          # it did compute in bf16


def test_training_step_on_cuda_matches_the_cpu():
    """One AdamW step of the model on the GPU: the same loss and the same updated weights as on
    the CPU (float32, TF32 off; reference: the CPU run)."""
    losses, weights = [], []
    for device in ("cpu", "cuda"):
        model = small_model(**ROBUST).train().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, 97, (4, 16), generator=g).to(device)
        y = torch.randint(0, 97, (4, 16), generator=g).to(device)
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
        weights.append(model.h[0].attn.c_attn.weight.detach().cpu())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    torch.testing.assert_close(weights[1], weights[0], atol=1e-6, rtol=1e-5)


def test_the_serving_scheduler_on_cuda_answers_as_generate_on_cuda():
    """The one engine on the GPU: two prompts in one request to the serving scheduler (greedy, then
    seeded with a penalty) give, sequence by sequence, ``generate()``'s tokens for that prompt
    alone on the GPU with ``row_seed(seed, i)`` (reference: ``generate_with`` on the same model),
    and the route is the decode view (the native forward and the compiled step are CPU routes)."""
    from gpt2mha import DEFAULT_MODEL
    from gpt2mha.inference.decoders import VIEW
    from gpt2mha.inference.generate import generate_with
    from gpt2mha.inference.params import SamplingParams
    from gpt2mha.inference.sampling import row_seed
    from gpt2mha.io.tokenizer import tokenizer_for
    from gpt2mha.inference.scheduler import Scheduler

    model = GPT2.from_pretrained(DEFAULT_MODEL).to(CUDA).eval()
    tok = tokenizer_for(model.config)
    sched = Scheduler(model, tok, max_batch=4, batch_invariant=True)
    assert sched.engine.route.decoder.name == VIEW
    assert sched.engine.cache.k.device.type == "cuda"
    encoded = [tok.encode(p) for p in ("ROMEO:", "JULIET:\nO Romeo")]
    for params in (SamplingParams(max_tokens=24, temperature=0),
                   SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=7, presence_penalty=0.3)):
        seqs = sched.submit(encoded, params, lambda *a: None)
        sched.run_until_idle()
        for i, seq in enumerate(seqs):
            alone = params if params.seed is None else SamplingParams(**{**params.__dict__, "seed": row_seed(7, i)})
            out = generate_with(model, [encoded[i]], alone, batch_invariant=True)
            assert out.device.type == "cuda"
            assert seq.tokens == out[0, len(encoded[i]):].tolist(), (i, params.temperature)
