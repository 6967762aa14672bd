"""The models the book and its readers train on top of GPT-2: chapter 6's classifier (the
book's GPTModel with a ``num_classes`` out_head) and transformers' GPT2ForSequenceClassification.

Every checkpoint is built by its own tool on small random weights: the book's GPTModel as the
book writes it (tests/data/book_gpt.py, sharing no code with gpt2mha) and transformers' own
classes. Reference logits come from those models, never from gpt2mha's conversion.
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

from conftest import randomize_norms_and_biases

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
from book_gpt import GPTModel  # noqa: E402

ATOL = 1e-5
#: A tiny model with GPT-2's BPE vocabulary (so texts tokenize as in the book, pad id 50256).
BPE_CFG = {"vocab_size": 50257, "context_length": 32, "emb_dim": 16, "n_heads": 2, "n_layers": 2,
           "drop_rate": 0.0, "qkv_bias": True}
BYTE_CFG = {**BPE_CFG, "vocab_size": 256, "emb_dim": 24, "n_heads": 3, "qkv_bias": False}
TEXTS = ["You are a winner you have been specially selected to receive $1000 cash!",
         "Hey, just wanted to check if we're still on for dinner tonight?", "ok"]


def randomize(model, seed):
    """Nonzero biases, non-unit LayerNorms: every tensor matters to the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.1)
                    + (1.0 if name.endswith("scale") else 0.0))
    return model.eval()


def book_classifier(cfg, num_classes=2, bias=True, seed=0):
    """Chapter 6: the pretrained GPTModel with ``model.out_head = torch.nn.Linear(emb_dim,
    num_classes)`` (gpt_class_finetune.py), weights random."""
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    model.out_head = nn.Linear(in_features=cfg["emb_dim"], out_features=num_classes, bias=bias)
    return randomize(model, seed)


def save_book(model, path, cfg):
    """``torch.save(model.state_dict(), path)`` and the config dict beside it (NAME.json)."""
    torch.save(model.state_dict(), path)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(cfg, f)
    return str(path)


def book_classify_logits(model, text, tokenizer, max_length=None, pad_token_id=50256):
    """Chapter 6's ``classify_review``, returning the logits instead of the argmax (the book's
    code; ``max_length=None`` reads the text unpadded)."""
    model.eval()
    input_ids = tokenizer.encode(text)
    supported_context_length = model.pos_emb.weight.shape[0]
    if max_length is not None:
        input_ids = input_ids[:min(max_length, supported_context_length)]
        input_ids += [pad_token_id] * (max_length - len(input_ids))
    input_tensor = torch.tensor(input_ids).unsqueeze(0)
    with torch.no_grad():
        return model(input_tensor)[:, -1, :][0]


@pytest.fixture(scope="module")
def bpe():
    from gpt2mha.io.tokenizer import get_tokenizer
    return get_tokenizer("gpt2")


# ---------------------------------------------------------------------- chapter 6
def test_book_chapter6_classifier_loads_and_classifies_as_the_book(tmp_path, bpe, one_thread):
    """The issue's reader: GPTModel with a 2-class out_head, torch.save(state_dict), config beside
    it; GPT2.from_pretrained returns a classifier whose logits are the book's model's at the last
    token, unpadded and with the book's padding to max_length."""
    book = book_classifier(BPE_CFG)
    path = save_book(book, tmp_path / "clf.pth", {**BPE_CFG, "labels": ["not spam", "spam"]})
    model = GPT2.from_pretrained(path)
    assert isinstance(model, GPT2Classifier)
    assert (model.config.n_labels, model.config.head_bias, model.config.pad_token_id) == (2, True, 50256)
    out = model.classify(TEXTS)
    want = torch.stack([book_classify_logits(book, t, bpe) for t in TEXTS])
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.probs, want.softmax(-1), atol=ATOL, rtol=0)
    assert out.labels == [["not spam", "spam"][i] for i in want.argmax(-1).tolist()]
    assert out.n_tokens == [len(bpe.encode(t)) for t in TEXTS]
    padded = model.classify(TEXTS, max_length=20)                # classify_review(max_length=20): pads, or cuts
    want = torch.stack([book_classify_logits(book, t, bpe, max_length=20) for t in TEXTS])
    torch.testing.assert_close(padded.logits, want, atol=ATOL, rtol=0)
    assert not torch.allclose(padded.logits[2], out.logits[2], atol=1e-3)   # reading a pad token differs


def test_book_classifier_max_length_from_its_config_and_no_bias(tmp_path, bpe, one_thread):
    book = book_classifier(BPE_CFG, num_classes=3, bias=False, seed=1)
    path = save_book(book, tmp_path / "clf3.pth", {**BPE_CFG, "max_length": 12,
                                                    "id2label": {"0": "a", "1": "b", "2": "c"}})
    model = GPT2Classifier.from_pretrained(path)
    assert (model.config.n_labels, model.config.head_bias, model.config.max_length) == (3, False, 12)
    out = model.classify(TEXTS)
    want = torch.stack([book_classify_logits(book, t, bpe, max_length=12) for t in TEXTS])
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
    assert set(out.labels) <= {"a", "b", "c"}
    assert out.n_tokens == [min(12, len(bpe.encode(t))) for t in TEXTS]


def test_book_classifier_round_trips_through_the_book_format(tmp_path, one_thread):
    """convert --to book writes out_head [C, emb_dim] + bias and the labels; the book's GPTModel
    with chapter 6's head loads it strictly, every tensor bitwise."""
    book = book_classifier(BYTE_CFG, num_classes=2, seed=2)
    path = save_book(book, tmp_path / "clf.pth", {**BYTE_CFG, "labels": ["ham", "spam"]})
    back = str(tmp_path / "back" / "clf.pth")
    assert main(["convert", path, back, "--to", "book"]) == 0
    with open(tmp_path / "back" / "clf.json") as f:
        assert json.load(f)["labels"] == ["ham", "spam"]
    sd = torch.load(back, weights_only=True)
    fresh = GPTModel(BYTE_CFG)
    fresh.out_head = nn.Linear(BYTE_CFG["emb_dim"], 2)
    fresh.load_state_dict(sd, strict=True)
    for k, v in book.state_dict().items():
        assert torch.equal(sd[k], v), k


def test_bad_classifier_heads_are_one_line_errors_naming_file_and_tensor(tmp_path):
    book = book_classifier(BYTE_CFG, seed=3)
    sd = book.state_dict()
    path = str(tmp_path / "bad.pth")
    cases = [({"out_head.weight": torch.zeros(2, 23)}, {},
              r"bad\.pth: out_head\.weight has shape \[2, 23\]; the head reads emb_dim=24 features"),
             ({"out_head.bias": torch.zeros(3)}, {},
              r"bad\.pth: out_head\.bias has shape \[3\] but out_head\.weight \[2, 24\] has 2 rows"),
             ({}, {"labels": ["a", "b", "c"]}, r"bad\.pth: labels=\['a', 'b', 'c'\] but out_head\.weight \[2, 24\] "
                                               r"has 2 rows")]
    for tensors, extra, message in cases:
        save_book(nn.Module(), path, {**BYTE_CFG, **extra})       # the config
        torch.save({**sd, **tensors}, path)
        with pytest.raises(CheckpointError, match=message) as e:
            GPT2.from_pretrained(path)
        assert "\n" not in str(e.value)


def test_classifier_class_refuses_a_language_model(tmp_path):
    lm = randomize(GPTModel(BYTE_CFG), 0)
    path = save_book(lm, tmp_path / "lm.pth", BYTE_CFG)
    assert type(GPT2.from_pretrained(path)) is GPT2
    with pytest.raises(CheckpointError, match=r"lm\.pth: a language model .*not a classifier"):
        GPT2Classifier.from_pretrained(path)


# ------------------------------------------------------------ transformers' classifier
def hf_classifier(num_labels=3, pad_token_id=0, seed=0, **cfg):
    """transformers' GPT2ForSequenceClassification with random weights (eval mode)."""
    from transformers import GPT2Config as HFConfig, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = HFConfig(**{**dict(vocab_size=256, n_positions=128, n_embd=32, n_head=4, n_layer=2, num_labels=num_labels,
                                pad_token_id=pad_token_id, bos_token_id=None, eos_token_id=None), **cfg})
    return randomize_norms_and_biases(GPT2ForSequenceClassification(config).eval(), **{"score.weight": 0.5})


def hf_batch(texts, pad_token_id):
    """Byte ids of each text, right-padded with ``pad_token_id`` (as a tokenizer with
    ``padding_side="right"`` gives them to GPT2ForSequenceClassification)."""
    ids = [list(t.encode()) for t in texts]
    T = max(map(len, ids))
    return torch.tensor([r + [pad_token_id] * (T - len(r)) for r in ids])


def test_hf_sequence_classification_loads_with_transformers_logits(tmp_path, one_thread):
    """GPT2ForSequenceClassification.save_pretrained → GPT2.from_pretrained: a classifier with
    id2label and pad_token_id; classify() equals transformers' pooled logits on a right-padded
    batch (the last non-pad token), and saving it back gives transformers the same logits."""
    from transformers import GPT2ForSequenceClassification

    hf = hf_classifier(pad_token_id=0)
    hf.config.id2label = {0: "neg", 1: "neutral", 2: "pos"}
    hf.config.label2id = {v: k for k, v in hf.config.id2label.items()}
    hf.save_pretrained(tmp_path / "hf")
    model = GPT2.from_pretrained(str(tmp_path / "hf"))
    assert isinstance(model, GPT2Classifier)
    c = model.config
    assert (c.n_labels, c.head_bias, c.pad_token_id, c.pooling, c.label_names) == (
        3, False, 0, "last_non_pad", ("neg", "neutral", "pos"))
    with torch.no_grad():
        want = hf(hf_batch(TEXTS, 0)).logits                     # [3, 3]
    out = model.classify(TEXTS, batch_size=2)
    torch.testing.assert_close(out.logits, want, atol=ATOL, rtol=0)
    assert out.labels == [c.label_names[i] for i in want.argmax(-1).tolist()]
    model.save_pretrained(str(tmp_path / "ours"))
    back = GPT2ForSequenceClassification.from_pretrained(str(tmp_path / "ours")).eval()
    assert back.config.id2label == {0: "neg", 1: "neutral", 2: "pos"} and back.config.pad_token_id == 0
    with torch.no_grad():
        torch.testing.assert_close(back(hf_batch(TEXTS, 0)).logits, want, atol=ATOL, rtol=0)


def test_hf_classifier_pooling_follows_transformers_on_pad_ids_inside_a_text(tmp_path, one_thread):
    """transformers reads the last token that is not pad_token_id, whatever the attention mask:
    a text whose own last ids are the pad id is read before them, as transformers does."""
    hf = hf_classifier(pad_token_id=ord("!"), seed=1)
    hf.save_pretrained(tmp_path / "hf")
    model = GPT2.from_pretrained(str(tmp_path / "hf"))
    texts = ["wow!!", "hello there"]
    with torch.no_grad():
        want = hf(hf_batch(texts, ord("!"))).logits
    torch.testing.assert_close(model.classify(texts).logits, want, atol=ATOL, rtol=0)


def test_biased_head_is_refused_by_the_hf_format(tmp_path):
    book = book_classifier(BYTE_CFG, seed=4)
    path = save_book(book, tmp_path / "clf.pth", BYTE_CFG)
    assert main(["convert", path, str(tmp_path / "hf")]) == 2


# ------------------------------------------------------------------------------ CLI
def test_classify_command_prints_labels_and_json(tmp_path, capsys, one_thread):
    book = book_classifier(BYTE_CFG, seed=5)
    path = save_book(book, tmp_path / "clf.pth", BYTE_CFG)
    (tmp_path / "texts.txt").write_text("first text\n\nsecond one\n")
    model = GPT2.from_pretrained(path)
    want = model.classify(["a b", "first text", "second one"], labels=["ham", "spam"])
    capsys.readouterr()
    assert main(["classify", "a b", "--model", path, "--file", str(tmp_path / "texts.txt"), "--labels", "ham,spam",
                 "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in rows] == ["a b", "first text", "second one"]
    assert [r["label"] for r in rows] == want.labels
    torch.testing.assert_close(torch.tensor([r["probs"] for r in rows]), want.probs, atol=1e-6, rtol=0)
    assert main(["classify", "a b", "--model", path]) == 0
    label, prob, text = capsys.readouterr().out.rstrip("\n").split("\t")
    assert (label, text) == (f"LABEL_{int(want.probs[0].argmax())}", "a b")
    assert float(prob) == pytest.approx(float(want.probs[0].max()), abs=1e-4)


def test_classify_command_errors(tmp_path, capsys):
    lm = randomize(GPTModel(BYTE_CFG), 0)
    path = save_book(lm, tmp_path / "lm.pth", BYTE_CFG)
    assert main(["classify", "x", "--model", path]) == 2
    assert "a language model" in capsys.readouterr().err
    assert main(["classify", "x"]) == 2
    assert "classify needs --model" in capsys.readouterr().err
    clf = save_book(book_classifier(BYTE_CFG), tmp_path / "clf.pth", BYTE_CFG)
    assert main(["classify", "x", "--model", clf, "--labels", "a,b,c"]) == 2
    assert "labels=['a', 'b', 'c']: this classifier has 2 outputs" in capsys.readouterr().err


# ------------------------------------------------------------------ chapter 7: alpaca
def format_input(entry):
    """Chapter 7's prompt (the book's code, verbatim)."""
    instruction_text = (
        f"Below is an instruction that describes a task. "
        f"Write a response that appropriately completes the request."
        f"\n\n### Instruction:\n{entry['instruction']}"
    )

    input_text = f"\n\n### Input:\n{entry['input']}" if entry["input"] else ""

    return instruction_text + input_text


ENTRIES = [{"instruction": "Identify the correct spelling of the following word.", "input": "Ocassion",
            "output": "The correct spelling is 'Occasion.'"},
           {"instruction": "What is an antonym of 'complicated'?", "input": "",
            "output": "An antonym of 'complicated' is 'simple'."}]


def alpaca_messages(entry, reply=False):
    user = {"role": "user", "content": entry["instruction"], "input": entry["input"]}
    return [user, {"role": "assistant", "content": entry["output"]}] if reply else [user]


def test_alpaca_template_renders_the_books_format_input(tmp_path):
    """The built-in alpaca template: a user message (instruction, input) is format_input(entry);
    with the assistant's reply it is the book's training text (format_input + "\\n\\n### Response:\\n"
    + output); the generation prompt adds the response header; transformers renders the same."""
    from gpt2mha.serving.chat import ChatTemplate, load_chat_template, special_tokens

    template = ChatTemplate(load_chat_template("alpaca"), special_tokens("gpt2", 1024))
    for entry in ENTRIES:
        response_text = f"\n\n### Response:\n{entry['output']}"       # the book's InstructionDataset
        assert template.render(alpaca_messages(entry), add_generation_prompt=False) == format_input(entry)
        assert template.render(alpaca_messages(entry)) == format_input(entry) + "\n\n### Response:\n"
        assert template.render(alpaca_messages(entry, True), add_generation_prompt=False) == (
            format_input(entry) + response_text)
    system = [{"role": "system", "content": "Answer briefly."}, *alpaca_messages(ENTRIES[1])]
    assert template.render(system) == format_input(ENTRIES[1]).replace(
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
        "Answer briefly.") + "\n\n### Response:\n"
    with pytest.raises(Exception, match="alpaca template takes a first system message.*got role tool"):
        template.render([{"role": "tool", "content": "x"}])
    transformers = pytest.importorskip("transformers")
    from gpt2mha.io.tokenizer import hf_tokenizer_files

    for file, data in hf_tokenizer_files("bytes", 256).items():
        (tmp_path / file).write_bytes(data)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for entry in ENTRIES:
        assert hf.apply_chat_template(alpaca_messages(entry), chat_template=load_chat_template("alpaca"),
                                      add_generation_prompt=True, tokenize=False) == template.render(
            alpaca_messages(entry))


def book_generate(model, idx, max_new_tokens, context_size, temperature=0.0, top_k=None, eos_id=None):
    """Chapter 5's ``generate`` (greedy branch and eos stop, the book's code)."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -context_size:]
        with torch.no_grad():
            logits = model(idx_cond)
        logits = logits[:, -1, :]
        idx_next = torch.argmax(logits, dim=-1, keepdim=True)
        if idx_next == eos_id:
            break
        idx = torch.cat((idx, idx_next), dim=1)
    return idx


def test_served_alpaca_chat_answers_as_the_books_generate(tmp_path, bpe, one_thread):
    """`gpt2mha serve --model instruct.pth --chat-template alpaca`: a chat client's message
    (instruction + input) gets the reply the book's generate continues format_input(entry) +
    "\\n\\n### Response:\\n" with (greedy, eos 50256), on the book's GPTModel itself."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from conftest import greedy_margin
    from gpt2mha.serving.chat import load_chat_template
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import serve_in_thread

    cfg = {**BPE_CFG, "context_length": 96}
    torch.manual_seed(7)
    book = randomize(GPTModel(cfg), 7)
    with torch.no_grad():
        book.out_head.weight.mul_(20)                            # clear greedy choices
    path = save_book(book, tmp_path / "instruct.pth", cfg)
    entry = ENTRIES[0]
    prompt = bpe.encode(format_input(entry) + "\n\n### Response:\n")
    want = book_generate(book, torch.tensor([prompt]), 8, cfg["context_length"], eos_id=50256)[0, len(prompt):]
    model = GPT2.from_pretrained(path)
    assert greedy_margin(model, prompt + want.tolist(), len(prompt)) > 1e-3
    with serve_in_thread(Scheduler(model, bpe, max_batch=2, max_queue=4), "instruct",
                         chat_template=load_chat_template("alpaca")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="instruct", messages=alpaca_messages(entry), max_tokens=8,
                                               temperature=0)
    assert reply.choices[0].message.content == bpe.decode(want.tolist())
    assert reply.usage.prompt_tokens == len(prompt)


# ----------------------------------------------------------------------- /v1/classify
def test_v1_classify_equals_offline_classify(tmp_path, bpe, one_thread):
    """A served chapter-6 classifier: /v1/classify (vLLM's request and response shapes) gives
    the probabilities of model.classify on the same inputs, bitwise; token-id inputs and
    truncate_prompt_tokens as vLLM takes them; the generation routes answer 400."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import serve_in_thread

    book = book_classifier(BPE_CFG, seed=6)
    path = save_book(book, tmp_path / "clf.pth", {**BPE_CFG, "labels": ["ham", "spam"]})
    model = GPT2.from_pretrained(path)
    offline = model.classify(TEXTS)
    ids = bpe.encode(TEXTS[0])
    with serve_in_thread(Scheduler(model, bpe, max_batch=2, max_queue=4), "clf", classifier=model) as url:
        r = httpx.post(url + "/v1/classify", json={"model": "clf", "input": TEXTS}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        one = httpx.post(url + "/classify", json={"input": ids, "truncate_prompt_tokens": 5}, timeout=60).json()
        raw = httpx.post(url + "/v1/classify", json={"input": TEXTS[1], "use_activation": False}, timeout=60).json()
        errors = [httpx.post(url + "/v1/classify", json=b, timeout=60) for b in
                  ({"input": []}, {"input": "x" * 400}, {"model": "other", "input": "x"}, {"input": 3},
                   {"input": "x", "temperature": 1})]
        completion = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert body["object"] == "list" and body["model"] == "clf" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["probs"] for d in body["data"]] == offline.probs.tolist()          # bitwise (JSON keeps every digit)
    assert [d["label"] for d in body["data"]] == offline.labels
    assert all(d["num_classes"] == 2 for d in body["data"])
    assert body["usage"] == {"prompt_tokens": sum(offline.n_tokens), "total_tokens": sum(offline.n_tokens),
                             "completion_tokens": 0, "prompt_tokens_details": None}
    assert one["data"][0]["probs"] == model.classify([ids[-5:]]).probs[0].tolist()
    assert raw["data"][0]["probs"] == model.classify([TEXTS[1]]).logits[0].tolist()
    assert [e.status_code for e in errors] == [400, 400, 404, 400, 400]
    assert [e.json()["error"]["param"] for e in errors] == ["input", "input", "model", "input", "temperature"]
    assert "more than the model's context" in errors[1].json()["error"]["message"]
    assert completion.status_code == 400 and completion.json()["error"]["code"] == "model_not_generative"
    assert "/v1/classify" in completion.json()["error"]["message"]


# ------------------------------------------------------------- the checker and explainer
def test_check_model_takes_the_books_classifier_and_lora_and_hf_classifiers(tmp_path, capsys, one_thread):
    """gpt2mha check-model: a chapter-6 classifier against the book's GPTModel with chapter 6's
    head (gpt2mha's, and the learner's class), an appendix-E LoRA model against the book's
    LinearWithLoRA model (gpt2mha explains it as its merged weights), a GPT2ForSequenceClassification
    against the NumPy reference with the score head; every stage matches."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data"))
    from book_lora import replace_linear_with_lora

    book_gpt = os.path.join(os.path.dirname(__file__), "data", "book_gpt.py")
    clf = save_book(book_classifier(BYTE_CFG, seed=8), tmp_path / "clf.pth", BYTE_CFG)
    lora = book_classifier(BYTE_CFG, seed=9)
    replace_linear_with_lora(lora, rank=3, alpha=6)
    randomize(lora, 10)
    lora = save_book(lora, tmp_path / "lora.pth", {**BYTE_CFG, "lora_alpha": 6})
    hf = hf_classifier(pad_token_id=0, seed=11)
    hf.save_pretrained(tmp_path / "hf")
    for argv in ([clf], [clf, "--class", book_gpt + ":GPTModel"], [lora], [str(tmp_path / "hf")]):
        capsys.readouterr()
        code = main(["check-model", *argv, "--json"])
        report = json.loads(capsys.readouterr().out)
        assert code == 0, (argv, report)
        logits = next(s for s in report["stages"] if s["name"] == "logits")
        assert logits["shape"][-1] == (3 if "hf" in argv[0] else 2) and logits["ok"], (argv, logits)


def test_explainer_shows_a_classifiers_head_and_a_lora_model_merged(tmp_path, one_thread):
    """The explainer's last view of a classifier lists its labels by probability (and it draws no
    next token); a model with adapters unmerged is explained as its merged weights."""
    from gpt2mha.learn.explain.session import ModelEntry, Sequence

    path = save_book(book_classifier(BYTE_CFG, seed=12), tmp_path / "clf.pth", {**BYTE_CFG, "labels": ["ham", "spam"]})
    model = GPT2.from_pretrained(path)
    seq = Sequence(ModelEntry(model, "clf"), list(b"win a prize"))
    pipeline = seq.unit("pipeline")
    want = model.classify(["win a prize"]).probs[0]
    assert pipeline["classifier"] == ["ham", "spam"]
    assert {t["label"]: t["p"] for t in pipeline["next"]} == pytest.approx(dict(zip(["ham", "spam"], want.tolist())),
                                                                          abs=1e-6)
    for refused in (lambda: seq.step(1.0, 0, 1.0), lambda: seq.unit("lens")):
        with pytest.raises(ValueError, match="this model is a classifier"):
            refused()

    pytest.importorskip("peft")
    from test_lora import hf_base, peft_adapter
    from gpt2mha.inference.lora import LoraLinear

    base, base_dir = hf_base(tmp_path, seed=13)
    peft_adapter(base, str(tmp_path / "a"), seed=14)
    lm = GPT2.from_pretrained(base_dir)
    lm.add_adapters({"a": str(tmp_path / "a")})
    x = torch.tensor([list(b"hello")])
    with torch.no_grad(), lm.adapter("a"):
        want = lm(x).logits
        entry = ModelEntry(lm, "lora")
    assert not any(isinstance(m, LoraLinear) for m in entry.model.modules())
    with torch.no_grad():
        torch.testing.assert_close(entry.model(x).logits, want, atol=ATOL, rtol=0)
