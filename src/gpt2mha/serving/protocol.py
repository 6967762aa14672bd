"""The OpenAI completions protocol: the request schema, its parsing and checks, errors, and the
bodies of answers (as OpenAI's API and llama.cpp's and vLLM's servers speak it).

Bad requests raise :class:`APIError`, answered as OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` with an HTTP status, the message naming the field. Nothing here touches the
network or the model: :mod:`.server` reads bodies and writes responses, :mod:`.scheduler` runs
the sequences.
"""

from __future__ import annotations

import json
import re

from pydantic import BaseModel, ConfigDict, ValidationError

from ..inference.params import FIELDS as SAMPLING_FIELDS
from ..inference.params import MAX_COMPLETION_LOGPROBS, MAX_LOGPROBS, ParamError, SamplingParams
from .errors import APIError  # noqa: F401  (raised here; importable from here too)
from ..inference.scheduler import ExceedsCapacity, QueueFull, ShuttingDown
from ..inference.sequence import Sequence
from ..inference.text_stream import CANCELLED, ERROR, TextStream

#: The default limit of stop strings per request (``gpt2mha serve --max-stop N``). OpenAI's API
#: takes 4, but lm-evaluation-harness's generate_until sends a task's ``until`` strings plus the
#: EOS string (5 for its tasks with 4), and vLLM and llama.cpp's server set no limit; 64 fits every
#: client we know and bounds the per-token work of matching them (each token is checked against each).
MAX_STOP = 64
RETRY_AFTER_S = 1
#: What a request's ``max_tokens`` beyond the room its prompt leaves in the context gets
#: (``gpt2mha serve --max-tokens-overflow``): ``"clip"`` (the default, as llama.cpp's server):
#: the completion stops where the context ends, ``finish_reason: "length"``, so that clients'
#: defaults work on small-context models (LangChain's ``OpenAI()`` sends ``max_tokens=256``;
#: the built-in model's context is 256 tokens); ``"refuse"`` (OpenAI's and vLLM's): a 400.
CLIP, REFUSE = "clip", "refuse"
MAX_TOKENS_OVERFLOW = (CLIP, REFUSE)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class RequestFields(BaseModel):
    """The fields both generating routes take (``/v1/completions`` and, as
    :class:`~gpt2mha.serving.chat.ChatRequest` inherits them, ``/v1/chat/completions``): the
    served ``model``, every field of :class:`~gpt2mha.inference.params.SamplingParams` as
    OpenAI's completions spell it (:func:`sampling_params` reads each one by name), streaming,
    and ``user``. A new sampling field is declared here once and both routes take it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # ---- choices, logprobs and logit adjustments (SamplingParams, logprobs_answer)
    n: int = 1
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # ---- repetition control (vLLM's fields; no_repeat_ngram_size transformers')
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # ---- structured outputs (OpenAI's response_format, vLLM's structured_outputs: .structured)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    # ---- past the context: each step on the last n_ctx tokens (SamplingParams.sliding_window)
    sliding_window: bool = False
    # ---- accepted at its neutral value (clients send it by default)
    user: str | None = None


class CompletionRequest(RequestFields):
    """The body of ``POST /v1/completions`` (OpenAI's fields; types checked strictly)."""

    # text, token ids, or a batch of either (OpenAI's four forms)
    prompt: str | list[str] | list[int] | list[list[int]]
    # accepted at its neutral value only
    suffix: str | None = None


#: What each field must be, for the messages of type errors.
EXPECTED = {
    "model": "a string", "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "max_tokens": "an integer",
    "temperature": "a number", "top_p": "a number", "top_k": "an integer", "min_p": "a number",
    "seed": "an integer",
    "stop": "a string or a list of strings", "stream": "a boolean", "stream_options": "an object {include_usage: bool}",
    "n": "an integer", "best_of": "an integer", "echo": "a boolean", "logprobs": "an integer",
    "presence_penalty": "a number", "frequency_penalty": "a number", "logit_bias": "an object of numbers",
    "repetition_penalty": "a number", "no_repeat_ngram_size": "an integer", "min_tokens": "an integer",
    "ignore_eos": "a boolean", "stop_token_ids": "a list of token ids (integers)",
    "include_stop_str_in_output": "a boolean",
    "response_format": "an object {type: 'text', 'json_object' or 'json_schema', json_schema: {name, schema}}",
    "structured_outputs": "an object with one of json, regex, choice, grammar, json_object",
    "sliding_window": "a boolean",
    "suffix": "a string", "user": "a string",
}


# ------------------------------------------------------------------------------ requests
def parse_body(raw: bytes, schema: type[BaseModel], expected: dict | None = None) -> BaseModel:
    """A request body (JSON, whatever the Content-Type) as ``schema``: nulls read as missing,
    every string checked for Unicode text, pydantic's first error a 400 naming the field
    (``expected``: each field's type in words, :data:`EXPECTED` by default).

    Raises:
        APIError: 400 for malformed JSON (no param) or a field of the wrong type, an unknown or
            missing field, a string that is not Unicode text (param = that field).
    """
    data = parse_json(raw)
    check_unicode(data)
    try:
        return schema.model_validate(drop_nulls(data))
    except ValidationError as e:
        raise validation_error(e.errors(), expected) from None


def parse_request(raw: bytes) -> CompletionRequest:
    """The ``/v1/completions`` body as a :class:`CompletionRequest` (:func:`parse_body`)."""
    return parse_body(raw, CompletionRequest)


def parse_json(raw: bytes):
    """The JSON value of a request body (whatever the Content-Type).

    Raises:
        APIError: 400 (no param) for malformed or too deeply nested JSON.
    """
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "The request body is not valid JSON: nested too deeply") from None


def drop_nulls(data):
    """The body without its ``null`` fields (top level and inside ``stream_options``): OpenAI's
    API and vLLM read ``"max_tokens": null`` as "the default", so a missing field and a null one
    mean the same. A null ``prompt`` thus reads as a missing one (400 naming ``prompt``).
    Anything but a JSON object is returned as it is (the schema refuses it)."""
    if not isinstance(data, dict):
        return data
    out = {k: v for k, v in data.items() if v is not None}
    if isinstance(out.get("stream_options"), dict):
        out["stream_options"] = {k: v for k, v in out["stream_options"].items() if v is not None}
    return out


def check_unicode(data, where: str = "", param: str | None = None) -> None:
    """Every string of the parsed body (values and keys, at any depth) must be Unicode text:
    JSON's ``\\ud800``-``\\udfff`` escapes that are not a surrogate pair decode to lone
    surrogates, which no tokenizer (nor UTF-8) can encode.

    Raises:
        APIError: 400 naming the top-level field (``param``) and the string's place in it.
    """
    if isinstance(data, str):
        try:
            data.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = data[e.start:e.end].encode("utf-8", "backslashreplace").decode("ascii")
            raise APIError(400, f"Invalid '{where or 'body'}': the string has a lone UTF-16 surrogate ({bad}) at "
                                f"character {e.start}, which is not Unicode text (a \\ud800-\\udbff escape must be "
                                f"followed by a \\udc00-\\udfff one)", param) from None
    elif isinstance(data, dict):
        for key, value in data.items():
            name = f"{where}.{key}" if where else key
            check_unicode(key, printable(name), param or printable(key))
            check_unicode(value, name, param or key)
    elif isinstance(data, list):
        for i, value in enumerate(data):
            check_unicode(value, f"{where}[{i}]", param)


def printable(text: str) -> str:
    """``text`` with its lone surrogates written as ``\\udXXX`` escapes (any other character,
    ASCII or not, kept): a name that an error message and its UTF-8 JSON can carry."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def validation_error(errors: list[dict], expected: dict | None = None) -> APIError:
    """pydantic's first error as a 400 naming the field (for a union such as ``prompt``, the
    branch error that reached deepest into the value: ``prompt[0][1]`` rather than ``prompt``);
    the message names the place inside the field (:func:`error_path`: ``messages[0].role``) and
    ``param`` the top-level field. ``expected`` says what each place must be, keyed by
    :func:`error_key` (default :data:`EXPECTED`, the completions fields; a place it does not list
    gets its top-level field's entry)."""
    first = errors[0].get("loc", ())[:1]
    err = max((e for e in errors if e.get("loc", ())[:1] == first), key=lambda e: len(e.get("loc", ())))
    loc = [x for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if not loc:
        return APIError(400, "The request body must be a JSON object of completion parameters")
    param, where = str(loc[0]), error_path(loc)
    if kind == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {where}", where)
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{where}'", param)
    got = json.dumps(err.get("input"))[:60]
    expected = expected or EXPECTED
    want = expected.get(error_key(where), expected.get(param, "another type"))
    return APIError(400, f"Invalid type for '{where}': expected {want}, got {got}", param)


#: pydantic's names of union branches and plain types in an error's location (``str``,
#: ``list[ContentPart]``), which are no place in the body.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def error_path(loc) -> str:
    """pydantic's error location as a place in the body: ``messages[0].content[1].type``, list
    indexes in brackets, the names of union branches (``str``, ``list[ContentPart]``) left out."""
    out = str(loc[0])
    for x in loc[1:]:
        if isinstance(x, int):
            out += f"[{x}]"
        elif x.isidentifier() and x.islower() and x not in _TYPE_NAMES:
            out += f".{x}"
    return out


def error_key(path: str) -> str:
    """A place's key in the tables of what each field must be: its indexes as ``[]``
    (``messages[0].role`` → ``messages[].role``)."""
    return re.sub(r"\[\d+\]", "[]", path)


def check_model(name: str | None, model_name: str) -> None:
    """404 naming ``model`` for a name other than the served one (None: the served one)."""
    if name is not None and name != model_name:
        raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_name}'", "model",
                       code="model_not_found")


def check_request(body: CompletionRequest, model_name: str, vocab_size: int,
                  max_logprobs: int = MAX_COMPLETION_LOGPROBS) -> SamplingParams:
    """A parsed request's checks: the model (404), ``logprobs`` in ``[0, max_logprobs]`` (the
    route's limit: OpenAI's 5 for completions, 20 for chat's ``top_logprobs``), every sampling
    field's range through :class:`~gpt2mha.inference.params.SamplingParams` (the one place
    ``generate()`` and the CLI check them too), its ``logit_bias`` and ``stop_token_ids``
    ids below ``vocab_size``, what
    this server takes only at its default (``suffix``), best_of with stream, and a prompt list
    that is not empty.

    Returns:
        The request's :class:`~gpt2mha.inference.params.SamplingParams`.

    Raises:
        APIError: 400/404 naming the field.
    """
    check_model(body.model, model_name)
    if body.logprobs is not None and not 0 <= body.logprobs <= max_logprobs:
        more = f" (OpenAI's limit for completions; chat's top_logprobs takes up to {MAX_LOGPROBS})" \
            if max_logprobs < MAX_LOGPROBS else ""
        raise APIError(400, f"logprobs={body.logprobs} must be an integer in [0, {max_logprobs}]{more}", "logprobs")
    params = sampling_params(body)
    try:
        params.check_vocab(vocab_size)
    except ParamError as e:
        raise APIError(400, str(e), e.param) from None
    if body.stream and params.best_of is not None and params.best_of > 1:
        raise APIError(400, f"best_of={body.best_of} cannot be used with stream: the best of several "
                            f"completions is known only once all are done", "best_of")
    if body.suffix is not None:
        raise APIError(400, f"suffix={body.suffix!r} is not supported by this server (only its default)", "suffix")
    if isinstance(body.prompt, list) and not body.prompt:
        raise APIError(400, "prompt is an empty list; give at least one prompt", "prompt")
    return params


def prompt_list(body: CompletionRequest) -> list[tuple[str, str | list[int]]]:
    """The request's prompts, each with the name its errors give it, in OpenAI's reading of
    ``prompt``: a string or a list of token ids is one prompt (``"prompt"``); a list of strings
    or a list of lists of ids is a batch (``"prompt[i]"``). An empty list is an empty batch."""
    p = body.prompt
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [("prompt", p)]
    return [(f"prompt[{i}]", x) for i, x in enumerate(p)]


def check_prompt_count(body: CompletionRequest, capacity: int, max_batch: int, max_queue: int) -> None:
    """More prompts than the server can ever hold at once (``capacity = max_batch + max_queue``)
    is a 400 naming ``prompt`` (``code="too_many_prompts"``): never admissible, not a 429 to retry."""
    batch = prompt_list(body)
    n = len(batch)
    each = body.best_of or body.n                       # sequences run per prompt
    if n * each > capacity:
        what = "the prompt" if n == 1 and batch[0][0] == "prompt" else f"prompt is a list of {n} prompts"
        runs = f" with {each} sequences each ({'best_of' if body.best_of else 'n'}={each})" if each > 1 else ""
        raise APIError(400, f"{what}{runs}; this server holds at most {capacity} "
                            f"sequences at once (--max-batch {max_batch} running + --max-queue "
                            f"{max_queue} waiting), so it can never admit them: send at most "
                            f"{capacity} {'prompts' if each == 1 else 'sequences'} per request", "prompt" if each == 1 else
                       ("best_of" if body.best_of else "n"), code="too_many_prompts")


def encode_prompts(body: CompletionRequest, tokenizer, n_ctx: int, n_vocab: int | None = None,
                   overflow: str = REFUSE) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized, token ids are checked against the
    vocabulary); raises :class:`APIError` 400 naming ``prompt`` for an empty prompt, an id outside
    ``[0, n_vocab)`` (default the tokenizer's), a prompt longer than ``n_ctx``, or naming
    ``max_tokens`` for prompt + max_tokens beyond the context: with ``overflow="clip"`` (the
    server's default, :data:`MAX_TOKENS_OVERFLOW`) only when the prompt fills the context (the
    scheduler clips the others' ``max_tokens`` to the room left); never with ``sliding_window``
    (the completion runs past the context on its last ``n_ctx`` tokens).

    A text prompt whose UTF-8 length alone proves it longer than ``n_ctx`` tokens (at least
    ``ceil(bytes / tokenizer.max_token_bytes)`` of them) is refused without being tokenized, so
    the work per prompt is bounded by ``n_ctx · max_token_bytes`` bytes whatever its size."""
    n_vocab = tokenizer.n_vocab if n_vocab is None else n_vocab
    out = []
    for where, prompt in prompt_list(body):
        ids = encode_text(prompt, where, tokenizer, n_ctx) if isinstance(prompt, str) else prompt
        if not ids:
            raise APIError(400, f"{where} is an empty list of token ids; give at least one token", "prompt")
        if len(ids) > n_ctx:
            raise APIError(400, f"{where} has {len(ids)} tokens; this model's maximum context length is "
                                f"{n_ctx} tokens", "prompt", code="context_length_exceeded")
        if len(ids) + body.max_tokens > n_ctx and (overflow == REFUSE or len(ids) == n_ctx) and \
                not body.sliding_window:
            hint = ("; lower max_tokens or shorten the prompt (a server started with --max-tokens-overflow clip "
                    "ends the completion where the context does)") if overflow == REFUSE else \
                f"; the prompt fills the context, which leaves no room for max_tokens={body.max_tokens}: shorten it"
            raise APIError(400, f"This model's maximum context length is {n_ctx} tokens, however you requested "
                                f"{len(ids) + body.max_tokens} tokens ({len(ids)} in {where}, {body.max_tokens} for "
                                f"the completion){hint}", "max_tokens", code="context_length_exceeded")
        out.append(ids if isinstance(prompt, str) else check_token_ids(prompt, where, n_vocab))
    return out


def encode_text(text: str, where: str, tokenizer, n_ctx: int, param: str = "prompt") -> list[int]:
    """``tokenizer.encode(text)``, refusing (400 naming ``param``, the message naming ``where``)
    an empty text, or one whose UTF-8 length alone proves it longer than ``n_ctx`` tokens, before
    tokenizing it."""
    if text == "":
        raise APIError(400, f"{where} is empty; give at least one character to continue", param)
    longest = getattr(tokenizer, "max_token_bytes", None)
    if longest:
        n_bytes = len(text.encode("utf-8", "surrogatepass"))
        at_least = -(-n_bytes // longest)
        if at_least > n_ctx:
            count = f"{at_least}" if longest == 1 else f"at least {at_least} ({n_bytes} bytes)"
            raise APIError(400, f"{where} has {count} tokens; this model's maximum context length is "
                                f"{n_ctx} tokens", param, code="context_length_exceeded")
    try:
        return tokenizer.encode(text)
    except UnicodeError:                          # parse_request refuses these first
        raise APIError(400, f"{where} is not Unicode text", param) from None


def check_token_ids(ids: list[int], where: str, n_vocab: int, param: str = "prompt") -> list[int]:
    """``ids`` if every one is a token id in ``[0, n_vocab)``; else 400 naming ``param``, the
    message naming the first bad id and its place (``prompt[1][3]=70000``)."""
    for j, t in enumerate(ids):
        if not 0 <= t < n_vocab:
            raise APIError(400, f"{where}[{j}]={t} is not a token id of this model: ids are integers in "
                                f"[0, {n_vocab})", param)
    return ids


def check_stop(body, max_stop: int = MAX_STOP) -> None:
    """At most ``max_stop`` stop strings (default :data:`MAX_STOP`; ``gpt2mha serve --max-stop
    N``), none empty; else 400 naming ``stop``, with how many were sent and the limit."""
    stops = stop_strings(body)
    if len(stops) > max_stop:
        raise APIError(400, f"stop has {len(stops)} strings; this server accepts at most {max_stop} (start the "
                            f"server with --max-stop {len(stops)} or more to accept them)", "stop")
    if any(s == "" for s in stops):
        raise APIError(400, f"stop has an empty string ({list(stops)!r}); every stop string needs a character", "stop")


def check_stream_options(body) -> None:
    """``stream_options`` only with ``stream: true`` (OpenAI answers 400 naming it)."""
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       "stream_options")


def stop_strings(body: CompletionRequest) -> tuple[str, ...]:
    """The request's ``stop`` as a tuple (a single string, a list, or none)."""
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def sampling_params(body: CompletionRequest) -> SamplingParams:
    """The request's :class:`~gpt2mha.inference.params.SamplingParams`: every field of it taken
    from the request's field of the same name (``stop`` and ``stop_token_ids`` as tuples;
    ``structured_outputs`` from it or from ``response_format``: :mod:`.structured`).

    Raises:
        APIError: 400 naming the field a :class:`~gpt2mha.inference.params.ParamError` names.
    """
    from .structured import structured_request

    values = {name: getattr(body, name) for name in SAMPLING_FIELDS}      # every one: a request field
    try:
        return SamplingParams(**{**values, "stop": stop_strings(body), "logit_bias": body.logit_bias or {},
                                 "stop_token_ids": tuple(body.stop_token_ids or ()),
                                 "structured_outputs": structured_request(body)})
    except ParamError as e:
        raise APIError(400, str(e), e.param) from None


def submit_error(e: Exception) -> APIError:
    """The answer to a refused submission: :class:`~gpt2mha.inference.scheduler.ExceedsCapacity`
    400, :class:`~gpt2mha.inference.scheduler.QueueFull` 429 and
    :class:`~gpt2mha.inference.scheduler.ShuttingDown` 503 (both with ``Retry-After``)."""
    if isinstance(e, ExceedsCapacity):
        return APIError(400, str(e), "prompt", code="too_many_prompts")
    if isinstance(e, QueueFull):
        return APIError(429, f"The server is busy: {e}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, ShuttingDown):
        return APIError(503, f"The server is shutting down: {e}", type="server_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    raise TypeError(f"not a refused submission: {type(e).__name__}: {e}")


# ------------------------------------------------------------------------------- answers
def cancelled_error() -> APIError:
    """503 for a request cancelled because the server is shutting down."""
    return APIError(503, "The request was cancelled: the server is shutting down", type="server_error")


def failure(seqs: list[Sequence]) -> APIError | None:
    """The error a request answers with when one of its sequences was cancelled (503) or failed
    (500, naming the exception); None when all finished normally."""
    bad = [s for s in seqs if s.finish_reason in (ERROR, CANCELLED)]
    if not bad:
        return None
    s = bad[0]
    if s.finish_reason == CANCELLED:
        return cancelled_error()
    return APIError(500, f"The server failed on this request: {s.error}", type="server_error")


def usage(seqs: list[Sequence]) -> dict:
    """OpenAI's ``usage``: prompt tokens (each prompt once, however many choices it has),
    completion tokens (of every sequence run, best_of's unreturned ones too), their total, and
    ``prompt_tokens_details.cached_tokens``: the prompt tokens taken from the prefix cache (each
    prompt's first sequence; :mod:`~gpt2mha.inference.prefix_cache`)."""
    first = {s.prompt_index: s for s in reversed(seqs)}.values()
    p = sum(len(s.prompt_ids) for s in first)
    c = sum(len(s.tokens) for s in seqs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in first)}}


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One entry of ``choices`` (a whole answer's, or a stream chunk's)."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` (or the literal ``[DONE]``) and a blank line."""
    return "data: " + (data if isinstance(data, str) else json.dumps(data)) + "\n\n"


# ------------------------------------------------------ choices (n, best_of) and logprobs
def token_text(tokenizer, token: int) -> str:
    """A token as ``logprobs.tokens`` shows it: its text, or, when its bytes are not whole UTF-8
    characters (part of a multi-byte character), ``"bytes:\\xe2\\x80"`` as OpenAI writes them."""
    raw = tokenizer.decode_bytes([token])
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprobs_answer(tokenizer, ids: list[int], entries: list, offsets: list[int]) -> dict:
    """OpenAI's ``choices[i].logprobs`` for tokens ``ids``: ``{tokens, token_logprobs,
    top_logprobs, text_offset}``.

    Args:
        ids: the tokens (the echoed prompt's, then the completion's).
        entries: one :data:`~gpt2mha.inference.engine.TokenLogprob` ``(logprob, [(id, logprob)])``
            per token, or None (the prompt's first token: no context, so ``null``).
        offsets: each token's character offset in the choice's text.
    """
    tokens = [token_text(tokenizer, t) for t in ids]
    token_logprobs = [None if e is None else e[0] for e in entries]
    top = [None if e is None else {token_text(tokenizer, i): lp for i, lp in e[1]} for e in entries]
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": list(offsets)}


def prompt_echo(tokenizer, seq: Sequence) -> tuple[str, dict | None]:
    """With ``echo``: the prompt's text and (with ``logprobs``) its part of the logprobs, its
    first token ``null``; without, ``("", None)``."""
    if not seq.params.echo:
        return "", None
    text = tokenizer.decode(seq.prompt_ids)
    if seq.params.logprobs is None:
        return text, None
    offsets = text_offsets(tokenizer, seq.prompt_ids)
    return text, logprobs_answer(tokenizer, seq.prompt_ids, [None] + list(seq.prompt_logprobs or []), offsets)


def text_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Each token's character offset in the text of ``ids`` (as :class:`TextStream` counts them)."""
    stream = TextStream(tokenizer)
    out = []
    for t in ids:
        out.append(len(stream.text))
        stream.push([t])
    return out


def completion_logprobs(tokenizer, seq: Sequence, start: int, end: int, shift: int) -> dict:
    """The logprobs of ``seq``'s generated tokens ``start … end-1``, offsets moved by ``shift``
    characters (the echoed prompt's length)."""
    offsets = [o + shift for o in seq.stream.offsets[start:end]]
    return logprobs_answer(tokenizer, seq.tokens[start:end], seq.logprobs[start:end], offsets)


def join_logprobs(*parts: dict | None) -> dict:
    """Logprobs objects one after another as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [x for p in parts if p is not None for x in p[k]] for k in keys}


def choice_answer(tokenizer, index: int, seq: Sequence) -> dict:
    """A finished sequence as ``choices[index]``: the echoed prompt then its text, and the
    logprobs of the tokens the text covers (:attr:`TextStream.released`) when asked."""
    echo, prompt_lp = prompt_echo(tokenizer, seq)
    lp = None
    if seq.params.logprobs is not None:
        tokens = completion_logprobs(tokenizer, seq, 0, seq.stream.released if seq.stream else 0, len(echo))
        lp = join_logprobs(prompt_lp, tokens)
    return choice(index, echo + seq.text, seq.finish_reason, lp)
