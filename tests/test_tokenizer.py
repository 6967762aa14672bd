"""Tokenizers. References: GPT-2's known ids for "Hello, I am" (OpenAI's encoder), and the
sha256 hashes tiktoken itself publishes for its gpt2 encoding (read from tiktoken's source);
for the files written for transformers, tiktoken's gpt2 encoding and UTF-8 bytes."""

import functools
import hashlib
import inspect
import os

import pytest
from hypothesis import given, settings, strategies as st

from gpt2mha.io.tokenizer import ByteTokenizer, StreamDecoder, bpe_data_files, get_tokenizer

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def test_known_ids():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello, I am") == [15496, 11, 314, 716]
    assert tok.decode([15496, 11, 314, 716]) == "Hello, I am"
    assert tok.encode("<|endoftext|>") != [50256]          # special text is encoded as plain text
    assert tok.n_vocab == 50257 and tok.eot_token == 50256


def test_shipped_files_match_tiktoken_published_hashes():
    import tiktoken_ext.openai_public as openai_public

    source = inspect.getsource(openai_public.gpt2)
    for path in bpe_data_files():
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        assert digest in source, f"{path} does not have the hash tiktoken publishes"


def test_round_trip_on_shipped_texts():
    for name in ("tinyshakespeare.txt", "the-verdict.txt"):
        with open(os.path.join(DATA, name), encoding="utf-8") as f:
            text = f.read()
        for tok in (get_tokenizer("gpt2"), ByteTokenizer()):
            ids = tok.encode(text[:200_000])
            assert tok.decode(ids) == text[:200_000]


# pieces that break naive tokenizers: emoji (incl. ZWJ sequences and flags), combining marks,
# NUL and control characters, mixed scripts, long runs of whitespace, the special-token text
PIECES = st.sampled_from(["🙂", "👩‍👩‍👧", "🇫🇷", "e\u0301", "\u0915\u094d\u0937", "\x00", "\x1b[0m", "日本語",
                          "Ελληνικά", "עברית", "\t" * 7, " " * 40, "\n\n\n", "\r\n", "<|endoftext|>", "'s'll"])
TEXTS = st.lists(st.one_of(PIECES, st.text(alphabet=st.characters(codec="utf-8"), max_size=30)),
                 max_size=12).map("".join)


@settings(max_examples=200, deadline=None)
@given(TEXTS)
def test_round_trip_random_unicode(text):
    for tok in (get_tokenizer("gpt2"), get_tokenizer("bytes")):
        ids = tok.encode(text)
        assert all(0 <= i < tok.n_vocab for i in ids)
        assert tok.decode(ids) == text


def test_stream_decoder_holds_back_split_characters():
    tok = get_tokenizer("bytes")
    ids = tok.encode("é🙂x")
    stream = StreamDecoder(tok)
    pieces = [stream.push([i]) for i in ids]
    assert pieces[0] == "" and "".join(pieces) + stream.flush() == "é🙂x"


def test_max_token_bytes_is_the_longest_token_so_bytes_bound_the_token_count():
    """max_token_bytes (which lets the server refuse an over-long prompt without encoding it)
    is the longest token's byte length over the whole vocabulary (reference: decode_bytes of
    every id), so a text of n bytes has at least ceil(n / max_token_bytes) tokens; the byte
    tokenizer's is 1 (its count is the UTF-8 length)."""
    tok = get_tokenizer("gpt2")
    assert tok.max_token_bytes == max(len(tok.decode_bytes([i])) for i in range(tok.n_vocab)) == 128
    for text in ("-" * 3000, " " * 5000, "Hello, I am a language model. " * 50, "é😀" * 300):
        assert len(tok.encode(text)) >= -(-len(text.encode()) // tok.max_token_bytes)
    assert ByteTokenizer().max_token_bytes == 1 and len(ByteTokenizer().encode("é😀")) == len("é😀".encode())


# ------------------------------------------------ the files transformers loads (hf_tokenizer_files)
# References: gpt2mha's GPT-2 tokenizer is tiktoken's gpt2 encoding over OpenAI's hash-checked
# files (test_known_ids, test_shipped_files_match_tiktoken_published_hashes); the byte
# tokenizer's ids are the text's UTF-8 bytes by definition (Python's str.encode).
SAMPLES = ["Hello, I am", "é", "JULIET:\nO Roméo, Roméo! wherefore art thou Roméo?", "  two  spaces\n\n\tx ",
           "<|endoftext|> in the text", "I'll've don't 12345 ok", "日本語 🙂 👩‍👩‍👧 naïve", "Ā\x00\x1b[0m\r\n", " " * 40]


def reference_ids(name, text):
    return tiktoken_gpt2().encode_ordinary(text) if name == "gpt2" else list(text.encode("utf-8"))


def tiktoken_gpt2():
    return get_tokenizer("gpt2")._enc


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """{name: a directory holding only hf_tokenizer_files(name, 1024)}."""
    from gpt2mha.io.tokenizer import hf_tokenizer_files

    out = {}
    for name in ("gpt2", "bytes"):
        d = tmp_path_factory.mktemp(f"tok-{name}")
        for file, content in hf_tokenizer_files(name, 1024).items():
            (d / file).write_bytes(content)
        out[name] = str(d)
    return out


@pytest.mark.parametrize("name", ["gpt2", "bytes"])
def test_hf_tokenizer_files_encode_and_decode_as_gpt2mha(tokenizer_dirs, name):
    """AutoTokenizer (transformers) and tokenizer.json alone (the tokenizers library, with
    ``encode_special_tokens`` as tokenizer_config.json's ``split_special_tokens`` sets it in
    transformers) give exactly gpt2mha's ids, add no BOS/EOS, and decode back to the text."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    d = tokenizer_dirs[name]
    auto = AutoTokenizer.from_pretrained(d)
    raw = _raw_tokenizer(d)
    for text in SAMPLES:
        want = reference_ids(name, text)
        assert auto.encode(text, add_special_tokens=False) == want, text
        assert auto(text)["input_ids"] == want, text                 # nothing added around it
        assert raw.encode(text, add_special_tokens=False).ids == want, text
        assert auto.decode(want) == text and raw.decode(want, skip_special_tokens=False) == text
    assert auto.model_max_length == 1024
    if name == "bytes":
        assert auto.encode("é") == [0xC3, 0xA9] and auto.decode([0xC3, 0xA9]) == "é"
        assert raw.get_vocab_size() == 256 and len(auto) == 256
        assert auto.decode([0xC3]) == "\ufffd" == ByteTokenizer().decode([0xC3])   # a split character, as gpt2mha
        # NUL stands in as bos/eos for tools that need one; hidden only when special tokens are skipped
        assert auto.eos_token_id == auto.bos_token_id == 0 and auto.pad_token_id is None
        assert auto.decode([97, 0, 98]) == "a\x00b" and auto.decode([97, 0, 98], skip_special_tokens=True) == "ab"
    else:
        assert auto.eos_token_id == auto.bos_token_id == 50256 and len(auto) == 50257
        assert auto.decode([50256]) == "<|endoftext|>" and auto.decode([15496, 50256], skip_special_tokens=True) == "Hello"
        # tokenizer.json keeps <|endoftext|> a special added token (as openai-community/gpt2's), so a
        # reader that does not split special tokens maps the literal text to 50256
        assert Tokenizer.from_file(os.path.join(d, "tokenizer.json")).encode("<|endoftext|>").ids == [50256]


@settings(max_examples=150, deadline=None)
@given(TEXTS)
def test_hf_tokenizer_json_matches_gpt2mha_on_random_unicode(tokenizer_dirs, text):
    for name in ("gpt2", "bytes"):
        raw = _raw_tokenizer(tokenizer_dirs[name])
        ids = raw.encode(text, add_special_tokens=False).ids
        assert ids == reference_ids(name, text)
        assert raw.decode(ids, skip_special_tokens=False) == text


@functools.lru_cache(maxsize=None)
def _raw_tokenizer(directory):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    raw.encode_special_tokens = True          # what split_special_tokens: true asks of transformers
    return raw


def test_hf_vocab_and_merges_are_openais_files(tokenizer_dirs):
    """vocab.json / merges.txt are encoder.json / vocab.bpe byte for byte (the hashes tiktoken
    publishes), and the byte table is the one transformers uses for GPT-2."""
    import tiktoken_ext.openai_public as openai_public
    from transformers.convert_slow_tokenizer import bytes_to_unicode as hf_bytes_to_unicode

    from gpt2mha.io.tokenizer import bytes_to_unicode

    source = inspect.getsource(openai_public.gpt2)
    for file in ("vocab.json", "merges.txt"):
        with open(os.path.join(tokenizer_dirs["gpt2"], file), "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() in source, file
    assert bytes_to_unicode() == hf_bytes_to_unicode()
    assert sorted(os.listdir(tokenizer_dirs["bytes"])) == ["tokenizer.json", "tokenizer_config.json"]


def test_hf_tokenizer_files_refuse_unknown_name_and_modified_bpe_files(tmp_path, monkeypatch):
    import gpt2mha.io.tokenizer as tk

    with pytest.raises(ValueError, match="tokenizer='sentencepiece'; expected 'gpt2' or 'bytes'"):
        tk.hf_tokenizer_files("sentencepiece", 1024)
    encoder_json, vocab_bpe = tk.bpe_data_files()
    bad = tmp_path / "encoder.json"
    bad.write_bytes(open(encoder_json, "rb").read().replace(b'"!": 0', b'"!": 1'))
    monkeypatch.setattr(tk, "bpe_data_files", lambda: (str(bad), vocab_bpe))
    tk._hf_tokenizer_files.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"encoder.json: sha256 \w+ is not OpenAI's GPT-2 file"):
            tk.hf_tokenizer_files("gpt2", 1024)
    finally:
        tk._hf_tokenizer_files.cache_clear()
