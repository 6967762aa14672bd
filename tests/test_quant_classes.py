"""One layer class per quantization scheme and activation treatment (inference/quant/int8_linear.py,
int4_linear.py), registered by ``(scheme, activations)``: the registry, the conversion that
setting ``activations`` makes, and that nothing outside the scheme files (and their registry and
the CLI's flags) branches on a scheme or activation name.

References: the registry's own tables against the values the package documents
(docs/explanation/quantization.md), the layer's buffers and products before a conversion, and
Python's own parser (``ast``) for the source scan."""

import ast
import copy
import pathlib

import pytest
import torch

from gpt2mha.inference.quant import (SCHEME_ACTIVATIONS, AutoInt8Linear, Int4Linear, Int8Linear, QuantizedHead,
                                     QuantizedLinear, W4A8Linear, W7A8Linear, layer_class)

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "gpt2mha"
#: The names a scheme or an activation treatment goes by ("auto" names other things too: attention
#: kernels, devices).
NAMES = {"int8", "int4", "per_row", "per_block", "exact"}
#: Where those names may be compared: the scheme files, their registry, the CLI's flags.
ALLOWED = {"inference/quant/int8_linear.py", "inference/quant/int4_linear.py", "inference/quant/linear.py"}
CLASSES = {("int8", "exact"): Int8Linear, ("int8", "per_row"): W7A8Linear, ("int8", "auto"): AutoInt8Linear,
           ("int4", "exact"): Int4Linear, ("int4", "per_block"): W4A8Linear}


def _names_compared(node: ast.Compare) -> set[str]:
    # the string constants among a comparison's operands, and inside tuples, lists and sets compared with `in`
    found = set()
    for operand in (node.left, *node.comparators):
        items = operand.elts if isinstance(operand, (ast.Tuple, ast.List, ast.Set)) else [operand]
        found |= {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}
    return found & NAMES


def test_no_comparison_with_a_scheme_or_activation_name_outside_the_scheme_classes():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ALLOWED or rel.startswith("cli/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare) and _names_compared(node):
                found.append(f"{rel}:{node.lineno} {sorted(_names_compared(node))}")
    assert not found, "compared outside the scheme classes:\n" + "\n".join(found)


def test_the_scan_sees_a_comparison():
    # the scan's own check: each form it must find (== and != either way, `in` a tuple)
    for code in ('s == "int8"', '"per_row" != a', 'a in ("exact", "fast")', 'a not in ["int4"]'):
        assert _names_compared(ast.parse(code).body[0].value), code
    assert not _names_compared(ast.parse('s == "int16"').body[0].value)


def test_the_registry_serves_each_scheme_and_treatment_with_its_class():
    assert SCHEME_ACTIVATIONS == {"int8": ("exact", "per_row", "auto"), "int4": ("exact", "per_block")}
    for (scheme, activations), cls in CLASSES.items():
        assert layer_class(scheme, activations) is cls
        head = layer_class(scheme, activations, head=True)
        assert issubclass(head, QuantizedHead) and issubclass(head, cls)
        assert (cls.scheme, cls.activations_mode) == (scheme, activations)
    with pytest.raises(ValueError, match=r"scheme='int3' is unknown; expected one of \('int8', 'int4'\)"):
        layer_class("int3")
    with pytest.raises(ValueError, match=r"activations='per_block': an int8 layer takes one of"):
        layer_class("int8", "per_block")
    with pytest.raises(ValueError, match=r"scheme=\['int8'\] is unknown"):           # unhashable: named too
        layer_class(["int8"])


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
def test_the_base_names_give_the_schemes_classes(scheme, group_size):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g)
    assert type(QuantizedLinear(64, 40, scheme, group_size)) is layer_class(scheme)
    assert type(QuantizedLinear.from_float(w, None, scheme, group_size)) is layer_class(scheme)
    head = QuantizedHead.from_float(w, None, scheme, group_size)
    assert type(head) is layer_class(scheme, head=True) and head.bias is None
    other = "int4" if scheme == "int8" else "int8"
    with pytest.raises(ValueError, match=f"scheme='{other}': {layer_class(scheme).__name__} holds {scheme} weights"):
        layer_class(scheme)(64, 40, other, 32 if other == "int4" else None)


@pytest.mark.parametrize("scheme,group_size", [("int8", None), ("int4", 32)])
@pytest.mark.parametrize("head", [False, True])
def test_setting_activations_converts_the_layer_in_place(scheme, group_size, head):
    g = torch.Generator().manual_seed(2)
    make = QuantizedHead if head else QuantizedLinear
    layer = make.from_float(torch.randn(48, 64, generator=g), None if head else torch.randn(48, generator=g),
                            scheme, group_size)
    x = torch.randn(3, 64, generator=g)
    buffers = dict(layer.named_buffers())
    for activations in SCHEME_ACTIVATIONS[scheme] + (SCHEME_ACTIVATIONS[scheme][0],):
        layer.activations = activations
        assert type(layer) is layer_class(scheme, activations, head=head) and layer.activations == activations
        now = dict(layer.named_buffers())
        assert now.keys() == buffers.keys() and all(now[n] is t for n, t in buffers.items())   # the same tensors
        fresh = layer_class(scheme, activations, head=head)(64, 48, scheme, group_size, bias=not head)
        fresh.load_state_dict(layer.state_dict())
        with torch.no_grad():
            assert torch.equal(layer(x), fresh(x)), activations                      # the class's own product
        assert type(copy.deepcopy(layer)) is type(layer)
    before = type(layer)
    with pytest.raises(ValueError, match=f"activations='rows': an {scheme} layer takes one of"):
        layer.activations = "rows"
    assert type(layer) is before
