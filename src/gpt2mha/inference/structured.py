"""Structured outputs: the token mask that keeps a sequence's text inside a grammar.

A :class:`~gpt2mha.inference.params.StructuredOutputs` (a JSON schema, any JSON object, a
regular expression, a choice of strings, a Lark or GBNF grammar) is turned into a grammar by
llguidance (:func:`grammar_of`, once per constraint), then compiled for a tokenizer
(:func:`compile_for`, once per constraint and tokenizer: llguidance builds its lexer over the
tokenizer's token → bytes table, :func:`token_table`, itself built once per tokenizer). Each
sequence gets its own copy of the compiled matcher (:meth:`Grammar.start`), so ``n`` and
``best_of`` candidates and the rows of a batch advance their own states. At each step
:meth:`GrammarState.allowed` is the set of token ids the grammar accepts next (llguidance's bit
mask, one bit a token); :class:`~gpt2mha.inference.sampling.RowSampler` sets every other logit
to -inf after its other adjustments and before temperature and the filters, and feeds the chosen
token back (:meth:`GrammarState.accept`). The end-of-text token is allowed only where the
grammar may end; a grammar that can take nothing more (:attr:`GrammarState.complete`) ends the
sequence. The byte tokenizer has no end-of-text token: its table gets one past the vocabulary
(id 256), which the mask holds but the model can never sample, so a byte model's text ends when
its grammar is complete.

Why llguidance rather than xgrammar: it depends on nothing but Python (xgrammar's wheel requires
torch and triton, and would pull another torch build into this CPU-only install), ships abi3
wheels of ~3 MB for Linux, macOS and Windows on x86-64 and arm64, compiles JSON schemas, regular
expressions, Lark and GBNF grammars into one Earley parser over a lazily built lexer (no
precomputation over the vocabulary per schema: a new schema compiles in about a millisecond), and
computes a mask in tens of microseconds for GPT-2's 50,257 tokens. vLLM (its ``guidance``
backend), SGLang and llama.cpp (``LLAMA_LLGUIDANCE``) use it too.

JSON whitespace: between the tokens of a JSON value the grammar allows nothing or one space
(:data:`JSON_WHITESPACE`: the separators of Python's ``json.dumps``, ``", "`` and ``": "``, or
none), not llguidance's default of any run of whitespace, on which a small model can spend every
token it has (the built-in model, a Shakespeare model, spends most of its bytes on newlines and
indentation when it may: with llama.cpp's bounded rule, a newline or two and up to 20 spaces,
its objects of three fields took 104-194 bytes, 58-62 with this one). A schema's own
``"x-guidance"`` options override it (llguidance's extension: ``{"x-guidance":
{"whitespace_pattern": "[ \\n]{0,4}"}}`` for pretty-printed JSON, say).

Sources: llguidance (github.com/guidance-ai/llguidance: ``LLMatcher``, ``LLTokenizer``,
``llguidance.numpy.fill_next_token_bitmask``, docs/json_schema.md); vLLM's
``StructuredOutputsParams`` and its guidance backend; llama.cpp's ``json_schema_to_grammar.py``
(``SPACE_RULE``, the bounded rule compared above).
"""

from __future__ import annotations

import collections
import json
import re
import threading
import time

import numpy as np

from .errors import GrammarError

#: Whitespace allowed between JSON tokens: nothing or one space (as ``json.dumps`` writes ``", "`` and ``": "``).
JSON_WHITESPACE = r" ?"
#: llguidance's JSON options by default (a schema's ``"x-guidance"`` object overrides them).
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
#: The longest error message from llguidance passed on (its messages may quote the grammar).
MAX_MESSAGE = 400
#: Compiled grammars kept (by constraint and tokenizer); the least recently used goes first.
MAX_COMPILED = 64


def _llguidance():
    try:
        import llguidance
        import llguidance.numpy                                 # noqa: F401  (the bit mask helpers)
    except ImportError:                                         # a core dependency; a broken install
        raise ImportError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


def _one_line(message: str) -> str:
    text = re.sub(r"\s*\n\s*", " ", str(message)).strip()
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "…"


_GRAMMARS: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()


def grammar_of(kind: str, spec) -> str:
    """llguidance's grammar (its JSON text) for a constraint: ``kind`` one of
    :data:`~gpt2mha.inference.params.STRUCTURED_KINDS` and ``spec`` its value as
    :class:`~gpt2mha.inference.params.StructuredOutputs` keeps it. Checked by llguidance's
    ``validate_grammar`` and kept (the last :data:`MAX_COMPILED`).

    Raises:
        GrammarError: naming ``kind``, with llguidance's message on one line (an unknown type, a
            ``$ref`` that points nowhere, an unsatisfiable schema, a regex or grammar that does
            not parse, a keyword it does not implement).
    """
    key = (kind, spec)
    with _LOCK:
        if key in _GRAMMARS:
            _GRAMMARS.move_to_end(key)
            return _GRAMMARS[key]
    llg = _llguidance()
    try:
        if kind == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec))
        elif kind == "grammar":
            grammar = llg.grammar_from("grammar", spec)          # Lark, or GBNF converted to Lark
        else:
            raise GrammarError(str(kind), "is not a kind of structured output")
    except (ValueError, TypeError) as e:
        if isinstance(e, GrammarError):
            raise
        raise GrammarError(kind, _one_line(e)) from None
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(kind, _one_line(messages[0] if messages else "not a valid grammar"))
    with _LOCK:
        _GRAMMARS[key] = grammar
        while len(_GRAMMARS) > MAX_COMPILED:
            _GRAMMARS.popitem(last=False)
    return grammar


def check_constraint(kind: str, spec) -> None:
    """Raises :class:`~gpt2mha.inference.errors.GrammarError` unless the constraint compiles
    (:func:`grammar_of`)."""
    grammar_of(kind, spec)


# ------------------------------------------------------------------------------ tokenizers
class _TokenBytes:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer: each id's bytes, the end
    token and a way to tokenize text."""

    bos_token_id = None

    def __init__(self, tokenizer, end: int):
        n = tokenizer.n_vocab
        self.tokens = [tokenizer.decode_bytes([i]) for i in range(n)]
        if end == n:                                            # the byte tokenizer: an end of its own
            self.tokens.append(b"<|end|>")
        self.eos_token_id = end
        self.special_token_ids = [end]
        self._encode = tokenizer.encode

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return [t for t in self._encode(text) if t < len(self.tokens)]


_TABLES: dict = {}


def token_table(tokenizer):
    """``(table, end)``: llguidance's ``LLTokenizer`` for ``tokenizer`` (each id's bytes, from
    ``tokenizer.decode_bytes``), built once per tokenizer (0.6 s for GPT-2's 50,257 tokens, 2 ms
    for the byte tokenizer) and kept; ``end`` is the id the grammar ends with: the tokenizer's
    ``eot_token``, or ``n_vocab`` (one past its ids) for a tokenizer without one."""
    key = (type(tokenizer), getattr(tokenizer, "name", None), tokenizer.n_vocab, tokenizer.eot_token)
    with _LOCK:
        hit = _TABLES.get(key)
    if hit is None:
        llg = _llguidance()
        end = tokenizer.eot_token if tokenizer.eot_token is not None else tokenizer.n_vocab
        hit = (llg.LLTokenizer(llg.TokenizerWrapper(_TokenBytes(tokenizer, end))), end)
        with _LOCK:
            hit = _TABLES.setdefault(key, hit)
    return hit


# -------------------------------------------------------------------------------- grammars
class Grammar:
    """A constraint compiled for one tokenizer: llguidance's matcher in its start state, which
    every sequence copies (:meth:`start`).

    Attributes:
        end: the id the grammar ends with (:func:`token_table`).
        words: int32 words of one bit mask (``ceil(ids / 32)``).
        compile_s: seconds the matcher took to build (its lexer over this tokenizer's tokens).

    Raises:
        GrammarError: llguidance refused the grammar for this tokenizer.
    """

    def __init__(self, kind: str, grammar: str, tokenizer):
        llg = _llguidance()
        table, self.end = token_table(tokenizer)
        t0 = time.perf_counter()
        self.matcher = llg.LLMatcher(table, grammar, log_level=0)
        self.compile_s = time.perf_counter() - t0
        if self.matcher.is_error():
            raise GrammarError(kind, _one_line(self.matcher.get_error()))
        self.kind = kind
        self.words = (table.vocab_size + 31) // 32

    def start(self) -> "GrammarState":
        """A sequence's own state, at the grammar's start."""
        return GrammarState(self, self.matcher.deep_copy())


_COMPILED: collections.OrderedDict = collections.OrderedDict()


def compile_for(structured, tokenizer) -> Grammar:
    """``structured`` (a :class:`~gpt2mha.inference.params.StructuredOutputs`) compiled for
    ``tokenizer``, kept (the last :data:`MAX_COMPILED`) so that each new sequence only copies it.

    Raises:
        GrammarError: the constraint or its grammar for this tokenizer is refused.
    """
    key = (structured.kind, structured.spec, type(tokenizer), getattr(tokenizer, "name", None), tokenizer.n_vocab,
           tokenizer.eot_token)
    with _LOCK:
        if key in _COMPILED:
            _COMPILED.move_to_end(key)
            return _COMPILED[key]
    compiled = Grammar(structured.kind, grammar_of(structured.kind, structured.spec), tokenizer)
    with _LOCK:
        _COMPILED[key] = compiled
        while len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)
    return compiled


class GrammarState:
    """One sequence's place in its grammar: the ids allowed next and the tokens taken.

    Attributes:
        grammar: the :class:`Grammar`.
        matcher: this sequence's llguidance ``LLMatcher``.
    """

    def __init__(self, grammar: Grammar, matcher):
        self.grammar, self.matcher = grammar, matcher
        self._bits = np.zeros((1, grammar.words), dtype=np.int32)
        import llguidance.numpy
        self._fill = llguidance.numpy.fill_next_token_bitmask

    def allowed(self, vocab_size: int, end: bool = True) -> np.ndarray:
        """The ids below ``vocab_size`` the grammar accepts next, as a bool array ``[vocab_size]``
        (a new one); ``end=False`` leaves the end token out (``ignore_eos``).

        Raises:
            ValueError: llguidance's matcher failed (a limit of its parser or lexer reached).
        """
        self._fill(self.matcher, self._bits)
        if self.matcher.is_error():
            raise ValueError(f"structured outputs: {_one_line(self.matcher.get_error())}")
        bits = self._bits.view(np.uint8)
        allowed = np.unpackbits(bits, count=min(vocab_size, 8 * bits.size), bitorder="little").view(bool)
        if allowed.size < vocab_size:                           # ids past the tokenizer's (a padded embedding)
            allowed = np.concatenate([allowed, np.zeros(vocab_size - allowed.size, dtype=bool)])
        if not end and self.grammar.end < vocab_size:
            allowed[self.grammar.end] = False
        return allowed

    def accept(self, token: int) -> None:
        """Advance past ``token``.

        Raises:
            ValueError: the grammar does not allow ``token`` here (it was not chosen under the mask).
        """
        if not self.matcher.consume_token(int(token)):
            raise ValueError(f"token {token} is not allowed by the structured output's grammar here "
                             f"({_one_line(self.matcher.get_error())})")

    @property
    def complete(self) -> bool:
        """Whether the text is a whole sentence of the grammar that nothing can extend (or the end
        token was taken): the sequence is done."""
        return self.matcher.is_stopped() and not self.matcher.is_error()
