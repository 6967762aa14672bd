"""How gpt2mha finds, checks and loads its C++ kernels (gpt2mha.kernels): the library built at
install, the switch GPT2MHA_KERNELS, the refusals that name their fix, the one warning where
none loads, and the opt-in build into the cache (lock, atomic writes, leftovers).

The loader keeps one answer per process (a library loads once): tests that try other libraries
call its parts (``_find``, ``_load``, ``cache.build_library``) with the compiler and torch's
``load_library`` stood in for, or run a subprocess. No test compiles or waits on a compiler.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gpt2mha import kernels
from gpt2mha.kernels import build, cache, loader


def test_the_kernels_load_where_they_are_required():
    # CI sets GPT2MHA_REQUIRE_KERNELS=1 (its passes with the kernels): there they must load, not skip
    if os.environ.get("GPT2MHA_REQUIRE_KERNELS") == "1":
        assert kernels.available(), kernels.unavailable_reason()
        if os.environ.get(kernels.ENV) is None:                  # the library built at install, not the cache's
            assert kernels.loaded_library() == loader.installed_library()
    else:
        assert kernels.available() or kernels.unavailable_reason()


@pytest.mark.skipif(loader.installed_library() is None, reason="gpt2mha was installed without its kernels")
def test_the_installed_library_was_built_against_this_torch_with_warnings_as_errors():
    record = json.loads(build.record_path(loader.installed_library()).read_text())
    assert record["torch"] == torch.__version__
    assert {"-Wall", "-Wextra", "-Werror"} <= set(record["flags"]) and "-w" not in record["flags"]
    assert record["seconds"] > 0 and record["compiler"]
    assert record["sources"] == build.sources_digest()         # built from the sources beside it


@pytest.mark.parametrize("value,meaning", [(None, "on"), ("1", "on"), ("on", "on"), ("0", "off"), ("off", "off"),
                                           ("False", "off"), ("no", "off"), ("build", "build"),
                                           ("/tmp/k.so", "/tmp/k.so"), ("k.so", "k.so")])
def test_the_switch_reads_off_on_build_or_a_path(monkeypatch, value, meaning):
    if value is None:
        monkeypatch.delenv(kernels.ENV, raising=False)
    else:
        monkeypatch.setenv(kernels.ENV, value)
    assert loader.setting() == meaning


def test_a_switch_it_cannot_read_is_an_error(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "maybe")
    with pytest.raises(ValueError, match=r"GPT2MHA_KERNELS='maybe': expected 1 .*, 0 .*, build .* or the path"):
        loader.setting()


def test_by_default_a_call_loads_the_installed_library_and_compiles_nothing(monkeypatch):
    monkeypatch.delenv(kernels.ENV, raising=False)

    def no(*args, **kwargs):
        raise AssertionError("compiled inside a call")

    monkeypatch.setattr(build, "compile_library", no)
    monkeypatch.setattr(build.subprocess, "run", no)
    library, origin, why = loader._find()
    if library is None:                                        # another platform, or installed without them
        assert why
    else:
        assert (library, origin) == (loader.installed_library(), "installed")


def _stand_ins(monkeypatch, loaded):
    monkeypatch.setattr(loader.torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(loader, "_LOADED", {"library": None})              # this process's answer stays
    monkeypatch.setattr("gpt2mha.kernels.fakes.register", lambda: None)


def test_refusals_name_the_reason_and_the_fix(monkeypatch, tmp_path):
    loaded = []
    _stand_ins(monkeypatch, loaded)
    monkeypatch.setattr(loader.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(loader.build, "platform_supported", lambda: "")
    monkeypatch.setenv(kernels.ENV, "0")
    assert loader._load() == "turned off (GPT2MHA_KERNELS=0)"
    monkeypatch.setenv(kernels.ENV, str(tmp_path / "none.so"))
    assert loader._load() == f"GPT2MHA_KERNELS={tmp_path / 'none.so'}: no such library"
    monkeypatch.setenv(kernels.ENV, "1")
    monkeypatch.setattr(loader, "installed_library", lambda: None)
    why = loader._load()
    assert "installed without its kernels" in why and "pip install ." in why and "GPT2MHA_KERNELS=build" in why
    # a library built against another torch, or from sources edited since
    library = tmp_path / "_kernels.abi3.so"
    library.write_bytes(b"stand-in")
    monkeypatch.setattr(loader, "installed_library", lambda: library)
    build.record_path(library).write_text(json.dumps({"torch": "2.0.1+cpu", "sources": build.sources_digest()}))
    why = loader._load()
    assert f"built against torch 2.0.1+cpu, this process runs torch {torch.__version__}" in why
    assert "--no-build-isolation" in why
    build.record_path(library).write_text(json.dumps({"torch": torch.__version__, "sources": "0" * 64}))
    why = loader._load()
    assert "built from other sources than those in" in why and "pip install -e ." in why
    assert loaded == []
    build.record_path(library).write_text(json.dumps({"torch": torch.__version__, "sources": build.sources_digest()}))
    assert loader._load() == "" and loaded == [str(library)]
    monkeypatch.setattr(loader.torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert "the CPU has no AVX2 and FMA" in loader._load()


def test_a_library_that_does_not_load_names_the_file_to_delete(monkeypatch, tmp_path):
    # garbage where a library should be (its record in order): dlopen refuses it, nothing is
    # registered, and the reason says which file to delete or how to reinstall
    garbage = tmp_path / "kernels-0123.so"
    garbage.write_bytes(b"\0not an ELF file" * 64)
    monkeypatch.setattr(loader, "_LOADED", {"library": None})
    monkeypatch.setattr(loader.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(loader.build, "platform_supported", lambda: "")
    monkeypatch.setattr("gpt2mha.kernels.cache.build_library", lambda: garbage)
    monkeypatch.setenv(kernels.ENV, "build")
    why = loader._load()
    assert why.startswith(f"{garbage} does not load (") and why.endswith(f"delete {garbage} (it is compiled again "
                                                                         f"on the next run)")
    monkeypatch.setattr(loader, "installed_library", lambda: garbage)
    monkeypatch.setenv(kernels.ENV, "1")
    assert "reinstall gpt2mha (pip install --force-reinstall --no-deps ." in loader._load()


@pytest.mark.slow
def test_where_none_loads_it_says_so_once_naming_the_routes_taken():
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from gpt2mha.inference.quant import gemv\n"
            "assert not gemv.available() and not gemv.available() and not gemv.vnni()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, kernels.ENV: "0"})
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "KernelsUnavailable" in line]
    assert len(lines) == 1, done.stderr
    assert "its C++ kernels are not loaded (turned off (GPT2MHA_KERNELS=0))" in lines[0]
    assert "bf16 activations" in lines[0] and "prefill attention by SDPA" in lines[0]


# --- the opt-in build into the cache (GPT2MHA_KERNELS=build) ---

@pytest.fixture
def stand_in_compiler(monkeypatch, tmp_path):
    """The cache in tmp_path and a stand-in compiler that writes a fake library (slowly, so that
    builds asked for at once overlap); returns the list of libraries it wrote."""
    monkeypatch.setenv("GPT2MHA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(build, "compiler_version", lambda cxx: "c++ 12.2.0")
    runs = []

    def compile_library(out, sanitize="", timeout=900):
        runs.append(out)
        time.sleep(0.2)
        out.write_bytes(b"a complete library" * 100)
        return 0.2

    monkeypatch.setattr(build, "compile_library", compile_library)
    return runs


def test_the_cache_build_compiles_once_and_again_when_cut_short_or_unrecorded(stand_in_compiler, tmp_path):
    runs = stand_in_compiler
    library = cache.build_library()
    assert library.parent == tmp_path / "cache" and library.name.startswith("kernels-") and len(runs) == 1
    assert cache.build_library() == library and len(runs) == 1              # complete: loaded, not rebuilt
    library.write_bytes(b"a complete")                                      # cut short
    assert cache.build_library() == library and len(runs) == 2
    build.record_path(library).unlink()                                     # no record: rebuilt too
    assert cache.build_library() == library and len(runs) == 3
    assert json.loads(build.record_path(library).read_text())["sha256"] == cache._sha256(library)


def test_a_killed_builds_leftovers_are_removed_and_a_file_for_a_cache_is_named(stand_in_compiler, tmp_path,
                                                                                 monkeypatch):
    library = cache.library_path("/usr/bin/c++")
    library.parent.mkdir(parents=True)
    left = library.with_name(f".{library.name}.4242.tmp")
    left.write_bytes(b"")                                                   # the empty .so a killed build left
    assert cache.build_library() == library and not left.exists()
    monkeypatch.setenv("GPT2MHA_CACHE", str(library))
    with pytest.raises(NotADirectoryError, match=f"the cache path {library} is not a directory"):
        cache.build_library()


def test_builds_asked_for_at_once_compile_once(stand_in_compiler):
    # the second waits on the file lock (no timeout involved), then loads the first one's library
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.build_library())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(stand_in_compiler) == 1 and len(set(results)) == 1 and len(results) == 3


@pytest.mark.slow
def test_every_process_computes_the_same_cache_name(tmp_path, monkeypatch):
    # two ranks of one torchrun once computed different names and both compiled: the name
    # depends on the sources, flags, compiler and torch only, not on the process, its directory
    # or its environment's temporary paths
    monkeypatch.setenv("GPT2MHA_CACHE", str(tmp_path))
    code = "from gpt2mha.kernels import build, cache; print(cache.library_path(build.compiler()))"
    here = cache.library_path(build.compiler()) if build.shutil.which("c++") or build.shutil.which("g++") else None
    if here is None:
        pytest.skip("no C++ compiler here")
    env = {**os.environ, "GPT2MHA_CACHE": str(tmp_path), "TMPDIR": str(tmp_path), "RANK": "1", "LOCAL_RANK": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(here)


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPT2MHA_CACHE", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.setenv("GPT2MHA_CACHE", "~/somewhere")
    assert "~" not in str(cache.cache_dir())
    monkeypatch.delenv("GPT2MHA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x" / "gpt2mha"


def test_sanitizer_flags_are_checked():
    assert build.sanitize_flags("") == []
    assert build.sanitize_flags("address,undefined")[0] == "-fsanitize=address,undefined"
    with pytest.raises(ValueError, match="'memory' is not one of address, undefined, thread"):
        build.sanitize_flags("address,memory")
    with pytest.raises(ValueError, match="ThreadSanitizer runs alone"):
        build.sanitize_flags("thread,address")


def test_the_server_loads_the_kernels_before_it_answers(monkeypatch):
    # create_app loads them (serve and serve_in_thread make their app with it before binding)
    pytest.importorskip("fastapi")
    from conftest import small_model
    from gpt2mha.io.tokenizer import ByteTokenizer
    from gpt2mha.inference.scheduler import Scheduler
    from gpt2mha.serving.server import create_app
    calls = []
    monkeypatch.setattr(kernels, "load", lambda: calls.append("load") or "")
    create_app(Scheduler(small_model(n_vocab=256), ByteTokenizer()), "tiny")
    assert calls == ["load"]


def test_a_reinstall_reuses_the_library_built_from_the_same_sources(tmp_path):
    """setup.py compiles nothing where the library beside the sources was built from those very
    sources with the same torch, compiler and flags (``build.reusable``); any difference compiles.
    Reference: the record ``build.record`` writes, here written by hand."""
    for name in build.SOURCES:
        (tmp_path / name).write_bytes((build.HERE / name).read_bytes())
    library = tmp_path / "_kernels.abi3.so"
    library.write_bytes(b"\x7fELF stand-in")
    good = {"library": library.name, "torch": "2.13.0+cpu", "sources": build.sources_digest(tmp_path),
            "compiler": "c++ (Debian 14.2.0-19) 14.2.0", "flags": build.flags(), "sanitize": "", "seconds": 300.0}

    def reused(torch_version="2.13.0", cxx="c++ (Debian 14.2.0-19) 14.2.0", **changes):
        build.record_path(library).write_text(json.dumps({**good, **changes}))
        return build.reusable(tmp_path, library.name, torch_version, cxx)

    assert reused() == library
    assert reused(torch_version="2.12.0") is None
    assert reused(cxx="clang version 19") is None
    assert reused(flags=build.flags("address")) is None
    assert reused(sanitize="address") is None
    assert reused(sources="0" * 64) is None
    assert build.reusable(tmp_path, "_kernels.cpython-311.so", "2.13.0", good["compiler"]) is None   # another name
    build.record_path(library).write_text(json.dumps(good))
    (tmp_path / "walk.h").write_text("// edited\n")                 # a source edited since the build
    assert build.reusable(tmp_path, library.name, "2.13.0", good["compiler"]) is None


def _setup_build(sources, out):
    """setup.py's build_ext (build.setuptools_command) run on one extension into ``out``, its
    reuse judged by the library beside ``sources``; returns the library it leaves."""
    from setuptools import Distribution, Extension
    extension = Extension(build.MODULE, ["products.cpp"], py_limited_api=True)
    dist = Distribution({"name": "gpt2mha", "ext_modules": [extension],
                         "cmdclass": {"build_ext": build.setuptools_command(sources)}})
    command = dist.get_command_obj("build_ext")
    command.build_lib, command.build_temp = str(out), str(out / "temp")
    command.ensure_finalized()
    command.run()
    return Path(command.get_ext_fullpath(build.MODULE))


def test_setup_the_cache_and_the_sanitizer_build_are_one_build(monkeypatch, tmp_path):
    # each goes through build.build_library (the compiler commands and flags of build.py), the
    # sanitizer build with its sanitizers added
    monkeypatch.setenv("GPT2MHA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(build, "compiler_version", lambda cxx: "c++ 12.2.0")
    builds = []

    def build_library(out, sanitize="", timeout=900):
        builds.append((Path(out).name, sanitize))
        Path(out).write_bytes(b"a library")
        build.record(Path(out), "/usr/bin/c++", 0.1, sanitize)
        return 0.1

    monkeypatch.setattr(build, "build_library", build_library)
    cache.build_library()
    assert build.main(["--sanitize", "address,undefined", str(tmp_path / "asan.so")]) == 0
    library = _setup_build(tmp_path / "no-library-here", tmp_path / "lib")
    assert builds == [(cache.library_path("/usr/bin/c++").name, ""), ("asan.so", "address,undefined"),
                      ("_kernels.abi3.so", "")]
    assert json.loads(build.record_path(library).read_text())["flags"] == build.flags()
    setup = Path(__file__).parents[1] / "setup.py"
    if setup.exists():                    # a source checkout (.ci/wheel runs this file outside one)
        assert "build.setuptools_command(" in setup.read_text()


def test_setup_reuses_the_library_built_from_the_same_sources_and_compiles_edited_ones(stand_in_compiler, tmp_path,
                                                                                      monkeypatch):
    # an editable install's library beside its sources, built from them with this torch, compiler
    # and flags: setup.py's build copies it (compiles nothing); edited sources compile again
    sources = tmp_path / "kernels"
    sources.mkdir()
    for name in build.SOURCES:
        (sources / name).write_bytes((build.HERE / name).read_bytes())
    monkeypatch.setattr(build, "HERE", sources)
    library = _setup_build(sources, tmp_path / "lib")
    record = json.loads(build.record_path(library).read_text())
    assert len(stand_in_compiler) == 1 and record["sources"] == build.sources_digest(sources)
    assert record["flags"] == build.flags() and record["sha256"] == cache._sha256(library)
    for path in (library, build.record_path(library)):                   # what an editable install leaves
        (sources / path.name).write_bytes(path.read_bytes())
    again = _setup_build(sources, tmp_path / "lib2")
    assert len(stand_in_compiler) == 1 and again.read_bytes() == library.read_bytes()
    (sources / "dispatch.h").write_text("// edited\n")
    _setup_build(sources, tmp_path / "lib3")
    assert len(stand_in_compiler) == 2
