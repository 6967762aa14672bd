"""LoRA adapters: the book's appendix-E ``LinearWithLoRA`` state dicts and PEFT's adapter
directories, merged into the weights (``GPT2.from_pretrained(..., lora=...)``, ``gpt2mha
convert --lora``).

Every adapter is made by its own tool on small random weights: the book's LoRA classes as the
book writes them (tests/data/book_lora.py) around its GPTModel (tests/data/book_gpt.py), PEFT's
``get_peft_model(model, LoraConfig(...))`` then ``save_pretrained``. Reference outputs are the
book's model and PEFT's model (unmerged) themselves.
"""

import json
import os
import sys

import pytest
import torch
from torch import nn

from gpt2mha import GPT2, GPT2Classifier
from gpt2mha.cli import main
from gpt2mha.io.checkpoints import CheckpointError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from book_gpt import GPTModel  # noqa: E402
from book_lora import LinearWithLoRA, replace_linear_with_lora  # noqa: E402

ATOL = 1e-5
BOOK_CFG = {"vocab_size": 256, "context_length": 24, "emb_dim": 24, "n_heads": 3, "n_layers": 2,
            "drop_rate": 0.0, "qkv_bias": True}


def randomize(model, seed, scale=0.1):
    """Every parameter random (LoRA's B too, which the book and PEFT start at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else scale)
                    + (1.0 if name.endswith(("scale", "ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0))
    return model.eval()


def ids(n=2, T=11, vocab=256, seed=3):
    return torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------ book
def book_lora_model(classifier: bool, rank=4, alpha=8, seed=0):
    """Appendix E: GPTModel (with chapter 6's 2-class head when ``classifier``), then
    ``replace_linear_with_lora(model, rank, alpha)``; all weights random."""
    torch.manual_seed(seed)
    model = GPTModel(BOOK_CFG)
    if classifier:
        model.out_head = nn.Linear(BOOK_CFG["emb_dim"], 2)
    replace_linear_with_lora(model, rank=rank, alpha=alpha)
    return randomize(model, seed)


def save_book(model, path, cfg):
    torch.save(model.state_dict(), path)
    with open(os.path.splitext(str(path))[0] + ".json", "w") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.mark.parametrize("classifier", [False, True])
def test_book_lora_state_dict_loads_merged_with_the_books_outputs(tmp_path, classifier, one_thread):
    """The book's LinearWithLoRA model (every nn.Linear wrapped: W_query/W_key/W_value fuse into
    c_attn, the head too) saved with torch.save(state_dict) and lora_alpha in NAME.json: loaded
    merged, its logits are the book's unmerged model's."""
    book = book_lora_model(classifier)
    assert isinstance(book.trf_blocks[0].att.W_query, LinearWithLoRA)
    path = save_book(book, tmp_path / "lora.pth", {**BOOK_CFG, "lora_alpha": 8})
    model = GPT2.from_pretrained(path)
    assert isinstance(model, GPT2Classifier) == classifier
    x = ids()
    with torch.no_grad():
        want = book(x)
        got = model(x).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    plain = str(tmp_path / "plain" / "model.pth")                  # convert writes a plain checkpoint
    assert main(["convert", path, plain, "--to", "book"]) == 0
    fresh = GPTModel(BOOK_CFG)
    if classifier:
        fresh.out_head = nn.Linear(BOOK_CFG["emb_dim"], 2)
    fresh.load_state_dict(torch.load(plain, weights_only=True), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), want, atol=ATOL, rtol=0)


def test_book_lora_needs_alpha_and_names_unknown_modules(tmp_path):
    book = book_lora_model(False)
    path = save_book(book, tmp_path / "lora.pth", BOOK_CFG)
    with pytest.raises(CheckpointError, match=r"lora\.pth: the book's LinearWithLoRA keeps alpha.*lora_alpha") as e:
        GPT2.from_pretrained(path)
    assert "\n" not in str(e.value)
    assert isinstance(GPT2.from_pretrained(path, book_config={"lora_alpha": 8}), GPT2)
    sd = book.state_dict()
    sd["tok_emb.lora.A"], sd["tok_emb.lora.B"] = torch.zeros(256, 2), torch.zeros(2, 24)
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"lora\.pth: tensor tok_emb\.lora\.A: unknown target module 'tok_emb'"):
        GPT2.from_pretrained(path, book_config={"lora_alpha": 8})
    sd = book.state_dict()
    sd["trf_blocks.0.ff.layers.0.lora.A"] = torch.zeros(23, 4)
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"lora\.pth: tensor trf_blocks\.0\.ff\.layers\.0\.lora\.A \[23, 4\] and "
                                              r".*do not fit trf_blocks\.0\.ff\.layers\.0\.linear\.weight \[96, 24\]"):
        GPT2.from_pretrained(path, book_config={"lora_alpha": 8})


# ------------------------------------------------------------------------------ PEFT
def hf_base(tmp_path, seed=0, n_layer=2, n_embd=32):
    """A random GPT2LMHeadModel saved with save_pretrained: (model, directory); skips the test
    without PEFT (the 'test' extra installs it), which every caller uses next."""
    pytest.importorskip("peft")
    from transformers import GPT2Config as HFConfig, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(HFConfig(vocab_size=256, n_positions=32, n_embd=n_embd, n_head=4, n_layer=n_layer,
                                     bos_token_id=None, eos_token_id=None)).eval()
    randomize(model, seed)
    directory = str(tmp_path / f"base{seed}_{n_layer}_{n_embd}")
    model.save_pretrained(directory)
    return model, directory


def peft_adapter(model, directory, seed=1, targets=("c_attn", "c_proj", "c_fc", "lm_head"), **lora):
    """PEFT's get_peft_model(model, LoraConfig(...)) with random A and B, saved: the PEFT model."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(**{"r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                                             "target_modules": list(targets), **lora}))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(directory)
    return pm.eval()


@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "r": 2, "lora_alpha": 3}])
def test_peft_adapter_merged_equals_peft(tmp_path, lora, one_thread):
    """A PEFT adapter on c_attn, c_proj, c_fc and the tied lm_head: GPT2.from_pretrained(base,
    lora=DIR) and `gpt2mha convert BASE DST --lora DIR` (read back by transformers) both give
    PEFT's own (unmerged) logits."""
    from transformers import GPT2LMHeadModel

    base, base_dir = hf_base(tmp_path)
    pm = peft_adapter(base, str(tmp_path / "adapter"), **lora)
    x = ids()
    with torch.no_grad():
        want = pm(input_ids=x).logits
    model = GPT2.from_pretrained(base_dir, lora=str(tmp_path / "adapter"))
    assert not model.config.tie_word_embeddings                     # the head gained ΔW, the embedding did not
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, want, atol=ATOL, rtol=0)
    out = str(tmp_path / "merged")
    assert main(["convert", base_dir, out, "--lora", str(tmp_path / "adapter")]) == 0
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, atol=ATOL, rtol=0)


def test_peft_merge_and_unload_agrees_without_a_head_adapter(tmp_path, one_thread):
    """Without lm_head among the targets, PEFT's own merge_and_unload gives the same weights."""
    base, base_dir = hf_base(tmp_path, seed=2)
    pm = peft_adapter(base, str(tmp_path / "adapter"), targets=("c_attn", "c_fc"), seed=3)
    merged = pm.merge_and_unload()
    model = GPT2.from_pretrained(base_dir, lora=str(tmp_path / "adapter"))
    sd = model.state_dict()
    for k, v in merged.state_dict().items():
        if k.startswith("transformer.") and not k.endswith((".attn.bias", ".masked_bias")):
            torch.testing.assert_close(sd[k.removeprefix("transformer.")], v, atol=1e-6, rtol=0, msg=k)


def test_peft_sequence_classification_adapter_makes_a_classifier(tmp_path, one_thread):
    """task_type SEQ_CLS on GPT2ForSequenceClassification built from the base LM: the adapter
    brings its trained score head (modules_to_save); merged, GPT2.from_pretrained(base, lora=…)
    is a classifier with PEFT's logits at the last token."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2ForSequenceClassification

    _, base_dir = hf_base(tmp_path, seed=4)
    clf = GPT2ForSequenceClassification.from_pretrained(base_dir, num_labels=3).eval()
    pm = get_peft_model(clf, LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["c_attn", "c_fc"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name or "score" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    pm.save_pretrained(tmp_path / "adapter")
    x = ids(n=1, T=9)
    with torch.no_grad():
        want = pm.eval()(input_ids=x).logits                      # [1, 3]
    model = GPT2.from_pretrained(base_dir, lora=str(tmp_path / "adapter"))
    assert isinstance(model, GPT2Classifier) and model.config.n_labels == 3
    torch.testing.assert_close(model.pooled(x), want, atol=ATOL, rtol=0)


def test_adapter_errors_name_the_file_and_the_tensor(tmp_path):
    base, base_dir = hf_base(tmp_path, seed=6)
    _, other_dir = hf_base(tmp_path, seed=7, n_embd=48)
    peft_adapter(base, str(tmp_path / "adapter"), targets=("c_attn",))
    with pytest.raises(CheckpointError) as e:                      # an adapter for another base (widths)
        GPT2.from_pretrained(other_dir, lora=str(tmp_path / "adapter"))
    message = str(e.value)
    assert "\n" not in message and "adapter_model.safetensors: tensors base_model.model.transformer.h.0.attn.c_attn." \
                                   "lora_A.weight [4, 32]" in message and "[r, 48]" in message, message
    _, deeper = hf_base(tmp_path, seed=8, n_layer=1)
    with pytest.raises(CheckpointError, match=r"targets block 1, but the base model has 1 blocks"):
        GPT2.from_pretrained(deeper, lora=str(tmp_path / "adapter"))
    base, _ = hf_base(tmp_path, seed=9)
    peft_adapter(base, str(tmp_path / "wte"), targets=("wte", "c_attn"))
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors: tensor base_model\.model\.transformer\.wte"
                                              r"\.lora_embedding_A: unknown target module 'wte'") as e:
        GPT2.from_pretrained(base_dir, lora=str(tmp_path / "wte"))
    assert "\n" not in str(e.value)
    assert main(["convert", base_dir, str(tmp_path / "out"), "--lora", str(tmp_path / "missing")]) == 2


# -------------------------------------------------------------------------- unmerged
def test_unmerged_adapters_equal_peft_and_the_books_and_the_base_is_untouched(tmp_path, one_thread):
    """Adapters applied unmerged (model.add_adapters): with model.adapter(name) the logits are
    PEFT's own model's, and the book's LinearWithLoRA model's, (<= 1e-5); with none (or the
    base) they are the base model's, bitwise."""
    base, base_dir = hf_base(tmp_path, seed=10)
    x = ids()
    with torch.no_grad():
        base_logits = base(input_ids=x).logits
    pm = peft_adapter(base, str(tmp_path / "peft"), seed=11)
    with torch.no_grad():
        want = pm(input_ids=x).logits
    model = GPT2.from_pretrained(base_dir)
    with torch.no_grad():
        plain = model(x).logits
    model.add_adapters({"peft": str(tmp_path / "peft")})
    with torch.no_grad(), model.adapter("peft"):
        torch.testing.assert_close(model(x).logits, want, atol=ATOL, rtol=0)
    with torch.no_grad():
        assert torch.equal(model(x).logits, plain)
        torch.testing.assert_close(plain, base_logits, atol=ATOL, rtol=0)

    torch.manual_seed(12)                                           # the book: the base saved, then LoRA on it
    book = randomize(GPTModel(BOOK_CFG), 12)
    base_path = save_book(book, tmp_path / "base.pth", BOOK_CFG)
    replace_linear_with_lora(book, rank=3, alpha=5)
    randomize(book, 13)
    lora_path = save_book(book, tmp_path / "lora.pth", {**BOOK_CFG, "lora_alpha": 5})
    with torch.no_grad():
        for name, p in book.named_parameters():                    # the base weights as they were saved
            if not name.endswith((".lora.A", ".lora.B")):
                p.copy_(torch.load(base_path, weights_only=True)[name.replace(".linear.", ".")])
        want = book(x)
    model = GPT2.from_pretrained(base_path)
    model.add_adapters({"book": lora_path})
    with torch.no_grad(), model.adapter("book"):
        torch.testing.assert_close(model(x).logits, want, atol=ATOL, rtol=0)


def test_quantized_base_applies_the_adapter_in_float(tmp_path, one_thread):
    """An int8 base with an adapter unmerged: each wrapped layer's output is the quantized
    layer's own plus the adapter's product in float32, scale · (x Aᵀ) Bᵀ."""
    from gpt2mha.inference.lora import LoraLinear
    from gpt2mha.inference.quant.linear import QuantizedLinear

    base, base_dir = hf_base(tmp_path, seed=14)
    peft_adapter(base, str(tmp_path / "a"), seed=15, targets=("c_attn", "c_fc"))
    model = GPT2.from_pretrained(base_dir).quantize("int8", method="rtn")
    model.add_adapters({"a": str(tmp_path / "a")})
    layer = model.h[1].mlp.c_fc
    assert isinstance(layer, LoraLinear) and isinstance(layer.base, QuantizedLinear)
    A_t, B_t, scale = layer.adapters[0]
    h = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), model.adapter("a"):
        got = layer(h)
    with torch.no_grad():
        torch.testing.assert_close(got, layer.base(h) + ((h @ A_t) @ B_t) * scale, atol=1e-6, rtol=0)
        assert torch.equal(layer(h), layer.base(h))                 # no adapter: the quantized layer alone


def adapters_server_setup(tmp_path):
    """A byte-level base and three PEFT adapters on it (different targets and ranks)."""
    from transformers import GPT2LMHeadModel

    _, base_dir = hf_base(tmp_path, seed=20)
    specs = {"a": dict(seed=21), "b": dict(seed=22, targets=("c_attn", "c_proj"), r=2, lora_alpha=4),
             "c": dict(seed=23, targets=("c_fc", "lm_head"), r=8, lora_alpha=8)}
    for name, spec in specs.items():                                # a fresh base for each PEFT model
        peft_adapter(GPT2LMHeadModel.from_pretrained(base_dir).eval(), str(tmp_path / name), **spec)
    return base_dir, {name: str(tmp_path / name) for name in specs}


@pytest.mark.slow
def test_served_adapters_interleaved_equal_each_adapter_alone_bitwise(tmp_path, one_thread):
    """`serve --lora a=… --lora b=… --lora c=…`: four requests (three adapters and the base, by
    `model`) sent together and batched together get the tokens and logprobs each gets alone
    offline (a scheduler of one slot, that adapter only), bitwise; /v1/models lists them."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    import threading

    from gpt2mha.inference.decoders import choose_decoder
    from gpt2mha.inference.params import SamplingParams
    from gpt2mha.io.tokenizer import tokenizer_for
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import serve_in_thread

    base_dir, adapters = adapters_server_setup(tmp_path)
    model = GPT2.from_pretrained(base_dir)
    model.add_adapters(adapters)
    tok = tokenizer_for(model.config)
    names = ["base", "a", "b", "c"]
    prompts = {"base": "To be, or not", "a": "ROMEO: what", "b": "The quick brown", "c": "Once upon a"}

    def alone(name):
        sched = Scheduler(model, tok, max_batch=1, max_queue=0, batch_invariant=True,
                          route=choose_decoder(model, batch_invariant=True))
        seq, = sched.submit([tok.encode(prompts[name])], SamplingParams(max_tokens=12, temperature=0, logprobs=2),
                            lambda *a: None, adapter=None if name == "base" else model.lora_state.index(name))
        sched.run_until_idle()
        return seq.tokens, [lp for lp, _ in seq.logprobs], seq.text

    want = {name: alone(name) for name in names}
    assert len({w[2] for w in want.values()}) == 4                  # each adapter changes the text
    sched = Scheduler(model, tok, max_batch=4, max_queue=4, batch_invariant=True,
                      route=choose_decoder(model, batch_invariant=True))
    got, barrier = {}, threading.Barrier(4)
    with serve_in_thread(sched, "base") as url:
        listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]

        def ask(name):
            barrier.wait(timeout=30)
            got[name] = httpx.post(url + "/v1/completions", json={
                "model": name, "prompt": prompts[name], "max_tokens": 12, "temperature": 0, "logprobs": 2},
                timeout=120).json()
        threads = [threading.Thread(target=ask, args=(n,)) for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=150)
        unknown = httpx.post(url + "/v1/completions", json={"model": "d", "prompt": "x", "max_tokens": 1})
        stats = httpx.get(url + "/health").json()
    assert listed == names
    assert unknown.status_code == 404
    assert stats["decode_steps"] < 4 * 12                            # the four decoded in shared steps
    for name in names:
        choice = got[name]["choices"][0]
        assert got[name]["model"] == name
        assert choice["text"] == want[name][2], name
        assert choice["logprobs"]["token_logprobs"] == want[name][1], name     # bitwise: JSON keeps every digit
