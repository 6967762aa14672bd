"""Check a multi-head attention module someone wrote against GPT-2's attention, stage by stage.

``check("my_mha.py:MultiHeadAttention", {"d_in": 20, ...})`` imports the file (this RUNS ITS
CODE), builds the class, recognises its parameter layout from names and shapes
(``W_query/W_key/W_value[/out_proj]``, ``q_proj/k_proj/v_proj[/o_proj]``, a fused qkv
``nn.Linear``, ``c_attn/c_proj`` Conv1D, a ``heads`` ModuleList of single-head modules, or a
``torch.nn.MultiheadAttention`` inside the module), copies random reference weights in, and
runs it and a reference on the same input. What learners write is taken as it is: the head
count from the constructor argument passed, an attribute or the signature's default, else one
head of width d_out (the book's ``CausalAttention``); no ``out_proj`` means a reference
without one; bare ``nn.Parameter`` weights are tried as ``x @ W`` and ``x @ W.T``. It reports:

* each stage of seed 001's order (input, projections, view, transpose, scores, weights,
  contexts, merged, output) with the expected shape and the shape seen in the module (forward
  hooks on its submodules plus a ``TorchFunctionMode`` that records every tensor operation);
  a stage counts as seen when a recorded tensor equals the reference's, and the stage after
  the last one seen is the first differing stage;
* the output's max abs error, and for a module whose forward takes a cache (``past``,
  ``past_key_values``, ``kv_cache``, ``use_cache``, ``start_pos`` ...) the error of a cached step
  (first ``past`` tokens, then the rest with what the first call cached);
* eval-mode determinism: a second run, and with a dropout argument a copy built with dropout
  0.5 run twice, must give the dropout-0 output (``F.dropout`` without ``training=``);
* a diagnosis: the reference is re-run with each classic mistake (seeds 000-003) and the
  mistakes that reproduce the module's output exactly are named; shapes and exceptions add
  the mistakes that stop a module from running (a ``view`` on a non-contiguous tensor, a
  missing transpose before ``q @ kᵀ``).

Every check also rebuilds the module with another head count and runs it at
:data:`LONG_TOKENS` tokens (past 64), cached step included, so a hard-coded head count or a
fixed-size mask or window is caught. The cached step tries the common conventions
(:func:`cached_step`): a returned ``present`` fed back (``past``, ``layer_past``,
``past_key_values`` with ``use_cache``), a cache object filled in place (the user's ``*Cache``
class, transformers' ``Cache`` interface, a dict, a list), or a cache kept in the module
(``use_cache=True``, ``start_pos``).

Exit codes (the CLI): 0 the module matches, 1 it runs but does not match, 2 it could not be
checked (file, class, constructor, layout or forward failed), 3 it matches without a cache but
its forward takes a cache (argument, flag or position) that no convention could use, so the
cached path was not compared.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import inspect as pyinspect
import itertools
import json
import math
import os
import sys
import traceback
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.attention import attention_mask

#: Seed 001's stage order (``view``/``transpose`` do not exist in the wrapper layout).
STAGES = ("input", "projections", "view", "transpose", "scores", "weights", "contexts", "merged", "output")

#: Output max abs error under which a module matches.
TOL = 1e-4
#: Tolerances for "this recorded tensor is that reference stage".
RTOL, ATOL = 1e-4, 1e-5

#: Constructor defaults for parameters the caller did not give (d_in != d_out != head_dim on purpose,
#: so scaling by the wrong width is visible; T = 5 tokens differs from every width).
DEFAULT_KWARGS = {
    "d_in": 20, "d_out": 24, "num_heads": 4, "n_head": 4, "n_heads": 4, "nhead": 4,
    "n_embd": 24, "embed_dim": 24, "d_model": 24, "hidden_size": 24,
    "context_length": 16, "n_ctx": 16, "block_size": 16, "max_seq_len": 16, "n_positions": 16,
    "dropout": 0.0, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "dropout_p": 0.0, "attn_dropout": 0.0,
}
DROPOUT_NAMES = ("dropout", "attn_pdrop", "resid_pdrop", "dropout_p", "attn_dropout")
HEAD_NAMES = ("num_heads", "n_head", "n_heads", "nhead")
#: Where else a head count may live: constructor arguments and attributes under these names.
HEAD_ALIASES = HEAD_NAMES + ("num_attention_heads", "heads", "h", "n_h", "nheads")
CONTEXT_NAMES = ("context_length", "n_ctx", "block_size", "max_seq_len", "n_positions")

SPLIT_NAMES = (("W_query", "W_key", "W_value"), ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"),
               ("W_q", "W_k", "W_v"), ("wq", "wk", "wv"))
FUSED_NAMES = ("c_attn", "qkv", "W_qkv", "Wqkv", "qkv_proj", "in_proj", "to_qkv")
OUT_NAMES = ("out_proj", "o_proj", "c_proj", "W_o", "wo", "proj", "out")
#: Names of forward's cache argument, preferred in this order; any other argument whose name
#: holds one of :data:`CACHE_WORDS` is taken as a cache argument too (``my_kv=None``).
PAST_NAMES = ("past", "layer_past", "past_kv", "kv_cache", "past_key_value", "past_key_values", "cache",
              "layer_cache", "kv")
CACHE_WORDS = ("past", "cache", "kv")
#: Flags asking forward to return or keep its keys/values (any bool argument whose name holds a
#: cache word or "present" counts too).
PRESENT_FLAGS = ("return_present", "use_cache", "return_cache", "use_kv_cache", "return_kv", "cache_enabled")
#: Position arguments of a cached forward: "int" takes the first new token's position (llama's
#: ``start_pos``), "tensor" the new tokens' positions ``arange(P, P + T)`` (transformers'
#: ``cache_position``, gpt-fast's ``input_pos``; ``position_ids`` as ``[b, T]``).
POSITION_ARGS = {"start_pos": "int", "offset": "int", "past_length": "int", "pos": "int", "position_offset": "int",
                 "seqlen_offset": "int", "cache_position": "tensor", "input_pos": "tensor", "position_ids": "tensor"}
#: A second sequence length every check also runs (with the cache step): past 64, and past any
#: small fixed window or buffer a module may hide.
LONG_TOKENS = 70

#: Classic mistakes the reference can reproduce: key → diagnosis.
MISTAKES = {
    "interleaved_qkv": "q|k|v read as interleaved per-head chunks [q_h | k_h | v_h] of 3*head_dim columns; the fused "
                       "projection holds three contiguous d_out blocks, all q | all k | all v (GPT-2's c_attn layout): split it "
                       "with qkv.split(d_out, dim=-1) before view(b, T, num_heads, head_dim)",
    "split_no_transpose": "missing transpose when splitting heads: q, k and v must be (b, num_heads, T, head_dim) "
                          "= view(b, T, num_heads, head_dim).transpose(1, 2); left as (b, T, num_heads, head_dim), "
                          "or viewed straight as (b, num_heads, T, head_dim), tokens and heads get mixed",
    "merge_no_transpose": "missing transpose when merging heads: contexts (b, num_heads, T, head_dim) were viewed "
                          "straight as (b, T, d_out); use transpose(1, 2).contiguous().view(b, T, d_out)",
    "scale_d_out": "scores scaled by 1/sqrt(d_out) instead of 1/sqrt(head_dim) (keys.shape[-1] read before the "
                   "head split?)",
    "scale_d_in": "scores scaled by 1/sqrt(d_in) instead of 1/sqrt(head_dim)",
    "scale_head_dim_no_sqrt": "scores scaled by 1/head_dim instead of 1/sqrt(head_dim)",
    "scale_none": "scores not scaled: divide them by sqrt(head_dim)",
    "no_mask": "no causal mask: each token also attends to later tokens; fill scores where key j > query i "
               "with -inf before the softmax",
    "mask_not_offset": "causal mask not offset for a cache: with P cached tokens the T new queries need rows "
                       "P..P+T-1 of the mask (attention_mask(T, P+T), aligned bottom-right), not the top-left "
                       "[:T, :P+T] slice that hides each query's own and most recent keys",
    "past_ignored": "the cache is stored but never read: with P cached tokens the T new queries attend only to "
                    "each other; attend to the cached keys and values followed by the new ones (torch.cat([past_k, "
                    "k], dim=token axis), the same for v), or append to the cache instead of replacing it",
    "past_after_new": "cache concatenated in the wrong order: the new keys/values come before the cached ones; "
                      "the cached tokens are earlier positions: torch.cat([past_k, k]) along the token axis",
    "mask_after_softmax": "mask applied after the softmax without renormalising: masking the weights to 0 after "
                          "softmax leaves rows that no longer sum to 1 (and the future still shaped them); fill the "
                          "scores with -inf before the softmax",
    "anti_causal_mask": "anti-causal (transposed) mask: each token attends to itself and the LATER tokens; the "
                        "hidden positions are key j > query i, triu(ones, diagonal=1), not tril(ones, diagonal=-1) "
                        "or mask.T",
    "split_keys_no_transpose": "head split done wrong on the keys only: keys were viewed straight as (b, num_heads, "
                               "T, head_dim) while queries and values used view(b, T, num_heads, head_dim)"
                               ".transpose(1, 2); split the keys the same way",
    "softmax_queries": "softmax over the wrong axis: over queries (dim=-2); it must run over keys (dim=-1)",
    "softmax_heads": "softmax over the wrong axis: over heads (dim=1); it must run over keys (dim=-1)",
    "merge_wrong_order": "heads merged in the wrong order: (b, T, head_dim, num_heads) was flattened, so the "
                         "heads' features interleave; flatten (b, T, num_heads, head_dim) so head h occupies "
                         "columns h*head_dim ... (h+1)*head_dim",
    "heads_reversed": "heads concatenated in reverse order (head h must occupy columns h*head_dim ...)",
    "no_out_proj": "out_proj not applied: the output is the merged heads; apply the output projection, which "
                   "mixes the heads",
    "dropout_in_eval": "dropout active in eval mode: with dropout > 0 and module.eval() the output changes from "
                       "run to run (or differs from dropout = 0); F.dropout(x, p) defaults to training=True, so "
                       "write F.dropout(x, p, training=self.training) (or dropout_p=p if self.training else 0.0 "
                       "for scaled_dot_product_attention), or use an nn.Dropout module",
    "hard_coded_heads": "head count hard-coded: built with another head count, the module still splits into the "
                        "first configuration's number of heads (a literal in view(b, T, 4, head_dim), d_out // 4, "
                        "or self.num_heads set to a constant?); use the constructor's num_heads everywhere",
    "view_non_contiguous": "view on a non-contiguous tensor: after transpose(1, 2) the tensor must be made "
                           "contiguous before view (transpose(1, 2).contiguous().view(b, T, d_out)) or use reshape",
}

MATMUL_OPS = ("matmul", "__matmul__", "__rmatmul__", "bmm", "einsum", "baddbmm")
SOFTMAX_OPS = ("softmax", "_softmax")
VIEW_OPS = ("view", "reshape", "unflatten", "split", "chunk", "unbind", "tensor_split")
TRANSPOSE_OPS = ("transpose", "permute", "swapaxes", "swapdims", "movedim")


class CheckError(Exception):
    """The module could not be checked (exit code 2); the message says why."""


# ------------------------------------------------------------------------------ loading
def _where(e: BaseException, path: str | None = None) -> str:
    """`` (at FILE line N: code)`` for the deepest traceback frame in ``path`` (else outside torch)."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    if not mine:
        mine = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename and not f.filename.endswith("check.py")]
    if not mine:
        return ""
    f = mine[-1]
    return f" (at {os.path.basename(f.filename)} line {f.lineno}: {(f.line or '').strip()})"


def load_class(spec: str) -> type:
    """``"path/to/file.py:ClassName"`` or ``"package.module:ClassName"`` → the class.

    Importing the file RUNS ITS CODE.

    Raises:
        CheckError: no ``:ClassName``, the file does not exist, importing it fails, the class
            does not exist (the message lists the nn.Module classes found) or is no nn.Module.
    """
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise CheckError(f"{spec!r}: expected FILE.py:ClassName (or package.module:ClassName)")
    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise CheckError(f"{target}: no such file")
        mod_name = f"gpt2mha_check_{abs(hash(os.path.abspath(target)))}"
        mspec = importlib.util.spec_from_file_location(mod_name, target)
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        try:
            mspec.loader.exec_module(module)
        except BaseException as e:  # a user file may raise anything, SystemExit included
            sys.modules.pop(mod_name, None)
            raise CheckError(f"{target}: importing it raised {type(e).__name__}: {e}{_where(e, target)}") from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise CheckError(f"{target}: cannot import module: {type(e).__name__}: {e}") from None
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, nn.Module)
                       and v.__module__ == module.__name__)
        raise CheckError(f"{target}: no class {name!r}; nn.Module classes defined there: {', '.join(found) or 'none'}")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise CheckError(f"{spec}: {name} is not an nn.Module subclass")
    return cls


def parse_args(items: list[str] | None) -> dict:
    """``--args`` values → constructor kwargs.

    Each item is a JSON object (``'{"d_in": 20, "num_heads": 4}'``) or ``key=value`` pairs,
    comma-separated or as separate items; values are read as JSON when they parse (``4``,
    ``0.0``, ``true``, ``null``) and kept as strings otherwise.

    Raises:
        CheckError: an item that is neither.
    """
    kwargs = {}
    for item in items or []:
        item = item.strip()
        if item.startswith("{"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as e:
                raise CheckError(f"--args {item!r}: not valid JSON: {e}") from None
            if not isinstance(obj, dict):
                raise CheckError(f"--args {item!r}: expected a JSON object")
            kwargs.update(obj)
            continue
        for pair in filter(None, (p.strip() for p in item.split(","))):
            key, eq, value = pair.partition("=")
            if not eq or not key.strip().isidentifier():
                raise CheckError(f"--args {pair!r}: expected key=value (e.g. num_heads=4) or a JSON object")
            try:
                kwargs[key.strip()] = json.loads(value)
            except json.JSONDecodeError:
                kwargs[key.strip()] = value
    return kwargs


@dataclass
class ForwardArgs:
    """What forward's signature says about a cache: the cache argument (``past``,
    ``past_key_values``, ``kv_cache`` ...), the flag asking for it (``use_cache``,
    ``return_present`` ...), position arguments (:data:`POSITION_ARGS` name → kind, and which
    of them are required) and the cache argument's annotation (None when none or unresolved)."""

    cache: str | None = None
    flag: str | None = None
    positions: dict = field(default_factory=dict)
    required_positions: list = field(default_factory=list)
    annotation: object = None

    @property
    def takes_cache(self) -> bool:
        """Whether forward has any cache path to compare (a cache argument, flag or position)."""
        return bool(self.cache or self.flag or self.positions)

    def names(self) -> list[str]:
        return [n for n in (self.cache, self.flag) if n] + list(self.positions)


def forward_args(target) -> ForwardArgs:
    """Classify the arguments of ``target.forward`` (a module or its class) after the input.

    A name in :data:`POSITION_ARGS` is a position; one in :data:`PRESENT_FLAGS`, or a bool
    default whose name holds a cache word or "present", the flag; one in :data:`PAST_NAMES` or
    holding a :data:`CACHE_WORDS` word (not a length, size or index), the cache argument
    (the first of :data:`PAST_NAMES`' order when several).
    """
    fn = target.forward
    try:
        params = list(pyinspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ForwardArgs()
    if isinstance(target, type) and params and params[0].name == "self":
        params = params[1:]
    out, caches = ForwardArgs(), []
    for p in params[1:]:                                   # the first one is the input x
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        low = p.name.lower()
        words = any(w in low for w in CACHE_WORDS)
        if p.name in POSITION_ARGS:
            out.positions[p.name] = POSITION_ARGS[p.name]
            if p.default is p.empty:
                out.required_positions.append(p.name)
        elif p.name in PRESENT_FLAGS or (isinstance(p.default, bool) and (words or "present" in low)):
            out.flag = out.flag or p.name
        elif p.name in PAST_NAMES or (words and not low.endswith(("len", "length", "size", "idx", "index"))):
            caches.append(p)
    if caches:
        best = min(caches, key=lambda p: PAST_NAMES.index(p.name) if p.name in PAST_NAMES else len(PAST_NAMES))
        out.cache = best.name
        try:
            import typing
            out.annotation = typing.get_type_hints(fn).get(best.name)
        except Exception:                                  # an annotation that does not resolve: ignore it
            out.annotation = None
    return out


def forward_takes_past(cls: type) -> bool:
    """Whether ``cls.forward`` has a cache path: a cache argument, a flag or a position
    (:func:`forward_args`)."""
    return forward_args(cls).takes_cache


def constructor_kwargs(cls: type, given: dict, min_context: int) -> dict:
    """The caller's kwargs plus :data:`DEFAULT_KWARGS` for required parameters (and dropout → 0).

    A required context length the caller left out is ``max(16, min_context)``.

    Raises:
        CheckError: a required parameter with no known default, or a context length below
            ``min_context`` (the tokens of the check, plus the past when the cache is tested).
    """
    kwargs = dict(given)
    for p in list(pyinspect.signature(cls.__init__).parameters.values())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in kwargs:
            continue
        if p.name in DEFAULT_KWARGS and (p.default is p.empty or p.name in DROPOUT_NAMES):
            kwargs[p.name] = DEFAULT_KWARGS[p.name]
            if p.name in CONTEXT_NAMES:
                kwargs[p.name] = max(kwargs[p.name], min_context)
        elif p.default is p.empty:
            raise CheckError(f"{cls.__name__}.__init__ needs {p.name!r}, which has no default the checker knows: "
                             f"pass it with --args {p.name}=VALUE")
    for name in CONTEXT_NAMES:
        if isinstance(kwargs.get(name), int) and kwargs[name] < min_context:
            what = "past + tokens" if forward_takes_past(cls) else "tokens"
            raise CheckError(f"{name}={kwargs[name]} is shorter than the check's {what} = {min_context}; "
                             f"pass a larger {name} or fewer --tokens" + ("/--past" if "past" in what else ""))
    return kwargs


# ------------------------------------------------------------------------------- layout
@dataclass
class Proj:
    """One projection: its name, weight and bias, and whether the weight is stored ``[in, out]``
    (Conv1D or a bare parameter used as ``x @ W``) rather than ``nn.Linear``'s ``[out, in]``."""

    name: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    in_out: bool
    bias_rows: slice | None = None     #: this projection's rows of a packed bias (nn.MultiheadAttention)
    bare: bool = False                 #: a bare nn.Parameter (its orientation is a guess the check tries both ways)

    @property
    def d_in(self) -> int:
        return self.weight.shape[0] if self.in_out else self.weight.shape[1]

    @property
    def d_out(self) -> int:
        return self.weight.shape[1] if self.in_out else self.weight.shape[0]

    def set(self, W: torch.Tensor, b: torch.Tensor) -> None:
        """Copy ``W [out, in]`` (nn.Linear orientation) and ``b [out]`` in."""
        self.weight.copy_(W.T if self.in_out else W)
        if self.bias is not None:
            (self.bias if self.bias_rows is None else self.bias[self.bias_rows]).copy_(b)


@dataclass
class Layout:
    """A recognised parameter layout.

    ``kind`` is ``"split"`` (one projection per role), ``"fused"`` (one q|k|v projection) or
    ``"wrapper"`` (per-head modules); ``q``/``k``/``v`` hold one :class:`Proj` per head for
    the wrapper, one otherwise; ``qkv`` the fused projection; ``out`` the output projection
    (None if the module has none); ``other`` the parameters the check leaves as they are.
    """

    kind: str
    d_in: int
    d_out: int
    num_heads: int
    q: list = field(default_factory=list)
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    qkv: Proj | None = None
    out: Proj | None = None
    other: list = field(default_factory=list)
    heads_from: str = ""       #: where num_heads came from (constructor argument, attribute, default ...)
    single_head: bool = False  #: no head count anywhere: checked as one head of width d_out
    source: str = ""           #: e.g. "torch.nn.MultiheadAttention at attn (batch_first=True)"

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    def describe(self) -> str:
        if self.kind == "fused":
            names = [self.qkv.name]
        elif self.kind == "wrapper":                               # e.g. heads[i].W_query for i < 4
            container = self.q[0].name.split(".")[0]
            names = [f"{container}[i].{p.name.rsplit('.', 1)[-1]}" for p in (self.q[0], self.k[0], self.v[0])]
            names[-1] += f" for i < {self.num_heads}"
        else:
            names = [p[0].name for p in (self.q, self.k, self.v)]
        names.append(self.out.name if self.out else "no output projection")
        text = (f"{self.kind} ({', '.join(names)}) d_in={self.d_in} d_out={self.d_out} num_heads={self.num_heads} "
                f"head_dim={self.head_dim}")
        if self.single_head:
            text += " (single head: no head count found, checked as one head of width d_out)"
        elif self.heads_from:
            text += f" (num_heads from {self.heads_from})"
        return text + (f"; {self.source}" if self.source else "")


def _proj(module: nn.Module, name: str, prefix: str = "", bare_in_out: bool = True) -> Proj | None:
    """The projection ``module.<name>``: an nn.Linear, a Conv1D, or a bare 2-D parameter (taken
    as ``[in, out]``, used as ``x @ W``, when ``bare_in_out``; else ``[out, in]``, ``x @ W.T``)."""
    obj = module._modules.get(name) or module._parameters.get(name)
    full = prefix + name
    if isinstance(obj, nn.Parameter):
        return Proj(full, obj, None, bare_in_out, bare=True) if obj.dim() == 2 else None
    if not isinstance(obj, nn.Module):
        return None
    w, b = getattr(obj, "weight", None), getattr(obj, "bias", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    b = b if isinstance(b, torch.Tensor) else None
    if isinstance(obj, nn.Linear):
        return Proj(full, w, b, False)
    if type(obj).__name__ == "Conv1D":
        return Proj(full, w, b, True)
    return None


def _split_projs(module: nn.Module, prefix: str = "", bare_in_out: bool = True) -> tuple | None:
    for names in SPLIT_NAMES:
        ps = [_proj(module, n, prefix, bare_in_out) for n in names]
        if all(ps):
            return tuple(ps)
    return None


def _out_proj(module: nn.Module, bare_in_out: bool = True) -> Proj | None:
    return next((p for p in (_proj(module, n, "", bare_in_out) for n in OUT_NAMES) if p), None)


def _torch_mha_layout(module: nn.Module) -> Layout | None:
    """The layout of the first ``torch.nn.MultiheadAttention`` inside ``module`` (None if none).

    Packed form: ``in_proj_weight [3E, E]`` (q | k | v rows, nn.Linear orientation) and
    ``in_proj_bias [3E]``; separate form (when kdim/vdim differ from embed_dim):
    ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight`` with rows of the packed bias.
    ``out_proj`` is an nn.Linear. Source: ``torch.nn.MultiheadAttention`` and
    ``torch.nn.functional.multi_head_attention_forward``.
    """
    name, mha = next(((n, m) for n, m in module.named_modules() if isinstance(m, nn.MultiheadAttention)),
                     (None, None))
    if mha is None:
        return None
    pre = f"{name}." if name else ""
    E, bias = mha.embed_dim, mha.in_proj_bias
    out = Proj(f"{pre}out_proj", mha.out_proj.weight, mha.out_proj.bias, False)
    source = f"torch.nn.MultiheadAttention at {name or 'the module itself'} (batch_first={mha.batch_first})"
    if mha._qkv_same_embed_dim:
        qkv = Proj(f"{pre}in_proj_weight", mha.in_proj_weight, bias, False)
        layout = Layout("fused", E, E, mha.num_heads, qkv=qkv, out=out)
    else:
        ps = [Proj(f"{pre}{r}_proj_weight", getattr(mha, f"{r}_proj_weight"), bias, False,
                   slice(i * E, (i + 1) * E) if bias is not None else None) for i, r in enumerate("qkv")]
        layout = Layout("split", ps[0].d_in, E, mha.num_heads, [ps[0]], [ps[1]], [ps[2]], out=out)
    layout.heads_from, layout.source = f"{pre}num_heads = {mha.num_heads}", source
    return layout


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def num_heads_source(module: nn.Module, kwargs: dict) -> tuple[int | None, str]:
    """The module's head count and where it came from, or ``(None, "")``.

    Sources, in order: a constructor argument the checker passed (``num_heads``, ``n_head``,
    ``h`` ... see :data:`HEAD_ALIASES`), an int attribute of the module under one of those
    names, the default of such a parameter in the constructor's signature (``num_heads=4``).
    """
    for name in HEAD_ALIASES:
        if _is_count(kwargs.get(name)):
            return kwargs[name], f"constructor argument {name}={kwargs[name]}"
    for name in HEAD_ALIASES:
        value = getattr(module, name, None)
        if _is_count(value):
            return value, f"self.{name} = {value}"
    try:
        params = pyinspect.signature(type(module).__init__).parameters
    except (TypeError, ValueError):
        params = {}
    for name in HEAD_ALIASES:
        if name in params and _is_count(params[name].default):
            return params[name].default, f"signature default {name}={params[name].default}"
    return None, ""


def _num_heads(module: nn.Module, kwargs: dict) -> int | None:
    return num_heads_source(module, kwargs)[0]


def recognise_layout(module: nn.Module, kwargs: dict | None = None, bare_in_out: bool = True) -> Layout:
    """Recognise the module's parameter layout from its names and shapes.

    Known layouts: ``W_query/W_key/W_value`` (+ optional ``out_proj``), ``q_proj/k_proj/v_proj``
    (+ ``o_proj``) and the other :data:`SPLIT_NAMES`; a fused q|k|v projection (:data:`FUSED_NAMES`);
    GPT-2's ``c_attn/c_proj`` Conv1D; a ``heads`` ModuleList of single-head modules; a
    ``torch.nn.MultiheadAttention`` inside the module. Bare ``nn.Parameter`` weights are read as
    ``[in, out]`` (``x @ W``) when ``bare_in_out``, else as ``[out, in]`` (``x @ W.T``).

    The head count comes from :func:`num_heads_source`; with none anywhere, a split or fused
    layout is checked as a single head of width d_out (the book's ``CausalAttention``,
    ``SelfAttention_v1/v2``).

    Raises:
        CheckError: no known layout (the message lists every parameter found with its
            shape), or projections of inconsistent shapes.
    """
    kwargs = kwargs or {}
    layout = None
    split, fused = _split_projs(module, "", bare_in_out), None
    if split is None:
        fused = next((p for p in (_proj(module, n, "", bare_in_out) for n in FUSED_NAMES) if p and p.d_out % 3 == 0),
                     None)
    heads = None
    if split is None and fused is None:
        for name, child in module.named_children():
            if isinstance(child, nn.ModuleList) and len(child):
                per_head = [_split_projs(m, f"{name}.{i}.", bare_in_out) for i, m in enumerate(child)]
                if all(per_head):
                    heads = per_head
                    break
    if split is None and fused is None and heads is None:
        layout = _torch_mha_layout(module)
    if split is None and fused is None and heads is None and layout is None:
        found = ", ".join(f"{n} {list(p.shape)}" for n, p in module.named_parameters()) or "none"
        raise CheckError(
            f"cannot recognise the parameter layout of {type(module).__name__}; parameters found: {found}. "
            f"Known layouts: W_query/W_key/W_value (+ out_proj); q_proj/k_proj/v_proj (+ o_proj); a fused qkv "
            f"nn.Linear named {'/'.join(FUSED_NAMES[1:])} (+ out_proj/c_proj); c_attn/c_proj Conv1D; "
            f"heads = ModuleList of single-head modules with W_query/W_key/W_value; a torch.nn.MultiheadAttention")
    if layout is None:
        out = _out_proj(module, bare_in_out)
        if heads is not None:
            q, k, v = (list(p) for p in zip(*heads))
            layout = Layout("wrapper", q[0].d_in, sum(p.d_out for p in q), len(heads), q, k, v, out=out)
            layout.heads_from = f"{len(heads)} modules in {q[0].name.split('.')[0]}"
        elif fused is not None:
            layout = Layout("fused", fused.d_in, fused.d_out // 3, 0, qkv=fused, out=out)
        else:
            layout = Layout("split", split[0].d_in, split[0].d_out, 0, [split[0]], [split[1]], [split[2]], out=out)
        if layout.kind != "wrapper":
            layout.num_heads, layout.heads_from = num_heads_source(module, kwargs)
            if not layout.num_heads:
                layout.num_heads, layout.single_head = 1, True
    _check_layout_shapes(layout)
    projs = [p for p in layout.q + layout.k + layout.v + [layout.qkv, layout.out] if p]
    used = {id(p.weight) for p in projs} | {id(p.bias) for p in projs if p.bias is not None}
    layout.other = [n for n, p in module.named_parameters() if id(p) not in used]
    return layout


def has_bare_weights(layout: Layout) -> bool:
    """Whether any projection is a bare nn.Parameter (so its orientation is a guess)."""
    return any(p.bare for p in layout.q + layout.k + layout.v + [layout.qkv, layout.out] if p)


def _check_layout_shapes(layout: Layout) -> None:
    """Raise CheckError if the projections do not fit one multi-head attention."""
    projs = layout.q + layout.k + layout.v + ([layout.qkv] if layout.qkv else [])
    shapes = ", ".join(f"{p.name} {list(p.weight.shape)}" for p in projs)
    if len({p.d_in for p in projs}) != 1:
        raise CheckError(f"the q/k/v projections read different input widths: {shapes}")
    if layout.kind == "split" and len({p.d_out for p in projs}) != 1:
        raise CheckError(f"the q/k/v projections have different output widths: {shapes}")
    if layout.kind == "wrapper" and len({p.d_out for p in projs}) != 1:
        raise CheckError(f"the heads' projections have different widths: {shapes}")
    if layout.d_out % layout.num_heads:
        raise CheckError(f"d_out={layout.d_out} is not divisible by num_heads={layout.num_heads}")
    if layout.out is not None and (layout.out.d_in, layout.out.d_out) != (layout.d_out, layout.d_out):
        raise CheckError(f"{layout.out.name} maps {layout.out.d_in} -> {layout.out.d_out}; expected "
                         f"d_out -> d_out = {layout.d_out} -> {layout.d_out}")


# ---------------------------------------------------------------------------- reference
@dataclass
class RefParams:
    """Reference weights in nn.Linear orientation: ``Wq, Wk, Wv [d_out, d_in]``, biases
    ``[d_out]`` (zeros where the module has none), ``Wo [d_out, d_out]`` and ``bo`` or None."""

    Wq: torch.Tensor
    Wk: torch.Tensor
    Wv: torch.Tensor
    bq: torch.Tensor
    bk: torch.Tensor
    bv: torch.Tensor
    Wo: torch.Tensor | None
    bo: torch.Tensor | None


def make_params(layout: Layout, gen: torch.Generator) -> RefParams:
    """Random reference weights with the layout's shapes (std 1/sqrt(fan_in), so q·k is O(head_dim)
    and the scale matters); biases only where the module has them."""
    d, d_in = layout.d_out, layout.d_in

    def w(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    def b(projs):
        has = any(p.bias is not None for p in projs)
        return torch.randn(d, generator=gen) * 0.5 if has else torch.zeros(d)

    qkv = [layout.qkv] if layout.qkv else []
    Wo = bo = None
    if layout.out is not None:
        Wo = w(d, d)
        bo = torch.randn(d, generator=gen) * 0.5 if layout.out.bias is not None else torch.zeros(d)
    return RefParams(w(d, d_in), w(d, d_in), w(d, d_in), b(layout.q + qkv), b(layout.k + qkv), b(layout.v + qkv),
                     Wo, bo)


def copy_params(layout: Layout, p: RefParams) -> None:
    """Copy the reference weights into the module's parameters (in place, no grad)."""
    with torch.no_grad():
        if layout.kind == "fused":
            layout.qkv.set(torch.cat([p.Wq, p.Wk, p.Wv]), torch.cat([p.bq, p.bk, p.bv]))
        else:
            hd = layout.d_out // len(layout.q)                  # one projection, or one per head
            for i, (q, k, v) in enumerate(zip(layout.q, layout.k, layout.v)):
                rows = slice(i * hd, (i + 1) * hd)
                q.set(p.Wq[rows], p.bq[rows])
                k.set(p.Wk[rows], p.bk[rows])
                v.set(p.Wv[rows], p.bv[rows])
        if layout.out is not None:
            layout.out.set(p.Wo, p.bo)


def reference(x: torch.Tensor, p: RefParams, h: int, past: int = 0, mistakes=frozenset()) -> dict:
    """Multi-head causal attention written out, optionally with classic mistakes (:data:`MISTAKES` keys).

    Args:
        x: ``[b, S, d_in]``; the first ``past`` tokens play the cache, the last ``T = S - past``
            are the new tokens (queries).
        p: :class:`RefParams`; h: number of heads.

    Returns:
        Stage name → tensor for the new tokens: ``input [b,T,d_in]``, ``q``/``k``/``v``
        ``[b,T,d_out]``, ``qkv [b,T,3·d_out]``, ``view`` (q, k, v ``[b,T,h,hd]``),
        ``transpose`` (q, k, v ``[b,h,T,hd]``), ``scores [b,h,T,S]`` (q @ kᵀ, unscaled),
        ``weights [b,h,T,S]``, ``contexts [b,h,T,hd]``, ``merged [b,T,d_out]``, ``output``.
    """
    b, S, d_in = x.shape
    d = p.Wq.shape[0]
    hd, T = d // h, S - past
    q, k, v = x @ p.Wq.T + p.bq, x @ p.Wk.T + p.bk, x @ p.Wv.T + p.bv                # [b, S, d]
    if "interleaved_qkv" in mistakes:                                                 # [q_h | k_h | v_h] chunks
        q4, k4, v4 = torch.cat([q, k, v], -1).view(b, S, h, 3 * hd).split(hd, dim=-1)
    else:
        q4, k4, v4 = (t.view(b, S, h, hd) for t in (q, k, v))                         # [b, S, h, hd]
    if "split_no_transpose" in mistakes:
        qh, kh, vh = (t.reshape(b, h, S, hd) for t in (q4, k4, v4))                   # memory reinterpreted
    else:
        qh, kh, vh = (t.transpose(1, 2) for t in (q4, k4, v4))                        # [b, h, S, hd]
    if "split_keys_no_transpose" in mistakes:
        kh = k4.reshape(b, h, S, hd)                                                  # keys only
    ka, va, S_att = kh, vh, S                                                         # the keys attended to
    if past and "past_ignored" in mistakes:                                           # new keys only
        ka, va, S_att = kh[:, :, past:], vh[:, :, past:], T
    elif past and "past_after_new" in mistakes:                                       # [new | past]
        ka, va = (torch.cat([t[:, :, past:], t[:, :, :past]], dim=2) for t in (kh, vh))
    scores = qh[:, :, past:] @ ka.transpose(-1, -2)                                   # [b, h, T, S]
    denominator = {"scale_d_out": math.sqrt(d), "scale_d_in": math.sqrt(d_in), "scale_head_dim_no_sqrt": hd,
                   "scale_none": 1.0}
    scale = next((denominator[m] for m in denominator if m in mistakes), math.sqrt(hd))
    mask = attention_mask(T, S_att)
    if "mask_not_offset" in mistakes:
        mask = torch.ones(S_att, S_att, dtype=torch.bool).tril()[:T, :S_att]
    if "anti_causal_mask" in mistakes:                                                # key j >= query i + past
        mask = torch.arange(S_att)[None, :] >= torch.arange(T)[:, None] + (S_att - T)
    if "no_mask" in mistakes:
        mask = torch.ones(T, S_att, dtype=torch.bool)
    dim = -2 if "softmax_queries" in mistakes else 1 if "softmax_heads" in mistakes else -1
    if "mask_after_softmax" in mistakes:
        weights = torch.softmax(scores / scale, dim=dim).masked_fill(~mask, 0.0)
    else:
        weights = torch.softmax((scores / scale).masked_fill(~mask, float("-inf")), dim=dim)
    a = weights @ va                                                                  # [b, h, T, hd]
    if "merge_no_transpose" in mistakes:
        merged = a.contiguous().view(b, T, d)
    elif "merge_wrong_order" in mistakes:
        merged = a.permute(0, 2, 3, 1).reshape(b, T, d)                               # (hd, h) order
    elif "heads_reversed" in mistakes:
        merged = a.flip(1).transpose(1, 2).reshape(b, T, d)
    else:
        merged = a.transpose(1, 2).reshape(b, T, d)                                   # [b, T, d]
    out = merged if p.Wo is None or "no_out_proj" in mistakes else merged @ p.Wo.T + p.bo
    new = slice(past, S)
    return {"input": x[:, new], "q": q[:, new], "k": k[:, new], "v": v[:, new],
            "qkv": torch.cat([q, k, v], -1)[:, new],
            "view": [t[:, new] for t in (q4, k4, v4)], "transpose": [t[:, :, new] for t in (qh, kh, vh)],
            "scores": scores, "scale": scale, "mask": mask, "weights": weights, "contexts": a,
            "merged": merged, "output": out}


def applicable_mistakes(layout: Layout, cache_tested: bool) -> list[str]:
    """The :data:`MISTAKES` the reference can reproduce for this layout."""
    skip = {"view_non_contiguous", "dropout_in_eval", "hard_coded_heads"}
    if layout.kind != "fused":
        skip.add("interleaved_qkv")
    if layout.kind == "wrapper":
        skip |= {"split_no_transpose", "split_keys_no_transpose", "merge_no_transpose", "merge_wrong_order"}
    if layout.num_heads == 1:                       # one head: these change nothing
        skip |= {"split_no_transpose", "split_keys_no_transpose", "merge_no_transpose", "merge_wrong_order",
                 "heads_reversed", "softmax_heads", "interleaved_qkv"}
    if layout.out is None:
        skip.add("no_out_proj")
    if not cache_tested:
        skip |= {"mask_not_offset", "past_ignored", "past_after_new"}
    return [m for m in MISTAKES if m not in skip]


# ---------------------------------------------------------------------------- recording
@dataclass
class Op:
    """One recorded tensor operation: its name, output shape and value, index, softmax dim,
    and whether a parameter was an operand (a projection, not attention)."""

    name: str
    shape: tuple
    value: torch.Tensor
    dim: int | None = None
    on_param: bool = False


class Recorder(TorchFunctionMode):
    """Records every floating tensor (2-D or more) produced by a torch operation, cloned (so
    in-place edits after it do not change the record)."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__setitem__", "size", "dim"):
            return out
        dim = kwargs.get("dim", args[1] if len(args) > 1 and isinstance(args[1], int) else None)
        on_param = any(isinstance(a, nn.Parameter) for a in args)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.is_floating_point():
                self.ops.append(Op(name, tuple(o.shape), o.detach().clone(), dim if name in SOFTMAX_OPS else None,
                                   on_param))
        return out


@dataclass
class Run:
    """One forward of the module: its output (or None), present, recorded ops, hook calls
    ``(module name, output shape)`` and the exception it raised (or None)."""

    output: torch.Tensor | None
    present: object
    ops: list
    calls: list
    error: BaseException | None = None


def _shape(t) -> tuple | None:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def run_module(module: nn.Module, x: torch.Tensor, **kwargs) -> Run:
    """Run ``module(x, **kwargs)`` under no_grad with the recorder and forward hooks on every
    submodule. Exceptions are caught into :attr:`Run.error`."""
    rec, calls = Recorder(), []
    def hook(name):
        return lambda mod, inp, out: calls.append((name, _shape(out[0] if isinstance(out, tuple) else out)))

    handles = [m.register_forward_hook(hook(name)) for name, m in module.named_modules() if name]
    output = present = error = None
    try:
        with torch.no_grad(), rec:
            result = module(x, **kwargs)
        output, present = result, None
        if isinstance(result, (tuple, list)):
            output, present = result[0], (result[1] if len(result) > 1 else None)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"forward returned {type(output).__name__}; expected a tensor or a (tensor, ...) tuple")
    except (Exception, SystemExit) as e:   # the user's forward may raise anything
        error, output = e, None
    finally:
        for h in handles:
            h.remove()
    ops = [Op("input", tuple(x.shape), x.clone())] + rec.ops
    if output is not None:
        ops.append(Op("output", tuple(output.shape), output.detach().clone()))
    return Run(output, present, ops, calls, error)


# -------------------------------------------------------------------------------- cache
class HFStyleCache:
    """An empty cache with the part of transformers' ``Cache`` interface attention layers call:
    ``update(key_states, value_states, layer_idx, cache_kwargs=None)`` appends ``[b, h, T, hd]``
    keys and values on the token axis (-2) and returns everything stored for that layer;
    ``get_seq_length(layer_idx=0)``, ``get_usable_length``, ``len()`` and ``cache[layer_idx]``
    → ``(keys, values)``. Source: transformers ``cache_utils.DynamicCache``."""

    def __init__(self):
        self.key_cache: dict[int, torch.Tensor] = {}
        self.value_cache: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx=0, cache_kwargs=None):
        if layer_idx in self.key_cache:
            key_states = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            value_states = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        self.key_cache[layer_idx], self.value_cache[layer_idx] = key_states, value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx=0) -> int:
        return self.key_cache[layer_idx].shape[-2] if layer_idx in self.key_cache else 0

    def get_usable_length(self, new_seq_length=0, layer_idx=0) -> int:
        return self.get_seq_length(layer_idx)

    def __len__(self) -> int:
        return len(self.key_cache)

    def __getitem__(self, layer_idx):
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


def _fingerprint(obj, depth: int = 3):
    """What identifies the contents of ``obj`` (tensors by identity, shape and version; containers
    and plain objects by their items), so an in-place write into it is noticed."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), tuple(obj.shape), None if obj.is_inference() else obj._version)
    if isinstance(obj, (bool, int, float, str, type(None))):
        return obj
    if depth == 0 or isinstance(obj, nn.Module) or callable(obj) and not hasattr(obj, "__dict__"):
        return ("object", id(obj))
    if isinstance(obj, dict):
        return ("dict", tuple((repr(k), _fingerprint(v, depth - 1)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return ("list", tuple(_fingerprint(v, depth - 1) for v in obj))
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return ("object", type(obj).__name__, _fingerprint(vars(obj), depth - 1))
    return ("object", id(obj))


def _module_state(module: nn.Module):
    """Fingerprint of what a module keeps between calls: its buffers and plain attributes
    (``self.cache_k``, ``self.ptr_current_pos`` ...), in every submodule."""
    return tuple((name, _fingerprint({k: v for k, v in vars(m).items() if not k.startswith("_") or k == "_buffers"}))
                 for name, m in module.named_modules())


def _fresh(module: nn.Module) -> nn.Module:
    """A deep copy (so a cache kept in the module does not touch the module checked), or the
    module itself when it cannot be copied."""
    try:
        return copy.deepcopy(module)
    except Exception:
        return module


def position_kwargs(fa: ForwardArgs, start: int, T: int, b: int, names=None) -> dict:
    """Values of forward's position arguments for ``T`` tokens starting at position ``start``."""
    out = {}
    for name in (fa.positions if names is None else names):
        pos = torch.arange(start, start + T)
        out[name] = start if fa.positions[name] == "int" else (pos.expand(b, T) if name == "position_ids" else pos)
    return out


def plain_kwargs(module: nn.Module, T: int, b: int) -> dict:
    """Arguments a plain (uncached) forward needs besides x: required positions, at 0."""
    fa = forward_args(module)
    return position_kwargs(fa, 0, T, b, fa.required_positions)


#: Constructor argument names of a cache class, and which size fills them.
CACHE_CLASS_ARGS = {"batch_size": "b", "max_batch_size": "b", "batch": "b", "b": "b", "bsz": "b",
                    "max_seq_len": "S", "max_seq_length": "S", "max_len": "S", "max_length": "S", "seq_len": "S",
                    "context_length": "S", "max_cache_len": "S", "n_heads": "h", "num_heads": "h", "n_head": "h",
                    "n_kv_heads": "h", "num_kv_heads": "h", "head_dim": "hd", "d_head": "hd"}


def _annotation_classes(annotation) -> list[type]:
    import typing
    if isinstance(annotation, type):
        return [annotation]
    return [c for arg in typing.get_args(annotation) for c in _annotation_classes(arg)]


def _cache_factories(module: nn.Module, fa: ForwardArgs, sizes: dict) -> list[tuple[str, object]]:
    """Empty caches to hand forward's cache argument, each ``(description, factory)``: the class
    its annotation names and the ``*Cache*`` classes defined beside the module (built with no
    arguments, or with the sizes their required arguments name, :data:`CACHE_CLASS_ARGS`), an
    :class:`HFStyleCache`, a dict, a list."""
    classes = [c for c in _annotation_classes(fa.annotation)
               if c.__module__ not in ("builtins", "torch", "typing") and not issubclass(c, (nn.Module, torch.Tensor))]
    home = sys.modules.get(type(module).__module__)
    if home is not None:
        classes += [c for c in vars(home).values() if isinstance(c, type) and "cache" in c.__name__.lower()
                    and c.__module__ == home.__name__ and not issubclass(c, (nn.Module, torch.Tensor))
                    and c not in classes]
    out = []
    for c in classes:
        try:
            params = [p for p in pyinspect.signature(c).parameters.values()
                      if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        except (TypeError, ValueError):
            continue
        if all(sizes.get(CACHE_CLASS_ARGS.get(p.name.lower())) is not None for p in params):
            args = {p.name: sizes[CACHE_CLASS_ARGS[p.name.lower()]] for p in params}
            shown = ", ".join(f"{k}={v}" for k, v in args.items())
            out.append((f"a {c.__name__}({shown}) filled in place", lambda c=c, args=args: c(**args)))
    out += [("a cache object with transformers' Cache interface (update(k, v, layer_idx)) filled in place",
             HFStyleCache), ("a dict filled in place", dict), ("a list filled in place", list)]
    return out


@dataclass
class CacheResult:
    """The cached step: ``status`` "tested" (``step`` is the run of the new tokens), "failed"
    (forward raised on it), "untested" (forward takes a cache the check could not use) or
    "none" (forward takes no cache); ``text`` says which and how the cache was passed."""

    status: str
    text: str
    step: Run | None = None


def cached_step(module: nn.Module, x: torch.Tensor, P: int, num_heads: int | None = None,
                head_dim: int | None = None) -> CacheResult:
    """Run ``module`` on the first ``P`` tokens of ``x [b, P + T, d_in]``, then on the last T
    with what it cached, trying each common convention on a fresh copy of the module:

    * returned: ``out, present = m(x1[, flag=True])``, then ``m(x2, cache=present)`` (OpenAI's
      ``past``, transformers' legacy ``layer_past``/``past_key_values`` with ``use_cache``);
    * filled in place: the same cache object passed to both calls (:func:`_cache_factories`:
      a ``*Cache`` class of the user's, transformers' Cache interface, a dict, a list);
    * kept in the module: a flag (``use_cache=True``) or positions (``start_pos``) and no cache
      argument, the module's own state changing between calls (the book's KV-cache chapter,
      llama's ``cache_k``).

    A convention counts when the first call stored something (a present returned, the object
    or the module changed); position arguments get ``0`` then ``P``. ``num_heads``/``head_dim``
    fill a cache class's constructor arguments of those names.
    """
    fa = forward_args(module)
    b, S, _ = x.shape
    T = S - P
    if not fa.takes_cache:
        return CacheResult("none", "not tested (forward takes no cache argument)")
    if P == 0:
        return CacheResult("untested", f"not tested (--past 0), although forward takes {', '.join(fa.names())}")
    flag = {fa.flag: True} if fa.flag else {}
    attempts = []                                               # (description, kind, factory)
    if fa.cache:
        attempts.append((f"{fa.cache}=present", "returned", None))
        sizes = {"b": b, "S": S, "h": num_heads, "hd": head_dim}
        attempts += [(f"{fa.cache} = {d}", "in place", f) for d, f in _cache_factories(module, fa, sizes)]
    else:
        attempts.append(((f"{fa.flag}=True" if fa.flag else ", ".join(fa.positions)) + ", the cache kept in the module",
                         "module", None))
    tried, failed = [], None
    for what, kind, factory in attempts:
        m = _fresh(module)
        container = factory() if factory else None
        first_kw = {**flag, **position_kwargs(fa, 0, P, b)}
        step_kw = {**flag, **position_kwargs(fa, P, T, b)}
        if kind == "in place":
            first_kw[fa.cache] = step_kw[fa.cache] = container
        before = _fingerprint(container) if kind == "in place" else _module_state(m)
        first = run_module(m, x[:, :P], **first_kw)
        if first.error is not None:
            tried.append(f"{what}: forward on the first {P} tokens raised {type(first.error).__name__}: {first.error}")
            continue
        if kind == "returned":
            took = first.present is not None
            step_kw[fa.cache] = first.present
        else:
            took = (_fingerprint(container) if kind == "in place" else _module_state(m)) != before
        if not took:
            tried.append(f"{what}: the first {P} tokens " + ("returned no present" if kind == "returned"
                                                             else "stored nothing"))
            continue
        step = run_module(m, x[:, P:], **step_kw)
        if step.error is None and step.output is not None:
            return CacheResult("tested", f"tested: {P} past tokens, then {T} new ones with {what}", step)
        failed = failed or (what, step.error)
        tried.append(f"{what}: forward on the new tokens raised {type(step.error).__name__}: {step.error}")
    if failed is not None:
        what, error = failed
        return CacheResult("failed", f"failed: forward with {what} raised {type(error).__name__}: {error}")
    return CacheResult("untested", f"not tested: forward takes {', '.join(fa.names())} but no way of passing a cache "
                                   f"worked (tried {'; '.join(tried)})")


# ------------------------------------------------------------------------------- stages
@dataclass
class StageRow:
    """One row of the report: stage, expected shape (and count), shape seen, whether the
    reference values were found, and where (op or module name)."""

    stage: str
    expected: tuple | None
    count: int
    seen: tuple | None
    found: bool
    where: str = ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b.to(a.dtype), rtol=RTOL, atol=ATOL, equal_nan=True)


def _find(ops: list[Op], ref: torch.Tensor) -> Op | None:
    return next((op for op in ops if op.shape == tuple(ref.shape) and _same(op.value, ref)), None)


def expected_stages(layout: Layout, ref: dict) -> dict[str, list[torch.Tensor] | None]:
    """Stage → reference tensors the module should produce somewhere (None: not in this layout).
    For the wrapper, head 0's slice; for scores, any of unscaled/scaled, masked or not."""
    wrapper = layout.kind == "wrapper"
    hd = layout.head_dim
    s, scaled = ref["scores"], ref["scores"] / ref["scale"]
    m = ref["mask"]
    score_forms = [s, scaled, s.masked_fill(~m, float("-inf")), scaled.masked_fill(~m, float("-inf")),
                   scaled.masked_fill(~m, -1e10), s.masked_fill(~m, -1e10)]
    head0 = (lambda t: t[:, 0]) if wrapper or layout.single_head else (lambda t: t)   # [b, T, ...] per head
    return {
        "input": [ref["input"]],
        "projections": ([ref[n][..., :hd] for n in "qkv"] if wrapper else
                        [ref["qkv"]] if layout.kind == "fused" else [ref["q"], ref["k"], ref["v"]]),
        "view": None if wrapper or layout.single_head else ref["view"],          # one head: nothing to split
        "transpose": None if wrapper or layout.single_head else ref["transpose"],
        "scores": [head0(t) for t in score_forms],
        "weights": [head0(ref["weights"])],
        "contexts": [head0(ref["contexts"])],
        "merged": None if wrapper or layout.out is None else [ref["merged"]],
        "output": [ref["output"]],
    }


def _role_indices(ops: list[Op]) -> dict[str, int | None]:
    """Best guess of which recorded op plays each stage, for the "seen" shape when values differ."""
    mm = [i for i, o in enumerate(ops) if o.name in MATMUL_OPS and not o.on_param]
    sm = next((i for i, o in enumerate(ops) if o.name in SOFTMAX_OPS), None)
    sdpa = next((i for i, o in enumerate(ops) if o.name == "scaled_dot_product_attention"), None)
    scores = next((i for i in mm if sm is None or i < sm), None)
    contexts = next((i for i in mm if sm is not None and i > sm), sdpa)
    before = scores if scores is not None else (sdpa if sdpa is not None else len(ops))
    view = next((i for i, o in enumerate(ops[:before]) if o.name in VIEW_OPS and len(o.shape) == 4), None)
    trans = next((i for i, o in enumerate(ops[:before]) if o.name in TRANSPOSE_OPS and len(o.shape) == 4), None)
    merged = None
    if contexts is not None:                       # the last 3-D op before the output projection (or the output)
        out_proj = next((i for i in range(contexts + 1, len(ops)) if ops[i].on_param), None)
        end = out_proj if out_proj is not None else len(ops) - (ops[-1].name == "output")
        merged = next((i for i in range(end - 1, contexts, -1) if len(ops[i].shape) == 3), None)
    return {"input": 0, "projections": next((i for i, o in enumerate(ops) if o.on_param), None),
            "view": view, "transpose": trans, "scores": scores, "weights": sm, "contexts": contexts,
            "merged": merged, "output": len(ops) - 1 if ops[-1].name == "output" else None}


def stage_rows(layout: Layout, ref: dict, run: Run) -> list[StageRow]:
    """Compare the recorded ops with the reference stage by stage (see :func:`expected_stages`)."""
    expected = expected_stages(layout, ref)
    roles = _role_indices(run.ops)
    rows = []
    for stage in STAGES:
        tensors = expected[stage]
        if tensors is None:
            continue
        if stage == "scores":
            hit = next((op for op in (_find(run.ops, t) for t in tensors) if op), None)
            found, count, where = hit is not None, 1, hit.name if hit else ""
        else:
            hits = [_find(run.ops, t) for t in tensors]
            found, count = all(hits), len(tensors)
            hit = hits[0]
            where = ", ".join(sorted({h.name for h in hits if h})) if found else ""
        i = roles.get(stage)
        seen = hit.shape if found else (run.ops[i].shape if i is not None else None)
        if stage == "projections" and layout.kind == "wrapper":
            count = 3 * layout.num_heads
        rows.append(StageRow(stage, tuple(tensors[0].shape), count, seen, found, where))
    return rows


def first_differing(rows: list[StageRow]) -> str | None:
    """The stage after the last stage whose values were found (None if the output was found)."""
    if rows and rows[-1].found:
        return None
    last = max((i for i, r in enumerate(rows) if r.found), default=-1)
    return rows[min(last + 1, len(rows) - 1)].stage


# ----------------------------------------------------------------------------- diagnosis
def _max_err(a: torch.Tensor | None, b: torch.Tensor) -> float:
    if a is None or a.shape != b.shape:
        return float("inf")
    diff = (a.float() - b.float()).abs()
    both_nan = a.isnan() & b.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def diagnose_by_reproduction(x, p: RefParams, layout: Layout, outputs: dict[int, torch.Tensor], T: int,
                             candidates: list[str]) -> list[str]:
    """Mistakes (one, else two together) whose reference reproduces the module's outputs.

    Args:
        x: ``[b, P+T, d_in]``; outputs: past length → the module's output for the last T
            tokens (0: the full run on ``x[:, P:]``; P: the cached step), each compared.
    """
    P = x.shape[1] - T

    def reproduces(ms) -> bool:
        for past, y in outputs.items():
            xs = x if past else x[:, P:]
            if _max_err(y, reference(xs, p, layout.num_heads, past, frozenset(ms))["output"]) > TOL:
                return False
        return True

    for size in (1, 2):
        found = [list(ms) for ms in itertools.combinations(candidates, size) if reproduces(ms)]
        if found:
            return sorted({m for ms in found for m in ms}, key=list(MISTAKES).index) if size == 1 else found[0]
    return []


def diagnose_by_shapes(run: Run, b: int, T: int, h: int) -> list[str]:
    """Mistakes visible from the recorded ops and the exception: a softmax over an axis other
    than the last, scores of shape (b, T, h, h) (q and k not transposed), a view on a
    non-contiguous tensor."""
    found = []
    for op in run.ops:
        if op.name in SOFTMAX_OPS and op.dim is not None and len(op.shape) >= 3:
            dim = op.dim % len(op.shape)
            if dim == len(op.shape) - 2:
                found.append("softmax_queries")
            elif dim == 1 and len(op.shape) == 4:
                found.append("softmax_heads")
        if op.name in MATMUL_OPS and not op.on_param and op.shape == (b, T, h, h) and T != h:
            found.append("split_no_transpose")
    if run.error is not None and "view size is not compatible" in str(run.error):
        found.append("view_non_contiguous")
    return sorted(set(found), key=list(MISTAKES).index)


# -------------------------------------------------------------------------------- report
@dataclass
class CheckReport:
    """Everything :func:`check` found; ``exit_code`` is 0 match, 1 mismatch, 2 could not run,
    3 match without cache (forward takes a cache that could not be compared); ``verdict`` is
    "match", "mismatch", "error" or "match_without_cache". ``variations``: the other head count
    and length checked (:class:`Variation`)."""

    target: str
    verdict: str = "error"
    exit_code: int = 2
    kwargs: dict = field(default_factory=dict)
    layout: str = ""
    config: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)
    first_differing_stage: str | None = None
    max_abs_error: float | None = None
    cache: str = "not tested"
    cache_max_abs_error: float | None = None
    cache_stages: list = field(default_factory=list)
    dropout: str = "not tested"
    diagnoses: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    error: str | None = None
    modules_called: list = field(default_factory=list)
    variations: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["diagnosis_text"] = [MISTAKES[m] for m in self.diagnoses]
        for item in [d] + d["variations"]:
            for key in ("max_abs_error", "cache_max_abs_error"):
                if item[key] is not None and not math.isfinite(item[key]):
                    item[key] = str(item[key])
        return d


def _build(target, kwargs: dict, tokens: int, past: int) -> tuple[nn.Module, dict]:
    """Load (if a string), fill kwargs and construct the module in eval mode; the context must
    hold ``tokens`` (plus ``past`` when forward takes a cache, so the cache step can run)."""
    cls = load_class(target) if isinstance(target, str) else target
    kwargs = constructor_kwargs(cls, kwargs, tokens + (past if forward_takes_past(cls) else 0))
    return _construct(cls, kwargs), kwargs


def _construct(cls, kwargs: dict) -> nn.Module:
    try:
        module = cls(**kwargs)
    except (Exception, SystemExit) as e:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise CheckError(f"{cls.__name__}({args}) raised {type(e).__name__}: {e}{_where(e)}") from None
    return module.float().eval()


def check(target, kwargs: dict | None = None, *, batch: int = 2, tokens: int = 5, past: int = 3,
          seed: int = 0, long_tokens: int = LONG_TOKENS, vary_heads: bool = True) -> CheckReport:
    """Check a multi-head attention module against the reference (see the module docstring).

    Args:
        target: ``"FILE.py:ClassName"``, ``"package.module:ClassName"`` or an nn.Module class.
            Loading a file RUNS ITS CODE.
        kwargs: constructor arguments; required ones the caller leaves out are filled from
            :data:`DEFAULT_KWARGS` (d_in=20, d_out=24, num_heads=4, context_length=16 or the
            tokens needed, dropout=0).
        batch, tokens: input ``[batch, tokens, d_in]``; past: cached tokens for the cache step
            (0 skips it; it runs only when forward takes a cache argument, flag or position
            (:func:`forward_args`), and only then must the context hold past + tokens).
        seed: seed of the random input and weights.
        long_tokens: a second length checked (default :data:`LONG_TOKENS`, past 64; 0 skips it);
            vary_heads: also rebuild the module with another head count.

    Bare ``nn.Parameter`` weights are tried as ``[in, out]`` (``x @ W``) and as ``[out, in]``
    (``x @ W.T``); the report keeps the convention that matches (else the one that runs) and
    says which. With a dropout argument the module is also built with dropout 0.5 and run
    twice in eval mode: both outputs must equal the dropout-0 output. The cached step tries
    each common way of passing a cache (:func:`cached_step`); when forward takes one and none
    works, a matching module gets the verdict "match_without_cache" (exit code 3).

    Returns:
        :class:`CheckReport`; never raises for a faulty module (verdict "error", exit code 2).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # tensors of a few hundred numbers: threads only add overhead
    try:
        return _check(target, kwargs, batch, tokens, past, seed, long_tokens, vary_heads)
    finally:
        torch.set_num_threads(threads)


def _check(target, kwargs, batch, tokens, past, seed, long_tokens, vary_heads) -> CheckReport:
    name = target if isinstance(target, str) else getattr(target, "__name__", repr(target))
    report = CheckReport(target=name)
    given = dict(kwargs or {})
    opts = dict(given=given, long_tokens=long_tokens, vary_heads=vary_heads)
    try:
        if batch < 1 or tokens < 2 or past < 0 or long_tokens < 0:
            raise CheckError(f"need batch >= 1, tokens >= 2, past >= 0 and long_tokens >= 0 (got {batch}, {tokens}, "
                             f"{past}, {long_tokens})")
        module, report.kwargs = _build(target, dict(given), tokens, past)
        try:
            layout = recognise_layout(module, report.kwargs)
        except CheckError as e:                 # bare weights read as [in, out] may not fit; try [out, in]
            try:
                layout = recognise_layout(module, report.kwargs, bare_in_out=False)
            except CheckError:
                raise e from None
        if not has_bare_weights(layout):
            _run_check(module, layout, report, batch, tokens, past, seed, **opts)
        else:
            report = _check_both_conventions(module, report, batch, tokens, past, seed, opts)
    except CheckError as e:
        report.verdict, report.exit_code, report.error = "error", 2, str(e)
    return report


CONVENTIONS = {True: "[in, out], used as x @ W", False: "[out, in], used as x @ W.T (nn.Linear's convention)"}


def _check_both_conventions(module, report: CheckReport, b, T, P, seed, opts: dict) -> CheckReport:
    """Run the check with bare weights read as ``[in, out]`` and as ``[out, in]``; keep the best."""
    def attempt(in_out: bool, diagnose: bool) -> CheckReport:
        r = dataclasses.replace(report, notes=[], diagnoses=[], stages=[], cache_stages=[], variations=[])
        try:
            _run_check(module, recognise_layout(module, report.kwargs, bare_in_out=in_out), r, b, T, P, seed,
                       diagnose, bare_in_out=in_out, **opts)
        except CheckError as e:
            r.verdict, r.exit_code, r.error = "error", 2, str(e)
        return r

    tried = []
    for in_out in (True, False):                      # without the (slower) diagnosis by reproduction
        tried.append((in_out, attempt(in_out, False)))
        if tried[-1][1].verdict in ("match", "match_without_cache"):
            break
    rank = {0: 0, 3: 1, 1: 2, 2: 3}                     # match, match without cache, mismatch, error
    in_out, best = min(tried, key=lambda t: (rank[t[1].exit_code], not t[0]))
    if best.verdict == "mismatch":
        best = attempt(in_out, True)
    others = [f"{CONVENTIONS[i]}: {r.verdict}" for i, r in tried if i != in_out]
    if best.verdict in ("match", "match_without_cache"):
        best.notes.append(f"bare nn.Parameter weights: the module stores them {CONVENTIONS[in_out]}")
    else:
        best.notes.append(f"bare nn.Parameter weights: tried both conventions; reporting {CONVENTIONS[in_out]}"
                          + (f" (other: {'; '.join(others)})" if others else ""))
    return best


def _run_check(module, layout: Layout, report: CheckReport, b: int, T: int, P: int, seed: int,
               diagnose: bool = True, given: dict | None = None, long_tokens: int = LONG_TOKENS,
               vary_heads: bool = True, bare_in_out: bool = True) -> None:
    """Fill ``report`` for a built module with a recognised layout (``diagnose``: also look for the
    classic mistakes that reproduce a mismatch). When the output and the cached step match, the
    module is also built and checked with another head count and at ``long_tokens`` tokens
    (:func:`plan_variations`; ``given``: the constructor arguments the caller passed)."""
    h, hd = layout.num_heads, layout.head_dim
    report.layout = layout.describe()
    report.config = dict(b=b, T=T, past=P, d_in=layout.d_in, d_out=layout.d_out, num_heads=h, head_dim=hd, seed=seed)
    if layout.other:
        report.notes.append(f"parameters outside the attention layout, left as they are: {', '.join(layout.other)}")
    if layout.single_head:
        report.notes.append("no head count found (no num_heads argument, attribute or default): checked as one head "
                            "of width d_out. If the module has several heads, keep the count in self.num_heads or "
                            "take it as a constructor argument num_heads")
    gen = torch.Generator().manual_seed(seed)
    p = make_params(layout, gen)
    try:
        copy_params(layout, p)
    except RuntimeError as e:
        raise CheckError(f"could not copy the reference weights in: {e}") from None
    x = torch.randn(b, P + T, layout.d_in, generator=gen)
    ref = reference(x[:, P:], p, h)
    plain = plain_kwargs(module, T, b)
    run = run_module(module, x[:, P:], **plain)
    report.modules_called = sorted({n for n, _ in run.calls})
    report.stages = stage_rows(layout, ref, run)
    report.diagnoses = diagnose_by_shapes(run, b, T, h)
    if run.error is not None:
        report.first_differing_stage = first_differing(report.stages)
        raise CheckError(f"forward raised {type(run.error).__name__}: {run.error}{_where(run.error)}")
    report.max_abs_error = _max_err(run.output, ref["output"])
    outputs = {0: run.output}
    if run.output.shape != ref["output"].shape:
        report.notes.append(f"output shape {tuple(run.output.shape)} != expected {tuple(ref['output'].shape)}")
    cache = cached_step(module, x, P, h, hd)
    report.cache = cache.text
    if cache.status == "failed":
        report.cache_max_abs_error = float("inf")
    elif cache.status == "tested":
        ref_cached = reference(x, p, h, P)
        report.cache_max_abs_error = _max_err(cache.step.output, ref_cached["output"])
        report.cache_stages = stage_rows(layout, ref_cached, cache.step)
        outputs[P] = cache.step.output
    report.first_differing_stage = first_differing(report.stages)
    if report.first_differing_stage is None and report.cache_stages:
        cached = first_differing(report.cache_stages)
        report.first_differing_stage = cached and f"{cached} (cached step)"
    ok = outputs_ok = report.max_abs_error <= TOL and (report.cache_max_abs_error is None or
                                                       report.cache_max_abs_error <= TOL)
    if layout.out is None and layout.kind != "wrapper":
        report.notes.append("no output projection (out_proj / o_proj / c_proj; the book calls it optional): checked "
                            "against the reference without one")
    if layout.out is not None and layout.out.name not in report.modules_called and not ok and not layout.source:
        # (torch.nn.MultiheadAttention uses out_proj's weight without calling the module)
        report.notes.append(f"{layout.out.name} is defined but forward never called it")
    if outputs_ok:
        report.variations = run_variations(type(module), report.kwargs, given or {}, layout, b, T, P, seed,
                                           long_tokens, vary_heads, bare_in_out, report.notes)
        failing = [v for v in report.variations if not v.ok]
        if failing:
            ok, f = False, failing[0]
            report.first_differing_stage = f"{f.first_differing_stage or 'output'} ({f.label})"
            report.diagnoses += [m for m in f.diagnoses if m not in report.diagnoses]
            what = f.error or f"the output differs by {_fmt_err(f.max_abs_error)}" + (
                f", the cached step by {_fmt_err(f.cache_max_abs_error)}" if f.cache_max_abs_error is not None else "")
            report.notes.append(f"the first configuration matches, but with {f.label}: {what}")
    nondeterministic = _check_dropout(module, layout, report, x[:, P:], run.output, plain)
    if nondeterministic:
        report.diagnoses.append("dropout_in_eval")
        ok = False
    if diagnose and not outputs_ok and not nondeterministic and all(o is not None and o.shape == ref["output"].shape
                                                       for o in outputs.values()):
        extra = diagnose_by_reproduction(x, p, layout, outputs, T, applicable_mistakes(layout, len(outputs) > 1))
        report.diagnoses += [m for m in extra if m not in report.diagnoses]
    if ok:
        report.diagnoses = []
    untested = cache.status == "untested" or any(v.cache_status == "untested" for v in report.variations)
    report.verdict, report.exit_code = (("match_without_cache", 3) if untested else ("match", 0)) if ok \
        else ("mismatch", 1)


def _fmt_err(e: float | None) -> str:
    return "-" if e is None else f"{e:.3g}"


# ------------------------------------------------------------------------- variations
@dataclass
class Variation:
    """One more configuration the check ran after the first one matched: ``label`` says what
    changed (``num_heads=3``, ``T=70``), ``config`` the sizes; the output's and the cached step's
    max abs errors, the cache text and status (see :class:`CacheResult`), ``ok``, the error
    forward raised (or None), the first differing stage and the diagnoses."""

    label: str
    config: dict = field(default_factory=dict)
    max_abs_error: float | None = None
    cache: str = ""
    cache_status: str = ""
    cache_max_abs_error: float | None = None
    ok: bool = False
    error: str | None = None
    first_differing_stage: str | None = None
    diagnoses: list = field(default_factory=list)


def other_head_counts(layout: Layout) -> list[int]:
    """Head counts to rebuild the module with, nearest the layout's first: divisors of d_out
    (not 1 or d_out) for one projection per role, any count for per-head modules."""
    h = layout.num_heads
    if layout.kind == "wrapper":
        return [c for c in (3, 2, 5) if c != h][:2]
    d = layout.d_out
    divisors = [c for c in range(2, d) if d % c == 0 and c != h]
    return sorted(divisors, key=lambda c: (abs(c - h), c))[:3]


def plan_variations(cls: type, kwargs: dict, given: dict, layout: Layout, T: int, P: int,
                    long_tokens: int = LONG_TOKENS, vary_heads: bool = True) -> tuple[list, list[str]]:
    """The configurations to check besides the first: ``([(label, [kwargs candidates], T), ...],
    notes on what could not be varied)``.

    * another head count (:func:`other_head_counts`), when the constructor takes one
      (:data:`HEAD_ALIASES`): a module that hard-codes its count passes only when the count
      asked for happens to equal it;
    * ``long_tokens`` tokens (past 64), with a context argument the caller did not give raised
      to hold them (plus the past); a context the caller gave caps the length.
    """
    try:
        params = pyinspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        params = {}
    plans, notes = [], []
    if vary_heads and not layout.single_head:
        name = next((n for n in HEAD_ALIASES if n in kwargs or n in params), None)
        counts = other_head_counts(layout)
        if name is None:
            notes.append(f"head count not varied: the constructor takes no head count argument ({layout.heads_from})")
        elif counts:
            plans.append((name, [{**kwargs, name: c} for c in counts], T))
    if long_tokens and long_tokens > T:
        past = P if forward_takes_past(cls) else 0
        contexts = [n for n in CONTEXT_NAMES if n in kwargs or n in params]
        fixed = {n: given[n] for n in contexts if _is_count(given.get(n))}
        T2 = min([long_tokens] + [v - past for v in fixed.values()])
        if T2 <= T:
            n = next(iter(fixed))
            notes.append(f"not checked at {long_tokens} tokens: {n}={fixed[n]} was given (pass {n}>={long_tokens + past} "
                         f"to check past 64 tokens)")
        else:
            long_kwargs = {**kwargs, **{n: max(T2 + past, kwargs[n] if _is_count(kwargs.get(n)) else 0)
                                        for n in contexts if n not in fixed}}
            plans.append((None, [long_kwargs], T2))
    return plans, notes


def run_variations(cls: type, kwargs: dict, given: dict, layout: Layout, b: int, T: int, P: int, seed: int,
                   long_tokens: int, vary_heads: bool, bare_in_out: bool, notes: list) -> list[Variation]:
    """Build and check each configuration of :func:`plan_variations` (new random weights and
    input, the cached step included); a head count the module cannot be built with is skipped
    for the next candidate. Notes on what was not varied are appended to ``notes``."""
    plans, skipped = plan_variations(cls, kwargs, given, layout, T, P, long_tokens, vary_heads)
    notes += skipped
    out = []
    for i, (name, candidates, tokens) in enumerate(plans):
        errors = []
        for kw in candidates:
            try:
                module = _construct(cls, kw)
                vlayout = recognise_layout(module, kw, bare_in_out=bare_in_out)
            except CheckError as e:
                errors.append(str(e))
                continue
            label = f"{name}={kw[name]}" if name else f"T={tokens}"
            out.append(_check_variation(module, vlayout, label, b, tokens, P, seed + 1 + i,
                                        layout.num_heads if name else None))
            break
        else:
            notes.append(f"{name} not varied: building the module with {name} in "
                         f"{[kw[name] for kw in candidates]} failed ({errors[-1] if errors else 'no candidate'})")
    return out


def _check_variation(module, layout: Layout, label: str, b: int, T: int, P: int, seed: int,
                     first_heads: int | None) -> Variation:
    """Compare one rebuilt module with the reference: the output and the cached step; on a
    mismatch the first differing stage and a diagnosis (``first_heads``: the first
    configuration's head count, to recognise a hard-coded one)."""
    h, hd = layout.num_heads, layout.head_dim
    v = Variation(label, dict(b=b, T=T, past=P, d_in=layout.d_in, d_out=layout.d_out, num_heads=h, head_dim=hd,
                              seed=seed))
    gen = torch.Generator().manual_seed(seed)
    p = make_params(layout, gen)
    try:
        copy_params(layout, p)
    except RuntimeError as e:
        v.error = f"could not copy the reference weights in: {e}"
        return v
    x = torch.randn(b, P + T, layout.d_in, generator=gen)
    ref = reference(x[:, P:], p, h)
    run = run_module(module, x[:, P:], **plain_kwargs(module, T, b))
    if run.error is not None:
        v.error = f"forward raised {type(run.error).__name__}: {run.error}{_where(run.error)}"
        v.first_differing_stage = first_differing(stage_rows(layout, ref, run))
        return v
    v.max_abs_error = _max_err(run.output, ref["output"])
    outputs, refs = {0: run.output}, {0: ref}
    cache = cached_step(module, x, P, h, hd)
    v.cache, v.cache_status = cache.text, cache.status
    if cache.status == "failed":
        v.cache_max_abs_error = float("inf")
    elif cache.status == "tested":
        refs[P] = reference(x, p, h, P)
        v.cache_max_abs_error = _max_err(cache.step.output, refs[P]["output"])
        outputs[P] = cache.step.output
    v.ok = v.max_abs_error <= TOL and (v.cache_max_abs_error is None or v.cache_max_abs_error <= TOL)
    if v.ok:
        return v
    v.first_differing_stage = first_differing(stage_rows(layout, ref, run))
    if v.first_differing_stage is None and P in refs:
        cached = first_differing(stage_rows(layout, refs[P], cache.step))
        v.first_differing_stage = cached and f"{cached} (cached step)"
    if any(o is None or o.shape != refs[k]["output"].shape for k, o in outputs.items()):
        return v
    if first_heads and first_heads != h and layout.d_out % first_heads == 0 and all(
            _max_err(o, reference(x if past else x[:, P:], p, first_heads, past)["output"]) <= TOL
            for past, o in outputs.items()):
        v.diagnoses = ["hard_coded_heads"]
    else:
        v.diagnoses = diagnose_by_reproduction(x, p, layout, outputs, T, applicable_mistakes(layout, len(outputs) > 1))
    return v


#: Dropout probability of the eval-mode determinism check.
DROPOUT_CHECK_P = 0.5


def _check_dropout(module, layout: Layout, report: CheckReport, x: torch.Tensor, y0: torch.Tensor,
                   plain: dict | None = None) -> bool:
    """Eval mode must turn dropout off: run the module again (same input), and, when its constructor
    takes a dropout argument, a copy built with dropout = :data:`DROPOUT_CHECK_P` twice; every
    output must equal ``y0`` (the dropout-0 output). ``plain``: forward's other arguments
    (:func:`plain_kwargs`). Returns True if one differs."""
    plain = plain or {}
    again = run_module(module, x, **plain)
    if again.error is None and _max_err(again.output, y0) > 0:
        report.dropout = "FAILED: two eval-mode runs on the same input differ"
        return True
    names = [n for n in DROPOUT_NAMES if n in report.kwargs]
    if not names:
        report.dropout = "eval-mode output deterministic (the constructor takes no dropout argument)"
        return False
    kwargs = {**report.kwargs, **{n: DROPOUT_CHECK_P for n in names}}
    try:
        other = _construct(type(module), kwargs)
        other.load_state_dict(module.state_dict())
    except (CheckError, RuntimeError) as e:
        report.dropout = f"not tested (building it with {names[0]}={DROPOUT_CHECK_P} failed: {e})"
        return False
    runs = [run_module(other, x, **plain) for _ in range(2)]
    if any(r.error is not None for r in runs):
        error = runs[0].error or runs[1].error
        report.dropout = f"not tested (forward with {names[0]}={DROPOUT_CHECK_P} raised {error})"
        return False
    errs = [_max_err(r.output, y0) for r in runs]
    what = ", ".join(f"{n}={DROPOUT_CHECK_P}" for n in names)
    if max(errs) > TOL:
        same = _max_err(runs[0].output, runs[1].output) == 0
        report.dropout = (f"FAILED: in eval mode with {what} the output differs from dropout 0 by {max(errs):.3g}"
                          + ("" if same else " and from run to run"))
        return True
    report.dropout = f"tested: in eval mode with {what} the output equals dropout 0 (max abs error {max(errs):.3g})"
    return False


def _fmt_shape(shape, count=1) -> str:
    if shape is None:
        return "-"
    return str(tuple(shape)) + (f" x{count}" if count > 1 else "")


def format_report(r: CheckReport) -> str:
    """The report as terminal text, ending with the result line that names the exit code."""
    args = ", ".join(f"{k}={v!r}" for k, v in r.kwargs.items())
    lines = [f"check {r.target}" + (f"({args})" if args else "")]
    if r.layout:
        c = r.config
        lines.append(f"layout: {r.layout}")
        lines.append(f"input: b={c['b']} T={c['T']} d_in={c['d_in']} (random weights and input, seed {c['seed']})")
    for title, rows in (("stages", r.stages), ("stages of the cached step", r.cache_stages)):
        if not rows or (title != "stages" and r.cache_max_abs_error is not None and r.cache_max_abs_error <= TOL):
            continue
        first = first_differing(rows)
        lines.append(f"\n{title}:\n  {'stage':<12} {'expected':<20} {'seen':<20} values")
        for row in rows:
            later_found = any(x.found for x in rows[rows.index(row):])
            status = ("ok" if row.found else "not materialised" if row.stage in ("scores", "weights") and later_found
                      else "not reached" if r.error and row.seen is None else "differ")
            if row.seen is not None and row.expected is not None and tuple(row.seen) != tuple(row.expected):
                status = "SHAPE differs"
            mark = "   <- first differing stage" if row.stage == first and r.verdict != "match" else ""
            lines.append(f"  {row.stage:<12} {_fmt_shape(row.expected, row.count):<20} "
                         f"{_fmt_shape(row.seen, row.count if row.found else 1):<20} {status}{mark}")
    if r.max_abs_error is not None:
        lines.append(f"\noutput max abs error: {r.max_abs_error:.3g} (match below {TOL:g})")
    if r.layout:
        lines.append(f"cache: {r.cache}" + (f", max abs error {r.cache_max_abs_error:.3g}"
                                            if r.cache_max_abs_error is not None else ""))
        lines.append(f"dropout: {r.dropout}")
    if r.variations:
        lines.append("also checked (rebuilt, new random weights and input):")
        for v in r.variations:
            c = v.config
            sizes = ", ".join(f"{k}={c[k]}" for k in ("num_heads", "head_dim", "T") if not v.label.startswith(k + "="))
            text = f"  {v.label} ({sizes}): "
            if v.error:
                text += f"{v.error}   DIFFERS"
            else:
                text += f"output max abs error {_fmt_err(v.max_abs_error)}"
                if v.cache_status in ("tested", "failed"):
                    text += f", cached step {_fmt_err(v.cache_max_abs_error)}"
                elif v.cache_status == "untested":
                    text += ", cache not tested"
                text += "   ok" if v.ok else "   DIFFERS" + (f" (first differing stage: {v.first_differing_stage})"
                                                           if v.first_differing_stage else "")
            lines.append(text)
    for note in r.notes:
        lines.append(f"note: {note}")
    if r.error:
        lines.append(f"\nerror: {r.error}")
    if r.diagnoses:
        lines.append("\ndiagnosis:")
        lines += [f"  - {MISTAKES[m]}" for m in r.diagnoses]
    elif r.verdict == "mismatch":
        lines.append("\ndiagnosis: none of the classic mistakes reproduces this output; start at the first "
                     "differing stage")
    result = {"match": "MATCH: the module computes GPT-2's multi-head causal attention (exit 0)",
              "mismatch": "MISMATCH: the module runs but its output differs from the reference (exit 1)",
              "error": "COULD NOT RUN: the module could not be checked (exit 2)",
              "match_without_cache": "MATCH WITHOUT CACHE: the module matches without a cache, but forward takes a "
                                     "cache the check could not compare (exit 3)"}[r.verdict]
    lines.append(f"\nresult: {result}")
    return "\n".join(lines)
