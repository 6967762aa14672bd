"""Which path each kernel takes for which CPU features (kernels/dispatch.h, gpt2mha.kernels.dispatch):
one switch per path asking exactly the features its code uses, the features narrowed by
``dispatch.allow`` or ``GPT2MHA_CPU_FEATURES``, and the sources asking the CPU and naming targets in
dispatch.h only.

The expected paths are the instruction sets each path's code is compiled for (dispatch.h's
TARGET_AVX512, TARGET_AVX512_VNNI, TARGET_AVX512_BF16 on its functions): a path may be taken on any
CPU that has those, and on no other. ``dispatch.paths(features)`` asks the switches themselves, so
these hold on any CPU, an AVX2-only one included."""

import os
import re
import subprocess
import sys

import pytest

from gpt2mha.kernels import build, dispatch, loader

pytestmark = pytest.mark.skipif(not loader.available(), reason=f"the kernels are not loaded: "
                                                               f"{loader.unavailable_reason()}")

FLOAT = ("conv1d", "linear", "gelu", "causal_attention", "per_row_rounding")     # 16 float32 lanes: AVX-512 F/BW/DQ/VL
VNNI = ("per_row", "w4a8")                                                        # vpdpbusd
BF16 = ("bf16", "causal_attention_bf16")                                          # vdpbf16ps


def _expected(features: set) -> dict:
    avx512 = "avx512" in features
    out = {s: "avx512" if avx512 else "avx2" for s in FLOAT}
    out |= {s: "avx512_vnni" if avx512 and "avx512_vnni" in features else "avx2" for s in VNNI}
    out |= {s: "avx512_bf16" if avx512 and "avx512_bf16" in features else "avx2" for s in BF16}
    if out["causal_attention_bf16"] == "avx2":
        out["causal_attention_bf16"] = "refused"                 # it has no AVX2 path
    return out


@pytest.mark.parametrize("features", [(), ("avx512",), ("avx512", "avx512_vnni"), ("avx512", "avx512_bf16"),
                                      ("avx512", "avx512_vnni", "avx512_bf16"), ("avx512_vnni",),
                                      ("avx512_vnni", "avx512_bf16")])
def test_each_switch_asks_exactly_the_features_its_path_uses(features):
    assert dispatch.paths(features) == _expected(set(features))


def test_avx512_without_vnni_runs_the_float_and_attention_kernels_on_16_lanes():
    # a CPU with AVX-512 but not VNNI (Skylake-SP and -X, before Cascade Lake; a VM that masks VNNI):
    # the float products, GELU, prompt attention and per_row's rounding take their 16-lane paths;
    # only the int8 dot products keep to AVX2
    paths = dispatch.paths(["avx512"])
    assert all(paths[s] == "avx512" for s in FLOAT)
    assert paths["per_row"] == paths["w4a8"] == "avx2"


def test_the_paths_taken_now_are_those_of_the_cpus_allowed_features():
    assert dispatch.enabled() == dispatch.cpu() & dispatch.allowed()
    assert dispatch.paths() == dispatch.paths(dispatch.enabled())
    before = dispatch.allowed()
    with dispatch.limited(()) as now:
        assert now == dispatch.enabled() == frozenset() and dispatch.allowed() == frozenset()
        assert dispatch.paths() == _expected(set())
        from gpt2mha.inference.dense import has_bf16_dot
        from gpt2mha.inference.quant import gemv
        assert not gemv.vnni() and not has_bf16_dot()
    with dispatch.limited(["avx512"]) as now:
        assert now == dispatch.cpu() & {"avx512"} and dispatch.allowed() == {"avx512"}
        assert dispatch.paths() == _expected(set(now))
    assert dispatch.allowed() == before and dispatch.paths() == dispatch.paths(dispatch.enabled())


def test_feature_names_it_does_not_know_are_refused_by_name():
    with pytest.raises(ValueError, match=r"features: 'avx3' is not one of avx512, avx512_vnni, avx512_bf16"):
        dispatch.allow(["avx512", "avx3"])
    with pytest.raises(TypeError, match=r"features='avx512': expected a collection of feature names"):
        dispatch.paths("avx512")
    with pytest.raises(RuntimeError, match=r"kernel_paths: 'avx2' is not a feature the kernels ask for"):
        import torch
        torch.ops.gpt2mha.kernel_paths(["avx2"])
    assert dispatch.paths(dispatch.enabled()) == dispatch.paths()        # nothing changed


@pytest.mark.parametrize("value,features", [(None, None), ("", None), ("avx2", ()), ("AVX2, avx512", ("avx512",)),
                                            ("avx512_bf16,avx512", ("avx512", "avx512_bf16")),
                                            ("avx512,avx512_vnni,avx512_bf16", loader.FEATURES)])
def test_GPT2MHA_CPU_FEATURES_reads_avx2_or_a_list_of_features(monkeypatch, value, features):
    if value is None:
        monkeypatch.delenv(loader.FEATURES_ENV, raising=False)
    else:
        monkeypatch.setenv(loader.FEATURES_ENV, value)
    assert loader.features_setting() == features


def test_a_GPT2MHA_CPU_FEATURES_it_cannot_read_is_an_error(monkeypatch):
    monkeypatch.setenv(loader.FEATURES_ENV, "avx512,sse4")
    with pytest.raises(ValueError, match=r"GPT2MHA_CPU_FEATURES='avx512,sse4': 'sse4' is not one of avx2, avx512, "):
        loader.features_setting()


@pytest.mark.slow
def test_GPT2MHA_CPU_FEATURES_narrows_the_features_at_load():
    code = ("from gpt2mha.kernels import dispatch\n"
            "print(sorted(dispatch.allowed()), sorted(dispatch.enabled()), dispatch.paths() == "
            "dispatch.paths(dispatch.enabled()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, loader.FEATURES_ENV: "avx512"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == f"['avx512'] {sorted(dispatch.cpu() & {'avx512'})} True"


def test_the_sources_ask_the_cpu_and_name_targets_in_dispatch_h_only():
    # one predicate per feature, one attribute per target: no source spells its own
    for name in build.SOURCES:
        if name == "dispatch.h":
            continue
        text = (build.HERE / name).read_text()
        for spelling in ("__builtin_cpu_supports", "__attribute__((target", "avx512f,", "avx512vnni", "avx512bf16"):
            assert spelling not in text, f"{name} spells {spelling!r}: dispatch.h's predicates and TARGET_* say it"


def test_every_switch_is_asked_by_a_kernel_and_named_in_the_docs():
    header = (build.HERE / "dispatch.h").read_text()
    switches = re.findall(r"inline constexpr Switch (\w+)\{\"(\w+)\"", header)
    assert {name for _, name in switches} == set(dispatch.paths())
    sources = "".join((build.HERE / n).read_text() for n in build.SOURCES if n.endswith(".cpp"))
    for const, name in switches:
        assert f"dispatch::on(dispatch::{const})" in sources, f"no kernel asks the switch {const} ({name})"
        assert f"``{name}``" in dispatch.__doc__, f"gpt2mha.kernels.dispatch's table lacks the switch {name}"
    names = re.search(r"FEATURE_NAMES\[\] = \{(.*?)\};", header).group(1)
    assert tuple(re.findall(r'"(\w+)"', names)) == loader.FEATURES
