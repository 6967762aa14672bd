"""LoRA adapters: the book's appendix-E ``LinearWithLoRA`` state dicts and PEFT's adapter
directories, read into one form and merged into a model's weights.

A LoRA layer adds ``scale · (x @ Aᵀ) @ Bᵀ`` to a linear layer's output: ``A [r, in]``,
``B [out, r]``; merged, the layer's weight gains ``ΔW = scale · B @ A`` (``[out, in]``; the
transpose for GPT-2's Conv1D ``[in, out]``). The targets, in gpt2mha's module names
(:data:`TARGETS`): ``h.{i}.attn.c_attn``, ``h.{i}.attn.c_proj``, ``h.{i}.mlp.c_fc``,
``h.{i}.mlp.c_proj`` and ``lm_head`` (the LM head, or a classifier's head).

* **PEFT** (``get_peft_model(model, LoraConfig(...))`` then ``save_pretrained``):
  ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``use_rslora``) and
  ``adapter_model.safetensors`` (or ``adapter_model.bin``) holding
  ``base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight [r, in]`` and ``….lora_B.weight
  [out, r]`` (``nn.Linear`` layouts, also for GPT-2's Conv1D layers); ``scale = lora_alpha / r``
  (``lora_alpha / √r`` with ``use_rslora``), ``r`` each layer's rank from its shapes. PEFT may
  also store ``lm_head.base_layer.weight`` (the tied head it targets: it must equal the base's)
  and, for ``task_type="SEQ_CLS"``, the trained head ``score.weight`` (``modules_to_save``),
  which makes the merged model a classifier. Source: PEFT ``tuners/lora/layer.py``
  (``Linear.forward``, ``get_delta_weight``).
* **The book** (appendix E: ``replace_linear_with_lora(model, rank, alpha)`` swaps every
  ``nn.Linear`` for ``LinearWithLoRA``): ``….linear.weight``/``….linear.bias`` (the original
  layer) beside ``….lora.A [in, r]`` and ``….lora.B [r, out]`` (``x @ A @ B``), ``scale =
  alpha`` (the book multiplies by ``alpha``, not ``alpha / r``). ``alpha`` is a plain attribute,
  in no tensor: it comes from the config dict (``"lora_alpha"``). ``W_query``, ``W_key`` and
  ``W_value`` become one LoRA layer on the fused ``c_attn``: ``A`` their ``A``\\ s stacked
  (rank 3r), ``B`` block-diagonal, so ``ΔW`` is theirs side by side, exactly.

Merging (:func:`merge_state_dict`) is arithmetic: ``W + ΔW`` as PEFT's ``merge_and_unload``
computes it, in float64 and rounded once to float32; a LoRA on GPT-2's tied head unties it (the head gains ``ΔW``,
the embedding does not: what PEFT's unmerged forward computes). Every check runs before
anything is merged; errors are one line naming the file and the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from ..core.classifier import ClassifierConfig
from ..core.model import GPT2Config
from .files import read_state_dict, read_torch_file
from .layouts import book_config_path, book_state_dict_of, is_book_lora
from .state_dicts import Checkpoint, CheckpointError

#: The module names a LoRA layer may target in gpt2mha's model.
TARGETS = re.compile(r"h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)|lm_head")
ADAPTER_CONFIG, ADAPTER_WEIGHTS, LEGACY_ADAPTER_WEIGHTS = ("adapter_config.json", "adapter_model.safetensors",
                                                          "adapter_model.bin")
#: The book's appendix-E module names → gpt2mha's (``W_query``/``W_key``/``W_value`` fuse into c_attn).
BOOK_TARGETS = {"att.W_query": "attn.c_attn", "att.W_key": "attn.c_attn", "att.W_value": "attn.c_attn",
                "att.out_proj": "attn.c_proj", "ff.layers.0": "mlp.c_fc", "ff.layers.2": "mlp.c_proj"}


@dataclass
class LoraLayer:
    """One layer's adapter: ``A [r, in]``, ``B [out, r]`` (float32), ``scale``; ``names``: the
    tensors' names in their file, for errors."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    names: tuple[str, str] = ("lora_A", "lora_B")

    def delta(self) -> torch.Tensor:
        """``ΔW = scale · B @ A``, ``[out, in]``, in float64 (PEFT's ``get_delta_weight``; the
        merge rounds ``W + ΔW`` once, to the weights' dtype)."""
        return (self.B.double() @ self.A.double()) * self.scale


@dataclass
class LoraAdapter:
    """A whole adapter: ``layers`` (target module name → :class:`LoraLayer`), ``source`` (the
    file, for errors), ``head`` (a classifier head the adapter brings: ``{"weight", "bias"?}``,
    PEFT's ``modules_to_save`` ``score``), ``base_copies`` (module name → the base weight the
    adapter stored, ``[out, in]``, which must be the base's)."""

    layers: dict[str, LoraLayer]
    source: str
    head: dict[str, torch.Tensor] | None = None
    base_copies: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """The largest rank of its layers."""
        return max((layer.A.shape[0] for layer in self.layers.values()), default=0)


# ------------------------------------------------------------------------------- PEFT
def is_peft_dir(path: str) -> bool:
    """Whether ``path`` is a PEFT adapter directory (``adapter_config.json`` in it)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ADAPTER_CONFIG))


def read_peft(directory: str) -> LoraAdapter:
    """A PEFT LoRA adapter directory → :class:`LoraAdapter` in gpt2mha's module names.

    Raises:
        CheckpointError: one line naming the file (and the tensor): no adapter files, a
            ``peft_type`` other than LORA, DoRA / LoRA biases / ``alpha_pattern`` (not read), a
            tensor of an unknown target module or kind, A and B of different ranks, an A without B.
    """
    cfg_path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{directory}: no {ADAPTER_CONFIG}; expected a PEFT adapter directory "
                              f"(PeftModel.save_pretrained)")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: cannot read JSON: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{cfg_path}: peft_type={cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r}; "
                              f"gpt2mha reads LoRA adapters (LORA)")
    for key, off in (("use_dora", False), ("lora_bias", False), ("alpha_pattern", {})):
        if cfg.get(key) not in (None, off):
            raise CheckpointError(f"{cfg_path}: {key}={cfg[key]!r} is not supported (plain LoRA only)")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise CheckpointError(f"{cfg_path}: lora_alpha={alpha!r} must be a number")
    weights = next((os.path.join(directory, n) for n in (ADAPTER_WEIGHTS, LEGACY_ADAPTER_WEIGHTS)
                    if os.path.isfile(os.path.join(directory, n))), None)
    if weights is None:
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS} (or {LEGACY_ADAPTER_WEIGHTS}) beside {ADAPTER_CONFIG}")
    sd = read_state_dict(weights)
    pairs, head, copies = {}, {}, {}
    for key, t in sd.items():
        name = key.removeprefix("base_model.model.").removeprefix("transformer.")
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B)(\.weight)?", name)
        if m:
            _check_target(m.group(1), weights, key)
            pairs.setdefault(m.group(1), {})[m.group(2)] = (key, t)
        elif re.fullmatch(r"score\.(weight|bias)", name):        # modules_to_save: the classifier's trained head
            head[name.split(".")[1]] = t
        elif re.fullmatch(r"(.+)\.base_layer\.weight", name):    # the tied head PEFT stores with lm_head targets
            _check_target(name.removesuffix(".base_layer.weight"), weights, key)
            copies[name.removesuffix(".base_layer.weight")] = t
        else:
            raise CheckpointError(f"{weights}: tensor {key}: not a LoRA layer of {_TARGET_NAMES}, a classifier head "
                                  f"(score) or a stored base weight; gpt2mha cannot apply it")
    rslora = bool(cfg.get("use_rslora", False))
    layers = {}
    for target, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            have = next(iter(ab.values()))[0]
            raise CheckpointError(f"{weights}: tensor {have} has no {'lora_B' if 'lora_A' in ab else 'lora_A'} beside it")
        (na, A), (nb, B) = ab["lora_A"], ab["lora_B"]
        if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
            raise CheckpointError(f"{weights}: tensor {na} {list(A.shape)} and {nb} {list(B.shape)}: expected "
                                  f"[r, in] and [out, r] of one rank r")
        r = A.shape[0]
        layers[target] = LoraLayer(A.float(), B.float(), alpha / (math.sqrt(r) if rslora else r), (na, nb))
    return LoraAdapter(layers, weights, head or None, copies)


_TARGET_NAMES = "c_attn, c_proj, c_fc, lm_head"


def _check_target(name: str, source: str, key: str) -> None:
    if not TARGETS.fullmatch(name):
        raise CheckpointError(f"{source}: tensor {key}: unknown target module {name!r}; gpt2mha applies LoRA to "
                              f"{_TARGET_NAMES} (h.{{i}}.attn.c_attn, h.{{i}}.attn.c_proj, h.{{i}}.mlp.c_fc, "
                              f"h.{{i}}.mlp.c_proj, lm_head)")


# ------------------------------------------------------------------------------- book
def split_book_lora(sd: dict[str, torch.Tensor], alpha, source: str) -> tuple[dict[str, torch.Tensor], LoraAdapter]:
    """Appendix E's state dict → (the plain GPTModel state dict, the adapter in gpt2mha's names).

    ``P.linear.weight``/``P.linear.bias`` become ``P.weight``/``P.bias``; each ``P.lora.A [in,
    r]`` and ``P.lora.B [r, out]`` a :class:`LoraLayer` with ``A = lora.Aᵀ``, ``B = lora.Bᵀ``,
    ``scale = alpha``; ``trf_blocks.{i}.att.W_query|W_key|W_value`` fuse into ``h.{i}.attn.c_attn``
    (rows of A stacked, B block-diagonal over the query | key | value columns).

    Raises:
        CheckpointError: one line naming the file or tensor: no ``alpha``, a LoRA on a module
            that is not a linear layer of GPTModel, A/B shapes that do not fit their layer.
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise CheckpointError(f"{source}: the book's LinearWithLoRA keeps alpha as a plain attribute, in no tensor: "
                              f"give it as lora_alpha in the config dict (CLI: --book-config '{{\"lora_alpha\": 16}}' "
                              f"or in {os.path.splitext(source)[0]}.json); got {alpha!r}")
    plain, found = {}, {}
    for key, t in sd.items():
        m = re.fullmatch(r"(.+)\.lora\.(A|B)", key)
        if m:
            found.setdefault(m.group(1), {})[m.group(2)] = (key, t)
            continue
        plain[re.sub(r"\.linear\.(weight|bias)$", r".\1", key)] = t
    emb = sd.get("tok_emb.weight")
    C = emb.shape[1] if isinstance(emb, torch.Tensor) and emb.dim() == 2 else None
    qkv, layers = {}, {}
    for prefix, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{source}: tensor {next(iter(ab.values()))[0]} has no "
                                  f"{'lora.B' if 'A' in ab else 'lora.A'} beside it")
        (na, A), (nb, B) = ab["A"], ab["B"]
        target = _book_target(prefix, source, na)
        w = plain.get(prefix + ".weight")
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[0] or (
                isinstance(w, torch.Tensor) and (w.dim() != 2 or tuple(A.shape[:1]) + tuple(B.shape[1:]) != (
                    w.shape[1], w.shape[0]))):
            shape = list(w.shape) if isinstance(w, torch.Tensor) else "absent"
            raise CheckpointError(f"{source}: tensor {na} {list(A.shape)} and {nb} {list(B.shape)} do not fit "
                                  f"{prefix}.linear.weight {shape}: expected [in, r] and [r, out]")
        layer = LoraLayer(A.t().float(), B.t().float(), float(alpha), (na, nb))
        if target.endswith("attn.c_attn"):
            qkv.setdefault(target, {})[prefix.rsplit(".", 1)[1]] = layer
        else:
            layers[target] = layer
    for target, parts in qkv.items():
        layers[target] = _fuse_qkv(parts, C, float(alpha))
    return plain, LoraAdapter(layers, source)


def _book_target(prefix: str, source: str, key: str) -> str:
    if prefix == "out_head":
        return "lm_head"
    m = re.fullmatch(r"trf_blocks\.(\d+)\.(.+)", prefix)
    if not m or m.group(2) not in BOOK_TARGETS:
        raise CheckpointError(f"{source}: tensor {key}: unknown target module {prefix!r}; the book's LinearWithLoRA "
                              f"wraps GPTModel's nn.Linear layers ({', '.join(BOOK_TARGETS)}, out_head)")
    return f"h.{m.group(1)}.{BOOK_TARGETS[m.group(2)]}"


def _fuse_qkv(parts: dict[str, LoraLayer], C: int | None, alpha: float) -> LoraLayer:
    """W_query/W_key/W_value's LoRA layers as one on c_attn ``[3C]``: A stacked, B block-diagonal."""
    order = [p for p in ("W_query", "W_key", "W_value") if p in parts]
    C = C or next(iter(parts.values())).B.shape[0]
    A = torch.cat([parts[p].A for p in order])                          # [Σr, C]
    B = torch.zeros(3 * C, A.shape[0])
    col = 0
    for p in order:
        r, row = parts[p].A.shape[0], ("W_query", "W_key", "W_value").index(p) * C
        B[row:row + C, col:col + r] = parts[p].B
        col += r
    return LoraLayer(A, B, alpha, parts[order[0]].names)


# ------------------------------------------------------------------------------ apply
def read_adapter(path: str, book_config: dict | None = None) -> LoraAdapter:
    """An adapter given on the command line or to the API: a PEFT directory (:func:`read_peft`)
    or the book's appendix-E ``.pth`` (its LoRA layers; ``lora_alpha`` from ``book_config`` or
    the JSON beside it).

    Raises:
        CheckpointError: neither, or what their readers refuse.
    """
    if is_peft_dir(path):
        return read_peft(path)
    if os.path.isfile(path):
        sd = book_state_dict_of(read_torch_file(path))
        if sd is not None and is_book_lora(sd):
            cfg = dict(book_config or {})
            side = book_config_path(path)
            if "lora_alpha" not in cfg and os.path.isfile(side):
                with open(side) as f:
                    cfg = {**json.load(f), **cfg}
            return split_book_lora(sd, cfg.get("lora_alpha"), path)[1]
    raise CheckpointError(f"{path}: not a LoRA adapter: expected a PEFT adapter directory ({ADAPTER_CONFIG} + "
                          f"{ADAPTER_WEIGHTS}) or the book's appendix-E state dict (….lora.A, ….lora.B)")


def target_shape(config: GPT2Config, target: str) -> tuple[int, int]:
    """``(out, in)`` of a target module of a model with ``config``."""
    C = config.n_embd
    if target == "lm_head":
        return (config.n_labels if isinstance(config, ClassifierConfig) else config.n_vocab), C
    kind = target.split(".", 2)[2]
    return {"attn.c_attn": (3 * C, C), "attn.c_proj": (C, C), "mlp.c_fc": (4 * C, C), "mlp.c_proj": (C, 4 * C)}[kind]


def check_adapter(adapter: LoraAdapter, config: GPT2Config, head: torch.Tensor | None = None) -> None:
    """Every layer of ``adapter`` fits a model with ``config`` (its modules exist, A and B fit
    their shapes), and the base weights it stored equal ``head`` (the base's head weight).

    Raises:
        CheckpointError: one line naming the adapter's file and the tensor (an adapter for
            another base model: other widths, more blocks, another head).
    """
    for target, layer in adapter.layers.items():
        m = re.match(r"h\.(\d+)\.", target)
        if m and int(m.group(1)) >= config.n_layer:
            raise CheckpointError(f"{adapter.source}: tensor {layer.names[0]} targets block {m.group(1)}, but the base "
                                  f"model has {config.n_layer} blocks (an adapter for another base model)")
        out, inp = target_shape(_as_classifier(config, adapter) if adapter.head is not None else config, target)
        if layer.A.shape[1] != inp or layer.B.shape[0] != out:
            raise CheckpointError(f"{adapter.source}: tensors {layer.names[0]} {list(layer.A.shape)} and "
                                  f"{layer.names[1]} {list(layer.B.shape)} do not fit the base model's {target} "
                                  f"({inp} → {out} features): expected [r, {inp}] and [{out}, r] (an adapter for "
                                  f"another base model?)")
    if adapter.head is not None:
        w = adapter.head.get("weight")
        if w is None or w.dim() != 2 or w.shape[1] != config.n_embd:
            raise CheckpointError(f"{adapter.source}: tensor score.weight {list(w.shape) if w is not None else 'absent'}:"
                                  f" expected [num_labels, n_embd={config.n_embd}]")
    for target, w in adapter.base_copies.items():
        if head is None or target != "lm_head" or w.shape != head.shape or not torch.allclose(
                w.float(), head.float(), rtol=1e-3, atol=1e-6):
            raise CheckpointError(f"{adapter.source}: tensor {target}.base_layer.weight {list(w.shape)} is not the base "
                                  f"model's {target} weight (an adapter trained on another base model)")


def _as_classifier(config: GPT2Config, adapter: LoraAdapter) -> ClassifierConfig:
    w, b = adapter.head["weight"], adapter.head.get("bias")
    base = {f.name: getattr(config, f.name) for f in dataclasses.fields(GPT2Config)}
    return ClassifierConfig(**{**base, "tie_word_embeddings": False}, n_labels=w.shape[0], head_bias=b is not None,
                            pooling="last_non_pad")


def merge_state_dict(sd: dict[str, torch.Tensor], config: GPT2Config,
                     adapter: LoraAdapter) -> tuple[dict[str, torch.Tensor], GPT2Config]:
    """``(state dict, config)`` of a model in gpt2mha's names with ``adapter`` merged:
    ``W += ΔW`` (its transpose for Conv1D), a tied head untied first, a classifier head the
    adapter brings put in the LM head's place (the config a
    :class:`~gpt2mha.core.classifier.ClassifierConfig`). Returns new dicts; ``sd`` is not changed.

    Raises:
        CheckpointError: see :func:`check_adapter`.
    """
    head = sd.get("lm_head.weight", sd.get("wte.weight"))
    check_adapter(adapter, config, None if adapter.head is not None else head)
    sd = dict(sd)
    if adapter.head is not None:                                  # PEFT's SEQ_CLS: the trained score replaces the head
        config = _as_classifier(config, adapter)
        sd["lm_head.weight"] = adapter.head["weight"].float()
        if "bias" in adapter.head:
            sd["lm_head.bias"] = adapter.head["bias"].float()
    for target, layer in adapter.layers.items():
        delta = layer.delta()                                     # [out, in]
        if target == "lm_head":
            if "lm_head.weight" not in sd:                        # GPT-2's tied head: the head alone changes
                sd["lm_head.weight"] = sd["wte.weight"]
                config = dataclasses.replace(config, tie_word_embeddings=False)
            sd["lm_head.weight"] = (sd["lm_head.weight"].double() + delta).float()
        else:
            sd[target + ".weight"] = (sd[target + ".weight"].double() + delta.t()).float()
    return sd, config


def merge_adapters(checkpoint: Checkpoint, lora, book_config: dict | None = None) -> Checkpoint:
    """``checkpoint`` (canonical: :func:`~.state_dicts.canonical`) with each adapter of ``lora``
    (a path or a list of paths: :func:`read_adapter`) merged into its tensors, in order
    (:func:`merge_state_dict`): the loading pass's step between reading and building.

    Raises:
        CheckpointError: a quantized base (merge into the float model, then quantize), or what
            :func:`read_adapter` / :func:`check_adapter` refuse.
    """
    if checkpoint.quantization:
        raise CheckpointError(f"the base model is quantized ({checkpoint.quantization['scheme']}); LoRA merges into "
                              f"float weights: merge into the float model, then quantize it")
    sd, config = checkpoint.state_dict, checkpoint.config
    for path in [lora] if isinstance(lora, (str, os.PathLike)) else lora:
        sd, config = merge_state_dict(sd, config, read_adapter(os.fspath(path), book_config))
    return checkpoint._replace(state_dict=sd, config=config)
