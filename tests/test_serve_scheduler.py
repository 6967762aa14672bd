"""The continuous-batching scheduler and the runner under it, in process (no HTTP): the engine's
slotted cache, sequences joining at different steps, cancellation and a failing sequence, the
limits on what it takes, and the text stream that turns tokens into whole characters and cuts
stop strings.

References: offline ``generate`` (the same model, one prompt alone) for every text; the model's
own uncached forward over one row for the runner's slotted cache; Python's UTF-8 codec for
streamed text.
"""

import pytest
import torch

from conftest import assert_same_greedy
from gpt2mha import GPT2, GPT2Config
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.params import SamplingParams
from gpt2mha.inference.sampling import RowSampler
from gpt2mha.io.tokenizer import ByteTokenizer, tokenizer_for
from gpt2mha.inference.scheduler import ExceedsCapacity, QueueFull, Scheduler
from gpt2mha.inference.text_stream import LENGTH, STOP, TextStream
import serve_helpers
from serve_helpers import draw_in, offline

builtin = serve_helpers.builtin          # the fixture (module scope): the built-in model and its tokenizer


def collect_events():
    texts = {}

    def on_event(seq, text, done):
        texts.setdefault(id(seq), []).append(text)
    return texts, on_event


# ----------------------------------------------------------------------------- scheduler
def test_engine_rows_of_different_lengths_decode_in_one_step_as_alone(one_thread, monkeypatch):
    """Engine: prompts of 5 and 11 tokens prefilled (each alone, in place) into slots 0
    and 2 of a 3-slot cache, slot 1 free; then one decode step over rows 0-2. Each row's logits,
    at the prefill and at the step, equal the model's own uncached forward over that row's tokens
    alone (reference); the free row keeps length 0, a released row is emptied, and an occupied
    slot cannot be opened again."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny")).eval()
    prompts = {0: torch.randint(0, 256, (5,)).tolist(), 2: torch.randint(0, 256, (11,)).tolist()}
    script = {0: [17, 3], 2: [99, 250]}                           # the "sampled" tokens of each slot
    seen = {0: [], 2: []}

    def draw(self, logits):                                       # records each row's logits [1, n_vocab]
        slot = engine.samplers.index(self)
        seen[slot].append(logits.clone())
        return script[slot][len(seen[slot]) - 1]

    monkeypatch.setattr(RowSampler, "draw", draw)
    engine = Engine(model, 3)
    for slot in prompts:
        engine.open(slot, SamplingParams(temperature=1.0), seed=slot)
    assert engine.prefill([0, 2], [prompts[0], prompts[2]]) == [17, 99]
    assert engine.cache.lengths == [5, 0, 11]
    assert engine.decode([0, 2]) == [3, 250]
    assert engine.cache.lengths == [6, 0, 12]
    for slot, ids in prompts.items():
        with torch.no_grad():
            ref = model(torch.tensor([ids + script[slot][:1]])).logits[0]     # [T + 1, n_vocab], uncached
        torch.testing.assert_close(seen[slot][0][0], ref[-2], rtol=1e-5, atol=1e-5)   # prefill
        torch.testing.assert_close(seen[slot][1][0], ref[-1], rtol=1e-5, atol=1e-5)   # the decode step
    engine.release(2)
    assert engine.cache.lengths == [6, 0, 0]
    with pytest.raises(ValueError, match="slot=0 is in use"):
        engine.open(0, SamplingParams(), seed=1)


def test_scheduler_sequences_joining_at_different_steps_equal_offline_generate(builtin):
    """Greedy and seeded (top-k, top-p) sequences of different lengths, each joining while
    others run, give exactly offline generate's tokens for their prompt alone (greedy ones up to
    a near-tie: float32 without batch_invariant); every slot is free at the end."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=3, max_queue=8)
    cases = [("ROMEO:", SamplingParams(max_tokens=30, temperature=0)),
             ("To be, or not", SamplingParams(max_tokens=12, temperature=0.9, seed=3)),
             ("First Citizen:\nBefore we proceed any further", SamplingParams(max_tokens=25, temperature=1.0,
                                                                             top_k=20, seed=7)),
             ("O", SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=11)),
             ("KING RICHARD III:\n", SamplingParams(max_tokens=9, temperature=0))]
    texts, on_event = collect_events()
    seqs = []
    for prompt, params in cases[:2]:                            # admitted at the same step
        seqs += sched.submit([tok.encode(prompt)], params, on_event)
    for prompt, params in cases[2:]:                            # then one at a time; 3 slots: some wait
        sched.step()
        seqs += sched.submit([tok.encode(prompt)], params, on_event)
        for _ in range(3):
            sched.step()
    sched.run_until_idle()
    for seq, (prompt, p) in zip(seqs, cases):
        ids, text = offline(model, tok, prompt, p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed)
        if p.temperature == 0:
            n = len(tok.encode(prompt))
            assert_same_greedy(model, tok.encode(prompt) + ids, tok.encode(prompt) + seq.tokens, n)
        else:
            assert seq.tokens == ids and seq.text == text
        assert "".join(texts[id(seq)]) == seq.text and seq.finish_reason == "length"
    assert sched.slots == [None] * 3 and sched.engine.cache.lengths == [0] * 3 and not sched.waiting
    assert sched.stats()["completed"] == 5 and sched.stats()["generated_tokens"] == sum(p.max_tokens for _, p in cases)


def test_text_stream_never_splits_a_character_or_shows_part_of_a_stop_string():
    """Byte by byte, deltas are whole characters (reference: str.encode/decode), a stop string
    split across tokens is held back and cut, and an unfinished character at the end becomes
    U+FFFD as bytes.decode(errors='replace') gives."""
    tok = ByteTokenizer()
    text = "héllo wörld 😀 ok"
    ts = TextStream(tok)
    deltas = [ts.push([b]) for b in text.encode()]
    assert "".join(deltas) + ts.finish() == text
    assert all("\ufffd" not in d for d in deltas) and "" in deltas        # held while a char was split
    ts = TextStream(tok, stop=("wör", "zz"))
    out = "".join(ts.push([b]) for b in text.encode())
    assert out == "héllo " and ts.stopped and ts.text == "héllo " and ts.finish() == ""
    ts = TextStream(tok, stop=("lo!",))                          # a tail "lo" held, then released at the end
    out = "".join(ts.push([b]) for b in b"hello")
    assert out == "hel" and ts.finish() == "lo" and not ts.stopped
    ts = TextStream(tok)
    assert ts.push(list("é".encode())[:1]) == "" and ts.finish() == b"\xc3".decode("utf-8", errors="replace")
    ts = TextStream(tok, stop=("b",), max_tokens=5)               # add: one token's text and finish reason
    assert ts.add(ord("a")) == ("a", None) and ts.add(ord("b")) == ("", STOP) and ts.text == "a"
    ts = TextStream(tok, max_tokens=2)
    assert ts.add(ord("a")) == ("a", None) and ts.add(ord("b")) == ("b", LENGTH)


def test_text_stream_offsets_and_released_tokens_follow_the_text_sent():
    """Each token's offset is the count of characters before it (a character's later bytes point
    at its start, as the characters of the bytes before it: str.decode on the prefix); the tokens
    released are those whose text starts within what was sent, so a held stop-string prefix and
    the tokens past a cut are not."""
    tok = ByteTokenizer()
    data = "aé😀b".encode()
    ts = TextStream(tok, stop=("bc",))
    sent = [(ts.add(b)[0], ts.released) for b in data]
    assert ts.offsets == [len(data[:j].decode(errors="ignore")) for j in range(len(data))] == [0, 1, 1, 2, 2, 2, 2, 3]
    assert sent == [("a", 1), ("", 1), ("é", 3), ("", 3), ("", 3), ("", 3), ("😀", 7), ("", 7)]   # "b" held: "bc"?
    assert ts.finish() == "b" and ts.released == 8
    ts = TextStream(tok, stop=("é",))
    assert [ts.add(b)[1] for b in "xé".encode()] == [None, None, STOP]
    assert ts.text == "x" and ts.released == 1                      # é's bytes are past the cut


def test_scheduler_cancel_frees_the_slot_and_a_failing_sequence_fails_alone(builtin, monkeypatch):
    """A cancelled sequence leaves its slot at the next step; an exception while sampling one
    sequence (at its prefill, or later) finishes it with 'error' while the others still
    equal offline generate."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=4)
    poison, poison_at_prefill = tok.encode("BOOM"), tok.encode("BANG!")
    def script(seq, logits):
        if seq.prompt_ids == poison and len(seq.tokens) == 5 or seq.prompt_ids == poison_at_prefill:
            raise RuntimeError("injected failure")

    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, script))
    texts, on_event = collect_events()
    good = sched.submit([tok.encode("ROMEO:")], SamplingParams(max_tokens=20, temperature=0.7, seed=1), on_event)[0]
    bad = sched.submit([poison], SamplingParams(max_tokens=20, temperature=0.7, seed=2), on_event)[0]
    early = sched.submit([poison_at_prefill], SamplingParams(max_tokens=20), on_event)[0]   # fails at its prefill
    gone = sched.submit([tok.encode("JULIET:")], SamplingParams(max_tokens=100, temperature=0), on_event)[0]
    for _ in range(2):
        sched.step()
    assert gone.slot is not None and sched.stats()["running"] == 3
    sched.cancel(gone)
    sched.step()
    assert early.finish_reason == "error" and early.tokens == [] and early.slot is None
    assert gone.finish_reason == "cancelled" and gone.slot is None and sched.slots.count(None) == 2
    sched.run_until_idle()
    assert bad.finish_reason == "error" and "injected failure" in bad.error and len(bad.tokens) == 5
    assert good.text == offline(model, tok, "ROMEO:", 20, 0.7, seed=1)[1] and good.finish_reason == "length"
    assert sched.slots == [None] * 4 and sched.stats()["failed"] == 2 and sched.stats()["cancelled"] == 1


def test_bpe_end_of_text_stops_with_finish_reason_stop(one_thread, monkeypatch):
    """A GPT-2 BPE model stops a sequence at <|endoftext|> (50256): finish_reason 'stop', the
    text is the tokens before it (reference: the tokenizer's decode), the slot is freed."""
    tok = tokenizer_for(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1))
    model = GPT2(GPT2Config(n_vocab=50257, n_ctx=32, n_embd=16, n_head=2, n_layer=1)).eval()
    script = tok.encode(" to be or not") + [tok.eot_token] + tok.encode(" never seen")
    monkeypatch.setattr(RowSampler, "draw", draw_in(lambda: sched, lambda seq, logits: script[len(seq.tokens)]))
    sched = Scheduler(model, tok, max_batch=2)
    seq = sched.submit([tok.encode("Hello")], SamplingParams(max_tokens=12, temperature=1.0), lambda *a: None)[0]
    sched.run_until_idle()
    assert seq.finish_reason == "stop" and seq.text == " to be or not" and seq.tokens == script[:5]
    assert sched.slots == [None, None]


def test_scheduler_refuses_work_beyond_free_slots_plus_queue(builtin):
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2, max_queue=1)
    p = SamplingParams(max_tokens=2, temperature=0)
    sched.submit([[65], [66]], p, lambda *a: None)
    with pytest.raises(QueueFull):
        sched.submit([[67], [68]], p, lambda *a: None)             # all or none
    sched.submit([[67]], p, lambda *a: None)
    with pytest.raises(QueueFull):
        sched.submit([[69]], p, lambda *a: None)
    with pytest.raises(ExceedsCapacity, match=r"at most 3 sequences at once \(max_batch=2 running \+ max_queue=1"):
        sched.submit([[1]] * 4, p, lambda *a: None)                   # more than could ever fit: not "retry later"
    assert sched.stats()["queued"] == 3 and sched.stats()["rejected"] == 3
    sched.run_until_idle()
    assert sched.stats()["completed"] == 3
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(model, tok, max_batch=0)


@pytest.mark.parametrize("prompts,params,match", [
    ([[65, 1.5]], SamplingParams(), r"prompts\[0\]\[1\]=1.5 is not a token id"),       # not truncated to 1
    ([[65], []], SamplingParams(), "prompt 1 is empty"),
    ([[65, 256]], SamplingParams(), r"outside \[0, n_vocab=256\)"),
    ([[65] * 250], SamplingParams(max_tokens=7), "250 tokens \\+ max_tokens=7 > n_ctx=256"),
    ([[65]], SamplingParams(logit_bias=((256, 1.0),)), "logit_bias key 256"),
    ([[65]], dict(max_tokens=3), "params must be a SamplingParams"),
], ids=["float-id", "empty", "vocab", "context", "bias-id", "not-params"])
def test_submit_refuses_bad_prompts_and_params_naming_them_and_queues_nothing(builtin, prompts, params, match):
    """The scheduler's own guard (for callers other than the HTTP app): every bad prompt, and what
    depends on the model (a logit_bias id past the vocabulary; every other field was checked when
    the SamplingParams was made: tests/test_params.py), is a ValueError naming it, raised before
    anything is queued."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2)
    with pytest.raises(ValueError, match=match):
        sched.submit(prompts, params, lambda *a: None)
    assert sched.idle() and sched.stats()["rejected"] == 0
