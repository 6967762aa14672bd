"""Batch invariance: a row's logits at every step are bitwise those of its prompt run alone.

For every dtype (float32, bfloat16, float16) and weight format (float, int8, int4; rounded to
nearest, and GPTQ once), batches of 2, 4, 8 and 16 prompts of mixed lengths (1 … 200 tokens, in
shuffled orders) give each row exactly (``torch.equal``) the per-step logits that ``generate``
computes for that prompt alone, hence the same greedy and seeded tokens; the serving scheduler
gives a sequence the same logits whatever runs beside it, in whichever slot, admitted whenever.
Reference: the same prompt alone (a batch of one). Exact equality is what is claimed: no row's
arithmetic reads another row (benchmarks/batch_invariance.py measures each kernel).
"""

import threading

import pytest
import torch

from conftest import record_sampled_logits, small_model
from gpt2mha import GPT2
from gpt2mha.inference.generate import left_pad
from gpt2mha.inference.sampling import row_seed
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.params import SamplingParams
from gpt2mha.inference.scheduler import Scheduler

LENGTHS = [1, 2, 3, 4, 5, 7, 9, 16, 17, 31, 33, 64, 100, 129, 150, 200]
#: batches of rows of PROMPTS, in the order given: 2, 4, 8 and 16 rows of mixed lengths
BATCHES = [[5, 12], [15, 0, 7, 3], [8, 1, 14, 2, 11, 6, 13, 4], [9, 3, 15, 0, 12, 6, 1, 10, 4, 14, 7, 2, 13, 8, 5, 11]]
STEPS = 5


def prompts_of(lengths, n_vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n_vocab, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts_of(LENGTHS, 256)


@pytest.fixture(autouse=True)
def threads(one_thread):
    """One intra-op thread (tiny tensors; a busy 2-core box); :func:`test_two_threads_split_no_row_differently`
    sets two itself."""


@pytest.fixture
def spy(monkeypatch):
    """Records the logits ``[B, n_vocab]`` generate samples each step from; ``spy()`` returns
    them as ``[B, steps, n_vocab]`` and forgets them."""
    seen = []
    real = Engine.sample

    def sample(self, slots, logits, rows):
        seen.append(logits[list(rows)].clone())
        return real(self, slots, logits, rows)
    monkeypatch.setattr(Engine, "sample", sample)

    def take():
        out = torch.stack(seen, 1)
        seen.clear()
        return out
    take.clear = seen.clear
    return take


def run(model, prompts, spy, n=STEPS, **kw):
    """``generate``'s tokens ``[B, T + n]`` and per-step logits ``[B, n, n_vocab]`` (batch
    invariant also for float32 weights, where it is asked for)."""
    spy.clear()                                  # what the server's engine sampled beside
    out = model.generate(prompts, n, batch_invariant=True, **kw)
    return out, spy()


def matrix_model(dtype, fmt):
    """A 2-layer random model (context 256, width 64) in ``dtype``, quantized as ``fmt``
    (``"float"``, ``"int8"``, ``"int4"`` rounded to nearest, ``"int4-gptq"``)."""
    model = small_model(3, n_vocab=256, n_ctx=256, n_embd=64, n_head=4, n_layer=2, noise="all", scale=0.05,
                        tokenizer="bytes").to(dtype)
    if fmt != "float":
        scheme, _, method = fmt.partition("-")
        calibration = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
        model.quantize(scheme, method=method or "rtn", calibration=calibration if method == "gptq" else None)
    return model


def assert_rows_equal_alone(model, spy, **kw):
    alone = [run(model, [p], spy, **kw) for p in PROMPTS]
    for rows in BATCHES:
        out, logits = run(model, [PROMPTS[i] for i in rows], spy, **kw)
        for b, i in enumerate(rows):
            ids, ref = alone[i]
            assert torch.equal(logits[b], ref[0]), f"row {b} (prompt {i}, {LENGTHS[i]} tokens) of a batch of {len(rows)}"
            assert out[b, -STEPS:].tolist() == ids[0, -STEPS:].tolist()


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_row_of_a_mixed_batch_has_the_logits_of_its_prompt_alone(dtype, fmt, spy):
    assert_rows_equal_alone(matrix_model(dtype, fmt), spy, temperature=0)


def test_two_threads_split_no_row_differently(spy):
    """With two threads MKL splits a float32 product of 5–7 or 9–11 rows into blocks of 4 and
    a remainder that rounds like a call of one row; the decode view's row padding keeps every
    row in one class. Batches of 5 and 6 rows (decode steps of 5 and 6 rows) against alone."""
    model = matrix_model(torch.float32, "float")
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = PROMPTS[:6]
        alone = [run(model, [p], spy, n=3, temperature=0)[1][0] for p in prompts]
        for rows in (prompts, prompts[1:]):
            logits = run(model, rows, spy, n=3, temperature=0)[1]
            assert all(torch.equal(logits[b], alone[prompts.index(p)]) for b, p in enumerate(rows))
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def builtin_f32():
    return GPT2.from_pretrained("shakespeare-byte")


@pytest.mark.parametrize("fmt,activations", [("float", None), ("int8", "exact"), ("int8", "auto"),
                                             ("int8", "per_row"), ("int4", "exact"), ("int4", "per_block")])
def test_two_threads_rows_of_one_length_equal_their_prompt_alone(builtin_f32, fmt, activations, spy, monkeypatch):
    """With two threads PyTorch's CPU attention splits one call's (row, head) pairs over its threads
    so that a row's rounding depends on the rows beside it, even rows of one length; each row is
    attended in a call of its own. Built-in model, batches with repeated prompts (equal lengths),
    every route generate takes (decode view, native forward), and the scheduler: bitwise alone."""
    import copy

    from gpt2mha.io.tokenizer import get_tokenizer

    model = builtin_f32 if fmt == "float" else copy.deepcopy(builtin_f32).quantize(
        fmt, method="rtn", activations=activations)
    p, q = PROMPTS[10], PROMPTS[12]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = [run(model, [x], spy, n=6, temperature=0)[1][0] for x in (p, q)]
        logits = run(model, [p, p, q, q, p], spy, n=6, temperature=0)[1]
        for b, i in enumerate([0, 0, 1, 1, 0]):
            assert torch.equal(logits[b], alone[i]), f"row {b}: {(logits[b] - alone[i]).abs().max().item():.3g} apart"
        if fmt == "float":
            plan = [(0, p, 6), (0, p, 6), (0, q, 6), (0, q, 6)]
            served = served_logits(model, get_tokenizer("bytes"), plan, monkeypatch)
            for (_, got), ref in zip(served, [alone[0], alone[0], alone[1], alone[1]]):
                assert torch.equal(got, ref)
    finally:
        torch.set_num_threads(n)


def test_invariance_is_the_default_except_for_float32_weights_and_the_flag_is_checked(spy):
    """``batch_invariant=None`` pads float32 products for every model but a float32 one (where
    it costs most at batch 1); a float32 batch without it is not held to bitwise equality, with
    it it is; a value other than True/False/None is a named error before any work."""
    from gpt2mha.inference.fast import RowPaddedConv1D, for_decoding, invariant_by_default

    assert not invariant_by_default(matrix_model(torch.float32, "float"))
    assert invariant_by_default(matrix_model(torch.bfloat16, "float"))
    assert invariant_by_default(matrix_model(torch.float32, "int8"))
    model = matrix_model(torch.float32, "float")
    assert not any(isinstance(m, RowPaddedConv1D) for m in for_decoding(model, batch_invariant=False).modules())
    assert not isinstance(for_decoding(model).h[0].mlp.c_fc, RowPaddedConv1D)
    assert isinstance(for_decoding(model, batch_invariant=True).h[0].mlp.c_fc, RowPaddedConv1D)
    with pytest.raises(ValueError, match="batch_invariant=1 must be True or False"):
        model.generate([[1, 2]], 2, batch_invariant=1)


def test_the_kernel_survey_finds_every_product_of_the_decode_view_row_invariant():
    """benchmarks/batch_invariance.py's survey, small: every product the decode view runs
    (float32 padded to 4 rows, bf16/fp16 F.linear, int8_matmul with outlier rows, the GEMV
    kernel where it builds, torch's int4 kernel where not) gives each row of a call of 1 … 20 or 64 rows the bits of that row alone, and attention
    gives each row of a batch its bits alone, from a cache buffer of any length."""
    from conftest import load_benchmark

    survey = load_benchmark("batch_invariance")
    products = survey.survey_products(K=64, N=96, ms=list(range(1, 21)) + [64])
    assert [name for name, bad in products.items() if "decode view" in name and bad] == []
    assert products["int8 int8_matmul, outlier rows mixed in"] == []
    from gpt2mha.inference.quant import gemv
    if gemv.available():                        # decode runs the GEMV kernel: checked above, as "decode view"
        assert "int4 int4_gemv (decode view)" in products
    else:                                       # decode runs torch's int4 kernel
        assert products["int4 _weight_int4pack_mm_for_cpu"] == []
    attention = survey.survey_attention(h=2, hd=16)
    assert [name for name, bad in attention.items() if "span" not in name and bad] == []


def test_int8_product_of_a_row_does_not_depend_on_an_outlier_row_beside_it():
    """int8_matmul splits a row with an outlier feature into three int8 pieces, the others into
    two: each row's count is its own, so an ordinary row gives the same bits beside an outlier
    row as alone (and the outlier row as alone too)."""
    from gpt2mha.inference.quant import int8_matmul
    from gpt2mha.inference.quant.schemes import quantize_int8

    gen = torch.Generator().manual_seed(4)
    q, scales = quantize_int8(torch.randn(48, 64, generator=gen) * 0.05)
    x = torch.randn(5, 64, generator=gen)
    x[2, 7] = 500.0                                             # an outlier feature in row 2 only
    batch = int8_matmul(x, q, scales)
    for i in range(5):
        assert torch.equal(batch[i], int8_matmul(x[i:i + 1], q, scales)[0]), i


def test_gptq_int4_rows_and_seeded_samples_equal_their_prompt_alone(spy):
    """GPTQ-rounded int4 in bfloat16, sampled with a seed: row i of the batch draws exactly what
    its prompt alone draws with ``row_seed(seed, i)``."""
    model = matrix_model(torch.bfloat16, "int4-gptq")
    rows = BATCHES[2]
    out, logits = run(model, [PROMPTS[i] for i in rows], spy, temperature=1.0, top_k=50, seed=11)
    for b, i in enumerate(rows):
        ids, ref = run(model, [PROMPTS[i]], spy, temperature=1.0, top_k=50, seed=row_seed(11, b))
        assert torch.equal(logits[b], ref[0]) and out[b, -STEPS:].tolist() == ids[0, -STEPS:].tolist()


def test_a_padded_tensor_with_its_mask_gives_each_row_its_prompt_alone(spy):
    """The same prompts as one left-padded tensor and mask (as the CLI passes them): each row's
    logits are its prompt's alone, and the output keeps the padding."""
    model = matrix_model(torch.bfloat16, "float")
    rows = [PROMPTS[i] for i in BATCHES[1]]
    idx, mask = left_pad(rows)
    out, logits = run(model, idx, spy, temperature=0, attention_mask=mask)
    assert torch.equal(out[:, :idx.shape[1]], idx)
    for b, p in enumerate(rows):
        assert torch.equal(logits[b], run(model, [p], spy, temperature=0)[1][0])


def test_sliding_window_rows_equal_their_prompt_alone(spy):
    """Rows that outgrow the context at different steps (``sliding_window``) are each recomputed
    over their own last n_ctx tokens: still their prompt alone, bit for bit."""
    model = small_model(5, n_vocab=256, n_ctx=24, n_embd=32, n_head=4, n_layer=2, noise="all", scale=0.05).to(torch.bfloat16)
    prompts = prompts_of([3, 19, 22, 30], 97, seed=2)
    out, logits = run(model, prompts, spy, n=8, temperature=0, sliding_window=True)
    for b, p in enumerate(prompts):
        assert torch.equal(logits[b], run(model, [p], spy, n=8, temperature=0, sliding_window=True)[1][0])


# ------------------------------------------------------------------------------- serving
def served_logits(model, tok, plan, monkeypatch, max_batch=4):
    """Drive a :class:`Scheduler` through ``plan``: a list of (steps to run first, prompt ids,
    max_tokens); returns each sequence's tokens and the logits its tokens were chosen from."""
    real = Engine.sample
    seen = record_sampled_logits(monkeypatch, lambda: sched.slots)
    sched = Scheduler(model, tok, max_batch=max_batch, max_queue=32, batch_invariant=True)
    seqs = []
    for steps, ids, n in plan:
        for _ in range(steps):
            sched.step()
        seqs += sched.submit([ids], SamplingParams(max_tokens=n, temperature=0), lambda *a: None)
    sched.run_until_idle()
    monkeypatch.setattr(Engine, "sample", real)
    return [(s.tokens, torch.stack(seen[id(s)])) for s in seqs]


@pytest.mark.parametrize("dtype,fmt", [(torch.float32, "float"), (torch.bfloat16, "float"), (torch.float16, "float"),
                                       (torch.float16, "int4"), (torch.bfloat16, "int8")], ids=str)
def test_served_sequences_have_the_logits_of_generate_alone(dtype, fmt, spy, monkeypatch):
    """Sequences admitted at different steps into 4 slots (some wait, slots are reused, rows of
    different lengths decode together): each one's logits at every step are generate's for its
    prompt alone, bit for bit."""
    from gpt2mha.io.tokenizer import get_tokenizer

    model = matrix_model(dtype, fmt)
    plan = [(0, PROMPTS[i], 4 + i % 5) for i in (15, 0, 3)] + [(2, PROMPTS[i], 6) for i in (7, 12, 1, 9)] + \
        [(1, PROMPTS[10], 3)]
    for (tokens, logits), (_, ids, n) in zip(served_logits(model, get_tokenizer("bytes"), plan, monkeypatch), plan):
        out, ref = run(model, [ids], spy, n=n, temperature=0)
        assert tokens == out[0, -n:].tolist() and torch.equal(logits, ref[0])


# --------------------------------------------------------------------- the built-in model
@pytest.fixture(scope="module")
def builtin_bf16():
    return GPT2.from_pretrained("shakespeare-byte", dtype="bfloat16")


@pytest.mark.slow
def test_readme_reproducer_holds_on_the_builtin_model(builtin_bf16):
    """The README's example: in bfloat16, a prompt generated beside a longer one gives its
    100 greedy tokens alone."""
    m = builtin_bf16
    p = list(b"First Citizen:\n")
    o = list(b"First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n")
    a = m.generate(torch.tensor([p]), 100, temperature=0)[0, len(p):]
    b = m.generate([p, o], 100, temperature=0)[0, -100:]
    assert torch.equal(a, b)


@pytest.mark.slow
def test_live_server_answers_under_concurrency_equal_offline_generate(builtin_bf16):
    """A live server on 127.0.0.1 (bfloat16 built-in model, 4 slots), 8 concurrent requests of
    different lengths, greedy and seeded: every text equals offline generate's for its prompt."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from gpt2mha.io.tokenizer import tokenizer_for
    from gpt2mha.serving.server import serve_in_thread

    model = builtin_bf16
    tok = tokenizer_for(model.config)
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed any further, hear me speak.\n", "O", "KING HENRY:\nWhat",
               "To be, or not to be", "JULIET:\nAy me!", "Go", "MENENIUS:\nEither you must confess yourselves wondrous"]
    bodies = [dict(prompt=p, max_tokens=24 + 3 * i, temperature=0 if i % 2 else 0.8, seed=i) for i, p in enumerate(prompts)]
    answers = [None] * len(bodies)
    sched = Scheduler(model, tok, max_batch=4, max_queue=16)
    with serve_in_thread(sched, "shakespeare-byte") as url:
        def ask(i):
            answers[i] = httpx.post(url + "/v1/completions", json=bodies[i], timeout=120).json()["choices"][0]["text"]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    for body, got in zip(bodies, answers):
        ids = tok.encode(body["prompt"])
        out = model.generate(torch.tensor([ids]), body["max_tokens"], temperature=body["temperature"],
                             seed=body["seed"])
        assert got == tok.decode(out[0, len(ids):].tolist()), body
