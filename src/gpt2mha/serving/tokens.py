"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize`` and ``GET
/tokenizer_info``, which evaluation tools (lm-evaluation-harness's ``tokenizer_backend=remote``)
and clients use to count tokens with the server's own tokenizer.

- ``/tokenize``: ``{"prompt": text}`` (or, on a server with a chat template, ``{"messages":
  [...], "add_generation_prompt": true}``), with an optional ``model`` and vLLM's
  ``add_special_tokens`` (GPT-2's tokenizers add none either way) → ``{"tokens", "count",
  "max_model_len"}``. The ids are exactly the ones a completion's ``prompt`` gives (so
  ``count`` equals its ``usage.prompt_tokens``); a text longer than the context is counted too.
- ``/detokenize``: ``{"tokens": [ids]}`` → ``{"prompt": text}`` (bytes that are not UTF-8
  become U+FFFD, as ``bytes.decode(errors="replace")``).
- ``/tokenizer_info``: the ``tokenizer_config.json`` that
  :func:`~gpt2mha.io.tokenizer.hf_tokenizer_files` writes (``tokenizer_class``, ``bos_token``,
  ``eos_token``, ``model_max_length``, ...), with ``bos_token_id``/``eos_token_id``,
  ``vocab_size``, ``max_model_len`` and the ``chat_template`` served (none with
  ``--chat-template none``).

Sources: vLLM's ``serving_tokenization.py`` and its protocol's ``TokenizeCompletionRequest``,
``TokenizeChatRequest``, ``DetokenizeRequest``, ``TokenizerInfoResponse``.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict

from .chat import MESSAGE_EXPECTED, Message, check_messages, template_messages
from .protocol import APIError, check_model, check_token_ids, parse_body

#: What each field must be, for the messages of type errors.
EXPECTED = {**MESSAGE_EXPECTED, "model": "a string", "prompt": "a string", "add_special_tokens": "a boolean",
            "add_generation_prompt": "a boolean", "tokens": "a list of token ids (integers)"}


class TokenizeRequest(BaseModel):
    """The body of ``POST /tokenize``: ``prompt`` or ``messages`` (not both)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """The body of ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def parse(raw: bytes, schema):
    """``raw`` as ``schema`` (:func:`~gpt2mha.serving.protocol.parse_body` with this module's
    field types)."""
    return parse_body(raw, schema, EXPECTED)


def tokenize(raw: bytes, tokenizer, model_name: str, n_ctx: int, template=None) -> dict:
    """The answer to ``POST /tokenize`` (see the module's docstring).

    Raises:
        APIError: 400 naming the field (neither or both of prompt/messages, messages without a
            chat template, messages the chat route refuses too:
            :func:`~gpt2mha.serving.chat.check_messages`, a wrong type), 404 for another model's name.
    """
    body = parse(raw, TokenizeRequest)
    check_model(body.model, model_name)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Give either 'prompt' (a string) or 'messages' (a list of chat messages)", "prompt")
    if body.messages is not None:
        if template is None:
            raise APIError(400, f"messages need a chat template, and '{model_name}' is served without one (the "
                                f"server was started with --chat-template none); send the text as 'prompt' instead",
                           "messages", code="chat_template_missing")
        check_messages(body.messages)
        text = template.render(template_messages(body), body.add_generation_prompt)
    else:
        text = body.prompt
    try:
        ids = tokenizer.encode(text)
    except UnicodeError:                          # parse refuses these first
        raise APIError(400, "prompt is not Unicode text", "prompt") from None
    return {"tokens": ids, "count": len(ids), "max_model_len": n_ctx}


def detokenize(raw: bytes, tokenizer, model_name: str, n_vocab: int) -> dict:
    """The answer to ``POST /detokenize``: ``{"prompt": text}``.

    Raises:
        APIError: 400 naming ``tokens`` (not a list of ids, or an id outside ``[0, n_vocab)``),
            404 for another model's name.
    """
    body = parse(raw, DetokenizeRequest)
    check_model(body.model, model_name)
    check_token_ids(body.tokens, "tokens", n_vocab, param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer, n_ctx: int, n_vocab: int, chat_template: str | None = None) -> dict:
    """The answer to ``GET /tokenizer_info`` (see the module's docstring; computed once per app)."""
    from ..io.tokenizer import hf_tokenizer_files

    files = hf_tokenizer_files(tokenizer.name, n_ctx)
    config = json.loads(files["tokenizer_config.json"])
    added = {t["content"]: t["id"] for t in json.loads(files["tokenizer.json"])["added_tokens"]}
    info = {**config, "bos_token_id": added.get(config.get("bos_token")),
            "eos_token_id": added.get(config.get("eos_token")), "vocab_size": n_vocab, "max_model_len": n_ctx}
    info.pop("chat_template", None)                   # the files' default: the served one (if any) instead
    if chat_template is not None:
        info["chat_template"] = chat_template
    return info
