"""Repetition control: ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``.

References: transformers' logits processors (``RepetitionPenaltyLogitsProcessor``,
``NoRepeatNGramLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``) on the same logits and
histories, to 1e-6 (random logits, and the built-in model's own logits along its generation);
vLLM's documented semantics for the stop fields (a stop token is among the tokens, its text is
not; ``include_stop_str_in_output`` keeps the stop; ``min_tokens`` bans EOS and the stop ids);
offline ``generate()`` for every served answer (the scheduler in this process, and the real
server through HTTP for completions and chat); the same row alone for batch invariance.
"""

import json
import re

import httpx
import pytest
import torch

from gpt2mha import DEFAULT_MODEL, GPT2, GPT2Config
from gpt2mha.inference.engine import Engine
from gpt2mha.inference.generate import generate_with
from gpt2mha.inference.params import ParamError, SamplingParams
from gpt2mha.inference.sampling import NoTokenAllowedError, RowSampler, row_seed, token_logprobs
from gpt2mha.io.tokenizer import tokenizer_for
from gpt2mha.inference.scheduler import Scheduler

lp = pytest.importorskip("transformers.generation.logits_process")

TEXT = "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun. It is the east."


@pytest.fixture(scope="module")
def builtin(one_thread):
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return model, tokenizer_for(model.config)


@pytest.fixture(scope="module")
def bpe(one_thread):
    """A tiny random model with GPT-2's BPE tokenizer (it has <|endoftext|>, 50256)."""
    torch.manual_seed(0)
    config = GPT2Config(n_vocab=50257, n_ctx=64, n_embd=16, n_head=2, n_layer=1, tokenizer="gpt2")
    model = GPT2(config).eval()
    return model, tokenizer_for(config)


def sampler(params, vocab, prompt, generated=(), eos=None):
    """A RowSampler that was given ``prompt`` and has accepted ``generated``."""
    s = RowSampler(params, None, vocab, "cpu", eos_token_id=eos, prompt=prompt)
    for t in generated:
        s.accept(None, t)
    return s


def hf_processors(params, prompt_len, eos=()):
    """transformers' processors for ``params``, in the order transformers' generate lists them."""
    out = []
    if params.repetition_penalty != 1:
        out.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.no_repeat_ngram_size:
        out.append(lp.NoRepeatNGramLogitsProcessor(params.no_repeat_ngram_size))
    if params.min_tokens:
        out.append(lp.MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, list(eos)))
    return lp.LogitsProcessorList(out)


def assert_close(ours, ref):
    """Equal to 1e-6 where finite, -inf at the same places."""
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(ours[finite], ref[finite], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------- against transformers' processors
@pytest.mark.parametrize("fields", [dict(repetition_penalty=1.3), dict(repetition_penalty=0.7),
                                    dict(repetition_penalty=2.5), dict(no_repeat_ngram_size=1),
                                    dict(no_repeat_ngram_size=2), dict(no_repeat_ngram_size=3),
                                    dict(no_repeat_ngram_size=5),
                                    dict(repetition_penalty=1.2, no_repeat_ngram_size=2, min_tokens=4,
                                         stop_token_ids=[46, 33])])
def test_adjusted_logits_equal_transformers_processors_on_random_logits(fields):
    """Random logits of both signs over a byte vocabulary, a real text as prompt and its next
    words as the generated tokens: at every step the sampler's adjusted logits equal
    transformers' processors on input_ids = prompt + generated (and something was changed)."""
    data = list(TEXT.encode())
    prompt, generated = data[:40], data[40:]
    params = SamplingParams(max_tokens=len(generated) + 1, **fields)
    eos = 10
    gen = torch.Generator().manual_seed(0)
    changed = 0
    for k in range(len(generated) + 1):
        logits = torch.randn(1, 256, generator=gen) * 4
        ours = sampler(params, 256, prompt, generated[:k], eos=eos).adjust(logits)
        ids = torch.tensor([prompt + generated[:k]])
        ref = hf_processors(params, len(prompt), (eos, *params.stop_token_ids))(ids, logits.clone())
        assert_close(ours, ref)
        changed += not torch.equal(ours, logits)
    assert changed >= 5                                           # the rule acted at several steps


def test_min_tokens_bans_eos_and_stop_ids_exactly_until_that_many_new_tokens():
    """MinNewTokensLengthLogitsProcessor's steps: banned at new tokens 0 … min_tokens-1, free
    from then on; ignore_eos leaves EOS out of the ban (vLLM's all_stop_token_ids)."""
    params = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[7])
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    hf = lp.MinNewTokensLengthLogitsProcessor(2, 3, [4, 7])
    for k in range(6):
        ours = sampler(params, 50, [1, 2], range(10, 10 + k), eos=4).adjust(logits)
        assert_close(ours, hf(torch.tensor([[1, 2, *range(10, 10 + k)]]), logits.clone()))
        assert bool(torch.isinf(ours[0, 4])) == bool(torch.isinf(ours[0, 7])) == (k < 3)
    ignoring = sampler(SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[7], ignore_eos=True), 50, [1], eos=4)
    out = ignoring.adjust(logits)
    assert torch.isinf(out[0, 7]) and out[0, 4] == logits[0, 4]


def test_the_builtin_models_generation_follows_transformers_processors_step_by_step(builtin, monkeypatch):
    """Real logits and a real history: greedy generate() with the three processors' fields; at
    each step the logits the model gave, adjusted by transformers' processors on the history
    so far, have their argmax at the token generate chose (the ngram rule seen holding too)."""
    model, tok = builtin
    seen = []
    real = Engine.sample

    def spy(self, slots, logits, rows):
        seen.append(logits[list(rows)].clone())
        return real(self, slots, logits, rows)
    monkeypatch.setattr(Engine, "sample", spy)
    prompt = tok.encode(TEXT[:30])
    params = SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, no_repeat_ngram_size=3,
                            min_tokens=5, stop_token_ids=[10])
    out = generate_with(model, [prompt], params)[0, len(prompt):].tolist()
    plain = generate_with(model, [prompt], SamplingParams(max_tokens=40, temperature=0))[0, len(prompt):].tolist()
    assert out != plain                                            # the fields changed the text
    out = out[:out.index(10) + 1] if 10 in out else out            # a finished row repeats its stop token
    assert len(out) > 20
    processors = hf_processors(params, len(prompt), (10,))
    for k, token in enumerate(out):
        ref = processors(torch.tensor([prompt + out[:k]]), seen[k].clone())
        assert int(ref.argmax()) == token, k
    grams = [tuple((prompt + out)[i:i + 3]) for i in range(len(prompt + out) - 2)]
    assert len(grams) == len(set(grams))                          # no 3-gram twice


def test_a_history_that_bans_every_token_is_a_clear_error(builtin):
    """no_repeat_ngram_size=1 after a prompt holding bytes 1 … 255, and min_tokens banning stop
    id 0, ban the whole vocabulary: an error naming the fields, not a NaN draw or 'infinite
    logits'."""
    model, _ = builtin
    with pytest.raises(NoTokenAllowedError, match=r"step 0: no_repeat_ngram_size=1 with min_tokens=1 bans all 256"):
        model.generate([list(range(1, 256))], 1, no_repeat_ngram_size=1, min_tokens=1, stop_token_ids=[0])


# -------------------------------------------------------------------- validation, entry points
@pytest.mark.parametrize("kwargs,param,match", [
    (dict(repetition_penalty=0), "repetition_penalty", r"repetition_penalty=0 must be a finite number > 0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty", "repetition_penalty=-1.0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty", "repetition_penalty=inf"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size", "no_repeat_ngram_size=-1 must be an integer >= 0"),
    (dict(no_repeat_ngram_size=2.0), "no_repeat_ngram_size", "no_repeat_ngram_size=2.0"),
    (dict(min_tokens=-2), "min_tokens", "min_tokens=-2 must be an integer >= 0"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "min_tokens=5 must be less than or equal to max_tokens=4"),
    (dict(ignore_eos=1), "ignore_eos", "ignore_eos=1 must be true or false"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids", r"stop_token_ids\[1\]=-1 must be a token id"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids", r"stop_token_ids\[0\]=1.5"),
    (dict(stop_token_ids="5"), "stop_token_ids", "stop_token_ids='5' must be a list of token ids"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output", "include_stop_str_in_output='yes'"),
])
def test_every_new_field_out_of_range_is_a_param_error_naming_it(kwargs, param, match):
    with pytest.raises(ParamError, match=match) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_defaults_are_off_and_stop_ids_are_checked_against_the_vocabulary():
    p = SamplingParams()
    assert (p.repetition_penalty, p.no_repeat_ngram_size, p.min_tokens, p.ignore_eos, p.stop_token_ids,
            p.include_stop_str_in_output) == (1.0, 0, 0, False, (), False) and not p.adjusted
    with pytest.raises(ParamError, match=r"stop_token_ids\[1\]=256 is not a token id of this model's tokenizer"):
        SamplingParams(stop_token_ids=[3, 256]).check_vocab(256)


def test_generate_takes_every_field_and_refuses_a_typo_by_name(builtin):
    """generate(**fields) for every SamplingParams field, the text's too (one scheduler runs them
    all: ``stop`` ends a row at its string, the rest of the row padded); a typo, or max_tokens
    beside max_new_tokens, is a TypeError naming it."""
    model, tok = builtin
    ids = torch.tensor([list(b"ROMEO:")])
    assert model.generate(ids, 3, temperature=0, repetition_penalty=1.5).shape == (1, 9)
    full = model.generate(ids, 40, temperature=0)[0, 6:].tolist()
    stop = tok.decode(full)[20:23]
    cut = model.generate(ids, 40, temperature=0, stop=[stop], include_stop_str_in_output=True)[0, 6:].tolist()
    end = tok.decode(full).index(stop) + len(stop)               # a byte model: one token a character
    assert cut == full[:end] + [0] * (40 - end)                  # then the byte tokenizer's pad, 0
    for name, value in (("repetition_penalt", 1.2), ("max_tokens", 3)):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            model.generate(ids, 3, **{name: value})
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\]=300 is not a token id"):
        model.generate(ids, 3, stop_token_ids=[300])


# ------------------------------------------------------------------- offline and served, per field
def served(sched, prompt, params):
    seq = sched.submit([prompt], params, lambda *a: None)[0]
    sched.run_until_idle()
    assert seq.finish_reason in ("stop", "length"), seq.error
    return seq


def offline(model, prompt, params, eos=None):
    return generate_with(model, [prompt], params, eos_token_id=eos, batch_invariant=True)[0, len(prompt):].tolist()


@pytest.mark.parametrize("fields", [dict(repetition_penalty=1.5), dict(repetition_penalty=0.8, temperature=0.9, seed=3),
                                    dict(no_repeat_ngram_size=4), dict(no_repeat_ngram_size=2, temperature=1.0, seed=5),
                                    dict(repetition_penalty=1.2, no_repeat_ngram_size=3, min_tokens=4)])
def test_served_tokens_equal_generates_for_the_penalties(builtin, fields):
    model, tok = builtin
    prompt = tok.encode("ROMEO:")
    params = SamplingParams(**{"max_tokens": 40, "temperature": 0, **fields})
    seq = served(Scheduler(model, tok, max_batch=2, batch_invariant=True), prompt, params)
    ref = offline(model, prompt, params)
    assert seq.tokens == ref and seq.text == tok.decode(ref) and seq.finish_reason == "length"
    assert ref != offline(model, prompt, SamplingParams(**{**params.__dict__, "repetition_penalty": 1.0,
                                                            "no_repeat_ngram_size": 0}))


def test_stop_token_ids_end_the_text_without_their_text_unless_asked(builtin):
    """Greedy "ROMEO:" continues "\\nWhat is the ...": stop at the first space (32): the tokens
    hold it, the text does not; with include_stop_str_in_output the text ends with it; without
    stop ids, min_tokens changes nothing; with newline (10) as a stop id, min_tokens=5 bans it
    for 5 tokens. Each equals generate()'s tokens up to the stop."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2, batch_invariant=True)
    prompt = tok.encode("ROMEO:")
    ref = offline(model, prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[32]))
    cut = ref.index(32) + 1
    assert ref[cut:] == [32] * (30 - cut)                           # a finished row repeats its stop token
    seq = served(sched, prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[32]))
    assert seq.tokens == ref[:cut] and seq.text == tok.decode(ref[:cut - 1]) and seq.finish_reason == "stop"
    kept = served(sched, prompt, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[32],
                                                include_stop_str_in_output=True))
    assert kept.tokens == ref[:cut] and kept.text == tok.decode(ref[:cut]) and kept.text.endswith(" ")
    params = SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[10], min_tokens=5)
    ref = offline(model, prompt, params)
    plain = offline(model, prompt, SamplingParams(max_tokens=30, temperature=0))
    assert plain[0] == 10 and 10 not in ref[:5] and ref[:5] != plain[:5]
    seq = served(sched, prompt, params)
    assert seq.tokens == (ref[:ref.index(10) + 1] if 10 in ref else ref)


def test_include_stop_str_in_output_and_min_tokens_with_stop_strings(builtin):
    """A stop string ends the text before it, or after it with include_stop_str_in_output; with
    min_tokens=k no stop string ends the text until more than k tokens (vLLM's rule): greedy
    "ROMEO:" starts with a newline, so stop "\\n" ends at once, but with min_tokens=3 at the next."""
    model, tok = builtin
    sched = Scheduler(model, tok, max_batch=2, batch_invariant=True)
    prompt = tok.encode("ROMEO:")
    ref = offline(model, prompt, SamplingParams(max_tokens=60, temperature=0))
    text = tok.decode(ref)
    assert text.startswith("\n") and "\n" in text[1:] and "the" in text
    cases = [(dict(stop=["the"]), text[:text.index("the")]),
             (dict(stop=["the"], include_stop_str_in_output=True), text[:text.index("the") + 3]),
             (dict(stop=["\n"]), ""),
             (dict(stop=["\n"], min_tokens=3), text[:text.index("\n", 3)]),
             (dict(stop=["\n"], min_tokens=3, include_stop_str_in_output=True), text[:text.index("\n", 3) + 1])]
    for fields, want in cases:
        seq = served(sched, prompt, SamplingParams(max_tokens=60, temperature=0, **fields))
        assert seq.text == want and seq.finish_reason == "stop", fields
        assert seq.tokens == ref[:len(seq.tokens)]


def test_ignore_eos_and_min_tokens_with_an_end_of_text_token(bpe):
    """A BPE model whose logit_bias makes <|endoftext|> certain: it ends at once ('stop', no
    text); with ignore_eos it runs to max_tokens, EOS an ordinary token (its text in the text);
    with min_tokens=3 EOS comes 4th. Served tokens equal generate()'s with eos_token_id."""
    model, tok = bpe
    eot = tok.eot_token
    sched = Scheduler(model, tok, max_batch=2, batch_invariant=True)
    prompt = tok.encode("Hello there")
    base = dict(max_tokens=6, temperature=1.0, seed=4, logit_bias={eot: 100})
    seq = served(sched, prompt, SamplingParams(**base))
    assert seq.tokens == [eot] and seq.text == "" and seq.finish_reason == "stop"
    params = SamplingParams(**base, ignore_eos=True)
    seq = served(sched, prompt, params)
    assert seq.tokens == offline(model, prompt, params, eos=eot) == [eot] * 6
    assert seq.finish_reason == "length" and seq.text == tok.decode([eot] * 6)
    params = SamplingParams(**base, min_tokens=3)
    ref = offline(model, prompt, params, eos=eot)
    assert eot not in ref[:3] and ref[3:] == [eot] * 3
    seq = served(sched, prompt, params)
    assert seq.tokens == ref[:4] and seq.text == tok.decode(ref[:3]) and seq.finish_reason == "stop"


# ------------------------------------------------------------------------------ batch invariance
ROW = SamplingParams(max_tokens=24, temperature=0.9, seed=11, logprobs=2, repetition_penalty=1.4,
                     no_repeat_ngram_size=2, min_tokens=3, stop_token_ids=[33], presence_penalty=0.2)


def test_a_row_with_the_fields_is_bitwise_the_same_batched_as_alone(builtin):
    """The scheduler: a sequence with every field (seeded, with logprobs) gives the same tokens
    and log-probabilities, bitwise, alone and admitted in another slot beside two others of other
    lengths and fields."""
    model, tok = builtin
    prompt = tok.encode("JULIET:\nO Romeo, Romeo")
    alone = served(Scheduler(model, tok, max_batch=4, batch_invariant=True), prompt, ROW)
    sched = Scheduler(model, tok, max_batch=4, batch_invariant=True)
    others = [sched.submit([tok.encode("ROMEO:")], SamplingParams(max_tokens=30, temperature=0), lambda *a: None),
              sched.submit([tok.encode("A")], SamplingParams(max_tokens=10, temperature=1.0, seed=2,
                                                            repetition_penalty=0.7), lambda *a: None)]
    sched.step()
    seq = sched.submit([prompt], ROW, lambda *a: None)[0]
    sched.run_until_idle()
    assert all(s[0].finish_reason == "length" for s in others)
    assert seq.tokens == alone.tokens and seq.logprobs == alone.logprobs and seq.text == alone.text


def test_generate_rows_with_the_fields_equal_their_prompts_alone(builtin):
    """generate() over three prompts of different lengths with the fields: row i is bitwise
    generate() of prompt i alone seeded row_seed(seed, i)."""
    model, tok = builtin
    prompts = [tok.encode(t) for t in ("ROMEO:", "JULIET:\nO Romeo, Romeo", "A")]
    params = SamplingParams(**{**ROW.__dict__, "logprobs": None})
    out = generate_with(model, prompts, params, batch_invariant=True)
    T = out.shape[1] - params.max_tokens
    for i, p in enumerate(prompts):
        alone = offline(model, p, SamplingParams(**{**params.__dict__, "seed": row_seed(11, i)}))
        assert out[i, T:].tolist() == alone, i


# --------------------------------------------------------------------------- the HTTP server
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def server(builtin):
    from gpt2mha.serving.server import serve_in_thread

    model, tok = builtin
    with serve_in_thread(Scheduler(model, tok, max_batch=2, batch_invariant=True), DEFAULT_MODEL) as url:
        yield url


def post(url, path, body):
    return httpx.post(url + path, content=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=60)


FIELDS = dict(repetition_penalty=1.3, no_repeat_ngram_size=3, min_tokens=4, stop_token_ids=[44],
              include_stop_str_in_output=True, stop=["not?"], ignore_eos=True)


def expected_text(tok, tokens):
    """What the stop fields of FIELDS make of generate()'s tokens (a byte model: one character a
    token): the text up to and with the first stop id (44, ","), then up to and with the first
    stop string (which must end past min_tokens characters, where vLLM's rule starts matching it)."""
    text = tok.decode(tokens[:tokens.index(44) + 1] if 44 in tokens else tokens)
    stop = FIELDS["stop"][0]
    at = text.find(stop)
    assert at == -1 or at + len(stop) > FIELDS["min_tokens"]
    return text if at == -1 else text[:at + len(stop)]


def test_completions_and_chat_take_every_field_and_answer_as_generate(builtin, server):
    """The real server: a completion and a chat completion carrying every field (greedy) give
    the text of generate()'s tokens for the same ids, cut where the stop fields say."""
    from gpt2mha.serving.chat import BUILTIN_TEMPLATES, ChatTemplate

    model, tok = builtin
    r = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, **FIELDS})
    assert r.status_code == 200, r.text
    ref = offline(model, tok.encode("ROMEO:"), SamplingParams(max_tokens=40, temperature=0, **FIELDS))
    plain = offline(model, tok.encode("ROMEO:"), SamplingParams(max_tokens=40, temperature=0))
    assert r.json()["choices"][0]["text"] == expected_text(tok, ref) != expected_text(tok, plain)
    messages = [{"role": "user", "content": "What light through yonder window breaks?"}]
    r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 30, "temperature": 0, **FIELDS})
    assert r.status_code == 200, r.text
    ids = tok.encode(ChatTemplate(BUILTIN_TEMPLATES["plain"], {}).render(messages))
    ref = offline(model, ids, SamplingParams(max_tokens=30, temperature=0, **FIELDS))
    assert r.json()["choices"][0]["message"]["content"] == expected_text(tok, ref)
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_null_fields_mean_their_defaults(server):
    """``null`` for each new field is the request without it (OpenAI's and vLLM's reading)."""
    body = {"prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}
    plain = post(server, "/v1/completions", body)
    nulls = post(server, "/v1/completions", {**body, **dict.fromkeys(FIELDS)})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"] == plain.json()["choices"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields,param,words", [
    (dict(repetition_penalty=0), "repetition_penalty", ["repetition_penalty=0", "> 0"]),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size", [">= 0"]),
    (dict(min_tokens=50, max_tokens=5), "min_tokens", ["min_tokens=50", "max_tokens=5"]),
    (dict(stop_token_ids=[256]), "stop_token_ids", ["stop_token_ids[0]=256", "ids 0 … 255"]),
    (dict(stop_token_ids=[-3]), "stop_token_ids", ["stop_token_ids[0]=-3"]),
    (dict(stop_token_ids=5), "stop_token_ids", ["a list of token ids"]),
    (dict(ignore_eos="yes"), "ignore_eos", ["a boolean"]),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output", ["a boolean"]),
    (dict(repetition_penalty="1.2"), "repetition_penalty", ["a number"]),
])
def test_bad_values_are_400_naming_the_field(server, path, fields, param, words):
    body = {"prompt": "ROMEO:"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    r = post(server, path, {**body, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err


# ------------------------------------------------------------------------------------ the CLI
def test_the_cli_flags_print_what_generate_and_the_scheduler_give(builtin, capsys):
    """`gpt2mha generate` with the penalty flags prints generate()'s text; with --stop-token-ids
    (run on the serving scheduler) the scheduler's; bad values are errors naming the flag."""
    from gpt2mha.cli import main

    model, tok = builtin
    flags = ["--max-new-tokens", "30", "--temperature", "0", "--repetition-penalty", "1.3",
             "--no-repeat-ngram-size", "3", "--min-tokens", "4"]
    assert main(["generate", "ROMEO:", *flags]) == 0
    params = SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, no_repeat_ngram_size=3, min_tokens=4)
    ref = offline(model, tok.encode("ROMEO:"), params)
    assert capsys.readouterr().out == "ROMEO:" + tok.decode(ref) + "\n"
    assert main(["generate", "ROMEO:", *flags, "--stop-token-ids", "44,63", "--include-stop-str-in-output"]) == 0
    params = SamplingParams(**{**params.__dict__, "stop_token_ids": (44, 63), "include_stop_str_in_output": True})
    seq = served(Scheduler(model, tok, max_batch=1), tok.encode("ROMEO:"), params)
    assert capsys.readouterr().out == "ROMEO:" + seq.text + "\n" and seq.text[-1] in ",?"
    for bad, match in [(["--repetition-penalty", "0"], "--repetition-penalty=0.0 must be a finite number > 0"),
                       (["--no-repeat-ngram-size", "-2"], "--no-repeat-ngram-size=-2 must be an integer >= 0"),
                       (["--min-tokens", "40"], "--min-tokens=40 must be less than or equal to --max-new-tokens=30"),
                       (["--stop-token-ids", "1,x"], "expected token ids separated by commas"),
                       (["--stop-token-ids", "256"], r"stop_token_ids\[0\]=256 is not a token id"),
                       (["--ignore-eos", "--stop-at-eos"], "--ignore-eos and --stop-at-eos contradict")]:
        try:
            code = main(["generate", "ROMEO:", "--max-new-tokens", "30", *bad])
        except SystemExit as e:                                    # argparse's usage error
            code = e.code
        assert code == 2, bad
        assert re.search(match, capsys.readouterr().err), bad
    # stop ids past the context, on the sliding window: generate()'s tokens (one scheduler runs both)
    assert main(["generate", "ROMEO:", "--max-new-tokens", "300", "--temperature", "0", "--stop-token-ids", "5",
                 "--sliding-window"]) == 0
    ref = offline(model, tok.encode("ROMEO:"), SamplingParams(max_tokens=300, temperature=0, stop_token_ids=[5],
                                                              sliding_window=True))
    assert 5 not in ref and capsys.readouterr().out == "ROMEO:" + tok.decode(ref) + "\n"
