"""Loading the module ``gpt2mha check`` checks: importing the learner's class, filling its
constructor arguments, and reading what its ``forward`` signature says about a cache.

Importing a file RUNS ITS CODE with the user's permissions.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect as pyinspect
import json
import os
import sys
import traceback
from dataclasses import dataclass, field

from torch import nn

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


class CheckError(Exception):
    """The module could not be checked (exit code 2); the message says why."""


#: The checker's own directory: frames in its ``check*.py`` files are not the learner's code.
_HERE = os.path.dirname(os.path.abspath(__file__))


def _checkers_frame(filename: str) -> bool:
    path = os.path.abspath(filename)
    return os.path.dirname(path) == _HERE and os.path.basename(path).startswith("check")


def raised_at(e: BaseException, path: str | None = None) -> str:
    """`` (at FILE line N: code)`` for the deepest traceback frame of ``e`` in ``path``, else the
    deepest outside torch and outside the checker itself; ``""`` when there is none."""
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path and os.path.abspath(f.filename) == os.path.abspath(path)]
    if not mine:
        mine = [f for f in frames if f"{os.sep}torch{os.sep}" not in f.filename and not _checkers_frame(f.filename)]
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
            raise CheckError(f"{target}: importing it raised {type(e).__name__}: {e}{raised_at(e, target)}") from None
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


def is_count(value) -> bool:
    """Whether ``value`` is a positive int (not a bool): a usable head count or length."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def construct(cls, kwargs: dict) -> nn.Module:
    """``cls(**kwargs)`` in float32 and eval mode.

    Raises:
        CheckError: the constructor raised (the message gives the arguments and, when it can,
            the line of the learner's file that raised).
    """
    try:
        module = cls(**kwargs)
    except (Exception, SystemExit) as e:
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise CheckError(f"{cls.__name__}({args}) raised {type(e).__name__}: {e}{raised_at(e)}") from None
    return module.float().eval()

