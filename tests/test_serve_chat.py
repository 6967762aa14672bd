"""Chat on the server as chat-first clients use it: the built-in chat templates (a default server
serves chat with the plain one; names select the others) and chat ``logprobs``/``top_logprobs``
in OpenAI's shape.

References: transformers' ``apply_chat_template`` (the same template strings on the tokenizer
files gpt2mha writes) and the literal texts of the templates' formats for the rendered prompts;
offline ``generate`` of the rendered prompt for the replies; the model's own uncached forward
(``log_softmax`` in float64) for every logprob; UTF-8 for ``bytes``; the official ``openai``
client for the wire format. Servers bind 127.0.0.1 on a free port and are started and stopped
by the tests.
"""

import pytest
import torch

from gpt2mha import GPT2, DEFAULT_MODEL
from gpt2mha.io.tokenizer import hf_tokenizer_files, tokenizer_for
from gpt2mha.inference.scheduler import Scheduler

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
openai = pytest.importorskip("openai")
from gpt2mha.serving.chat import BUILTIN_TEMPLATES, ChatTemplate, load_chat_template, special_tokens  # noqa: E402
from gpt2mha.serving.server import serve_in_thread       # noqa: E402

MESSAGES = [{"role": "system", "content": "Thou speakest as Romeo."},
            {"role": "user", "content": "What light through yonder window breaks?"}]
#: The prompt each built-in template makes of MESSAGES, written out by hand from the formats:
#: "role: content" lines then "assistant:"; ChatML's <|im_start|>role\ncontent<|im_end|>\n turns.
RENDERED = {
    "plain": "system: Thou speakest as Romeo.\nuser: What light through yonder window breaks?\nassistant:",
    "chatml": "<|im_start|>system\nThou speakest as Romeo.<|im_end|>\n"
              "<|im_start|>user\nWhat light through yonder window breaks?<|im_end|>\n<|im_start|>assistant\n",
}


@pytest.fixture(scope="module")
def builtin(one_thread):
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return model, tokenizer_for(model.config)


@pytest.fixture(scope="module")
def server(builtin):
    """A server with every default (what `gpt2mha serve` runs)."""
    model, tok = builtin
    with serve_in_thread(Scheduler(model, tok, max_batch=4, max_queue=16), DEFAULT_MODEL) as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(model, ids, max_tokens):
    """Offline ``generate``'s greedy continuation of ``ids``: (ids, text)."""
    tok = tokenizer_for(model.config)
    out = model.generate(torch.tensor([ids]), max_tokens, temperature=0, vocab_size=tok.n_vocab)[0, len(ids):].tolist()
    return out, tok.decode(out)


# ------------------------------------------------------------------------ built-in templates
@pytest.mark.parametrize("name", sorted(RENDERED))
def test_builtin_templates_render_their_format_as_transformers_does(name, tmp_path):
    """Each built-in template turns MESSAGES into its format's text (RENDERED, written by hand),
    which is also what transformers' apply_chat_template makes of the same template string;
    selected by name (load_chat_template), a file is still read as a file."""
    transformers = pytest.importorskip("transformers")
    for file, data in hf_tokenizer_files("bytes", 256).items():
        (tmp_path / file).write_bytes(data)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    source = load_chat_template(name)
    assert source == BUILTIN_TEMPLATES[name]
    ours = ChatTemplate(source, special_tokens("bytes", 256)).render(MESSAGES)
    assert ours == RENDERED[name]
    assert hf.apply_chat_template(MESSAGES, chat_template=source, add_generation_prompt=True, tokenize=False) == ours
    (tmp_path / name).write_text("{{ messages[0]['content'] }}")      # a file: given as a path, read
    assert load_chat_template(str(tmp_path / name)) == "{{ messages[0]['content'] }}"


def test_template_names_and_none_and_their_errors():
    """`none` serves no chat; an unknown name that is no file either is an error naming it and
    the built-in names; the CLI's default is the plain template."""
    from gpt2mha.cli import build_parser

    assert load_chat_template("none") is None
    with pytest.raises(ValueError, match=r"'chatm'.*cannot read.*built-in templates: alpaca, chatml, plain"):
        load_chat_template("chatm")
    assert build_parser().parse_args(["serve"]).chat_template == "plain"


def test_a_default_server_serves_chat_with_the_plain_template(server, builtin):
    """The official client's chat.completions on a server started with every default: the reply
    is offline generate's greedy continuation of the plain template's text, streamed or not;
    /tokenize of the messages counts that text's tokens; /tokenizer_info carries the template."""
    import httpx

    model, tok = builtin
    ids = tok.encode(RENDERED["plain"])
    want = greedy(model, ids, 20)[1]
    c = client(server)
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    chunks = list(c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert httpx.post(server + "/tokenize", json={"messages": MESSAGES}).json()["tokens"] == ids
    assert httpx.get(server + "/tokenizer_info").json()["chat_template"] == BUILTIN_TEMPLATES["plain"]


def test_cli_serve_chat_template_by_name_and_none(monkeypatch):
    """`gpt2mha serve` hands serve() the built-in template's source for a name (default plain),
    None for `none`; an unknown name fails before the model is loaded."""
    import gpt2mha.cli.tools as tools
    import gpt2mha.serving.server as server
    from gpt2mha.cli import main

    got = []
    monkeypatch.setattr(server, "serve", lambda *a, **kw: got.append(kw))
    for argv, want in (([], BUILTIN_TEMPLATES["plain"]), (["--chat-template", "chatml"], BUILTIN_TEMPLATES["chatml"]),
                       (["--chat-template", "none"], None)):
        assert main(["serve", "--port", "0", *argv]) == 0
        assert got[-1]["chat_template"] == want and got[-1]["max_tokens_overflow"] == "clip"
    assert main(["serve", "--port", "0", "--max-tokens-overflow", "refuse"]) == 0
    assert got[-1]["max_tokens_overflow"] == "refuse"
    monkeypatch.setattr(tools, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "0", "--chat-template", "chatm"])
    assert "'chatm'" in str(e.value.code) and "plain" in str(e.value.code)


def test_convert_writes_the_chat_template_a_default_server_renders(server, builtin, tmp_path):
    """`gpt2mha convert` writes tokenizer_config.json with the default server's chat template:
    transformers' apply_chat_template on the directory renders the text the server's own
    ChatTemplate renders and tokenizes it to the ids the server's /tokenize gives for the same
    messages (and chat's usage.prompt_tokens counts), with and without the generation prompt;
    /tokenizer_info names the template served, not the files' (none with --chat-template none)."""
    import json

    import httpx
    transformers = pytest.importorskip("transformers")
    from gpt2mha.cli import main
    from gpt2mha.serving.chat import DEFAULT_CHAT_TEMPLATE

    model, tok = builtin
    assert main(["convert", DEFAULT_MODEL, str(tmp_path / "sb")]) == 0
    config = json.loads((tmp_path / "sb" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == BUILTIN_TEMPLATES[DEFAULT_CHAT_TEMPLATE]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "sb"))
    ours = ChatTemplate(BUILTIN_TEMPLATES[DEFAULT_CHAT_TEMPLATE], special_tokens(model.config.tokenizer, 256))
    conversations = [MESSAGES, MESSAGES + [{"role": "assistant", "content": "It is the east."},
                                           {"role": "user", "content": "Ünd Juliët? 😀"}],
                     [{"role": "user", "content": None}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            text = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
            assert text == ours.render(messages, generation_prompt)
            served = httpx.post(server + "/tokenize", json={"messages": messages,
                                                             "add_generation_prompt": generation_prompt}, timeout=60)
            ids = hf(text, add_special_tokens=False)["input_ids"]
            assert served.json()["tokens"] == ids == tok.encode(text)
            if generation_prompt:
                r = httpx.post(server + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                               timeout=60)
                assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert json.loads(hf_tokenizer_files("gpt2", 1024)["tokenizer_config.json"])["chat_template"] == \
        BUILTIN_TEMPLATES[DEFAULT_CHAT_TEMPLATE]


# ------------------------------------------------------------------------ chat logprobs
def reference_logprobs(model, prompt_ids, ids):
    """log_softmax (float64) of the model's own uncached forward over prompt + generated ids: the
    row that predicts each generated token, [len(ids), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + ids])).logits[0].double()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)]


def byte_token(i: int) -> str:
    """How logprobs name a byte-model token: its character, or ``bytes:\\xNN`` for a byte that is
    not a whole UTF-8 character (first principles: UTF-8 has one-byte characters below 0x80)."""
    return chr(i) if i < 0x80 else f"bytes:\\x{i:02x}"


def assert_entries_match(content, ref, ids, k):
    """Each OpenAI ``logprobs.content`` entry against the reference rows: the token, its UTF-8
    bytes and its logprob; ``top_logprobs`` the k largest values in order, each naming a token
    (its bytes) that has that logprob (to 1e-4; robust to near ties)."""
    assert len(content) == len(ids) == len(ref)
    for e, t, row in zip(content, ids, ref):
        assert e.token == byte_token(t) and e.bytes == [t]
        assert e.logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)
        for x in e.top_logprobs:
            (i,) = x.bytes
            assert x.token == byte_token(i) and x.logprob == pytest.approx(row[i].item(), abs=1e-4)


def test_chat_logprobs_equal_the_models_log_softmax_streamed_or_not(server, builtin):
    """The official client's chat with ``logprobs=True, top_logprobs=3`` (greedy, and seeded
    sampling): ``choices[0].logprobs.content`` has one entry per generated token with its
    token, UTF-8 ``bytes`` and logprob, and ``top_logprobs`` the 3 most probable, every value
    equal to log_softmax of the model's own uncached forward over the prompt and the tokens
    (float64, to 1e-4); the entries' bytes join to the reply; the greedy tokens are offline
    generate's. Streamed, the chunks' entries join to the same list."""
    model, tok = builtin
    prompt_ids = tok.encode(RENDERED["plain"])
    c = client(server)
    for kwargs in (dict(temperature=0), dict(temperature=0.9, seed=7)):
        body = dict(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24, logprobs=True, top_logprobs=3, **kwargs)
        r = c.chat.completions.create(**body)
        (choice,) = r.choices
        content = choice.logprobs.content
        ids = [b for e in content for b in e.bytes]                    # byte model: one token per byte
        assert bytes(ids).decode() == choice.message.content and len(ids) == r.usage.completion_tokens == 24
        if kwargs["temperature"] == 0:
            assert ids == greedy(model, prompt_ids, 24)[0]
            assert all(e.logprob == e.top_logprobs[0].logprob for e in content)          # the argmax: exact
        ref = reference_logprobs(model, prompt_ids, ids)
        assert_entries_match(content, ref, ids, 3)
        chunks = list(c.chat.completions.create(**body, stream=True))
        streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == choice.message.content


def test_chat_logprobs_shapes_and_errors(server, builtin):
    """``top_logprobs=0``: each entry's top_logprobs is empty; ``top_logprobs=20`` (OpenAI's chat
    limit): the 20 most probable; no ``logprobs``: ``null``; a stop string: the entries cover the
    tokens of the text sent (the text is a prefix of their bytes); ``top_logprobs`` without
    ``logprobs: true``, or outside OpenAI's [0, 20], is a 400 naming it."""
    import httpx

    model, tok = builtin
    c = client(server)
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=0)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(e.top_logprobs == [] for e in content)
    ids = greedy(model, tok.encode(RENDERED["plain"]), 6)[0]
    assert_entries_match(content, reference_logprobs(model, tok.encode(RENDERED["plain"]), ids), ids, 0)
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=6, temperature=0,
                                  logprobs=True, top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert all(len(e.top_logprobs) == 20 for e in content)
    assert_entries_match(content, reference_logprobs(model, tok.encode(RENDERED["plain"]), ids), ids, 20)
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.choices[0].logprobs is None
    full = greedy(model, tok.encode(RENDERED["plain"]), 40)[1]
    stop = full[10:12]
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                                  logprobs=True, stop=[stop])
    text = r.choices[0].message.content
    joined = bytes(b for e in r.choices[0].logprobs.content for b in e.bytes).decode(errors="replace")
    assert text == full[:full.index(stop)] and joined.startswith(text) and len(joined) - len(text) < len(stop)
    for body, words in (({"top_logprobs": 2}, ["logprobs"]),
                        ({"logprobs": True, "top_logprobs": 21}, ["21", "[0, 20]"]),
                        ({"logprobs": False, "top_logprobs": 1}, ["logprobs"]),
                        ({"logprobs": True, "top_logprobs": -1}, ["-1"]), ({"logprobs": 1}, ["a boolean"])):
        err = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, **body},
                         timeout=60)
        assert err.status_code == 400, err.text
        error = err.json()["error"]
        param = "logprobs" if type(body.get("logprobs")) is int else "top_logprobs"      # 1 is not a boolean
        assert error["param"] == param and all(w in error["message"] for w in words), error


# ------------------------------------------------------------------------ fields and errors
#: A valid value other than its default for every field of SamplingParams, as a chat request
#: spells it (chat's logprobs is a boolean; echo is taken at its default only).
CHAT_VALUES = {"max_tokens": 12, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.2, "presence_penalty": 0.5,
               "frequency_penalty": 0.5, "logit_bias": {"101": -100}, "seed": 3, "stop": ["e\n"], "logprobs": True,
               "echo": False, "n": 2, "best_of": 3, "repetition_penalty": 1.3, "no_repeat_ngram_size": 2,
               "min_tokens": 4, "ignore_eos": True, "stop_token_ids": [10], "include_stop_str_in_output": True,
               "structured_outputs": {"regex": "[a-z ]+"}, "sliding_window": True}


def test_chat_takes_every_sampling_field_completions_takes(server, builtin):
    """Every field of SamplingParams (what /v1/completions and the CLI take) is a field of the
    chat request, declared once for both routes; a chat request with each one set (the others
    at their defaults) is answered, and its text is what /v1/completions answers for the
    template's token ids with the same field (so min_p, best_of, ... reach the sampler)."""
    import httpx

    from gpt2mha.inference.params import FIELDS
    from gpt2mha.serving.chat import ChatRequest
    from gpt2mha.serving.protocol import CompletionRequest

    assert set(CHAT_VALUES) == set(FIELDS), "a new SamplingParams field: give it a value here"
    assert set(CompletionRequest.model_fields) - {"prompt", "suffix"} <= set(ChatRequest.model_fields)
    ids = builtin[1].encode(RENDERED["plain"])
    base = {"max_tokens": 12, "seed": 1}
    texts = {}
    for name, value in {"": None, **CHAT_VALUES}.items():
        body = {**base, name: value} if name else base
        chat = httpx.post(server + "/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
        assert chat.status_code == 200, (name, chat.text)
        texts[name] = [c["message"]["content"] for c in chat.json()["choices"]]
        if name in ("logprobs", "echo"):                     # spelled differently on the two routes
            continue
        done = httpx.post(server + "/v1/completions", json={"prompt": ids, **body}, timeout=60)
        assert done.status_code == 200, (name, done.text)
        assert texts[name] == [c["text"] for c in done.json()["choices"]], name
    assert texts["min_p"] != texts[""] and texts["echo"] == texts["logprobs"] == texts[""]
    assert_chat_error(server, {"messages": MESSAGES, "echo": True}, "echo", "/v1/completions")


def assert_chat_error(server, body, param, *words, path="/v1/chat/completions"):
    import httpx

    r = httpx.post(server + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and all(w in err["message"] for w in words), err
    return err


BAD_MESSAGES = [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}],
     ["messages[0].content[0].type", "'image_url'", "only text"]),
    ([MESSAGES[0], {"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
     ["messages[1].content[1].type", "'input_audio'", "only text"]),
    ([{"content": "hi"}], ["messages[0].role", "Missing"]),
    ([MESSAGES[0], {"role": 3, "content": "hi"}], ["messages[1].role", "expected a string", "got 3"]),
    ([{"role": "user", "content": [{"type": "text"}]}], ["messages[0].content[0].text", "Missing"]),
    ([{"role": "user", "content": [{"type": "text", "text": "a", "detail": 1}]}], ["messages[0].content[0].detail"]),
    ([{"role": "user", "content": ["hi"]}], ["messages[0].content[0]", "a content part"]),
    (["hi"], ["messages[0]", "expected a message"]),
    ([], ["messages is an empty list"]),
]


@pytest.mark.parametrize("messages,words", BAD_MESSAGES, ids=[str(i) for i in range(len(BAD_MESSAGES))])
def test_bad_messages_are_400s_naming_their_place_on_chat_and_tokenize(server, messages, words):
    """A non-text content part, a message without a role, a part of the wrong shape or an empty
    list: chat answers 400 naming ``messages``, its message naming the place
    (``messages[0].content[0].type``) and why; /tokenize refuses the same messages alike."""
    err = assert_chat_error(server, {"messages": messages, "max_tokens": 1}, "messages", *words)
    assert err == assert_chat_error(server, {"messages": messages}, "messages", *words, path="/tokenize")
