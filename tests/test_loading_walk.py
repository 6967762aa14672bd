"""Loading a checkpoint is one pass through gpt2mha.io (io/registry.py): the walk of
``GPT2.from_pretrained`` enters each io module at most once, and converts each stored tensor
to the asked dtype once.

The instrument: ``sys.setprofile`` records every Python call whose function lives in a module
of ``gpt2mha.io`` and whose caller lives in another module ("entering" that module; calls into
torch, safetensors or ``gpt2mha.core`` do not count, nor a module's calls to itself). The walk
is that sequence with consecutive repeats collapsed; a module that appears twice was left for
another io module and entered again. Each checkpoint is written by the test in its real format
on a small model: a Hugging Face directory (transformers' ``GPT2LMHeadModel.save_pretrained``),
nanoGPT's ``ckpt.pt`` (``model_args`` + ``model`` in nanoGPT's names and nn.Linear layout, as
nanoGPT's ``train.py`` saves it), and an int8 directory (``GPT2.quantize`` + ``save_pretrained``).

The conversions are counted by a ``TorchFunctionMode`` that sees every ``Tensor.to`` /
``float`` / ``half`` / ``copy_`` (what ``nn.Module.to`` and ``load_state_dict`` run): the files
store float16, so every conversion of a stored tensor starts from float16, and each must happen
once, straight to the dtype asked for (no float32 detour, no second pass to check for
overflow). Float64 copies (the quantized format's overflow bounds) are not dtype conversions.
"""

import collections
import importlib
import os
import pkgutil
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode

import gpt2mha.io
from gpt2mha import GPT2, GPT2Config

pytestmark = pytest.mark.usefixtures("one_thread")

for _module in pkgutil.iter_modules(gpt2mha.io.__path__):           # module bodies are not part of a walk
    importlib.import_module(f"gpt2mha.io.{_module.name}")


def io_walk(load):
    """``(walk, result)``: the io modules ``load()`` enters, consecutive repeats collapsed."""
    walk = []

    def profile(frame, event, arg):
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
        if module.startswith("gpt2mha.io.") and caller != module and (not walk or walk[-1] != module):
            walk.append(module)

    sys.setprofile(profile)
    try:
        result = load()
    finally:
        sys.setprofile(None)
    return walk, result


class Conversions(TorchFunctionMode):
    """Counts ``(from dtype, to dtype)`` of every conversion between floating dtypes of a tensor
    with data (meta tensors hold none)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        src, dst = (args[1], args[0]) if name == "copy_" else (args[0] if args else None, out)
        if (name in ("copy_", "to", "float", "half", "bfloat16", "double", "type") and isinstance(src, torch.Tensor)
                and isinstance(dst, torch.Tensor) and src.is_floating_point() and dst.is_floating_point()
                and src.dtype != dst.dtype and not src.is_meta):
            self.seen[(src.dtype, dst.dtype)] += 1
        return out


def hf_directory(path):
    from conftest import hf_random_gpt2

    hf_random_gpt2(vocab_size=256, n_positions=32, n_embd=32, n_head=4, n_layer=2).half().save_pretrained(path)
    return path


def nanogpt_file(path):
    """nanoGPT's ``ckpt.pt``, in its names and layouts (model.py's GPT: nn.Linear ``[out, in]``,
    ``lm_head`` tied to ``wte``, ``torch.compile``'s ``_orig_mod.`` prefix)."""
    torch.manual_seed(0)
    C, V, T, L = 32, 256, 32, 2
    r = lambda *shape: torch.randn(*shape).half()  # noqa: E731
    sd = {"transformer.wte.weight": r(V, C), "transformer.wpe.weight": r(T, C),
          "transformer.ln_f.weight": r(C), "transformer.ln_f.bias": r(C)}
    for i in range(L):
        p = f"transformer.h.{i}."
        for name, shape in (("ln_1", (C,)), ("ln_2", (C,)), ("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C)),
                            ("mlp.c_fc", (4 * C, C)), ("mlp.c_proj", (C, 4 * C))):
            sd[p + name + ".weight"], sd[p + name + ".bias"] = r(*shape), r(shape[0])
    sd["lm_head.weight"] = sd["transformer.wte.weight"]
    args = {"n_layer": L, "n_head": 4, "n_embd": C, "block_size": T, "bias": True, "vocab_size": V, "dropout": 0.0}
    os.makedirs(path)
    torch.save({"model": {"_orig_mod." + k: v for k, v in sd.items()}, "model_args": args, "iter_num": 0,
                "best_val_loss": 1.0, "config": {}}, os.path.join(path, "ckpt.pt"))
    return os.path.join(path, "ckpt.pt")


def int8_directory(path):
    torch.manual_seed(0)
    model = GPT2(GPT2Config.from_preset("tiny")).eval().quantize("int8", method="rtn")
    model.save_pretrained(path, dtype=torch.float16)
    return path


def stored_float16(path):
    """How many float16 tensors the checkpoint stores, read from its file (a tensor stored
    twice, nanoGPT's ``lm_head`` tied to ``wte``, once)."""
    if os.path.isdir(path):
        tensors = load_file(os.path.join(path, "model.safetensors")).values()
    else:
        tensors = torch.load(path, weights_only=True)["model"].values()
    return len({t.untyped_storage().data_ptr() for t in tensors if t.dtype == torch.float16})


CHECKPOINTS = {"hf": hf_directory, "nanogpt": nanogpt_file, "int8": int8_directory}


@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_the_loading_walk_enters_each_io_module_once(kind, tmp_path):
    path = CHECKPOINTS[kind](str(tmp_path / kind))
    walk, model = io_walk(lambda: GPT2.from_pretrained(path, dtype=torch.bfloat16))
    print(f"{kind}: {len(walk)} io modules entered: {' > '.join(m.removeprefix('gpt2mha.io.') for m in walk)}")
    again = [m for m in set(walk) if walk.count(m) > 1]
    assert not again, f"{kind}: the walk returns to {again}: {walk}"
    assert walk[:2] == ["gpt2mha.io.formats", "gpt2mha.io.registry"] and walk[-1] == "gpt2mha.io.state_dicts"
    assert next(model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", list(CHECKPOINTS))
def test_each_stored_tensor_is_converted_once_to_the_dtype_asked(kind, dtype, tmp_path):
    path = CHECKPOINTS[kind](str(tmp_path / kind))
    stored = stored_float16(path)
    with Conversions() as conversions:
        model = GPT2.from_pretrained(path, dtype=dtype)
    from_file = {k: n for k, n in conversions.seen.items() if k[0] == torch.float16 and k[1] != torch.float64}
    assert from_file == {(torch.float16, dtype): stored}, conversions.seen
    assert not any(k[1] == dtype for k in conversions.seen if k[0] == torch.float32 and kind != "int8")
    assert {v.dtype for v in model.state_dict().values() if v.is_floating_point()} <= {dtype, torch.bfloat16}
