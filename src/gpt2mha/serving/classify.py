"""``POST /v1/classify`` (and ``/classify``): a classifier's labels and probabilities, in vLLM's
request and response shapes.

Request: ``{"model", "input": a string | a list of strings | a list of token ids | a list of
token-id lists, "truncate_prompt_tokens": k (keep each input's last k tokens), "use_activation":
true (softmax; false: the raw logits in ``probs``), "add_special_tokens", "user", "priority"}``.
Response: ``{"id": "classify-…", "object": "list", "created", "model", "data": [{"index",
"label", "probs": [C floats], "num_classes", "object": "classify"}], "usage": {"prompt_tokens",
"total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}``. The numbers are those
of :func:`gpt2mha.inference.classify.classify` on the same inputs (one call per request, run in
a worker thread, one request at a time). A server of a classifier answers ``/v1/completions``
and ``/v1/chat/completions`` with a 400 naming this route.

Source: vLLM's ``entrypoints/pooling/classify/protocol.py`` (``ClassificationRequest``,
``ClassificationResponse``, ``ClassificationData``).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from ..inference.classify import classify_ids, encode_texts
from .completions import read_body
from .protocol import APIError, check_model, parse_body

#: What each field must be, for the messages of type errors.
CLASSIFY_EXPECTED = {"model": "a string", "input": "a string, a list of strings, a list of token ids or a list of "
                                                   "token-id lists",
                     "truncate_prompt_tokens": "an integer", "use_activation": "a boolean",
                     "add_special_tokens": "a boolean", "user": "a string", "priority": "an integer"}


class ClassifyRequest(BaseModel):
    """The body of ``POST /v1/classify`` (vLLM's fields; types checked strictly)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    use_activation: bool = True
    add_special_tokens: bool = True                  # GPT-2's tokenizer adds none either way
    user: str | None = None
    priority: int = 0


def parse_classify_request(raw: bytes) -> ClassifyRequest:
    """The request body as a :class:`ClassifyRequest`.

    Raises:
        APIError: 400 naming the field: malformed JSON, a wrong type, an unknown field, a
            missing or empty ``input``, a string that is not Unicode text.
    """
    body = parse_body(raw, ClassifyRequest, CLASSIFY_EXPECTED)
    if body.input == [] or body.input == "":
        raise APIError(400, "input is empty; give a text, a list of texts or token ids to classify", "input")
    return body


def inputs_of(body: ClassifyRequest) -> list:
    """The request's inputs as a list of texts or token-id lists (a flat id list is one input)."""
    if isinstance(body.input, str):
        return [body.input]
    if body.input and isinstance(body.input[0], int):
        return [body.input]
    return list(body.input)


def answer(model, tokenizer, model_name: str, raw: bytes) -> dict:
    """The whole route in one call (run in a worker thread): parse, check, classify, shape.

    Raises:
        APIError: 400/404 naming the field (an input that is empty, too long or holds ids
            outside the vocabulary: ``input``).
    """
    body = parse_classify_request(raw)
    check_model(body.model, model_name)
    config = model.config
    try:
        encoded, n_tokens = encode_texts(tokenizer, inputs_of(body), config, truncate=body.truncate_prompt_tokens)
    except ValueError as e:
        param = "truncate_prompt_tokens" if str(e).startswith("truncate") else "input"
        raise APIError(400, str(e).replace("texts[", "input["), param) from None
    out = classify_ids(model, encoded, n_tokens)
    values = out.probs if body.use_activation else out.logits
    data = [{"index": i, "label": out.labels[i], "probs": values[i].tolist(), "num_classes": config.n_labels,
             "object": "classify"} for i in range(len(encoded))]
    n = sum(out.n_tokens)
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model_name,
            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                    "prompt_tokens_details": None}}


def not_a_generator(model_name: str, route: str) -> APIError:
    """The 400 of a text-generation route on a server of a classifier."""
    return APIError(400, f"'{model_name}' is a classifier, not a language model: it does not serve {route}; send "
                         f"the texts to classify to POST /v1/classify ({{\"input\": [...]}})", code="model_not_generative")


def add_routes(app, model, tokenizer, model_name: str, max_body_bytes: int) -> None:
    """Serve ``model`` (a :class:`~gpt2mha.core.classifier.GPT2Classifier`) at ``POST
    /v1/classify`` and ``POST /classify`` on ``app``, and refuse the generation routes
    (:func:`not_a_generator`)."""
    lock = threading.Lock()

    def run(raw: bytes) -> dict:
        with lock:                                               # one forward at a time
            return answer(model, tokenizer, model_name, raw)

    async def handle(request: Request):
        raw = await read_body(request, max_body_bytes)
        return await asyncio.get_running_loop().run_in_executor(None, run, raw)

    def refuse(route: str):
        async def handler(request: Request):
            await read_body(request, max_body_bytes)
            raise not_a_generator(model_name, route)
        return handler

    generation = ("/v1/completions", "/v1/chat/completions")
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in generation]
    for path in generation:
        app.add_api_route(path, refuse(path), methods=["POST"])
    for path in ("/v1/classify", "/classify"):
        app.add_api_route(path, handle, methods=["POST"])
