"""How to continue a prompt: one validated :class:`SamplingParams`, built by ``generate()``, the
CLI and the server alike, so an option and its range live in one place.

The fields are OpenAI's completions fields (``max_tokens``, ``temperature``, ``top_p``,
``stop``, ``n``, ``best_of``, ``logprobs``, ``echo``, the penalties, ``logit_bias``, ``seed``)
plus ``top_k`` and ``min_p`` (as vLLM's ``SamplingParams`` and llama.cpp's server take them) and
vLLM's repetition control: ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, transformers' ``no_repeat_ngram_size``, and
vLLM's ``structured_outputs`` (:class:`StructuredOutputs`: a JSON schema, any JSON object, a
regular expression, a choice of strings or a grammar that the text must follow), and
``sliding_window`` (a sequence may run past the model's context, on its last ``n_ctx`` tokens).
Every range is checked once, in :meth:`SamplingParams.__post_init__`; a bad value raises
:class:`ParamError` (a ValueError) naming the field, which the server answers as OpenAI's 400
with that ``param``. What depends on the model (a ``logit_bias`` id below its vocabulary, a
prompt that fits n_ctx) is checked by :meth:`SamplingParams.check_vocab` and by the engine.

Imports no torch: the CLI checks its flags with it before torch loads.

Source: OpenAI's API reference (completions), vLLM's ``SamplingParams`` and
``StructuredOutputsParams``, transformers' ``GenerationConfig`` (``no_repeat_ngram_size``).
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from dataclasses import dataclass, fields

from .errors import GrammarError, ParamError  # noqa: F401  (raised here; importable from here too)

#: OpenAI's range of ``presence_penalty`` / ``frequency_penalty``.
MAX_PENALTY = 2.0
#: OpenAI's range of a ``logit_bias`` value.
MAX_LOGIT_BIAS = 100.0
#: OpenAI's limits: ``n`` up to 128, ``best_of`` up to 20; ``logprobs`` up to 20, as OpenAI's chat
#: ``top_logprobs`` (and vLLM's ``max_logprobs``) take.
MAX_LOGPROBS, MAX_N, MAX_BEST_OF = 20, 128, 20
#: OpenAI's limit of the completions API's ``logprobs`` (``/v1/completions`` keeps it; chat's
#: ``top_logprobs`` and the CLI's ``--logprobs`` take up to :data:`MAX_LOGPROBS`).
MAX_COMPLETION_LOGPROBS = 5
#: Temperatures below float32's smallest normal number (2⁻¹²⁶) sample as temperature 0 (greedy):
#: the limit of ``softmax(logits / t)`` as t → 0 puts all the mass on the largest logit.
MIN_TEMPERATURE = 2.0 ** -126
#: A ``logit_bias`` key longer than this many digits is refused unread (``int()`` of a
#: 4300-digit string raises; no vocabulary has ids of 20 digits).
MAX_ID_DIGITS = 20


def _int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, (bool, float)):
        raise ParamError(name, f"{name}={value!r} must be an integer >= {low}; got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ParamError(name, f"{name}={value!r} must be an integer >= {low}; got {type(value).__name__}") from None
    if value < low or (high is not None and value > high):
        raise ParamError(name, f"{name}={value} must be an integer in [{low}, {high}]" if high is not None
                         else f"{name}={value} must be an integer >= {low}")
    return value


def _finite(value) -> bool:
    """Whether a real number is finite as a float (an int past float's range is not: 10**400)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _real(name: str, value, ok, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) or not ok(value):
        raise ParamError(name, f"{name}={_show(value)} must be {expected}")
    return float(value)


def _flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ParamError(name, f"{name}={_show(value)} must be true or false")
    return value


def _token_ids(name: str, ids) -> tuple[int, ...]:
    """A sequence of token ids (ints >= 0) as a tuple of ints, in the order given."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ParamError(name, f"{name}={_show(ids)} must be a list of token ids (integers >= 0)")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, (bool, float, str)):
            raise ParamError(name, f"{name}[{i}]={_show(t)} must be a token id (an integer >= 0)")
        try:
            t = operator.index(t)
        except TypeError:
            raise ParamError(name, f"{name}[{i}]={_show(t)} must be a token id (an integer >= 0)") from None
        if t < 0:
            raise ParamError(name, f"{name}[{i}]={t} must be a token id (an integer >= 0)")
        out.append(t)
    return tuple(out)


def _token_id(key) -> int | None:
    """A logit_bias key as a token id: an int, or a string of ASCII digits (JSON keys are strings)."""
    if not isinstance(key, (bool, str, float)):
        try:
            key = operator.index(key)                           # ints, numpy and 0-d torch integers
        except TypeError:
            return None
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        digits = key.lstrip("0") or "0"
        return int(digits) if len(digits) <= MAX_ID_DIGITS else None
    return None


def _show(key) -> str:
    """A value as an error message shows it: whole up to 42 characters, else its start, its end
    and its length (an int past Python's 4300-digit printing limit: its size in bits)."""
    try:
        text = repr(key)
    except ValueError:
        return f"an integer of {key.bit_length()} bits"
    return text if len(text) <= 42 else f"{text[:20]}…{text[-10:]} ({len(text)} characters)"


def logit_bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` (a mapping or pairs of token id → bias, ids as ints or decimal strings) as
    sorted ``((id, bias), …)``.

    Raises:
        ParamError: not a mapping, a key that is not a token id, a value that is not a finite
            number in ``[-100, 100]``.
    """
    if bias is None:
        return ()
    items = bias.items() if hasattr(bias, "items") else bias
    try:
        items = list(items)
    except TypeError:
        items = [bias]
    out = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ParamError("logit_bias", f"logit_bias must be an object mapping token ids to biases; got "
                                           f"{_show(bias)}")
        key, value = item
        token = _token_id(key)
        if token is None:
            raise ParamError("logit_bias", f"logit_bias key {_show(key)} is not a token id (an integer >= 0, or a "
                                           f"string of ASCII digits such as \"50256\")")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) or \
                not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ParamError("logit_bias", f"logit_bias[{_show(key)}]={_show(value)} must be a number in "
                                           f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if token in out:
            raise ParamError("logit_bias", f"logit_bias names token {token} twice ({_show(key)} and an earlier key)")
        out[token] = float(value)
    return tuple(sorted(out.items()))


#: The constraints of :class:`StructuredOutputs`, one of which is given.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputs:
    """What the generated text must be (vLLM's ``StructuredOutputsParams``): exactly one of

    Attributes:
        json: a JSON schema (a dict, or its JSON text); kept as compact JSON text (its keys in
            their order: a JSON object's properties are generated in the schema's order), so that
            the parameters stay hashable and a schema sent again compiles once.
        regex: a regular expression the whole text matches (Rust ``regex`` syntax, as llguidance
            reads it).
        choice: strings, one of which is the whole text; kept as a tuple.
        grammar: a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's).
        json_object: True: any JSON object (OpenAI's ``response_format: {"type": "json_object"}``).

    The constraint is compiled here (by llguidance, once per constraint: :mod:`~gpt2mha.inference.structured`)
    to check it; a tokenizer's token mask is built from it when a sequence starts.

    Raises:
        GrammarError: (a :class:`ParamError` naming ``structured_outputs``) none or several
            given, a value of the wrong type, or a constraint llguidance refuses, with its message.
    """

    json: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        put = object.__setattr__
        if not isinstance(self.json_object, bool):
            raise GrammarError("json_object", f"{_show(self.json_object)} must be true or false")
        given = [k for k in STRUCTURED_KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            got = ", ".join(given) if given else "none"
            raise GrammarError("", f"give exactly one of {', '.join(STRUCTURED_KINDS)}; "
                                                                  f"got {got}")
        if self.json is not None:
            put(self, "json", _schema_text(self.json))
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrammarError(key, f"{_show(value)} must be a non-empty string")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, (list, tuple)) or not choice or \
                    any(not isinstance(c, str) for c in choice):
                raise GrammarError("choice", f"{_show(choice)} must be a non-empty list of strings")
            put(self, "choice", tuple(choice))
        from .structured import check_constraint
        check_constraint(self.kind, self.spec)

    @property
    def kind(self) -> str:
        """Which constraint is given: one of :data:`STRUCTURED_KINDS`."""
        return next(k for k in STRUCTURED_KINDS if (getattr(self, k) is not None if k != "json_object"
                                                     else self.json_object))

    @property
    def spec(self):
        """The constraint's value (the schema's JSON text, the regex, the choices, the grammar;
        True for ``json_object``)."""
        return getattr(self, self.kind)

    @classmethod
    def of(cls, value) -> "StructuredOutputs | None":
        """``value`` as a :class:`StructuredOutputs`: one itself, None, or a mapping of its
        fields (a request's ``structured_outputs`` object).

        Raises:
            GrammarError: not a mapping, an unknown key, or the fields' own errors.
        """
        if value is None or isinstance(value, cls):
            return value
        if not hasattr(value, "items"):
            raise GrammarError("", f"{_show(value)} must be an object with one of {', '.join(STRUCTURED_KINDS)}")
        unknown = [k for k in value if k not in STRUCTURED_KINDS]
        if unknown:
            raise GrammarError(str(unknown[0]), f"{_show(unknown[0])} is not supported; give one of "
                                                f"{', '.join(STRUCTURED_KINDS)}")
        return cls(**value)


def _schema_text(schema) -> str:
    """A JSON schema (a dict or a bool, or JSON text of one) as JSON text, its keys in order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError("json", f"is not JSON text ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json", f"json={_show(schema)} must be a JSON schema (an object)")
    try:
        return json.dumps(schema, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise GrammarError("json", f"is not a JSON value ({e})") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt: every field checked when it is made.

    Attributes:
        max_tokens: new tokens at most (>= 0).
        temperature: softmax temperature, a finite number >= 0 (0: greedy, the argmax).
        top_k: keep the k most likely tokens (0: all).
        top_p: nucleus sampling, in (0, 1] (1: off); OpenAI's ``top_p_logits``.
        min_p: keep tokens at least ``min_p`` times as likely as the most likely one, in [0, 1]
            (0: off).
        presence_penalty, frequency_penalty: OpenAI's penalties in [-2, 2], subtracted from the
            logits of tokens already generated (once / per occurrence).
        logit_bias: ``{token id: bias in [-100, 100]}`` added to those logits (a mapping or
            pairs; ids as ints or decimal strings); kept as sorted ``((id, bias), …)``.
        repetition_penalty: a finite number > 0 (1: off); the logit of every token of the prompt
            or generated so far is divided by it where positive, multiplied where negative
            (transformers' ``RepetitionPenaltyLogitsProcessor``, vLLM's ``repetition_penalty``).
        no_repeat_ngram_size: n >= 0 (0: off): a token that would repeat an n-gram already in the
            prompt plus the tokens generated is banned (transformers' ``NoRepeatNGramLogitsProcessor``).
        min_tokens: the end-of-text token and ``stop_token_ids`` are banned until this many new
            tokens are generated, and no stop string ends the text before more than this many
            (vLLM's); in [0, max_tokens].
        seed: None (a random draw) or an integer in ``[0, 2**63)``; prompt i's candidate j of a
            request draws from ``row_seed(seed, i·m + j)`` (m = ``best_of or n``), as row
            ``i·m + j`` of ``generate`` (:func:`~gpt2mha.inference.sampling.row_seed`).
        stop: strings that end the text (cut before the first one); a string or a sequence of
            non-empty strings, kept as a tuple.
        ignore_eos: the end-of-text token does not end the sequence (an ordinary token; vLLM's).
        stop_token_ids: token ids that end the sequence when sampled: the token is among the
            sequence's tokens, its text is not in the text (vLLM's); kept as a tuple.
        include_stop_str_in_output: the stop string (or stop token's text) that ended the text
            is kept at its end (vLLM's).
        logprobs: None, or k in [0, 20]: each new token's log-probability and the k most likely.
        echo: with ``logprobs``, also the log-probabilities of the prompt's own tokens.
        n: completions per prompt, in [1, 128].
        best_of: None, or candidates per prompt in [1, 20] (>= n) of which the n of highest
            mean log-probability are returned.
        structured_outputs: None, or a :class:`StructuredOutputs` (or a mapping of its fields):
            each step's tokens are masked to those its grammar allows next (after every other
            adjustment, before temperature and the filters), the end-of-text token only where
            the grammar may end; a sequence whose grammar is complete (nothing can follow) ends
            there with finish reason ``"stop"``.
        sliding_window: the prompt plus the new tokens may run past the model's context (the
            prompt itself may be longer): once a sequence's context is full, each step conditions
            on its last ``n_ctx`` tokens only, positions restarting at 0 for that window (one
            uncached forward of the window a step: slower once it slides). False: a prompt plus
            ``max_tokens`` past the context is an error (or, served, clipped).

    Raises:
        ParamError: (a ValueError) naming the field and what it must be.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    echo: bool = False
    n: int = 1
    best_of: int | None = None
    structured_outputs: StructuredOutputs | None = None
    sliding_window: bool = False

    def __post_init__(self):
        put = object.__setattr__
        put(self, "max_tokens", _int("max_tokens", self.max_tokens, 0))
        put(self, "temperature", _real("temperature", self.temperature, lambda v: v >= 0,
                                       "a finite number >= 0 (0 means greedy)"))
        put(self, "top_k", _int("top_k", self.top_k, 0))
        put(self, "top_p", _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1]"))
        put(self, "min_p", _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1] (0 turns it off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _real(name, getattr(self, name), lambda v: -MAX_PENALTY <= v <= MAX_PENALTY,
                                  f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"))
        put(self, "logit_bias", logit_bias_pairs(self.logit_bias))
        put(self, "repetition_penalty", _real("repetition_penalty", self.repetition_penalty, lambda v: v > 0,
                                              "a finite number > 0 (1 turns it off)"))
        put(self, "no_repeat_ngram_size", _int("no_repeat_ngram_size", self.no_repeat_ngram_size, 0))
        put(self, "min_tokens", _int("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", f"min_tokens={self.min_tokens} must be less than or equal to "
                                           f"max_tokens={self.max_tokens}")
        if self.seed is not None:
            put(self, "seed", _int("seed", self.seed, 0, 2**63 - 1))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if stop is None or not isinstance(stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in stop):
            raise ParamError("stop", f"stop={_show(self.stop)} must be a non-empty string or a list of them")
        put(self, "stop", tuple(stop))
        put(self, "ignore_eos", _flag("ignore_eos", self.ignore_eos))
        put(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        put(self, "include_stop_str_in_output", _flag("include_stop_str_in_output", self.include_stop_str_in_output))
        if self.logprobs is not None:
            put(self, "logprobs", _int("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        if not isinstance(self.echo, bool):
            raise ParamError("echo", f"echo={self.echo!r} must be true or false")
        put(self, "n", _int("n", self.n, 1, MAX_N))
        if self.best_of is not None:
            put(self, "best_of", _int("best_of", self.best_of, 1, MAX_BEST_OF))
            if self.best_of < self.n:
                raise ParamError("best_of", f"best_of={self.best_of} must be greater than or equal to n={self.n}")
        put(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))
        put(self, "sliding_window", _flag("sliding_window", self.sliding_window))

    @property
    def greedy(self) -> bool:
        """Temperature 0 (below :data:`MIN_TEMPERATURE`): the argmax."""
        return self.temperature < MIN_TEMPERATURE

    @property
    def adjusted(self) -> bool:
        """Whether penalties, a logit bias, bans or a grammar's mask change the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias or self.repetition_penalty != 1
                    or self.no_repeat_ngram_size or self.min_tokens or self.structured_outputs is not None)

    @property
    def per_prompt(self) -> int:
        """Sequences run for each prompt: ``best_of`` when given, else ``n``."""
        return self.best_of or self.n

    @property
    def ranked(self) -> bool:
        """Whether n of more candidates are picked (``best_of > n``): every token's logprob is kept."""
        return self.per_prompt > self.n

    def check_vocab(self, vocab_size: int) -> None:
        """Raises :class:`ParamError` naming ``logit_bias`` or ``stop_token_ids`` unless their ids
        are below ``vocab_size``."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise ParamError("logit_bias", f"logit_bias key {token} is not a token id of this model's "
                                               f"tokenizer (ids 0 … {vocab_size - 1})")
        for i, token in enumerate(self.stop_token_ids):
            if token >= vocab_size:
                raise ParamError("stop_token_ids", f"stop_token_ids[{i}]={token} is not a token id of this model's "
                                                   f"tokenizer (ids 0 … {vocab_size - 1})")


#: The names of :class:`SamplingParams`' fields, in order (what every entry point must accept).
FIELDS = tuple(f.name for f in fields(SamplingParams))
