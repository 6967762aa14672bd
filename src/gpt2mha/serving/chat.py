"""OpenAI's chat completions over a completions model: a Jinja chat template turns ``messages``
into one prompt, which the server continues as ``/v1/completions`` does; the answer is shaped
as OpenAI's ``chat.completion`` (or ``chat.completion.chunk`` events when streamed).

GPT-2 has no chat template of its own. The server ships built-in ones, selected by name
(:data:`BUILTIN_TEMPLATES`: ``plain``, "role: content" lines, the default, and ``chatml``), and
takes a Jinja file as vLLM's ``--chat-template`` does (``gpt2mha serve --chat-template
NAME|FILE``); with ``--chat-template none`` the route answers 400 (:func:`no_template_error`).
The template is rendered as transformers'
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`` renders
it (a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``raise_exception`` and ``strftime_now`` functions, a ``tojson`` that keeps non-ASCII text, and
the tokenizer's special tokens ``bos_token``/``eos_token``/``unk_token`` as variables), and the
text is tokenized by gpt2mha's tokenizer as a completions prompt is (special-token text is
ordinary text, as transformers does with the ``split_special_tokens`` of the files
:func:`~gpt2mha.io.tokenizer.hf_tokenizer_files` writes).

Sources: OpenAI's chat completions API reference; transformers
``utils/chat_template_utils.py`` (``_compile_jinja_template``, ``render_jinja_template``).
"""

from __future__ import annotations

import datetime
import json
import os

from pydantic import BaseModel, ConfigDict, ValidationError

from ..inference.params import MAX_LOGPROBS
from .completions import Completions
from .protocol import (EXPECTED, APIError, CompletionRequest, StreamOptions, check_model, check_unicode,
                       drop_nulls, encode_prompts, encode_text, parse_json, token_text, validation_error)
from .scheduler import Sequence


# ------------------------------------------------------------------------------ template
#: The built-in chat templates, by name (``gpt2mha serve --chat-template NAME``), in transformers'
#: dialect. ``plain``: one "role: content" line per message, then ``assistant:`` (text a base
#: model such as GPT-2 reads as a dialogue to continue); ``chatml``: OpenAI's ChatML turns,
#: ``<|im_start|>role\ncontent<|im_end|>\n``, then ``<|im_start|>assistant\n`` (the layout
#: of chat models tuned on it; to GPT-2's tokenizer its markers are ordinary text).
BUILTIN_TEMPLATES = {
    "plain": ("{% for message in messages %}"
              r"{{ message['role'] + ': ' + (message['content'] or '') + '\n' }}"
              "{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
    "chatml": ("{% for message in messages %}"
               r"{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
               "{% endfor %}"
               r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
}
#: The template ``gpt2mha serve`` and :func:`~gpt2mha.serving.server.create_app` serve chat with by
#: default: chat-first clients (the openai client's chat, LangChain's ``ChatOpenAI``, litellm)
#: then work against a default server, as they do against llama.cpp's server.
DEFAULT_CHAT_TEMPLATE = "plain"
#: The name that serves no chat (``--chat-template none``).
NO_TEMPLATE = "none"


def load_chat_template(spec: str) -> str | None:
    """The Jinja source of a chat template: a built-in one by name (:data:`BUILTIN_TEMPLATES`),
    None for ``"none"`` (no chat), else a file's text, or for a ``.json`` file (a
    ``tokenizer_config.json``) its ``chat_template`` string. A name wins over a file of that name
    in the current directory (give that one as ``./plain``).

    Raises:
        ValueError: the file is missing or unreadable (the message names the built-in templates
            too), a JSON file has no string ``chat_template``, or the template is not valid Jinja
            (the message names the file and the line).
    """
    if spec == NO_TEMPLATE:
        return None
    if spec in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[spec]
    path = spec
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path!r}: cannot read the file ({e}); the built-in templates: "
                         f"{', '.join(sorted(BUILTIN_TEMPLATES))} (or {NO_TEMPLATE} for no chat)") from None
    if path.endswith(".json"):
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--chat-template {path!r}: a JSON file must hold a 'chat_template' string "
                             f"({e!r})") from None
        if not isinstance(text, str):
            raise ValueError(f"--chat-template {path!r}: 'chat_template' must be a single template string")
    ChatTemplate(text, {}, source=os.path.basename(path))            # compiles: a syntax error fails now
    return text


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with.

    Args:
        source_text: the Jinja template.
        special_tokens: variables such as ``{"bos_token": "<|endoftext|>", "eos_token": ...}``
            (transformers passes its tokenizer's ``special_tokens_map``).
        source: a name for error messages (the file's).

    Raises:
        ValueError: the template is not valid Jinja (names ``source`` and the line).
    """

    def __init__(self, source_text: str, special_tokens: dict, source: str = "chat template"):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            """transformers' ``{% generation %}`` block (it marks assistant text): rendered as is."""
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source_text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{source}: not a valid Jinja template (line {e.lineno}: {e.message})") from None
        self.source_text, self.special_tokens, self.errors = source_text, dict(special_tokens), jinja2.TemplateError

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (each a dict with ``role`` and ``content``).

        Raises:
            APIError: 400 naming ``messages`` when the template raises (``raise_exception``, an
                undefined variable used, a wrong type), with the template's message.
        """
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except (self.errors, TypeError, ValueError) as e:
            raise APIError(400, f"The chat template could not render these messages: {e}", "messages") from None


def special_tokens(tokenizer_name: str, n_ctx: int) -> dict:
    """The special tokens a chat template sees for gpt2mha's tokenizer ``tokenizer_name``: those
    of the ``tokenizer_config.json`` that :func:`~gpt2mha.io.tokenizer.hf_tokenizer_files` writes
    (so transformers' ``apply_chat_template`` on a saved directory renders the same text)."""
    from ..io.tokenizer import hf_tokenizer_files

    config = json.loads(hf_tokenizer_files(tokenizer_name, n_ctx)["tokenizer_config.json"])
    return {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k) is not None}


def no_template_error(model_name: str) -> APIError:
    """The 400 of ``/v1/chat/completions`` on a server started without a chat template."""
    return APIError(400, f"'{model_name}' is a completions model and this server was started without a chat "
                         f"template (--chat-template none), so it does not serve /v1/chat/completions. Send the text "
                         f"to continue to POST /v1/completions ('prompt'), or start the server with --chat-template "
                         f"{' or '.join(sorted(BUILTIN_TEMPLATES))} (built in) or FILE (a Jinja chat template, as "
                         f"transformers' apply_chat_template and vLLM take) to serve chat.",
                    code="chat_template_missing")


# ------------------------------------------------------------------------------ requests
class ContentPart(BaseModel):
    """One part of a message's content given as a list (OpenAI's ``{"type": "text", "text": ...}``;
    other types are refused by :func:`parse_chat_request`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: str
    text: str


class Message(BaseModel):
    """One chat message: ``role``, ``content`` (a string, a list of text parts, or null), and any
    other fields (``name``, ...), which the template sees as they are."""

    model_config = ConfigDict(extra="allow", strict=True)       # name, tool_call_id...: passed to the template
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (OpenAI's fields; types checked strictly;
    ``add_generation_prompt`` as vLLM's extension, default true)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_generation_prompt: bool = True
    # passed on to the completion, which checks them as /v1/completions does
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    response_format: dict | None = None
    structured_outputs: dict | None = None
    user: str | None = None
    # each generated token's logprob, and the top_logprobs most probable (choices[i].logprobs.content)
    logprobs: bool = False
    top_logprobs: int | None = None


#: The most ``top_logprobs`` a chat request may ask for: the server's limit of completions'
#: ``logprobs`` (OpenAI's, for completions; OpenAI's chat takes 20).
MAX_TOP_LOGPROBS = MAX_LOGPROBS

#: What each field must be, for the messages of type errors.
CHAT_EXPECTED = {**EXPECTED, "messages": "a list of messages {role: string, content: string or list of text parts}",
                 "max_tokens": "an integer", "max_completion_tokens": "an integer",
                 "add_generation_prompt": "a boolean", "logprobs": "a boolean", "top_logprobs": "an integer"}


def parse_chat_request(raw: bytes) -> ChatRequest:
    """The request body as a :class:`ChatRequest` (``null`` fields read as missing).

    Raises:
        APIError: 400 for malformed JSON, a field of the wrong type, an unknown field, missing
            messages, a string that is not Unicode text, a content part that is not text, or
            ``top_logprobs`` without ``logprobs: true`` or outside ``[0, MAX_TOP_LOGPROBS]`` (each
            naming the field).
    """
    data = parse_json(raw)
    check_unicode(data)
    try:
        body = ChatRequest.model_validate(drop_nulls(data))
    except ValidationError as e:
        raise validation_error(e.errors(), CHAT_EXPECTED) from None
    if not body.messages:
        raise APIError(400, "messages is an empty list; give at least one message", "messages")
    for i, m in enumerate(body.messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type != "text":
                raise APIError(400, f"messages[{i}].content[{j}] has type {part.type!r}; this model reads only "
                                    f"'text' parts", "messages")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs: true (the top tokens come with "
                                f"each token's logprob)", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs={body.top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}] on this server "
                                f"(OpenAI's API takes up to 20)", "top_logprobs")
    return body


def template_messages(body: ChatRequest) -> list[dict]:
    """The messages as the template sees them: plain dicts, a list of text parts joined into one
    string with newlines (as vLLM does for templates that expect string content)."""
    out = []
    for m in body.messages:
        d = m.model_dump(exclude_none=False)
        if isinstance(m.content, list):
            d["content"] = "\n".join(p.text for p in m.content)
        out.append(d)
    return out


def completion_request(body: ChatRequest, template: ChatTemplate, tokenizer, n_ctx: int) -> CompletionRequest:
    """The completion a chat request asks for: the template's text as token ids, and the
    sampling fields. ``max_tokens`` (or ``max_completion_tokens``) defaults to the rest of the
    context, as vLLM's does.

    Raises:
        APIError: 400 naming ``messages`` (the template failed, or its text is empty or longer
            than the context) or ``max_completion_tokens`` (both max fields, different).
    """
    limit = body.max_completion_tokens if body.max_tokens is None else body.max_tokens
    if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
        raise APIError(400, f"max_tokens={body.max_tokens} and max_completion_tokens={body.max_completion_tokens} "
                            f"differ; give one of them", "max_completion_tokens")
    text = template.render(template_messages(body), body.add_generation_prompt)
    ids = encode_text(text, "the chat template's text for messages", tokenizer, n_ctx, param="messages")
    if len(ids) > n_ctx or (len(ids) == n_ctx and limit is None):
        raise APIError(400, f"messages make {len(ids)} tokens with the chat template; this model's maximum context "
                            f"length is {n_ctx} tokens, which leaves no room for a reply", "messages",
                       code="context_length_exceeded")
    fields = body.model_dump(include={"model", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                                      "stream_options", "n", "presence_penalty", "frequency_penalty", "logit_bias",
                                      "repetition_penalty", "no_repeat_ngram_size", "min_tokens", "ignore_eos",
                                      "stop_token_ids", "include_stop_str_in_output", "response_format",
                                      "structured_outputs", "user"}, exclude_none=True)
    if body.logprobs:              # completions' logprobs=k: each token's logprob and the k most probable
        fields["logprobs"] = body.top_logprobs or 0
    return CompletionRequest.model_validate({**fields, "prompt": ids,
                                             "max_tokens": n_ctx - len(ids) if limit is None else limit})


# ------------------------------------------------------------------------------- answers
def message_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One entry of a ``chat.completion``'s ``choices`` (``logprobs``: :func:`logprobs_content`'s, or None)."""
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def delta_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    """One entry of a ``chat.completion.chunk``'s ``choices``: ``delta`` is ``{"role":
    "assistant", "content": ""}`` in a choice's first chunk, then ``{"content": text}`` (with
    the logprobs of the tokens it covers when asked), and ``{}`` in a last chunk that only
    carries the finish reason."""
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def top_entry(tokenizer, token: int, logprob: float) -> dict:
    """One token as OpenAI's chat logprobs name it: ``{"token", "logprob", "bytes"}``, the token's
    text (``"bytes:\\xNN…"`` for bytes that are not whole UTF-8 characters, as completions'
    logprobs write them) and its raw bytes as integers."""
    return {"token": token_text(tokenizer, token), "logprob": logprob,
            "bytes": list(tokenizer.decode_bytes([token]))}


def logprobs_content(tokenizer, seq: Sequence, start: int, end: int) -> dict:
    """OpenAI's chat ``logprobs`` for ``seq``'s generated tokens ``start … end-1``: ``{"content":
    [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}],
    "refusal": None}``, ``top_logprobs`` the ``seq.params.logprobs`` most probable tokens, most
    probable first (all from the model's raw distribution, :mod:`~gpt2mha.inference.engine`)."""
    k = seq.params.logprobs
    content = [{**top_entry(tokenizer, t, lp), "top_logprobs": [top_entry(tokenizer, i, v) for i, v in top[:k]]}
               for t, (lp, top) in zip(seq.tokens[start:end], seq.logprobs[start:end])]
    return {"content": content, "refusal": None}


# -------------------------------------------------------------------------------- route
class ChatCompletions(Completions):
    """``POST /v1/chat/completions``: the messages rendered by ``template``
    (:class:`ChatTemplate`) into one prompt of token ids, continued as a
    completion, answered in OpenAI's ``chat.completion`` / ``chat.completion.chunk`` shapes."""

    OBJECT, CHUNK_OBJECT, ID_PREFIX = "chat.completion", "chat.completion.chunk", "chatcmpl-"

    def __init__(self, template: "ChatTemplate", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.template = template

    def prepare(self, raw: bytes):
        """Parse and check a chat body, render its messages and tokenize them.

        Raises:
            APIError: 400/404 naming the field (:mod:`.chat`, :mod:`.protocol`).
        """
        s = self.scheduler
        body = parse_chat_request(raw)
        check_model(body.model, self.model_name)                 # before rendering anything
        request = completion_request(body, self.template, s.tokenizer, s.n_ctx)
        self.check(request)
        return request, encode_prompts(request, s.tokenizer, s.n_ctx)

    def whole_choice(self, index: int, seq: Sequence) -> dict:
        """A finished sequence as ``choices[index]``, with the logprobs of the tokens its text
        covers (:attr:`TextStream.released <gpt2mha.serving.text_stream.TextStream.released>`) when asked."""
        lp = None
        if seq.params.logprobs is not None:
            lp = logprobs_content(self.scheduler.tokenizer, seq, 0, seq.stream.released if seq.stream else 0)
        return message_choice(index, seq.text, seq.finish_reason, lp)

    def chunk_choices(self, seq: Sequence, text: str, finished: bool, seen: list[int]) -> list[dict]:
        """A choice's first chunk carries the role (``{"role": "assistant", "content": ""}``), as
        OpenAI's do; the finish reason comes with the last text, or alone with an empty delta.
        With logprobs, a chunk carries those of the tokens its event covers (``seq.marks``, as
        :meth:`~gpt2mha.serving.completions.Completions.chunk`)."""
        index, finish_reason = seq.index, seq.finish_reason if finished else None
        k = seen[index]
        seen[index] += 1
        out = [delta_choice(index, {"role": "assistant", "content": ""}, None)] if k == 0 else []
        lp = None
        if seq.params.logprobs is not None:
            lp = logprobs_content(self.scheduler.tokenizer, seq, seq.marks[k - 1] if k else 0, seq.marks[k])
            lp = lp if lp["content"] or text else None          # a finish-only chunk: null, as OpenAI's
        out.append(delta_choice(index, {"content": text} if text or finish_reason is None else {}, finish_reason, lp))
        return out
