"""What real clients send to the server beyond plain text prompts: token-id prompts, ``null``
fields, ``stream_options`` rules, stop-string limits, OpenAI-shaped errors for unknown routes
and methods, ``GET /v1/models/{id}``, chat completions through a chat template, and vLLM's
tokenizer endpoints.

References: OpenAI's API behaviour (the official ``openai`` client's parsing and error
classes; its documented prompt forms, nulls and ``stream_options`` rule); offline ``generate``
of the same ids for every text; transformers' ``apply_chat_template`` and ``AutoTokenizer`` on
the tokenizer files gpt2mha writes for the rendered chat prompt and the special tokens;
tiktoken (GPT-2 BPE) and UTF-8 (byte model) for ``/tokenize``. Live servers bind 127.0.0.1 on
a free port and are started and stopped by the tests; endpoints that generate nothing use an
in-process ASGI client.
"""

import json

import httpx
import pytest
import torch

from gpt2mha import GPT2, DEFAULT_MODEL, GPT2Config
from gpt2mha.inference.sampling import row_seed
from gpt2mha.io.tokenizer import get_tokenizer, hf_tokenizer_files, tokenizer_for
from gpt2mha.inference.scheduler import Scheduler

pytest.importorskip("fastapi")                  # the 'serve' extra (the 'test' extra installs it)
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient                 # noqa: E402
from gpt2mha.serving.chat import BUILTIN_TEMPLATES      # noqa: E402
from gpt2mha.serving.server import create_app, serve_in_thread       # noqa: E402

#: A chat template in transformers' dialect: loops, the special tokens, raise_exception, the
#: generation prompt, and whitespace that trim_blocks/lstrip_blocks remove.
TEMPLATE = """{% for m in messages %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + m['role']) }}
    {% endif %}
{{ bos_token }}{{ m['role'] | upper }}: {{ m['content'] }}
{% endfor %}
{% if add_generation_prompt %}
ASSISTANT:{% endif %}"""
MESSAGES = [{"role": "system", "content": "Thou speakest as Romeo."},
            {"role": "user", "content": "What light through yonder window breaks?"}]


@pytest.fixture(scope="module")
def builtin(one_thread):
    model = GPT2.from_pretrained(DEFAULT_MODEL).eval()
    return model, tokenizer_for(model.config)


@pytest.fixture(scope="module")
def server(builtin):
    """The default server (its default stop-string limit)."""
    model, tok = builtin
    with serve_in_thread(Scheduler(model, tok, max_batch=4, max_queue=16), DEFAULT_MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def chat_server(builtin):
    """A server with TEMPLATE and up to 9 stop strings (lm-evaluation-harness's count)."""
    model, tok = builtin
    with serve_in_thread(Scheduler(model, tok, max_batch=4, max_queue=16), DEFAULT_MODEL, chat_template=TEMPLATE,
                         max_stop=9) as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def offline(model, ids, max_tokens, temperature=0.0, seed=None):
    """Offline ``generate``'s continuation of token ids: (ids, text)."""
    tok = tokenizer_for(model.config)
    out = model.generate(torch.tensor([ids]), max_tokens, temperature=temperature, seed=seed,
                         vocab_size=tok.n_vocab)[0, len(ids):].tolist()
    return out, tok.decode(out)


def post(url, path, body):
    return httpx.post(url + path, content=body if isinstance(body, str) else json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=60)


def assert_error(r, status, param=None, *words):
    """``r`` is OpenAI's error object with ``status``, naming ``param`` and every word."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err


# ------------------------------------------------------------------------ token-id prompts
def test_token_id_prompts_equal_their_text(server, builtin):
    """OpenAI's four prompt forms: a list of ints is one prompt, a list of lists a batch. With
    the official client, ids give exactly the choices their text gives (one prompt greedy; a
    batch seeded, choice i with seed row_seed(seed, i)), and both equal offline generate of
    those ids; usage counts the ids."""
    model, tok = builtin
    c = client(server)
    ids = tok.encode("ROMEO:")
    by_text = c.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=20, temperature=0)
    by_ids = c.completions.create(model=DEFAULT_MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text == offline(model, ids, 20)[1]
    assert by_ids.usage.prompt_tokens == len(ids) == 6

    texts = ["To be", "HAMLET:\n"]
    batch = [tok.encode(t) for t in texts]
    r_ids = c.completions.create(model=DEFAULT_MODEL, prompt=batch, max_tokens=12, temperature=0.8, seed=11)
    r_text = c.completions.create(model=DEFAULT_MODEL, prompt=texts, max_tokens=12, temperature=0.8, seed=11)
    assert [x.index for x in r_ids.choices] == [0, 1]
    for i, ids_i in enumerate(batch):
        want = offline(model, ids_i, 12, temperature=0.8, seed=row_seed(11, i))[1]
        assert r_ids.choices[i].text == r_text.choices[i].text == want
    assert r_ids.usage.prompt_tokens == sum(map(len, batch))


BAD_ID_PROMPTS = [
    ([72, 256], "prompt[1]=256"),                   # one past the byte model's vocabulary
    ([[72, 73], [74, -1]], "prompt[1][1]=-1"),
    ([2**70], f"prompt[0]={2**70}"),
    ([[]], "prompt[0] is an empty list of token ids"),
    ([1.5], "got 1.5"),                             # a float is no token id
    ([True], "got true"),                           # nor is a boolean (strict JSON types)
    ([[1, "x"]], "prompt[0][1]"),
    (["a", [1]], "prompt[1]"),                      # strings and id lists are not mixed
]


@pytest.mark.parametrize("prompt,words", BAD_ID_PROMPTS, ids=[str(i) for i in range(len(BAD_ID_PROMPTS))])
def test_bad_token_id_prompts_are_400_naming_prompt_and_the_id(server, prompt, words):
    err = assert_error(post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}), 400, "prompt", words)
    assert err["type"] == "invalid_request_error"
    if "=" in words:
        assert "[0, 256)" in err["message"]


def test_token_id_prompt_longer_than_the_context_is_refused_before_its_ids_are_read(server):
    """A list of 257 ids (more than n_ctx = 256) is refused as too long, whatever its ids; one
    that fills the context leaves no room for max_tokens, a 400 naming it."""
    assert_error(post(server, "/v1/completions", {"prompt": [-5] * 257}), 400, "prompt", "257 tokens", "256")
    assert_error(post(server, "/v1/completions", {"prompt": [65] * 256, "max_tokens": 1}), 400, "max_tokens",
                 "257", "leaves no room")


def test_max_tokens_past_the_context_is_clipped_by_default_and_refused_on_request(server, builtin):
    """A default server clips max_tokens past the room a prompt leaves in the context (as
    llama.cpp's server): prompts of 250 and 6 tokens with max_tokens 7 in a 256-token context
    give 6 and 7 tokens, offline generate's greedy text, finish_reason length; chat alike. A
    server started with max_tokens_overflow="refuse" (``--max-tokens-overflow refuse``) answers
    400 context_length_exceeded naming max_tokens (as OpenAI and vLLM), and takes what fits."""
    model, tok = builtin
    prompts = [[65] * 250, tok.encode("ROMEO:")]
    r = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["text"] for c in choices] == [offline(model, ids, n)[1] for ids, n in zip(prompts, (6, 7))]
    assert [c["finish_reason"] for c in choices] == ["length"] * 2 and r.json()["usage"]["completion_tokens"] == 13
    long = [{"role": "user", "content": "x" * 230}]                 # "user: x…x\nassistant:" is 247 tokens
    r = post(server, "/v1/chat/completions", {"messages": long, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 247, "completion_tokens": 9,
                                                          "total_tokens": 256,
                                                          "prompt_tokens_details": {"cached_tokens": 0}}, r.text
    with TestClient(create_app(Scheduler(model, tok, max_batch=2), DEFAULT_MODEL, max_tokens_overflow="refuse")) as app:
        for path, body in (("/v1/completions", {"prompt": prompts[0], "max_tokens": 7}),
                           ("/v1/chat/completions", {"messages": long, "max_tokens": 16})):
            err = assert_error(app.post(path, json=body), 400, "max_tokens", "256 tokens", "--max-tokens-overflow clip")
            assert err["code"] == "context_length_exceeded"
        assert app.post("/v1/completions", json={"prompt": prompts[0], "max_tokens": 6}).status_code == 200
    with pytest.raises(ValueError, match="max_tokens_overflow='drop'"):
        create_app(Scheduler(model, tok, max_batch=1), DEFAULT_MODEL, max_tokens_overflow="drop")


# ------------------------------------------------------------------------ nulls, stream_options, stop
def test_null_optional_fields_mean_their_defaults(server):
    """`null` for every optional field is the same request as leaving them out (OpenAI and
    vLLM): same seeded text, and max_tokens null means OpenAI's default of 16; a null prompt is
    a missing prompt."""
    optional = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "stream_options", "n",
                "best_of", "echo", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "suffix",
                "user"]
    plain = post(server, "/v1/completions", {"prompt": "ROMEO:", "seed": 4})
    nulls = post(server, "/v1/completions", {"prompt": "ROMEO:", "seed": 4, **dict.fromkeys(optional)})
    assert plain.status_code == nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    assert nulls.json()["usage"]["completion_tokens"] == 16
    r = post(server, "/v1/completions", {"prompt": "ROMEO:", "stream": True, "stream_options": {"include_usage": None},
                                         "max_tokens": 2})
    assert r.status_code == 200 and "usage" not in r.text                  # include_usage null: false
    assert_error(post(server, "/v1/completions", {"prompt": None}), 400, "prompt", "prompt")


def test_stream_options_without_stream_is_400_naming_it(server):
    """OpenAI answers 400 naming stream_options when it comes without stream: true (stream
    false or left out); with stream it is honoured."""
    c = client(server)
    for extra in ({}, {"stream": False}):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=1,
                                 stream_options={"include_usage": True}, **extra)
        assert e.value.body["param"] == "stream_options" and "stream" in e.value.body["message"]
    chunks = list(c.completions.create(model=DEFAULT_MODEL, prompt="a", max_tokens=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 2


def test_stop_strings_a_default_server_takes_lm_evals_and_a_server_flag_sets_the_limit(server, chat_server,
                                                                                      builtin):
    """The default server takes the stop strings real clients send: lm-evaluation-harness's
    generate_until sends a task's `until` strings plus the EOS string (5 for a task with 4; 9
    here), and vLLM and llama.cpp's server set no limit. All 9 apply: the text is the greedy
    text cut before the first place any of them occurs (reference: offline generate without
    stops, cut by str.find). Past the default limit (64), 65 get a 400 naming stop, the count
    and the limit; a server started with max_stop=9 refuses 10 naming 9."""
    from gpt2mha.serving.protocol import MAX_STOP

    model, tok = builtin
    stops = ["zq", "xj", "qz", "jx", "vv", "kk", "ww", "e", "Ā"]
    full = offline(model, tok.encode("ROMEO:"), 40)[1]
    cut = min(i for i in (full.find(s) for s in stops) if i >= 0)          # 'e' occurs in the greedy text
    for url in (server, chat_server):
        r = post(url, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 40, "temperature": 0, "stop": stops})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == full[:cut] and r.json()["choices"][0]["finish_reason"] == "stop"
    assert MAX_STOP == 64
    many = [f"q{i}z" for i in range(65)]
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 1, "stop": many[:64]}).status_code == 200
    assert_error(post(server, "/v1/completions", {"prompt": "a", "stop": many}), 400, "stop",
                 "65 strings", "at most 64", "--max-stop")
    assert_error(post(chat_server, "/v1/completions", {"prompt": "a", "stop": stops + ["yy"]}), 400, "stop",
                 "10 strings", "at most 9")


# ------------------------------------------------------------------------ keys: non-ASCII, huge ids
#: Bodies whose keys are not ASCII (or a logit_bias id past int()'s 4300-digit limit), the route
#: and the field the 400 must name. Each once answered 500 and closed the connection.
ODD_KEYS = [
    ("/v1/completions", {"prömpt": "a"}, "prompt"),                                       # then prompt is missing
    ("/v1/completions", {"prompt": "a", "prömpt": "a"}, "prömpt"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"é": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"１": 1}}, "logit_bias"),            # a fullwidth digit
    ("/v1/completions", {"prompt": "a", "logit_bias": {"9" * 5000: 1}}, "logit_bias"),    # > 4300 digits
    ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"ü": True}}, "stream_options.ü"),
    ("/v1/chat/completions", {"messages": [{"rôle": "user", "content": "a"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tëmperature": 0}, "tëmperature"),
    ("/tokenize", {"prömpt": "a"}, "prömpt"),
    ("/detokenize", {"tokens": [1], "tökens": [1]}, "tökens"),
]


def test_non_ascii_keys_and_huge_logit_bias_ids_are_400s_on_a_connection_that_stays_open(chat_server):
    """Every body of ODD_KEYS gets OpenAI's 400 naming its field (the key itself, or the object
    that holds it), over one keep-alive connection that the server keeps open (the socket of
    the first answer serves them all and a valid request after them: a logit_bias id written
    with 5000 leading zeros is still a token id)."""
    import http.client
    from urllib.parse import urlsplit

    conn = http.client.HTTPConnection(urlsplit(chat_server).netloc, timeout=60)
    sock = None
    try:
        for path, body, param in ODD_KEYS:
            conn.request("POST", path, json.dumps(body, ensure_ascii=False).encode(),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            data = json.loads(r.read())
            assert r.status == 400, (path, body, data)
            err = data["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
            assert param.split(".")[-1] in err["message"] or param == "messages", err["message"]
            sock = sock or conn.sock
            assert conn.sock is sock and r.getheader("connection") != "close", (path, body)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "a", "max_tokens": 1, "logit_bias": {"0" * 5000
                     + "98": 5}}), {"Content-Type": "application/json"})   # leading zeros: still token 98
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 1 and conn.sock is sock
    finally:
        conn.close()


# ------------------------------------------------------------------------ errors and models
@pytest.mark.parametrize("method,path,status,words", [
    ("GET", "/nope", 404, ["GET /nope"]),
    ("POST", "/v1/complete", 404, ["POST /v1/complete"]),
    ("GET", "/v1/completions", 405, ["GET /v1/completions", "POST, OPTIONS"]),
    ("DELETE", "/v1/models", 405, ["DELETE /v1/models", "GET, HEAD, OPTIONS"]),
    ("PUT", "/tokenize", 405, ["PUT /tokenize", "POST, OPTIONS"]),
    ("HEAD", "/v1/chat/completions", 405, ["POST, OPTIONS"]),
    ("OPTIONS", "/nope", 404, ["OPTIONS /nope"]),
])
def test_unknown_routes_and_wrong_methods_get_openai_error_objects(server, method, path, status, words):
    """404 for an unknown route, 405 for a known route with another method, each OpenAI's error
    object (a HEAD answer: its headers, no body); a 405's ``Allow`` lists every method the route
    answers, OPTIONS included."""
    r = httpx.request(method, server + path, timeout=30)
    if method == "HEAD":
        assert r.status_code == status and r.content == b"" and r.headers["allow"] == words[-1]
        return
    err = assert_error(r, status, None, *words)
    assert err["type"] == "invalid_request_error"
    if status == 405:
        assert r.headers["allow"] == words[-1]


def test_head_and_options_are_answered_on_every_route(server):
    """HEAD on the routes that read (/health: what load balancers send) answers GET's status and
    headers with no body (RFC 9110 §9.3.2); OPTIONS on every route answers 200, no body, and
    ``Allow`` listing the route's methods (§9.3.7)."""
    for path in ("/health", "/v1/models", f"/v1/models/{DEFAULT_MODEL}", "/tokenizer_info"):
        get, head = httpx.get(server + path, timeout=30), httpx.head(server + path, timeout=30)
        assert get.status_code == head.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"] == "application/json"
        assert head.headers["content-length"] == get.headers["content-length"] or path == "/health"  # its counters move
    for path, allow in (("/health", "GET, HEAD, OPTIONS"), ("/v1/models", "GET, HEAD, OPTIONS"),
                        ("/v1/models/any", "GET, HEAD, OPTIONS"), ("/v1/completions", "POST, OPTIONS"),
                        ("/v1/chat/completions", "POST, OPTIONS"), ("/tokenize", "POST, OPTIONS"),
                        ("/detokenize", "POST, OPTIONS"), ("/tokenizer_info", "GET, HEAD, OPTIONS")):
        r = httpx.options(server + path, timeout=30)
        assert r.status_code == 200 and r.content == b"" and r.headers["allow"] == allow, (path, r.headers)


def test_models_retrieve_and_unknown_ids_with_the_openai_client(server):
    """client.models.retrieve: the served model's card (as in the list), and NotFoundError
    naming the unknown id, also one with a slash (hub-style names)."""
    c = client(server)
    card = c.models.retrieve(DEFAULT_MODEL)
    assert card.id == DEFAULT_MODEL and card.object == "model"
    assert card.model_dump() == c.models.list().data[0].model_dump()
    for name in ("gpt-4", "openai-community/gpt2"):
        with pytest.raises(openai.NotFoundError) as e:
            c.models.retrieve(name)
        assert e.value.body["code"] == "model_not_found" and name in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):                   # the client's 404 class for an unknown route too
        c.post("/nope", cast_to=object, body={})


# ------------------------------------------------------------------------ chat
def test_chat_without_a_template_is_a_400_saying_how_to_serve_chat(bare_app):
    """A server started with --chat-template none (chat_template=None): the official client's
    chat gets BadRequestError naming the built-in templates and /v1/completions; /tokenize of
    messages is a 400 naming messages."""
    c = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=bare_app)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny-bpe", messages=MESSAGES, max_tokens=4)
    body = e.value.body
    assert body["code"] == "chat_template_missing" and body["type"] == "invalid_request_error"
    for word in ("completions model", "--chat-template none", "--chat-template alpaca or chatml or plain", "/v1/completions"):
        assert word in body["message"], (word, body["message"])
    assert_error(bare_app.post("/tokenize", json={"messages": MESSAGES}), 400, "messages", "--chat-template none")
    assert "chat_template" not in bare_app.get("/tokenizer_info").json()


@pytest.fixture(scope="module")
def hf_chat_tokenizer(tmp_path_factory):
    """transformers' tokenizer on the files gpt2mha writes for the byte model, with TEMPLATE."""
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("byte_tokenizer")
    for name, data in hf_tokenizer_files("bytes", 256).items():
        (d / name).write_bytes(data)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = TEMPLATE
    return tok


def test_chat_with_a_template_equals_transformers_rendering_and_offline_generate(chat_server, builtin,
                                                                                 hf_chat_tokenizer):
    """With --chat-template: the prompt is transformers' apply_chat_template(messages,
    add_generation_prompt=True) text (special tokens from the tokenizer files), tokenized as
    transformers tokenizes it; the reply is offline generate's greedy continuation of it, in
    OpenAI's chat.completion shape; streamed, the chunks (role first, then content, the finish
    reason last) join to the same reply."""
    model, tok = builtin
    text = hf_chat_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = hf_chat_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(text) and text.endswith("ASSISTANT:") and "Ā" in text     # bos_token of the byte files
    r = post(chat_server, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200 and r.json()["tokens"] == ids

    c = client(chat_server)
    want = offline(model, ids, 24)[1]
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length" and r.usage.prompt_tokens == len(ids)

    chunks = list(c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_defaults_parts_nulls_and_errors(chat_server, builtin, hf_chat_tokenizer):
    """max_tokens left out fills the context (as vLLM); text content parts read as one string
    joined by newlines; null fields are defaults; a template's raise_exception, a non-text part
    and top_logprobs without logprobs are 400s naming their field; another model's name is 404."""
    model, _ = builtin
    c = client(chat_server)
    r = c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES[1:], temperature=0)
    assert r.usage.total_tokens == model.config.n_ctx and r.choices[0].finish_reason == "length"

    parts = [{"role": "user", "content": [{"type": "text", "text": "What light"},
                                          {"type": "text", "text": "through yonder window?"}]}]
    joined = [{"role": "user", "content": "What light\nthrough yonder window?"}]
    a = post(chat_server, "/v1/chat/completions", {"messages": parts, "max_tokens": 8, "temperature": 0,
                                                   "seed": None, "stop": None, "max_completion_tokens": None})
    b = c.chat.completions.create(model=DEFAULT_MODEL, messages=joined, max_tokens=8, temperature=0)
    assert a.status_code == 200 and a.json()["choices"][0]["message"]["content"] == b.choices[0].message.content

    bad = [({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "unknown role: tool"),
           ({"messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}, 400, "messages",
            "'image_url'"),
           ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "logprobs: true"),
           ({"messages": []}, 400, "messages", "empty"),
           ({"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 3}, 400, "max_completion_tokens",
            "differ"),
           ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
           ({"messages": MESSAGES, "model": "gpt-4"}, 404, "model", "gpt-4"),
           ({"messages": [{"role": "user", "content": "x" * 300}], "max_tokens": 1}, 400, "messages", "256 tokens"),
           ({"messages": [{"role": 3, "content": "x"}]}, 400, "messages", "messages[0]")]
    for body, status, param, word in bad:
        assert_error(post(chat_server, "/v1/chat/completions", body), status, param, word)


def test_cli_chat_template_file_errors_before_loading_the_model(tmp_path, capsys):
    """`gpt2mha serve --chat-template FILE`: a missing file or invalid Jinja is one error line
    naming the file (and the line), before any model is loaded."""
    from gpt2mha.cli import main

    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m['content'] }\n")
    for path, words in ((bad, ["bad.jinja", "line 2"]), (tmp_path / "missing.jinja", ["missing.jinja", "cannot read"])):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--chat-template", str(path), "--port", "0", "--model", str(tmp_path / "no-such-model")])
        assert all(w in str(e.value.code) for w in words), e.value.code


def test_streams_end_as_openais_text_completion_and_chat_chunk_streams(server, builtin):
    """Streamed completions: the last text chunk carries the finish reason (``length``), no
    chunk has empty text, as OpenAI's stream ends; a stop string whose text is all cut ends with
    an empty-text chunk carrying ``stop`` (nothing is left to carry it). Streamed chat: the
    role first, then the text with no finish reason, then an empty delta with the finish reason
    (OpenAI's chat shape). Texts: offline generate's greedy continuation."""
    model, tok = builtin
    ids = tok.encode("ROMEO:")
    want = offline(model, ids, 12)[1]
    c = client(server)
    chunks = list(c.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want and all(ch.choices[0].text for ch in chunks)
    assert [ch.choices[0].finish_reason for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    stop = want[4:6]
    chunks = list(c.completions.create(model=DEFAULT_MODEL, prompt="ROMEO:", max_tokens=12, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == want[:want.index(stop)]
    assert (chunks[-1].choices[0].text, chunks[-1].choices[0].finish_reason) == ("", "stop")
    chunks = list(c.chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True))
    deltas = [(ch.choices[0].delta.role, ch.choices[0].delta.content, ch.choices[0].finish_reason) for ch in chunks]
    assert deltas[0] == ("assistant", "", None) and deltas[-1] == (None, None, "length")
    assert all(r is None and t and f is None for r, t, f in deltas[1:-1])


@pytest.mark.slow
def test_litellm_streamed_text_completion_rebuilds_the_whole_text(server, builtin, monkeypatch):
    """litellm's ``text_completion(stream=True)`` against the server: its chunks' texts join to
    the non-streamed answer's (offline generate's greedy text), and ``litellm.stream_chunk_builder``
    rebuilds that text and its finish reason. litellm ends every text stream with a chunk of
    its own whose text is None (whatever the server sends), so the join skips None."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # its price list from the package, not the network
    litellm = pytest.importorskip("litellm")
    model, tok = builtin
    want = offline(model, tok.encode("ROMEO:"), 16)[1]
    kwargs = dict(model=f"text-completion-openai/{DEFAULT_MODEL}", api_base=server + "/v1", api_key="unused",
                  prompt="ROMEO:", max_tokens=16, temperature=0)
    assert litellm.text_completion(**kwargs).choices[0].text == want
    chunks = list(litellm.text_completion(stream=True, **kwargs))
    assert "".join(ch.choices[0].text or "" for ch in chunks if ch.choices) == want
    assert [ch.choices[0].text for ch in chunks if ch.choices].count(None) <= 1
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt.choices[0].text == want and rebuilt.choices[0].finish_reason == "length"


def test_langchain_openai_with_its_default_max_tokens_works_on_the_built_in_model(server, builtin, monkeypatch):
    """LangChain's ``OpenAI()`` sends its default ``max_tokens=256`` into the built-in model's
    256-token context: the default server clips it to the room left, so the call answers the
    greedy text offline generate gives for the rest of the context (near ties allowed), as
    does ``ChatOpenAI`` (no max_tokens: the rest of the context)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    from serve_helpers import assert_same_text

    for name in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING"):          # no tracing to the network
        monkeypatch.delenv(name, raising=False)
    model, tok = builtin
    llm = langchain_openai.OpenAI(base_url=server + "/v1", api_key="unused", model=DEFAULT_MODEL, temperature=0,
                                  max_retries=0)
    assert llm.max_tokens == 256 == model.config.n_ctx                  # LangChain's default, the whole context
    prompt = "ROMEO:"
    room = model.config.n_ctx - len(tok.encode(prompt))
    text = llm.invoke(prompt)
    assert len(tok.encode(text)) == room
    assert_same_text(model, tok, prompt, text, offline(model, tok.encode(prompt), room)[1])
    chat = langchain_openai.ChatOpenAI(base_url=server + "/v1", api_key="unused", model=DEFAULT_MODEL, temperature=0,
                                       max_retries=0)
    assert chat.invoke("Who art thou?").content


# ------------------------------------------------------------------------ tokenizer endpoints
@pytest.fixture(scope="module")
def bpe_app(one_thread):
    """A tiny random model with GPT-2's BPE tokenizer behind an in-process ASGI client."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny", n_vocab=50257, tokenizer="gpt2")).eval()
    app = create_app(Scheduler(model, tokenizer_for(model.config), max_batch=1), "tiny-bpe")
    with TestClient(app) as http:
        yield http


@pytest.fixture(scope="module")
def bare_app(one_thread):
    """As bpe_app, served without a chat template (``--chat-template none``)."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny", n_vocab=50257, tokenizer="gpt2")).eval()
    app = create_app(Scheduler(model, tokenizer_for(model.config), max_batch=1), "tiny-bpe", chat_template=None)
    with TestClient(app) as http:
        yield http


@pytest.mark.parametrize("text", ["Hello world, <|endoftext|> and ünïcödé 😀", "x" * 300])
def test_tokenize_detokenize_round_trip_equals_gpt2mhas_tokenizer_bpe(bpe_app, text):
    """/tokenize gives tiktoken's GPT-2 ids (what a completion's prompt becomes: the text
    <|endoftext|> is ordinary text), with count and max_model_len, a text longer than the
    context counted too; /detokenize gives the text back; a completion of those ids counts the
    same prompt tokens."""
    want = get_tokenizer("gpt2").encode(text)
    for body in ({"prompt": text}, {"model": "tiny-bpe", "prompt": text, "add_special_tokens": False}):
        r = bpe_app.post("/tokenize", json=body)
        assert r.status_code == 200 and r.json() == {"tokens": want, "count": len(want), "max_model_len": 64}
    assert bpe_app.post("/detokenize", json={"tokens": want}).json() == {"prompt": text}
    if len(want) <= 60:
        r = bpe_app.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)


def test_tokenizer_info_is_what_transformers_reads_from_the_saved_files(bpe_app, tmp_path):
    """/tokenizer_info (what lm-evaluation-harness's remote tokenizer reads: eos_token,
    bos_token) carries the tokenizer_config.json gpt2mha writes, and its ids are transformers'
    for the same files (reference: AutoTokenizer on them)."""
    transformers = pytest.importorskip("transformers")
    files = hf_tokenizer_files("gpt2", 64)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    info = bpe_app.get("/tokenizer_info").json()
    config = json.loads(files["tokenizer_config.json"])
    assert {k: info[k] for k in config} == config
    assert (info["eos_token"], info["bos_token"]) == (hf.eos_token, hf.bos_token) == ("<|endoftext|>",) * 2
    assert (info["eos_token_id"], info["bos_token_id"]) == (hf.eos_token_id, hf.bos_token_id) == (50256, 50256)
    assert info["max_model_len"] == 64 and info["vocab_size"] == 50257
    assert info["chat_template"] == BUILTIN_TEMPLATES["plain"]                # served by default


@pytest.mark.parametrize("path,body,status,param,word", [
    ("/tokenize", {}, 400, "prompt", "either"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt", "either"),
    ("/tokenize", {"messages": [{"role": "user"}], "prompt": None, "add_generation_prompt": 1}, 400,
     "add_generation_prompt", "a boolean"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "a string"),
    ("/tokenize", {"model": "gpt-4", "prompt": "a"}, 404, "model", "gpt-4"),
    ("/detokenize", {"tokens": [50257]}, 400, "tokens", "tokens[0]=50257"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "token ids"),
    ("/detokenize", {"model": "gpt-4", "tokens": [1]}, 404, "model", "gpt-4"),
    ("/detokenize", '{"tokens": [1,', 400, None, "not valid JSON"),
])
def test_tokenizer_endpoints_refuse_bad_bodies_naming_the_field(bpe_app, path, body, status, param, word):
    content = body if isinstance(body, str) else json.dumps(body)
    r = bpe_app.post(path, content=content, headers={"Content-Type": "application/json"})
    assert_error(r, status, param, word)


def test_an_unexpected_exception_in_a_route_is_a_500_error_object(bpe_app, monkeypatch):
    """A bug in a route (here /detokenize made to raise) answers OpenAI's error object with 500
    and type server_error naming the exception, not Starlette's text/plain page."""
    from gpt2mha.serving import tokens

    def broken(*args):
        raise RuntimeError("decoder exploded")
    monkeypatch.setattr(tokens, "detokenize", broken)
    r = TestClient(bpe_app.app, raise_server_exceptions=False).post("/detokenize", json={"tokens": [1]})
    err = assert_error(r, 500, None, "RuntimeError", "decoder exploded")
    assert err["type"] == "server_error"


def test_bpe_token_id_prompts_take_the_whole_vocabulary(bpe_app):
    """Ids up to 50256 (<|endoftext|>) are prompts; 50257 is refused naming it."""
    assert bpe_app.post("/v1/completions", json={"prompt": [50256, 15496], "max_tokens": 1}).status_code == 200
    assert_error(bpe_app.post("/v1/completions", json={"prompt": [[15496], [50257]]}), 400, "prompt",
                 "prompt[1][0]=50257", "[0, 50257)")


# ------------------------------------------------------------------------ the command
def test_cli_serve_on_a_port_in_use_fails_at_once_with_one_line(monkeypatch, capsys):
    """`gpt2mha serve --port P` with P taken by another listening socket: exit 2 with one error
    line naming the address and the reason, in under a second and before the model is loaded
    (in process: load_model made to fail); the same in a subprocess (one line: no uvicorn start,
    no traceback). A free port passes the check; a host that does not resolve is named."""
    import socket
    import subprocess
    import sys
    import time

    import gpt2mha.cli.tools as tools
    from gpt2mha.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(tools, "load_model", lambda *a: pytest.fail("the model was loaded"))
        t0 = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.monotonic() - t0 < 1                           # a socket's bind, no model
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"127.0.0.1:{port}" in err and "Address already in use" in err, err
        assert "--port" in err
        run = subprocess.run([sys.executable, "-m", "gpt2mha", "serve", "--port", str(port), "--threads", "1"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == "", (run.returncode, run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in run.stderr, run.stderr
    assert "Uvicorn" not in run.stderr and "startup" not in run.stderr         # no model loaded, no server started
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    from gpt2mha.serving.address import check_address
    check_address("127.0.0.1", port)
    with pytest.raises(ValueError, match="--host 'no-such-host.invalid'"):
        check_address("no-such-host.invalid", port)


@pytest.mark.slow
def test_cli_serve_chat_template_and_max_stop(tmp_path):
    """`gpt2mha serve --port 0 --chat-template FILE --max-stop 9` in a subprocess: chat answers
    with the template's prompt (its token count equals /tokenize of the messages), 9 stop
    strings are accepted and 10 refused, /tokenizer_info carries the template; SIGTERM exits 0."""
    import re
    import subprocess
    import sys
    import time

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gpt2mha", "serve", "--port", "0", "--threads", "1",
                                 "--chat-template", str(template), "--max-stop", "9"], stdout=log, stderr=log)
    try:
        deadline, url = time.monotonic() + 60, None
        while url is None:
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = found.group(1) if found else time.sleep(0.1)
        while httpx.get(url + "/health").status_code != 200:      # the port opens before the model is loaded
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        r = client(url).chat.completions.create(model=DEFAULT_MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == post(url, "/tokenize", {"messages": MESSAGES}).json()["count"]
        assert r.usage.completion_tokens <= 4 and r.choices[0].message.role == "assistant"
        stops = ["zq", "xj", "qz", "jx", "vv", "kk", "ww", "yy", "uu"]
        assert post(url, "/v1/completions", {"prompt": "a", "max_tokens": 2, "stop": stops}).status_code == 200
        assert_error(post(url, "/v1/completions", {"prompt": "a", "stop": stops + ["e"]}), 400, "stop", "at most 9")
        assert httpx.get(url + "/tokenizer_info").json()["chat_template"] == TEMPLATE
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_lm_eval_generate_until_against_the_server_with_its_remote_tokenizer(builtin, tmp_path):
    """lm-evaluation-harness's `local-completions` model, `tokenizer_backend=remote` (it reads
    /tokenizer_info and tokenizes through /tokenize, then sends token-id prompts with its 8
    `until` strings plus the EOS string as `stop`), on the local generate_until task against a
    server with the default stop-string limit: exit 0, and every answer is gpt2mha's offline greedy
    continuation cut before the first stop string (test_lm_eval_tasks.greedy_until)."""
    import glob
    import os
    import subprocess
    import sys

    from test_lm_eval_tasks import REPO, TASKS, greedy_until, read_jsonl

    model, tok = builtin
    output = str(tmp_path / "out")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    with serve_in_thread(Scheduler(model, tok, max_batch=4), DEFAULT_MODEL) as url:
        args = (f"model={DEFAULT_MODEL},base_url={url}/v1/completions,tokenizer_backend=remote,max_length=256,"
                f"max_retries=1")
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                              "--include_path", TASKS, "--tasks", "gpt2mha_shakespeare_gen", "--output_path", output,
                              "--log_samples"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    docs = read_jsonl(os.path.join(REPO, TASKS, "shakespeare_gen.jsonl"))
    (path,) = glob.glob(os.path.join(output, "*", "samples_gpt2mha_shakespeare_gen_*.jsonl"))
    samples = sorted(read_jsonl(path), key=lambda s: s["doc_id"])
    until = [" ", "\n", ".", ",", ";", ":", "!", "?", "Ā"]          # the EOS string of /tokenizer_info
    assert len(samples) == len(docs) == 8
    for doc, sample in zip(docs, samples):
        assert sample["filtered_resps"] == [greedy_until(model, doc["prompt"], 16, until)], doc
