"""Tokenizers. References: GPT-2's known ids for "Hello, I am" (OpenAI's encoder), and the
sha256 hashes tiktoken itself publishes for its gpt2 encoding (read from tiktoken's source)."""

import hashlib
import inspect
import os

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
