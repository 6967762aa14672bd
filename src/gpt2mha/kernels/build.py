"""How gpt2mha's C++ kernels are compiled: the sources, the flags, the compiler commands and the
record kept beside a built library. Every build is :func:`build_library`'s, with the same
commands and flags: ``setup.py``'s at install (:func:`setuptools_command`), the opt-in build
into the cache (``GPT2MHA_KERNELS=build``, :mod:`.cache`) and CI's sanitizer build (``python -m
gpt2mha.kernels build --sanitize address,undefined OUT``, which adds the sanitizers' flags).
torch's ``cpp_extension`` gives the headers and libraries (:func:`torch_include_flags`,
:func:`link_command`); its ``BuildExtension`` is not used: it is a setuptools command (the cache
and sanitizer builds run outside setuptools) that adds Python's own compiler flags to ours and
links ``libtorch_python``, and its ``load()`` loads the library into the process that builds it
(a sanitizer build loads only under its runtime, ``.ci/sanitize``).

Standard library only at import (``setup.py`` loads this file by its path in the build
environment, before gpt2mha is installed); torch and setuptools are imported where needed.

The library needs AVX2, FMA and F16C (``-mavx2 -mfma -mf16c``; every AVX2 CPU has F16C); the AVX-512
paths are compiled for their own targets and chosen at run time (``dispatch.h``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The library's sources, all compiled into one library (products.cpp: int8 GEMV and W7A8
#: products; int4_products.cpp: int4 GEMV and W4A8 operators; w4a8_products.cpp: W4A8 on packed
#: tiles; causal_attention.cpp: prefill attention; cached_forward.cpp: the forward in one call;
#: float_products.cpp, head_products.cpp, bf16_products.cpp: float32, fp16 and bf16 products;
#: dispatch.cpp: the CPU features and paths as operators) and the headers they share (kernels.h:
#: what cached_forward.cpp calls in the others; simd.h: exp, GELU and sums on vectors; walk.h: how
#: the threads walk a product's weights; dispatch.h: the CPU features, targets and switches).
SOURCES = ("products.cpp", "int4_products.cpp", "w4a8_products.cpp", "causal_attention.cpp", "cached_forward.cpp",
           "float_products.cpp", "head_products.cpp", "bf16_products.cpp", "dispatch.cpp", "kernels.h", "simd.h",
           "walk.h", "dispatch.h")
#: The extension's module name (setup.py) and so its file: ``_kernels.abi3.so`` beside this file.
MODULE = "gpt2mha.kernels._kernels"
#: What a build writes beside its library, named after it (:func:`record_path`).
RECORD_SUFFIX = ".json"
#: Our sources compile warning-free: warnings are errors. torch's headers are system headers
#: (``-isystem``), outside these rules. ``-ffp-contract=off``: the compiler fuses no multiply-add
#: the sources do not write (the AVX2 and AVX-512 paths give the same bits). ``-g0``: no debug
#: information (7.8 MB against ~0.5). ``-DNDEBUG``: a release build (torch's headers' debug-only
#: checks compiled out; the sanitizer build keeps them, :data:`SANITIZE_FLAGS`).
CXX_FLAGS = ("-O3", "-g0", "-DNDEBUG", "-std=c++20", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp",
             "-fPIC", "-Wall", "-Wextra", "-Werror")
#: Linked against libgomp.so.1: at run time the one torch has loaded (its OpenMP threads are ours).
LINK_FLAGS = ("-fopenmp",)
#: ``--sanitize`` values and their flags: every report stops the process (``-fno-sanitize-recover``).
SANITIZERS = ("address", "undefined", "thread")
SANITIZE_FLAGS = ("-O1", "-g", "-UNDEBUG", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all")


def platform_supported() -> str:
    """"" where the kernels are built (Linux on x86-64), else why not."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are built for Linux on x86-64 only (this is {sys.platform} on {platform.machine()})"
    return ""


def sources_digest(directory: Path | None = None) -> str:
    """sha256 over :data:`SOURCES` in ``directory`` (default :data:`HERE`; names and bytes), or ""
    when one is missing."""
    h = hashlib.sha256()
    for name in SOURCES:
        path = Path(directory or HERE) / name
        if not path.is_file():
            return ""
        h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def torch_include_flags() -> list[str]:
    """torch's header directories as system headers (``-isystem``), with torch's C++ ABI flag."""
    import torch
    from torch.utils import cpp_extension
    return [*(f for p in cpp_extension.include_paths() for f in ("-isystem", p)),
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]


def sanitize_flags(sanitize: str) -> list[str]:
    """The compile and link flags for ``sanitize``, a comma-separated list of :data:`SANITIZERS`
    ("" for none).

    Raises:
        ValueError: an unknown sanitizer, or ``thread`` with another (TSan runs alone).
    """
    names = [s for s in sanitize.split(",") if s]
    bad = [s for s in names if s not in SANITIZERS]
    if bad:
        raise ValueError(f"sanitize={sanitize!r}: {bad[0]!r} is not one of {', '.join(SANITIZERS)}")
    if "thread" in names and len(names) > 1:
        raise ValueError(f"sanitize={sanitize!r}: ThreadSanitizer runs alone, not with {', '.join(names)}")
    return [f"-fsanitize={','.join(names)}", *SANITIZE_FLAGS] if names else []


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``c++``, else ``g++``, as a path.

    Raises:
        FileNotFoundError: none is found (install g++, or set CXX).
    """
    cxx = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")
    if cxx is None:
        raise FileNotFoundError(f"no C++ compiler found (CXX={os.environ.get('CXX')!r}, no c++ or g++ on PATH): "
                                f"install g++, or set CXX")
    return cxx


def compiler_version(cxx: str) -> str:
    """The first line ``cxx --version`` prints ("" when it prints nothing)."""
    done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    return (done.stdout.splitlines() or [""])[0].strip()


def compile_command(cxx: str, source: str, obj: str, sanitize: str = "") -> list[str]:
    """The command that compiles one source into the object file ``obj`` (every build's)."""
    return [cxx, *CXX_FLAGS, *sanitize_flags(sanitize), *torch_include_flags(), "-c", source, "-o", obj]


def link_command(cxx: str, objects: list[str], out: str, sanitize: str = "") -> list[str]:
    """The command that links ``objects`` into the shared library ``out`` against torch's libraries."""
    from torch.utils import cpp_extension
    lib = cpp_extension.library_paths()[0]
    return [cxx, "-shared", *sanitize_flags(sanitize), *objects, f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10",
            "-ltorch_cpu", *LINK_FLAGS, "-o", out]


def _run(cmd: list[str], timeout: float) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{cmd[0]} ran past {timeout:.0f} s building gpt2mha's kernels") from None
    if done.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed building gpt2mha's kernels ({' '.join(cmd[-3:])}):\n"
                           f"{(done.stdout + done.stderr).strip()[-3000:]}")


def record_path(library: Path) -> Path:
    """Where the record of ``library`` is kept: beside it, ``LIBRARY.json``."""
    return library.with_name(library.name + RECORD_SUFFIX)


def flags(sanitize: str = "") -> list[str]:
    """Every compile and link flag of a build with ``sanitize`` (as :func:`record` keeps them)."""
    return [*CXX_FLAGS, *sanitize_flags(sanitize), *LINK_FLAGS]


def record(library: Path, cxx: str, seconds: float, sanitize: str = "") -> Path:
    """Writes :func:`record_path` of ``library``: the torch it was built against (its C++ ABI is
    that version's), the sources' digest, the compiler, the flags, the sanitizers, the build's
    seconds and the library's sha256, read at load (:mod:`.loader`), by the cache
    (:mod:`.cache`) and by ``python -m gpt2mha.kernels``. Written whole or not at all. Returns
    its path."""
    import torch
    path = record_path(library)
    data = {"library": library.name, "torch": torch.__version__, "sources": sources_digest(),
            "compiler": compiler_version(cxx), "flags": flags(sanitize), "sanitize": sanitize,
            "seconds": round(seconds, 1), "sha256": hashlib.sha256(Path(library).read_bytes()).hexdigest()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def reusable(directory: Path, name: str, torch_version: str, cxx_version: str) -> Path | None:
    """The library ``directory/name`` where its record (:func:`record`) says it was built from the
    sources now in ``directory``, against ``torch_version`` (local suffix ignored), by
    ``cxx_version`` (:func:`compiler_version`), with this build's flags and no sanitizer; else
    None. setup.py reuses such a library instead of compiling the same sources again (an editable
    install's library sits beside its sources: ``pip install -e ".[test]"`` after ``pip install
    -e .`` compiles nothing)."""
    library = Path(directory) / name
    try:
        data = json.loads(record_path(library).read_text())
    except (OSError, ValueError):
        return None
    digest = sources_digest(Path(directory))
    same = (library.is_file() and digest != "" and data.get("sources") == digest
            and str(data.get("torch", "")).split("+")[0] == torch_version.split("+")[0]
            and data.get("compiler") == cxx_version and data.get("flags") == flags() and not data.get("sanitize"))
    return library if same else None


def compile_library(out: Path, sanitize: str = "", timeout: float = 900) -> float:
    """Compiles the sources (in parallel, ``$MAX_JOBS`` or a job per core) and links them into
    ``out``, written whole or not at all (a temporary file beside it, renamed); returns the
    seconds it took. Writes nothing else (the objects go to a temporary directory).

    Raises:
        FileNotFoundError: no compiler (:func:`compiler`).
        RuntimeError: the compiler failed (its last lines of output) or ran past ``timeout`` s.
    """
    cxx = compiler()
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory() as objects:
            units = [(str(HERE / name), str(Path(objects) / f"{name}.o")) for name in SOURCES if name.endswith(".cpp")]
            with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
                for done in [pool.submit(_run, compile_command(cxx, src, obj, sanitize), timeout) for src, obj in units]:
                    done.result()
            _run(link_command(cxx, [obj for _, obj in units], str(tmp), sanitize), timeout)
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return time.monotonic() - start


def build_library(out: Path, sanitize: str = "", timeout: float = 900) -> float:
    """The build: compiles the sources into ``out`` (:func:`compile_library`: written whole or
    not at all) and writes its record beside it (:func:`record`); returns the seconds it took.
    setup.py's (:func:`setuptools_command`), the cache's (:mod:`.cache`) and ``python -m
    gpt2mha.kernels build``'s.

    Raises:
        FileNotFoundError: no compiler (:func:`compiler`).
        RuntimeError: the compiler failed (its last lines of output) or ran past ``timeout`` s.
        ValueError: ``sanitize`` is not a list of :data:`SANITIZERS` (:func:`sanitize_flags`).
    """
    sanitize_flags(sanitize)
    cxx = compiler()
    seconds = compile_library(Path(out), sanitize, timeout)
    record(Path(out), cxx, seconds, sanitize)
    return seconds


def setuptools_command(directory: Path | None = None):
    """setup.py's ``build_ext``: each extension's library built by :func:`build_library` where
    it is written (the package's directory under ``build/``; beside the sources for an editable
    install), its record beside it, the build's time printed; or, where the library beside the
    sources in ``directory`` (default :data:`HERE`) is :func:`reusable`, that one copied instead
    of compiling the same sources again (an editable install's library sits beside its sources:
    ``pip install -e ".[test]"`` after ``pip install -e .`` compiles nothing)."""
    from setuptools.command.build_ext import build_ext

    sources = Path(directory or HERE)

    class BuildKernels(build_ext):
        def build_extension(self, ext) -> None:
            library = Path(self.get_ext_fullpath(ext.name))
            library.parent.mkdir(parents=True, exist_ok=True)
            if not self._reuse(library):
                print(f"gpt2mha: compiling its C++ kernels ({', '.join(n for n in SOURCES if n.endswith('.cpp'))}) "
                      f"...", flush=True)
                try:
                    seconds = build_library(library)
                except (FileNotFoundError, RuntimeError) as e:
                    raise RuntimeError(f"gpt2mha: compiling its C++ kernels failed ({e}). Install without them with "
                                       f"GPT2MHA_KERNELS=0 set (PyTorch's routes run instead, slower)") from e
                print(f"gpt2mha: compiled its C++ kernels into {library.name} in {seconds:.0f} s", flush=True)
            self.records = [*getattr(self, "records", []), record_path(library)]

        def _reuse(self, library: Path) -> bool:
            import torch
            found = reusable(sources, library.name, torch.__version__, compiler_version(compiler()))
            if found is None:
                return False
            print(f"gpt2mha: reusing its C++ kernels {found} (built from the same sources, torch, compiler and "
                  f"flags; delete it to compile again)", flush=True)
            if not (library.exists() and library.samefile(found)):
                shutil.copy2(found, library)
                shutil.copy2(record_path(found), record_path(library))
            return True

        def copy_extensions_to_source(self) -> None:
            """Editable installs: the library goes beside its sources, and its record with it."""
            super().copy_extensions_to_source()
            for path in getattr(self, "records", []):
                if not (sources / path.name).exists() or not (sources / path.name).samefile(path):
                    self.copy_file(str(path), str(sources / path.name), level=self.verbose)

    return BuildKernels


def main(argv: list[str] | None = None) -> int:
    """``python -m gpt2mha.kernels build [--sanitize LIST] OUT``: compiles the library into OUT
    (with its record beside it) and prints the time; load it with ``GPT2MHA_KERNELS=OUT``."""
    p = argparse.ArgumentParser(prog="python -m gpt2mha.kernels build", description=main.__doc__)
    p.add_argument("out", type=Path, help="the library to write (a .so path)")
    p.add_argument("--sanitize", default="", help=f"comma-separated sanitizers: {', '.join(SANITIZERS)}")
    args = p.parse_args(argv)
    why = platform_supported()
    if why:
        p.error(why)
    try:
        sanitize_flags(args.sanitize)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        seconds = build_library(args.out, args.sanitize)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"gpt2mha: {e}", file=sys.stderr)
        return 1
    print(f"gpt2mha: compiled its C++ kernels into {args.out} in {seconds:.0f} s"
          + (f" (sanitizers: {args.sanitize})" if args.sanitize else ""))
    return 0

