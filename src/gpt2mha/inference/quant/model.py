"""Quantizing a whole model: every block Conv1D and the LM head swapped for a
:class:`~.linear.QuantizedLinear`, rounded to nearest or by GPTQ on calibration text.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
from torch import nn

from ...core.hooks import HookPoint, record
from ...progress import progress_bar

from .linear import (ABNORMAL_ERROR, DEFAULT_ACTIVATIONS, DEFAULT_GROUP_SIZE, SCHEME_ACTIVATIONS, QuantizedHead,
                     QuantizedLinear, check_head, check_scheme, layer_class)
from .schemes import DEFAULT_CALIBRATION, HEAD_SCHEME, METHODS
from .tables import ACTIVATIONS, SCHEMES

#: The four Conv1Ds of a block, by their path inside it.
BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


class QuantizationWarning(UserWarning):
    """A tensor whose quantization error is abnormal (:data:`ABNORMAL_ERROR`)."""


def error_row(name: str, w: torch.Tensor, layer: QuantizedLinear, hessian: torch.Tensor | None = None) -> dict:
    """Quantization error of one tensor.

    ``rel_error = rms(W − deq(W)) / rms(W)``, and ``robust_rel_error``, the same error over a
    robust spread of W, ``1.4826 · median |W|`` (σ for a Gaussian): an outlier channel inflates
    rms(W) as much as the error, so only the robust figure shows that it stretched the scales
    for every other weight of its rows or groups. ``abnormal`` when the robust figure exceeds
    :data:`ABNORMAL_ERROR`, or an error is not finite. Also ``max_abs_error``, and with the
    calibration inputs' ``hessian = Σ xᵀx`` the error of the products,
    ``output_rel_error = ‖x·(W − deq(W))ᵀ‖ / ‖x·Wᵀ‖`` over those inputs (None without).
    """
    w = w.detach().float()
    err = layer.dequantized() - w
    rms_err = err.pow(2).mean().sqrt()
    rel = float(rms_err / w.pow(2).mean().sqrt().clamp(min=1e-30))
    robust = float(rms_err / (1.4826 * w.abs().median()).clamp(min=1e-30))
    out = None
    if hessian is not None:
        h = hessian.float()
        out = float(((err @ h) * err).sum().clamp(min=0).sqrt() / ((w @ h) * w).sum().clamp(min=1e-30).sqrt())
    return dict(name=name, shape=list(w.shape), scheme=layer.scheme, rel_error=rel, robust_rel_error=robust,
                max_abs_error=float(err.abs().max()), output_rel_error=out,
                abnormal=not robust <= layer.abnormal_error)


def head_group(head: str, group_size: int | None) -> int | None:
    """The head's group size: the blocks' ``group_size`` for a head in groups (int4), None for int8."""
    return group_size if layer_class(head).grouped else None


def quantized_layers(model, scheme: str, group_size: int | None, head: str = HEAD_SCHEME) -> dict[str, QuantizedLinear]:
    """Empty :class:`QuantizedLinear` layers for every block Conv1D and the ``head``-scheme head of
    ``model`` (shapes only, to be filled by ``load_state_dict``), by module path."""
    c = model.config
    layers = {}
    for i in range(c.n_layer):
        for path, (n_in, n_out) in zip(BLOCK_LINEARS, ((c.n_embd, 3 * c.n_embd), (c.n_embd, c.n_embd),
                                                      (c.n_embd, 4 * c.n_embd), (4 * c.n_embd, c.n_embd))):
            layers[f"h.{i}.{path}"] = QuantizedLinear(n_in, n_out, scheme, group_size)
    layers["lm_head"] = QuantizedHead(c.n_embd, c.n_vocab, head, head_group(head, group_size))
    return layers


def install(model, layers: dict[str, nn.Module], scheme: str, group_size: int | None, tied: bool,
            head: str = HEAD_SCHEME) -> None:
    """Put ``layers`` into ``model`` at their paths, record the schemes, freeze the rest."""
    for path, layer in layers.items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, layer)
    model.quantization = {"scheme": scheme, "group_size": group_size, "head": head, "tied": tied}
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


#: Rows of calibration tokens run through the model at a time.
CALIBRATION_BATCH = 8


def default_calibration() -> str:
    """The packaged calibration text (:data:`DEFAULT_CALIBRATION`)."""
    from importlib.resources import files
    return files("gpt2mha").joinpath("data", DEFAULT_CALIBRATION).read_text(encoding="utf-8")


def calibration_ids(model, calibration) -> torch.Tensor:
    """Calibration tokens ``[B, T]`` (int64) for :func:`quantize_model` from text (encoded with
    the model's tokenizer) or token ids (1-D, cut into rows of ``T = min(n_ctx, 256)``, or
    ``[B, T]``).

    Raises:
        ValueError: naming ``calibration``: not text or integer ids, ids outside the
            vocabulary, rows longer than n_ctx, or fewer tokens than one row.
    """
    c = model.config
    path_hint = ""
    if isinstance(calibration, (bytes, bytearray, os.PathLike)):
        raise ValueError(f"calibration: expected text (str) or integer token ids, got {type(calibration).__name__}; "
                         f"to calibrate on a file pass its text, open(path, encoding='utf-8').read() (the CLI's "
                         f"--calibration FILE reads the file)")
    if isinstance(calibration, str):
        if not calibration:
            raise ValueError("calibration: the text is empty")
        if len(calibration) < 4096 and os.path.isfile(calibration):
            path_hint = (f" (calibration= takes the text itself, and {calibration!r} is a file name: pass "
                         f"open({calibration!r}, encoding='utf-8').read())")
        from ...io.tokenizer import get_tokenizer
        calibration = get_tokenizer(c.tokenizer).encode(calibration)
    try:
        ids = torch.as_tensor(calibration)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"calibration: expected text or integer token ids [N] or [B, T] (equal rows), got "
                         f"{type(calibration).__name__} ({e})") from None
    if ids.numel() == 0 and ids.dim() == 1:
        raise ValueError("calibration: no tokens")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() not in (1, 2):
        raise ValueError(f"calibration: expected text or integer token ids [N] or [B, T], got a {ids.dim()}-D "
                         f"{ids.dtype} tensor")
    ids = ids.long()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < c.n_vocab):
        raise ValueError(f"calibration: token ids must be in [0, {c.n_vocab}), got {int(ids.min())}..{int(ids.max())}")
    if ids.dim() == 1:
        T = min(c.n_ctx, 256)
        if len(ids) < T:
            raise ValueError(f"calibration: {len(ids)} tokens, fewer than one row of {T}; give more text{path_hint}")
        ids = ids[:len(ids) // T * T].view(-1, T)
    if ids.shape[1] > c.n_ctx or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"calibration: rows [{ids.shape[0]}, {ids.shape[1]}]: need at least one row of at most "
                         f"n_ctx={c.n_ctx} tokens")
    return ids


def _gram(xs) -> torch.Tensor:
    """``Σ xᵀx`` (float64 ``[K, K]``) over activations ``xs`` (tensors ``[..., K]``)."""
    total = 0
    for x in xs:
        x = x.detach().reshape(-1, x.shape[-1]).float()
        h = x.t() @ x
        if not torch.isfinite(h).all():                         # float32 overflow: redo in float64
            h = x.double().t() @ x.double()
        total = total + h.double()
    return total


def _hessians(modules: dict[str, nn.Module], run) -> dict[str, torch.Tensor]:
    """``Σ xᵀx`` (float64 ``[K, K]``) of each module's inputs while ``run()`` runs."""
    hessians, hooks = {}, []
    for name, m in modules.items():
        def hook(mod, args, name=name):
            hessians[name] = hessians.get(name, 0) + _gram([args[0]])
        hooks.append(m.register_forward_pre_hook(hook))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return hessians


@torch.no_grad()
def first_non_finite(model: nn.Module, idx: torch.Tensor) -> str:
    """The path of the first module (in the order the forward over ``idx [B, T]`` finishes
    them: a layer before the block that holds it) whose output holds NaN or inf, or
    ``"none (the logits are finite)"``. For naming where a calibration went wrong."""
    found: list[str] = []
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, HookPoint):                            # capture points: the layers' own names say more
            continue

        def hook(mod, args, out, name=name or "the model"):
            out = out[0] if isinstance(out, tuple) else getattr(out, "logits", out)
            if not found and isinstance(out, torch.Tensor) and out.is_floating_point() and \
                    not bool(torch.isfinite(out).all()):
                found.append(name)
        hooks.append(m.register_forward_hook(hook))
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else "none (the logits are finite)"


@torch.no_grad()
def _gptq_layers(model, scheme: str, group_size: int | None, ids: torch.Tensor, weights: dict,
                 head: str = HEAD_SCHEME, bar=None) -> tuple[dict, dict]:
    """GPTQ every layer of ``weights`` on the calibration ``ids``, block after block (GPTQ's
    sequential order: each block is calibrated on the outputs of the blocks already quantized).
    The quantized layers replace the Conv1Ds as they are made.

    The head comes first, from the float model's final LayerNorm outputs: a tied ``wte`` is then
    the dequantized head before the blocks are calibrated, so they see the embeddings they will
    get (on the built-in model this order agreed with float32 on more held-out bytes than the
    head last). Returns ``(layers by path, hessians by path)``; ``bar`` (a progress bar) advances
    by one per layer.
    """
    rows = max(1, 2048 // ids.shape[1])                         # ~2048 tokens per forward
    chunks = ids.to(model.wte.weight.device).split(rows)

    def layer(path, w, b, scheme, group_size, hessian, cls=QuantizedLinear):
        if bar is not None:
            bar.set_postfix_str(path, refresh=False)
        try:
            out = cls.from_float(w, b, scheme, group_size, hessian=hessian)
        except ValueError as e:
            if not torch.isfinite(hessian).all():               # the cause lies upstream: name it
                raise ValueError(f"{path}: its calibration inputs hold NaN or inf; the first module whose output "
                                 f"is not finite is {first_non_finite(model, chunks[0])}") from None
            raise ValueError(f"{path}: {e}") from None
        if bar is not None:
            bar.update()
        return out

    def at(point):                                              # the activations at one capture point
        return [record(model, [point], lambda: model(idx), stop=True)[point] for idx in chunks]

    hessians = {"lm_head": _gram(at("ln_f.hook_normalized"))}   # the float model's final states
    w, _ = weights["lm_head"]
    layers = {"lm_head": layer("lm_head", w, None, head, head_group(head, group_size), hessians["lm_head"],
                               QuantizedHead)}
    if w is model.wte.weight:                                   # a new tensor: the float one stays intact
        model.wte.weight = nn.Parameter(layers["lm_head"].dequantized().to(w.dtype), requires_grad=False)
    xs = at("h.0.hook_resid_pre")                               # block 0's inputs (embeddings)
    for i, block in enumerate(model.h):                         # GPTQ's order: block by block
        paths = {f"h.{i}.{p}": block.get_submodule(p) for p in BLOCK_LINEARS}
        hessians.update(_hessians(paths, lambda: [block(x) for x in xs]))
        for path in paths:
            w, b = weights[path]
            layers[path] = layer(path, w, b, scheme, group_size, hessians[path])
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, layers[path])
        xs = [block(x)[0] for x in xs]
    return layers, hessians


def _bar_over(bar, items):
    """``items`` (``(path, …)`` pairs), advancing ``bar`` by one after each, named by its path."""
    for item in items:
        bar.set_postfix_str(item[0], refresh=False)
        yield item
        bar.update()


def _state_before(model, sources: dict) -> dict:
    """What :func:`quantize_model` changes, to put back if it stops half-way."""
    return dict(sources=dict(sources), wte=model.wte.weight, lm_head=model.lm_head,
                training=model.training, grads=[(p, p.requires_grad) for p in model.parameters()])


def _restore(model, before: dict) -> None:
    """Undo a :func:`quantize_model` that stopped half-way: the original modules and tensors
    (never written in place) go back, nothing quantized stays."""
    for path, module in before["sources"].items():
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, module)
    model.wte.weight = before["wte"]
    model.lm_head = before["lm_head"]
    model.quantization = None
    for p, flag in before["grads"]:
        with contextlib.suppress(RuntimeError):
            p.requires_grad_(flag)
    model.train(before["training"])


def _plan(model, scheme, group_size, method, calibration, head=HEAD_SCHEME):
    """What :func:`quantize_model` needs, every argument checked before anything changes:
    ``(group_size, calibration ids or None, the float modules by path, their weights [out, in]
    and biases by path)``.

    Raises:
        ValueError: see :func:`quantize_model`.
    """
    if getattr(model, "quantization", None):
        raise ValueError(f"this model is already quantized ({model.quantization['scheme']}); quantizing twice would "
                         f"round the rounded weights again: quantize the float model instead")
    defaulted = group_size is None
    if scheme in SCHEMES and group_size is None:
        group_size = DEFAULT_GROUP_SIZE[scheme]
    try:
        check_scheme(scheme, group_size, model.config.n_embd)
    except ValueError as e:
        if defaulted and group_size is not None:
            raise ValueError(f"{e} (group_size was not given: {group_size} is {scheme}'s default)") from None
        raise
    check_head(head, scheme)
    sources = {f"h.{i}.{path}": model.get_submodule(f"h.{i}.{path}") for i in range(model.config.n_layer)
               for path in BLOCK_LINEARS}
    weights = {path: (m.weight.t(), m.bias) for path, m in sources.items()}      # [out, in]
    weights["lm_head"] = (model.lm_head.weight, None)
    bad = [path for path, (w, b) in weights.items()
           if not torch.isfinite(w).all() or (b is not None and not torch.isfinite(b).all())]
    if bad:
        raise ValueError(f"cannot quantize: {', '.join(bad)} hold NaN or inf values")
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; expected one of {METHODS}")
    if method == "rtn" and calibration is not None:
        raise ValueError("calibration: round-to-nearest (method='rtn') uses no calibration text; "
                         "pass method='gptq' to use it")
    ids = None
    if method == "gptq":
        try:
            ids = calibration_ids(model, default_calibration() if calibration is None else calibration)
        except ValueError as e:
            if calibration is not None:
                raise
            raise ValueError(f"{e} (the packaged calibration text, encoded with this model's {model.config.tokenizer!r} "
                             f"tokenizer); pass calibration= token ids the model takes, or method='rtn'") from None
    return group_size, ids, sources, weights


@torch.no_grad()
def quantize_model(model, scheme: str, group_size: int | None = None, method: str = "gptq", calibration=None,
                   activations: str = DEFAULT_ACTIVATIONS, head: str = HEAD_SCHEME, progress: bool = False):
    """Weight-only quantize ``model`` in place: every block Conv1D (``c_attn``, ``attn.c_proj``,
    ``c_fc``, ``mlp.c_proj``) becomes a :class:`QuantizedLinear` and the LM head a
    :class:`QuantizedHead`.

    The LM head is quantized to ``head`` (int8 by default, :data:`HEAD_SCHEME`; or, with int4
    blocks, int4 in their groups) into ``model.lm_head``. When it is tied to ``wte``, ``wte`` is
    overwritten with the dequantized head, so the float embedding lookup and the head read the
    same numbers, and a checkpoint stores them once (quantized): the model reloads with
    identical logits. LayerNorms, biases and ``wpe`` stay float. An int4 head takes the blocks'
    activations (``"per_block"``: W4A8 in every product, as the blocks).

    ``method="gptq"`` (the default) rounds the weights by :func:`gptq`, block after block, so
    that the layers' outputs on the calibration text stay close to the float model's;
    ``"rtn"`` rounds each weight to nearest (gpt-fast's and llama.cpp's default: instant, no
    data). GPTQ takes seconds to minutes (docs/how-to/quantize.md) and reaches the top-1
    agreement with float32 that docs/explanation/quantization.md, "Quality", states.

    Each tensor's error is measured (:func:`error_row`) into ``model.quantization_report``;
    tensors with an abnormal error (e.g. an outlier channel stretching a scale) are listed in a
    :class:`QuantizationWarning`.

    Args:
        model: a float :class:`~gpt2mha.core.model.GPT2` on the CPU (eval mode afterwards; no
            parameter requires grad).
        scheme: ``"int8"`` or ``"int4"``; group_size: int4's group (default
            :data:`DEFAULT_GROUP_SIZE`), None for int8.
        method: ``"gptq"`` or ``"rtn"`` (:data:`METHODS`).
        calibration: GPTQ's text, or token ids ``[N]`` / ``[B, T]`` (:func:`calibration_ids`);
            None: the packaged :func:`default_calibration` text. Only with ``"gptq"``.
        activations: how the products treat the activations (:func:`set_activations`):
            ``"exact"`` (default), ``"per_row"`` or ``"auto"`` (int8), ``"per_block"`` (int4).
        head: the LM head's scheme, ``"int8"`` (default) or ``"int4"`` (int4 models only:
            on 124M a 24 MB head instead of 38.6, ~1.5 points less top-1 agreement with
            float32 on the built-in model; docs/explanation/quantization.md, "Quality").
        progress: show a progress bar on stderr (when it is a terminal): each tensor quantized,
            then each tensor's error measured.

    Returns:
        ``model``.

    Raises:
        ValueError: unknown scheme, head or method, an int4 head with int8 blocks, a group
            size the scheme or n_embd does not allow, calibration given with ``"rtn"`` or unusable (:func:`calibration_ids`), a
            model already quantized, or weights holding NaN/inf (named).
    """
    group_size, ids, sources, weights = _plan(model, scheme, group_size, method, calibration, head)
    tied = model.lm_head.weight is model.wte.weight
    before = _state_before(model, sources)
    model.eval()
    bar = progress_bar(desc=f"quantize {scheme} ({method})", total=2 * len(weights), unit="tensor", enabled=progress)
    try:
        if ids is not None:
            layers, hessians = _gptq_layers(model, scheme, group_size, ids, weights, head, bar)
        else:
            layers, hessians = {}, {}
            for path, (w, b) in _bar_over(bar, weights.items()):
                layers[path] = (QuantizedHead if path == "lm_head" else QuantizedLinear).from_float(
                    w, b, *((head, head_group(head, group_size)) if path == "lm_head" else (scheme, group_size)))
        bar.set_description(f"measure {scheme} errors", refresh=False)
        report = [error_row(path, w, layers[path], hessians.get(path)) for path, (w, b) in _bar_over(bar, weights.items())]
        install(model, layers, scheme, group_size, tied, head)
        if tied:                                                # a new tensor: never written in place
            model.wte.weight = nn.Parameter(layers["lm_head"].dequantized().to(before["wte"].dtype),
                                            requires_grad=False)
        model.quantization["method"] = method
        set_activations(model, activations)
    except BaseException:                                       # errors and Ctrl-C: the float model, as it was
        _restore(model, before)
        raise
    finally:
        bar.close()
    model.quantization_report = report
    abnormal = [r for r in report if r["abnormal"]]
    for r in abnormal:
        warnings.warn(f"{r['name']} {r['shape']}: abnormal {r['scheme']} quantization error ({r['robust_rel_error']:.3f} "
                      f"of the weights' robust spread, limit {ABNORMAL_ERROR[r['scheme']]}; an outlier channel or group "
                      f"stretching the scales?)", QuantizationWarning, stacklevel=3)
    return model




def check_activations(activations, scheme) -> None:
    """Raises ValueError unless ``activations`` is one of :data:`ACTIVATIONS` that ``scheme`` takes."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r}: expected one of {ACTIVATIONS}")
    if activations not in SCHEME_ACTIVATIONS[scheme]:
        raise ValueError(f"activations={activations!r} does not apply to scheme={scheme!r}: {scheme} takes "
                         f"{' or '.join(SCHEME_ACTIVATIONS[scheme])}")


def set_activations(model, activations: str) -> None:
    """Set how a quantized model's products treat the activations, in every
    :class:`QuantizedLinear` (:attr:`QuantizedLinear.activations`), and record it in
    ``model.quantization["activations"]`` (saved with the checkpoint):

    - ``"exact"``: integer pieces exact to ~1e-4 (:func:`~.int8_products.int8_matmul`), or float32
      products of the dequantized weight for many rows (:data:`~.linear.DEQUANTIZE_FROM_ROWS`).
    - ``"per_row"``: each activation row rounded to 8 bits with its own scale and zero point,
      over the weights re-rounded to 7 bits per output channel (:func:`~.int8_products.int8_matmul_per_row`;
      W7A8, in the spirit of CTranslate2's per-row int8), for every product: decode steps as
      well as prefill. One integer product instead of two: on an AVX2 CPU faster than float32
      in prefill of 64–512 tokens, where the exact route is slower; less close to float32:
      97.4% top-1 agreement on the built-in model against 99.4% (llama.cpp q8_0 98.3%, ONNX
      Runtime int8 96.3%, CTranslate2 int8 95.8%; benchmarks/results/quality.json).
    - ``"auto"``: per shape, the exact path for decode and the fast one for prefill:
      ``"exact"``'s integer pieces wherever ``"exact"`` runs them (decode steps,
      short prompts), ``"per_row"``'s W7A8 where ``"exact"`` would multiply by the dequantized
      float32 weight (:meth:`~.linear.QuantizedLinear.dequantize_for`: 64 tokens or more per
      sequence on CPUs without VNNI, where that GEMM is no faster than float32). Decode keeps
      the exact route's agreement; a prompt's forward (and a scored window) gets per_row's.
    - ``"per_block"`` (int4 models; ``"exact"`` is their default): every product, decode steps
      and prompts, runs the W4A8 kernel (``kernels/w4a8_products.cpp``), each activation row
      rounded to 8 bits per group of the weight's ``group_size`` inputs (llama.cpp's q8_0
      activations against its q4_0 weights), exact int32 sums over weights packed for it
      (:func:`~.gemv.int4_gemv`), each step and prompt in one C++ call on the CPU
      (:mod:`~gpt2mha.inference.native`); an int8 head stays exact, an int4 one
      (``head="int4"``) takes W4A8 as the blocks. Where the kernel does not build it changes
      nothing.

    Set on the layers of the model's scheme (an int4 model's int8 head keeps ``"exact"``; an int4
    head takes it).

    Raises:
        ValueError: ``model`` is not quantized, or ``activations`` is not one its scheme takes
            (:data:`~.linear.SCHEME_ACTIVATIONS`).
    """
    if not getattr(model, "quantization", None):
        raise ValueError("set_activations: the model is not quantized (call model.quantize('int8', ...) first)")
    check_activations(activations, model.quantization["scheme"])
    for m in model.modules():
        if isinstance(m, QuantizedLinear) and m.scheme == model.quantization["scheme"]:   # not an int4 model's int8 head
            m.activations = activations
    model.quantization["activations"] = activations
