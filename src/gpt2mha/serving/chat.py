"""OpenAI's chat completions over a completions model: a Jinja chat template turns ``messages``
into one prompt, which the server continues as ``/v1/completions`` does; the answer is shaped
as OpenAI's ``chat.completion`` (or ``chat.completion.chunk`` events when streamed).

GPT-2 has no chat template of its own. The server ships built-in ones, selected by name
(:data:`BUILTIN_TEMPLATES`: ``plain``, "role: content" lines, the default, ``chatml``, and
``alpaca``, the book's chapter-7 instruction format), and
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

from pydantic import BaseModel, ConfigDict

from ..inference.params import MAX_LOGPROBS
from ..io.tokenizer import CHAT_TEMPLATES
from ..io.tokenizer import DEFAULT_CHAT_TEMPLATE as TOKENIZER_CHAT_TEMPLATE
from .completions import Completions
from .protocol import (EXPECTED, APIError, CompletionRequest, RequestFields, check_model, encode_prompts, encode_text,
                       parse_body, token_text)
from ..inference.sequence import Sequence


# ------------------------------------------------------------------------------ template
#: The built-in chat templates, by name (``gpt2mha serve --chat-template NAME``): ``plain``,
#: ``chatml`` and ``alpaca`` (:data:`gpt2mha.io.tokenizer.CHAT_TEMPLATES`, where the tokenizer files
#: take the default from).
BUILTIN_TEMPLATES = CHAT_TEMPLATES
#: The template ``gpt2mha serve`` and :func:`~gpt2mha.serving.server.create_app` serve chat with by
#: default: chat-first clients (the openai client's chat, LangChain's ``ChatOpenAI``, litellm)
#: then work against a default server, as they do against llama.cpp's server; it is also the
#: ``chat_template`` of the ``tokenizer_config.json`` gpt2mha writes.
DEFAULT_CHAT_TEMPLATE = TOKENIZER_CHAT_TEMPLATE
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
    """One part of a message's content given as a list (OpenAI's ``{"type": "text", "text": ...}``).
    Any ``type`` and fields parse, so that :func:`check_messages` can say which part is not
    text (an ``image_url`` or ``input_audio`` part) and why."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class Message(BaseModel):
    """One chat message: ``role``, ``content`` (a string, a list of text parts, or null), and any
    other fields (``name``, ...), which the template sees as they are."""

    model_config = ConfigDict(extra="allow", strict=True)       # name, tool_call_id...: passed to the template
    role: str
    content: str | list[ContentPart] | None = None


#: The sampling fields chat spells its own way (OpenAI's chat API): ``max_tokens`` (or
#: ``max_completion_tokens``) defaults to the rest of the context, ``logprobs`` is a boolean
#: with ``top_logprobs`` k, and ``echo`` (the prompt's text before the completion) is taken at
#: its default only: a chat answer carries the new message alone. Every other field of
#: :class:`~gpt2mha.serving.protocol.RequestFields` is passed to the completion as it is.
CHAT_SPELLED = frozenset({"max_tokens", "logprobs", "echo"})


class ChatRequest(RequestFields):
    """The body of ``POST /v1/chat/completions``: every field of
    :class:`~gpt2mha.serving.protocol.RequestFields` (what ``/v1/completions`` takes besides its
    prompt, so each sampling field both routes take is declared once), ``messages``, and chat's
    own spellings (:data:`CHAT_SPELLED`; ``add_generation_prompt`` as vLLM's extension, default
    true). Types are checked strictly."""

    messages: list[Message]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # each generated token's logprob, and the top_logprobs most probable (choices[i].logprobs.content)
    logprobs: bool = False
    top_logprobs: int | None = None


#: The most ``top_logprobs`` a chat request may ask for: OpenAI's chat limit (and vLLM's).
MAX_TOP_LOGPROBS = MAX_LOGPROBS

#: What each place of a message must be, for the messages of type errors (keys:
#: :func:`~gpt2mha.serving.protocol.error_key`).
MESSAGE_EXPECTED = {"messages": "a list of messages {role: string, content: string or list of text parts}",
                    "messages[]": "a message {role: string, content: string or list of text parts}",
                    "messages[].role": "a string", "messages[].content": "a string, a list of content parts or null",
                    "messages[].content[]": "a content part {type: \"text\", text: string}",
                    "messages[].content[].type": "a string", "messages[].content[].text": "a string"}
#: What each field must be, for the messages of type errors.
CHAT_EXPECTED = {**EXPECTED, **MESSAGE_EXPECTED, "max_tokens": "an integer", "max_completion_tokens": "an integer",
                 "add_generation_prompt": "a boolean", "logprobs": "a boolean", "top_logprobs": "an integer"}


def parse_chat_request(raw: bytes) -> ChatRequest:
    """The request body as a :class:`ChatRequest` (``null`` fields read as missing).

    Raises:
        APIError: 400 for malformed JSON, a field of the wrong type (the message naming its place,
            ``messages[0].role``), an unknown field, missing messages, a string that is not Unicode
            text, messages :func:`check_messages` refuses, ``echo`` other than false, or
            ``top_logprobs`` without ``logprobs: true`` or outside ``[0, MAX_TOP_LOGPROBS]`` (each
            naming the field).
    """
    body = parse_body(raw, ChatRequest, CHAT_EXPECTED)
    check_messages(body.messages)
    if body.echo:
        raise APIError(400, "echo=true is a /v1/completions field (the prompt's text before the completion); a chat "
                            "answer carries only the new message. Send the prompt to /v1/completions with echo, or "
                            "leave echo out", "echo")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, f"top_logprobs={body.top_logprobs} needs logprobs: true (the top tokens come with "
                                f"each token's logprob)", "top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs={body.top_logprobs} must be an integer in [0, {MAX_TOP_LOGPROBS}]",
                           "top_logprobs")
    return body


def check_messages(messages: list[Message]) -> None:
    """What the chat route and ``/tokenize`` refuse in parsed messages, each a 400 naming
    ``messages`` whose message names the place: an empty list, a content part whose type is not
    ``"text"`` (an ``image_url`` or ``input_audio`` part: this model reads text only), a text part
    without its ``text`` or with another field."""
    if not messages:
        raise APIError(400, "messages is an empty list; give at least one message", "messages")
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            where = f"messages[{i}].content[{j}]"
            if part.type != "text":
                raise APIError(400, f"{where}.type is {part.type!r}: this model reads only text, so a content part "
                                    f"must be {{\"type\": \"text\", \"text\": ...}}", "messages")
            if part.text is None:
                raise APIError(400, f"Missing required parameter: '{where}.text' (the text of a text part)", "messages")
            extra = next(iter(part.model_extra or {}), None)
            if extra is not None:
                raise APIError(400, f"Unrecognized request argument supplied: {where}.{extra}", "messages")


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
    fields = body.model_dump(include=set(RequestFields.model_fields) - CHAT_SPELLED, exclude_none=True)
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
    MAX_LOGPROBS = MAX_TOP_LOGPROBS

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
        check_model(body.model, self.served_name(body.model))    # before rendering anything
        request = completion_request(body, self.template, s.tokenizer, s.n_ctx)
        self.check(request)
        return request, encode_prompts(request, s.tokenizer, s.n_ctx, overflow=self.overflow)

    def whole_choice(self, index: int, seq: Sequence) -> dict:
        """A finished sequence as ``choices[index]``, with the logprobs of the tokens its text
        covers (:attr:`TextStream.released <gpt2mha.inference.text_stream.TextStream.released>`) when asked."""
        lp = None
        if seq.params.logprobs is not None:
            lp = logprobs_content(self.scheduler.tokenizer, seq, 0, seq.stream.released if seq.stream else 0)
        return message_choice(index, seq.text, seq.finish_reason, lp)

    def chunk_choices(self, seq: Sequence, text: str, finished: bool, seen: list[int]) -> list[dict]:
        """A choice's first chunk carries the role (``{"role": "assistant", "content": ""}``), as
        OpenAI's do; its text follows, and the finish reason comes alone, with an empty delta and
        null logprobs, in a last chunk of its own (OpenAI's chat shape). With logprobs, a text
        chunk carries those of the tokens its event covers (``seq.marks``, as
        :meth:`~gpt2mha.serving.completions.Completions.chunk`)."""
        index, finish_reason = seq.index, seq.finish_reason if finished else None
        k = seen[index]
        seen[index] += 1
        out = [delta_choice(index, {"role": "assistant", "content": ""}, None)] if k == 0 else []
        if text or finish_reason is None:
            lp = None
            if seq.params.logprobs is not None:
                lp = logprobs_content(self.scheduler.tokenizer, seq, seq.marks[k - 1] if k else 0, seq.marks[k])
            out.append(delta_choice(index, {"content": text}, None, lp))
        if finish_reason is not None:
            out.append(delta_choice(index, {}, finish_reason))
        return out
