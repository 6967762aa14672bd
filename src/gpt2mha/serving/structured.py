"""Structured outputs on the server: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, on ``/v1/completions`` and ``/v1/chat/completions`` alike, read into one
:class:`~gpt2mha.inference.params.StructuredOutputs` (the field of
:class:`~gpt2mha.inference.params.SamplingParams` that ``generate()`` and the CLI take too).

- ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "description", "schema",
  "strict"}}`` (the text is JSON valid for ``schema``; ``strict`` is accepted either way: the
  schema is always enforced).
- ``structured_outputs``: an object with one of ``json`` (a schema, or its JSON text), ``regex``,
  ``choice`` (a list of strings), ``grammar`` (Lark or GBNF) and ``json_object: true``.

A shape that is not one of these, both fields together, or a schema, regex or grammar that
llguidance refuses is a 400 naming the field, the message naming the key inside it.

Sources: OpenAI's API reference (``response_format``, Structured Outputs), vLLM's
``ResponseFormat`` / ``StructuredOutputsParams``.
"""

from __future__ import annotations

from ..inference.params import GrammarError, StructuredOutputs
from .errors import APIError

#: The keys of OpenAI's ``response_format`` object and of its ``json_schema``.
RESPONSE_FORMAT_KEYS = ("type", "json_schema")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def structured_request(body) -> StructuredOutputs | None:
    """The request's constraint: its ``structured_outputs`` or its ``response_format`` (None for
    neither, or ``{"type": "text"}``).

    Raises:
        APIError: 400 naming the field (see the module's docstring).
    """
    fmt, so = getattr(body, "response_format", None), getattr(body, "structured_outputs", None)
    if fmt is not None and so is not None:
        raise APIError(400, "response_format and structured_outputs both constrain the text; give one of them",
                       "response_format")
    if so is not None:
        try:
            return StructuredOutputs.of(so)
        except GrammarError as e:
            raise APIError(400, str(e), "structured_outputs") from None
    return None if fmt is None else response_format(fmt)


def response_format(fmt: dict) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` object as a constraint (None for ``{"type": "text"}``).

    Raises:
        APIError: 400 naming ``response_format``: an unknown type or key, a ``json_schema``
            without an object ``schema``, or a schema llguidance refuses (its message).
    """
    def bad(message: str) -> APIError:
        return APIError(400, message, "response_format")

    unknown = [k for k in fmt if k not in RESPONSE_FORMAT_KEYS]
    if unknown:
        raise bad(f"response_format has an unknown key {unknown[0]!r}; expected {', '.join(RESPONSE_FORMAT_KEYS)}")
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad(f"response_format.type={kind!r} is not supported; expected one of "
                  f"{', '.join(repr(t) for t in RESPONSE_FORMAT_TYPES)}")
    if kind != "json_schema":
        if "json_schema" in fmt:
            raise bad(f"response_format.json_schema goes with type 'json_schema', not {kind!r}")
        return StructuredOutputs(json_object=True) if kind == "json_object" else None
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema must be an object {name, description, schema, strict} with type "
                  "'json_schema'")
    unknown = [k for k in spec if k not in JSON_SCHEMA_KEYS]
    if unknown:
        raise bad(f"response_format.json_schema has an unknown key {unknown[0]!r}; expected "
                  f"{', '.join(JSON_SCHEMA_KEYS)}")
    if not isinstance(spec.get("schema"), dict):
        raise bad(f"response_format.json_schema.schema must be a JSON schema (an object); got "
                  f"{type(spec.get('schema')).__name__ if 'schema' in spec else 'none'}")
    for key, kinds, what in (("name", str, "a string"), ("description", str, "a string"), ("strict", bool, "a boolean")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad(f"response_format.json_schema.{key} must be {what}")
    try:
        return StructuredOutputs(json=spec["schema"])
    except GrammarError as e:
        raise bad(f"response_format.json_schema.schema: {e.detail}") from None


def check_grammar(params, engine, body) -> None:
    """Compile the request's grammar for the served tokenizer now (in the request's worker
    thread; kept, so the scheduler's thread only copies it).

    Raises:
        APIError: 400 naming ``response_format`` (or ``structured_outputs``, the one ``body``
            gave) for a grammar llguidance refuses for this tokenizer.
    """
    try:
        engine.grammar(params)
    except GrammarError as e:
        if getattr(body, "response_format", None) is not None:
            raise APIError(400, f"response_format: {e.detail}", "response_format") from None
        raise APIError(400, str(e), "structured_outputs") from None
