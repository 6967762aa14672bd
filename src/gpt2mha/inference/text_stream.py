"""Tokens to text for a served sequence: UTF-8-safe deltas, stop strings, and why it ends.

A sequence's text reaches the client piece by piece while it is generated. A byte-level model
emits a multi-byte character over several tokens, and a stop string may arrive split across
tokens, so a piece is sent only once it is certain: whole characters
(:class:`~gpt2mha.io.tokenizer.StreamDecoder`), and no tail that could still grow into a stop
string. Finish reasons are OpenAI's (``"stop"``, ``"length"``) plus the server's own
(``"cancelled"``, ``"error"``).
"""

from __future__ import annotations

import bisect

from ..io.tokenizer import StreamDecoder

#: The text ended at a stop string or the end-of-text token.
STOP = "stop"
#: ``max_tokens`` tokens were generated.
LENGTH = "length"
#: The client went away, or the server is shutting down.
CANCELLED = "cancelled"
#: An exception while running this sequence.
ERROR = "error"
FINISH_REASONS = (STOP, LENGTH, CANCELLED, ERROR)
#: :class:`TextStream`'s default ``eos_token_id``: the tokenizer's end-of-text token.
TOKENIZERS_EOS = "the tokenizer's"


class TextStream:
    """Token ids → text deltas that never split a UTF-8 character or show part of a stop string.

    ``push(ids)`` returns the text that is now certain, holding back an incomplete multi-byte
    character (:class:`~gpt2mha.io.tokenizer.StreamDecoder`) and any tail that could still grow
    into a stop string; once a stop string appears, the text is cut before it and
    :attr:`stopped` is set. ``finish()`` returns the rest (an incomplete trailing character
    becomes U+FFFD, as ``bytes.decode(errors="replace")``). :meth:`add` is ``push`` for one
    sampled token together with the finish reason it causes.

    Args:
        tokenizer: has ``decode_bytes(ids)``, and ``eot_token`` (an id, or None) for :meth:`add`;
            None: no text at all (the tokens alone end the stream: ``generate()`` without stop
            strings decodes nothing).
        stop: strings that end the text (cut before the first one found).
        max_tokens: tokens after which :meth:`add` answers :data:`LENGTH` (None: no limit).
        stop_token_ids: ids that end the text when :meth:`add` is given one, as the end-of-text
            token does (their text left out).
        ignore_eos: the end-of-text token is an ordinary token (its text is text).
        min_tokens: no stop string ends the text until :meth:`add` has been given more than
            this many tokens (vLLM's ``min_tokens``: the stop tokens are banned until then).
        include_stop: keep the stop string that ends the text, or the text of a stop token (not
            the end-of-text token's), at its end (vLLM's ``include_stop_str_in_output``).
        eos_token_id: the id that ends the text as the end-of-text token (:data:`TOKENIZERS_EOS`:
            the tokenizer's ``eot_token``; None: none).

    Attributes:
        text: all text decoded so far (cut at a stop string once found).
        stopped: whether a stop string was found.
        n_tokens: tokens given to :meth:`add`.
        offsets: for each token given to :meth:`add`, the characters of :attr:`text` before it
            (OpenAI's ``text_offset``): a token that completes a multi-byte character started by
            an earlier one points at that character's start too.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), max_tokens: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False, min_tokens: int = 0,
                 include_stop: bool = False, eos_token_id: int | None | str = TOKENIZERS_EOS):
        if stop and tokenizer is None:
            raise ValueError("stop strings are found in the text: give the tokenizer")
        self.decoder = None if tokenizer is None else StreamDecoder(tokenizer)
        if eos_token_id == TOKENIZERS_EOS:
            eos_token_id = getattr(tokenizer, "eot_token", None)
        self.eot = None if ignore_eos else eos_token_id
        self.stop_ids = frozenset(stop_token_ids)
        self.stop = tuple(stop)
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.text = ""
        self.sent = 0           # characters of text already returned
        self.stopped = False
        self.n_tokens = 0
        self.offsets: list[int] = []

    def push(self, ids) -> str:
        """The text that token ids ``ids`` make certain (possibly empty)."""
        if self.stopped or self.decoder is None:
            return ""
        self.text += self.decoder.push(ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text, once no more tokens come."""
        if not self.stopped and self.decoder is not None:
            self.text += self.decoder.flush()
        return self._release(final=True)

    def add(self, token: int) -> tuple[str, str | None]:
        """One sampled token: ``(delta, reason)``, the text it makes certain and the finish reason
        it causes (None: the sequence goes on). The end-of-text token ends it with :data:`STOP`
        and adds no text; so does a stop token (its text kept with ``include_stop``) and a stop
        string (the text cut before it, or after it with ``include_stop``); the
        ``max_tokens``-th token ends it with :data:`LENGTH`."""
        self.n_tokens += 1
        self.offsets.append(len(self.text))
        if token == self.eot:
            return "", STOP
        if token in self.stop_ids:
            return (self.push([token]) if self.include_stop else ""), STOP
        delta = self.push([token])
        if self.stopped:
            return delta, STOP
        if self.max_tokens is not None and self.n_tokens >= self.max_tokens:
            return delta, LENGTH
        return delta, None

    @property
    def released(self) -> int:
        """How many of the tokens given to :meth:`add` the text returned so far covers: those whose
        text starts before its end. Once finished, the tokens of the final text: a stop string's
        tokens that start past the cut, and the end-of-text token, are not among them."""
        return bisect.bisect_left(self.offsets, self.sent)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        found = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in self.stop)
                 if i >= 0] if not self.min_tokens or self.n_tokens > self.min_tokens else []
        if found:
            cut, s = min(found)
            cut += len(s) if self.include_stop else 0
            self.text, self.stopped = self.text[:cut], True
            end = cut
        elif final:
            end = len(self.text)
        else:                   # hold back the longest tail that is the start of a stop string
            hold = max((n for s in self.stop for n in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1)
                        if self.text.endswith(s[:n])), default=0)
            end = len(self.text) - hold
        delta, self.sent = self.text[self.sent:end], max(self.sent, end)
        return delta
