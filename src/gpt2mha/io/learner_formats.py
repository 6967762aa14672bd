"""The checkpoints learners make: the book's ``GPTModel`` and nanoGPT's ``ckpt.pt``, read and written.

* ``book``: the state dict of ``GPTModel`` from "Build a Large Language Model (From Scratch)",
  ch. 4/5 (``tok_emb``, ``pos_emb``, ``trf_blocks.{i}.att.W_query|W_key|W_value|out_proj``,
  ``norm1|norm2.scale|shift``, ``ff.layers.0|2``, ``final_norm``, ``out_head``; nn.Linear
  ``[out, in]``), a plain ``.pth`` or ch. 5's ``{"model_state_dict": …}``, with the book's
  config dict (``vocab_size, context_length, emb_dim, n_heads, n_layers, drop_rate, qkv_bias``)
  given, stored in the file, or in ``<name>.json`` beside it.
* ``nanogpt``: nanoGPT's ``ckpt.pt`` (``model_args`` + ``model``: ``transformer.…`` keys in
  nn.Linear layout, ``_orig_mod.`` prefixes from ``torch.compile``, biases absent with
  ``bias=False``, ``lm_head`` tied to ``wte``).

Every mapping is an exact copy or transpose (no arithmetic), so a round trip is bitwise.
"""

from __future__ import annotations

import json
import os

import torch

from ..core.classifier import ClassifierConfig
from ..core.model import GPT2, GPT2Config
from .files import read_torch_file
from .layouts import book_config_path, book_state_dict_of, check_tensors, conv1d_to_linear_state_dict, is_book_lora
from .layouts import linear_to_conv1d_state_dict, strip_wrapper_prefixes, tensor_shapes, tie_head
from .lora import merge_state_dict, split_book_lora
from .registry import CheckpointFormat, Source, register_format
from .state_dicts import Checkpoint, CheckpointError, detached_state_dict


BOOK_CONFIG_KEYS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "qkv_bias")
#: Keys of a chapter-6 classifier's settings that may sit in the config dict beside the book's:
#: ``labels`` (a list of names) or ``id2label`` (``{"0": name, …}``, transformers' spelling),
#: ``pad_token_id`` (default 50256, the book's, for a GPT-2 vocabulary) and ``max_length``
#: (the book pads every text to the training set's length: ``classify_review(...,
#: max_length=train_dataset.max_length)``).
BOOK_CLASSIFIER_KEYS = ("labels", "id2label", "pad_token_id", "max_length")
#: The key of appendix E's LoRA scale in the config dict: ``replace_linear_with_lora(model,
#: rank, alpha)`` keeps ``alpha`` as a plain attribute, so it is in no tensor.
BOOK_LORA_KEYS = ("lora_alpha",)
#: The book's pad id (chapter 6's ``SpamDataset(..., pad_token_id=50256)``).
BOOK_PAD_TOKEN_ID = 50256



def book_config(sd: dict[str, torch.Tensor], cfg: dict | None, source: str) -> dict:
    """The book's config dict for a GPTModel state dict: sizes read off the tensors, checked
    against ``cfg`` where it gives them; ``n_heads`` must come from ``cfg`` (no shape holds it).

    Raises:
        CheckpointError: no ``n_heads``, an unknown key, or a value contradicting the tensors.
    """
    cfg = dict(cfg or {})
    unknown = sorted(set(cfg) - set(BOOK_CONFIG_KEYS) - set(BOOK_CLASSIFIER_KEYS) - set(BOOK_LORA_KEYS))
    if unknown:
        raise CheckpointError(f"{source}: unknown book config keys {unknown}; expected {list(BOOK_CONFIG_KEYS)} "
                              f"(and for a classifier {list(BOOK_CLASSIFIER_KEYS)})")
    for k in ("tok_emb.weight", "pos_emb.weight"):
        if k not in sd or sd[k].dim() != 2:
            raise CheckpointError(f"{source}: no 2-D {k}; not the book's GPTModel state dict")
    n_layers = len({k.split(".")[1] for k in sd if k.startswith("trf_blocks.")})
    found = {"vocab_size": sd["tok_emb.weight"].shape[0], "context_length": sd["pos_emb.weight"].shape[0],
             "emb_dim": sd["tok_emb.weight"].shape[1], "n_layers": n_layers,
             "qkv_bias": "trf_blocks.0.att.W_query.bias" in sd}
    for k, v in found.items():
        if k in cfg and cfg[k] != v:
            raise CheckpointError(f"{source}: config {k}={cfg[k]!r} but the tensors say {v!r}")
    if "n_heads" not in cfg:
        raise CheckpointError(f"{source}: the book's config needs n_heads (no tensor shape holds it): pass it "
                              f"(CLI: --book-config '{{\"n_heads\": 12}}' or a JSON file), or put the config dict "
                              f"in {os.path.splitext(source)[0]}.json")
    return {**found, "drop_rate": 0.0, **cfg}


def book_to_gpt2(sd: dict[str, torch.Tensor], cfg: dict | None = None,
                 source: str = "book state dict") -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """The book's GPTModel state dict (nn.Linear ``[out, in]``) → (gpt2mha state dict, config).

    Per block i (C = emb_dim): ``c_attn.weight [C, 3C] = cat(W_query, W_key, W_value).T``,
    ``c_attn.bias`` their biases (zeros for ``qkv_bias=False``), ``c_proj = out_proj.T``,
    ``ln_1/ln_2 = norm1/norm2 (scale → weight, shift → bias)``, ``mlp.c_fc = ff.layers.0.T``,
    ``mlp.c_proj = ff.layers.2.T``; ``wte = tok_emb``, ``wpe = pos_emb``, ``ln_f =
    final_norm``, ``lm_head = out_head`` (tied when equal to tok_emb). ``drop_rate`` becomes all
    three dropouts. The ``att.mask`` buffers are ignored (GPT-2's mask is built, not stored).

    Raises:
        CheckpointError: see :func:`book_config`; any missing, unexpected or mis-shaped tensor.
    """
    cfg = book_config(sd, cfg, source)
    C, V, T, L = cfg["emb_dim"], cfg["vocab_size"], cfg["context_length"], cfg["n_layers"]
    head = book_head(sd, cfg, source)
    norms = lambda p: {p + ".scale": (C,), p + ".shift": (C,)}  # noqa: E731
    expected = {"tok_emb.weight": (V, C), "pos_emb.weight": (T, C), **norms("final_norm"),
                "out_head.weight": (V if head is None else head["n_labels"], C)}
    if head is not None and head["head_bias"]:
        expected["out_head.bias"] = (head["n_labels"],)
    optional = {}
    for i in range(L):
        b = f"trf_blocks.{i}."
        for w in ("W_query", "W_key", "W_value"):
            expected[b + f"att.{w}.weight"] = (C, C)
            if cfg["qkv_bias"]:
                expected[b + f"att.{w}.bias"] = (C,)
        expected.update({b + "att.out_proj.weight": (C, C), b + "att.out_proj.bias": (C,),
                         b + "ff.layers.0.weight": (4 * C, C), b + "ff.layers.0.bias": (4 * C,),
                         b + "ff.layers.2.weight": (C, 4 * C), b + "ff.layers.2.bias": (C,),
                         **norms(b + "norm1"), **norms(b + "norm2")})
        optional[b + "att.mask"] = (T, T)
    check_tensors(tensor_shapes(sd), expected, source, optional)
    try:
        config = (GPT2Config if head is None else ClassifierConfig)(
            n_vocab=V, n_ctx=T, n_embd=C, n_head=cfg["n_heads"], n_layer=L, embd_pdrop=cfg["drop_rate"],
            attn_pdrop=cfg["drop_rate"], resid_pdrop=cfg["drop_rate"], tokenizer="gpt2" if V >= 50257 else "bytes",
            **(head or {}))
    except ValueError as e:
        raise CheckpointError(f"{source}: book config: {e}") from None
    out = {"wte.weight": sd["tok_emb.weight"], "wpe.weight": sd["pos_emb.weight"],
           "ln_f.weight": sd["final_norm.scale"], "ln_f.bias": sd["final_norm.shift"],
           "lm_head.weight": sd["out_head.weight"]}
    if head is not None and head["head_bias"]:
        out["lm_head.bias"] = sd["out_head.bias"]
    for i in range(L):
        b, h = f"trf_blocks.{i}.", f"h.{i}."
        qkv = [b + f"att.{w}" for w in ("W_query", "W_key", "W_value")]
        out[h + "attn.c_attn.weight"] = torch.cat([sd[k + ".weight"] for k in qkv], 0).t().contiguous()  # [C, 3C]
        out[h + "attn.c_attn.bias"] = (torch.cat([sd[k + ".bias"] for k in qkv]) if cfg["qkv_bias"]
                                       else torch.zeros(3 * C, dtype=sd[qkv[0] + ".weight"].dtype))
        out[h + "attn.c_proj.weight"] = sd[b + "att.out_proj.weight"].t().contiguous()
        out[h + "attn.c_proj.bias"] = sd[b + "att.out_proj.bias"]
        for ln, norm in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[h + ln + ".weight"], out[h + ln + ".bias"] = sd[b + norm + ".scale"], sd[b + norm + ".shift"]
        for mine, theirs in (("mlp.c_fc", "ff.layers.0"), ("mlp.c_proj", "ff.layers.2")):
            out[h + mine + ".weight"] = sd[b + theirs + ".weight"].t().contiguous()
            out[h + mine + ".bias"] = sd[b + theirs + ".bias"]
    return (out, config) if head is not None else tie_head(out, config)


def book_head(sd: dict[str, torch.Tensor], cfg: dict, source: str) -> dict | None:
    """What the book's ``out_head`` is: None for chapter 5's language model (``[vocab_size,
    emb_dim]``, no bias), else chapter 6's classifier head (``model.out_head =
    torch.nn.Linear(emb_dim, num_classes)``: another row count, or a bias) as
    :class:`~gpt2mha.core.classifier.ClassifierConfig`'s fields: ``n_labels``, ``head_bias``,
    ``labels`` (from ``cfg``'s ``labels`` or ``id2label``), ``pad_token_id`` (default 50256 for
    a GPT-2 vocabulary, the book's), ``max_length``, ``pooling="last"`` (the book reads
    ``logits[:, -1, :]``).

    Raises:
        CheckpointError: one line naming the file and the tensor: ``out_head.weight`` not 2-D
            or not reading ``emb_dim`` features, an ``out_head.bias`` that is not one value per
            row, or labels of another count than the rows.
    """
    w, b = sd.get("out_head.weight"), sd.get("out_head.bias")
    C, V = cfg["emb_dim"], cfg["vocab_size"]
    if not isinstance(w, torch.Tensor):
        return None                                              # reported as missing by check_tensors
    if w.dim() != 2 or w.shape[1] != C:
        raise CheckpointError(f"{source}: out_head.weight has shape {list(w.shape)}; the head reads emb_dim={C} "
                              f"features: expected [vocab_size={V}, {C}] (a language model) or [n_labels, {C}] "
                              f"(a classifier)")
    if isinstance(b, torch.Tensor) and tuple(b.shape) != (w.shape[0],):
        raise CheckpointError(f"{source}: out_head.bias has shape {list(b.shape)} but out_head.weight "
                              f"{list(w.shape)} has {w.shape[0]} rows: expected [{w.shape[0]}]")
    if w.shape[0] == V and b is None:
        return None
    n = w.shape[0]
    labels = cfg.get("labels")
    if labels is None and isinstance(cfg.get("id2label"), dict):
        labels = id2label_names(cfg["id2label"], n, source)
    if labels is not None and (not isinstance(labels, (list, tuple)) or len(labels) != n):
        raise CheckpointError(f"{source}: labels={labels!r} but out_head.weight {list(w.shape)} has {n} rows: expected "
                              f"{n} names, one per row")
    pad = cfg.get("pad_token_id", BOOK_PAD_TOKEN_ID if V > BOOK_PAD_TOKEN_ID else None)
    return {"n_labels": n, "head_bias": b is not None, "labels": None if labels is None else tuple(labels),
            "pad_token_id": pad, "pooling": "last", "max_length": cfg.get("max_length")}


def id2label_names(id2label: dict, n: int, source: str) -> list[str]:
    """transformers' ``id2label`` (``{"0": name, …}``, keys as strings or ints) → the ``n`` names
    in id order.

    Raises:
        CheckpointError: keys other than ``0 … n-1``.
    """
    try:
        names = {int(k): v for k, v in id2label.items()}
    except (TypeError, ValueError):
        names = {}
    if sorted(names) != list(range(n)):
        raise CheckpointError(f"{source}: id2label={id2label!r}: expected the ids 0 … {n - 1}, one per output of the "
                              f"head")
    return [names[i] for i in range(n)]


def gpt2_to_book(model: GPT2) -> tuple[dict[str, torch.Tensor], dict]:
    """:class:`GPT2` → (the book's GPTModel state dict, its config dict); inverse of :func:`book_to_gpt2`.

    ``qkv_bias`` is True iff some ``c_attn.bias`` entry is nonzero; the ``att.mask`` buffers
    (``triu(ones(T, T), 1)``, which GPTModel's ``load_state_dict`` expects) are written;
    ``out_head`` is the head weight (wte when tied).

    Raises:
        ValueError: the dropouts differ (the book has one ``drop_rate``).
    """
    c = model.config
    if not c.embd_pdrop == c.attn_pdrop == c.resid_pdrop:
        raise ValueError(f"the book's GPTModel has one drop_rate; this model has embd_pdrop={c.embd_pdrop}, "
                         f"attn_pdrop={c.attn_pdrop}, resid_pdrop={c.resid_pdrop}")
    sd, C = detached_state_dict(model.state_dict()), c.n_embd
    qkv_bias = any(bool(sd[f"h.{i}.attn.c_attn.bias"].ne(0).any()) for i in range(c.n_layer))
    cfg = {"vocab_size": c.n_vocab, "context_length": c.n_ctx, "emb_dim": C, "n_heads": c.n_head,
           "n_layers": c.n_layer, "drop_rate": c.resid_pdrop, "qkv_bias": qkv_bias}
    out = {"tok_emb.weight": sd["wte.weight"], "pos_emb.weight": sd["wpe.weight"]}
    mask = torch.triu(torch.ones(c.n_ctx, c.n_ctx), diagonal=1)
    for i in range(c.n_layer):
        b, h = f"trf_blocks.{i}.", f"h.{i}."
        w, bias = sd[h + "attn.c_attn.weight"].t(), sd[h + "attn.c_attn.bias"]      # [3C, C], [3C]
        for j, name in enumerate(("W_query", "W_key", "W_value")):
            out[b + f"att.{name}.weight"] = w[j * C:(j + 1) * C].contiguous()
            if qkv_bias:
                out[b + f"att.{name}.bias"] = bias[j * C:(j + 1) * C].clone()
        out[b + "att.out_proj.weight"] = sd[h + "attn.c_proj.weight"].t().contiguous()
        out[b + "att.out_proj.bias"] = sd[h + "attn.c_proj.bias"]
        out[b + "att.mask"] = mask
        out[b + "ff.layers.0.weight"] = sd[h + "mlp.c_fc.weight"].t().contiguous()
        out[b + "ff.layers.0.bias"] = sd[h + "mlp.c_fc.bias"]
        out[b + "ff.layers.2.weight"] = sd[h + "mlp.c_proj.weight"].t().contiguous()
        out[b + "ff.layers.2.bias"] = sd[h + "mlp.c_proj.bias"]
        for ln, norm in (("ln_1", "norm1"), ("ln_2", "norm2")):
            out[b + norm + ".scale"], out[b + norm + ".shift"] = sd[h + ln + ".weight"], sd[h + ln + ".bias"]
    out["final_norm.scale"], out["final_norm.shift"] = sd["ln_f.weight"], sd["ln_f.bias"]
    out["out_head.weight"] = model.output_weight().detach()
    if isinstance(c, ClassifierConfig):                          # chapter 6's head and its settings
        if c.head_bias:
            out["out_head.bias"] = sd["lm_head.bias"]
        cfg.update({k: v for k, v in (("labels", c.labels and list(c.labels)), ("pad_token_id", c.pad_token_id),
                                      ("max_length", c.max_length)) if v is not None})
    return out, cfg


def read_book(path: str, cfg: dict | None = None, obj=None) -> tuple[dict[str, torch.Tensor], GPT2Config, dict]:
    """A book checkpoint file → (gpt2mha state dict, config, the book's config dict).

    The config dict comes from ``cfg``, else a ``"config"``/``"cfg"`` dict stored in the file,
    else :func:`~.layouts.book_config_path` beside it (``cfg`` entries win over the stored ones). Appendix
    E's ``LinearWithLoRA`` layers are merged into the weights (:mod:`gpt2mha.io.lora`, with the
    config's ``lora_alpha``).

    Raises:
        CheckpointError: see :func:`~.files.read_torch_file`, :func:`book_to_gpt2`.
    """
    obj = read_torch_file(path) if obj is None else obj
    sd = book_state_dict_of(obj)
    if sd is None:
        raise CheckpointError(f"{path}: expected the book's GPTModel state dict (or {{'model_state_dict': …}})")
    stored = next((obj[k] for k in ("config", "cfg") if isinstance(obj, dict) and isinstance(obj.get(k), dict)), None)
    side = book_config_path(path)
    if stored is None and os.path.isfile(side):
        try:
            with open(side) as f:
                stored = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{side}: cannot read JSON: {e}") from None
    merged = {**(stored or {}), **(cfg or {})}
    adapter = None
    if is_book_lora(sd):                                          # appendix E: merged into the plain weights
        sd, adapter = split_book_lora(sd, merged.get("lora_alpha"), path)
    full = book_config(sd, merged, path)
    sd_ours, config = book_to_gpt2(sd, full, path)
    if adapter is not None:
        sd_ours, config = merge_state_dict(sd_ours, config, adapter)
    return sd_ours, config, full


def save_book(model: GPT2, path: str, overwrite: bool = False) -> tuple[str, str]:
    """Write the book's GPTModel state dict to ``path`` (``torch.save``; the book loads it with
    ``model.load_state_dict(torch.load(path, weights_only=True))``) and its config dict to
    :func:`~.layouts.book_config_path`. Returns both paths.

    Raises:
        FileExistsError: either file exists, unless ``overwrite``.
    """
    sd, cfg = gpt2_to_book(model)
    side = book_config_path(path)
    _refuse_existing([path, side], overwrite)
    _mkdir_for(path)
    torch.save(sd, path)
    with open(side, "w") as f:
        json.dump(cfg, f, indent=2)
    return path, side


def nanogpt_to_gpt2(ckpt: dict, source: str = "ckpt.pt") -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """nanoGPT's checkpoint dict (``model_args`` + ``model``) → (gpt2mha state dict, config).

    ``_orig_mod.``/``module.`` prefixes are stripped, the causal-mask buffers ``attn.bias``
    (nanoGPT without flash attention) dropped, the four nn.Linear weights per block transposed
    (:func:`~gpt2mha.io.layouts.linear_to_conv1d_state_dict`), and with ``bias=False`` every
    bias is zeros. ``block_size`` → n_ctx; ``vocab_size`` (e.g. 50304, padded) → n_vocab.

    Raises:
        CheckpointError: missing ``model_args`` fields, a missing, unexpected or mis-shaped tensor.
    """
    args = ckpt.get("model_args")
    need = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
    if not isinstance(args, dict) or any(k not in args for k in need):
        raise CheckpointError(f"{source}: model_args must hold {', '.join(need)}; got {args!r}"[:300])
    if not isinstance(ckpt.get("model"), dict):
        raise CheckpointError(f"{source}: 'model' is not a state dict")
    bias = bool(args.get("bias", True))
    try:
        config = GPT2Config(n_vocab=args["vocab_size"], n_ctx=args["block_size"], n_embd=args["n_embd"],
                            n_head=args["n_head"], n_layer=args["n_layer"],
                            **{k: float(args.get("dropout", 0.0)) for k in ("embd_pdrop", "attn_pdrop", "resid_pdrop")},
                            tokenizer="gpt2" if args["vocab_size"] >= 50257 else "bytes")
    except ValueError as e:
        raise CheckpointError(f"{source}: model_args: {e}") from None
    try:
        sd = strip_wrapper_prefixes(ckpt["model"])
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    C, V, T = config.n_embd, config.n_vocab, config.n_ctx
    expected, optional = {"transformer.wte.weight": (V, C), "transformer.wpe.weight": (T, C)}, {}
    optional["lm_head.weight"] = (V, C)

    def linear(name, out_f, in_f):
        expected[name + ".weight"] = (out_f, in_f)
        if bias:
            expected[name + ".bias"] = (out_f,)

    def norm(name):
        expected[name + ".weight"] = (C,)
        if bias:
            expected[name + ".bias"] = (C,)

    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        norm(p + "ln_1"), norm(p + "ln_2")
        linear(p + "attn.c_attn", 3 * C, C), linear(p + "attn.c_proj", C, C)
        linear(p + "mlp.c_fc", 4 * C, C), linear(p + "mlp.c_proj", C, 4 * C)
        optional[p + "attn.bias"] = (1, 1, T, T)
    norm("transformer.ln_f")
    check_tensors(tensor_shapes(sd), expected, source, optional)
    sd = {k: v for k, v in sd.items() if not k.endswith(".attn.bias")}
    sd = {k.removeprefix("transformer."): v for k, v in linear_to_conv1d_state_dict(sd).items()}
    if not bias:                                   # nanoGPT's bias=False: LayerNorms and Linears without bias
        for name, t in list(sd.items()):
            if name.endswith(".weight") and name not in ("wte.weight", "wpe.weight", "lm_head.weight"):
                sd[name.removesuffix("weight") + "bias"] = torch.zeros(t.shape[-1], dtype=t.dtype)  # out features
    return tie_head(sd, config)


def gpt2_to_nanogpt(model: GPT2) -> dict:
    """:class:`GPT2` → a nanoGPT checkpoint dict that nanoGPT's ``sample.py`` loads: ``model``
    (``transformer.…`` keys, nn.Linear layout, ``lm_head.weight`` = wte), ``model_args``
    (``bias=False`` iff every bias is exactly zero, ``dropout`` = resid_pdrop), ``iter_num`` 0,
    ``best_val_loss`` inf, ``config`` {} (no optimizer state: not a run to resume).

    Raises:
        ValueError: an untied LM head (nanoGPT always ties it to wte).
    """
    c = model.config
    if not c.tie_word_embeddings:
        raise ValueError("nanoGPT ties lm_head to wte; this model has a separate LM head (tie_word_embeddings=False)")
    sd = detached_state_dict(model.state_dict())
    bias = any(bool(v.ne(0).any()) for k, v in sd.items() if k.endswith(".bias"))
    lin = conv1d_to_linear_state_dict({"transformer." + k: v for k, v in sd.items()})
    if not bias:
        lin = {k: v for k, v in lin.items() if not k.endswith(".bias")}
    lin["lm_head.weight"] = lin["transformer.wte.weight"]
    args = {"n_layer": c.n_layer, "n_head": c.n_head, "n_embd": c.n_embd, "block_size": c.n_ctx,
            "bias": bias, "vocab_size": c.n_vocab, "dropout": c.resid_pdrop}
    return {"model": lin, "model_args": args, "iter_num": 0, "best_val_loss": float("inf"), "config": {}}


def read_nanogpt(path: str, obj=None) -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """nanoGPT's ``ckpt.pt`` (or its ``out_dir``) → (gpt2mha state dict, config)."""
    if os.path.isdir(path):
        path = os.path.join(path, "ckpt.pt")
    obj = read_torch_file(path) if obj is None else obj
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected nanoGPT's checkpoint dict (model_args + model)")
    return nanogpt_to_gpt2(obj, path)


def save_nanogpt(model: GPT2, path: str, overwrite: bool = False) -> str:
    """``torch.save`` :func:`gpt2_to_nanogpt` to ``path`` (a directory gets ``ckpt.pt``)."""
    if os.path.isdir(path) or not os.path.splitext(path)[1]:
        path = os.path.join(path, "ckpt.pt")
    ckpt = gpt2_to_nanogpt(model)
    _refuse_existing([path], overwrite)
    _mkdir_for(path)
    torch.save(ckpt, path)
    return path


def _refuse_existing(paths: list[str], overwrite: bool) -> None:
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; refusing to "
                              f"overwrite {'it' if len(existing) == 1 else 'them'} (pass --overwrite / "
                              f"overwrite=True)")


def _mkdir_for(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


# ------------------------------------------------------------------------------ the registry
def is_nanogpt_file(source: Source) -> bool:
    """Whether a probed file is nanoGPT's checkpoint dict (``model_args`` + ``model``)."""
    return isinstance(source.obj, dict) and "model_args" in source.obj and "model" in source.obj


def is_book_file(source: Source) -> bool:
    """Whether a probed file is the book's GPTModel state dict (or chapter 5's
    ``{"model_state_dict": …}``): a key ending in ``tok_emb.weight``, wrapper prefixes or not."""
    obj = source.obj
    if isinstance(obj, dict) and isinstance(obj.get("model_state_dict"), dict):
        obj = obj["model_state_dict"]
    return isinstance(obj, dict) and any(isinstance(k, str) and k.endswith("tok_emb.weight") for k in obj)


def read_nanogpt_source(source: Source, options: dict | None = None) -> Checkpoint:
    """The registry's reader: :func:`read_nanogpt` of a probed ``ckpt.pt``."""
    sd, config = read_nanogpt(source.path, source.obj)
    return Checkpoint(sd, config, source.path)


def read_book_source(source: Source, options: dict | None = None) -> Checkpoint:
    """The registry's reader: :func:`read_book` of a probed file, with ``options["book_config"]``."""
    sd, config, _ = read_book(source.path, (options or {}).get("book_config"), source.obj)
    return Checkpoint(sd, config, source.path)


register_format(CheckpointFormat("nanogpt", "nanogpt", is_nanogpt_file, read_nanogpt_source, order=30, file="ckpt.pt",
                                 kinds=("dir", "file"),
                                 describe={"dir": "nanoGPT's out_dir (ckpt.pt)",
                                           "file": "nanoGPT's ckpt.pt (model_args + model)"}))
register_format(CheckpointFormat("book", "book", is_book_file, read_book_source, order=40, kinds=("file",),
                                 describe={"file": "the book's GPTModel state dict (tok_emb.weight, trf_blocks.…)"}))
