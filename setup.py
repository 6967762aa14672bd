"""gpt2mha's build: the package (pyproject.toml says what it holds) and its C++ kernels
(src/gpt2mha/kernels/), compiled here at ``pip install``, by torch's ``CppExtension`` and
``BuildExtension`` (setuptools: torch's own extension machinery knows its headers, libraries and
C++ ABI, and ninja compiles the C++ sources in parallel).

On Linux x86-64 the kernels are built (or the install fails, saying why); elsewhere, or with
``GPT2MHA_KERNELS=0`` set for the install, the package installs without them and gpt2mha says so
when it runs (PyTorch's routes). The flags and sources are :mod:`gpt2mha.kernels.build`'s, loaded
by its path: the build environment has torch (``[build-system]``) but not gpt2mha.
"""

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
KERNELS = Path("src", "gpt2mha", "kernels")                  # relative: setuptools wants relative sources


def _build_module():
    spec = importlib.util.spec_from_file_location("gpt2mha_kernels_build", ROOT / KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernels() -> dict:
    """setup()'s arguments for the kernels: none where they are not built (said on stdout)."""
    build = _build_module()
    off = os.environ.get("GPT2MHA_KERNELS", "").strip().lower() in ("0", "false", "off", "no")
    why = f"GPT2MHA_KERNELS={os.environ.get('GPT2MHA_KERNELS')}" if off else build.platform_supported()
    if why:
        print(f"gpt2mha: installing without its C++ kernels ({why}): PyTorch's routes will run instead")
        return {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, get_cxx_compiler

    class BuildKernels(BuildExtension):
        """BuildExtension that prints the build's time and writes the library's record beside it."""

        def build_extension(self, ext):
            if self.reuse(ext):
                return
            start = time.monotonic()
            print(f"gpt2mha: compiling its C++ kernels ({', '.join(ext.sources)}) ...", flush=True)
            try:
                super().build_extension(ext)
            except Exception as e:
                raise RuntimeError(f"gpt2mha: compiling its C++ kernels failed ({e}; the compiler's output is above). "
                                   f"Install without them with GPT2MHA_KERNELS=0 set (PyTorch's routes run "
                                   f"instead, slower)") from e
            seconds = time.monotonic() - start
            library = Path(self.get_ext_fullpath(ext.name))
            self.records = [*getattr(self, "records", []), build.record(library, get_cxx_compiler(), seconds)]
            print(f"gpt2mha: compiled its C++ kernels into {library.name} in {seconds:.0f} s", flush=True)

        def reuse(self, ext) -> bool:
            """Copies the library beside the sources instead of compiling, where its record says it
            was built from these sources with this torch, compiler and flags (:func:`build.reusable`)."""
            import torch
            target = Path(self.get_ext_fullpath(ext.name))
            found = build.reusable(ROOT / KERNELS, target.name, torch.__version__,
                                   build.compiler_version(get_cxx_compiler()))
            if found is None:
                return False
            print(f"gpt2mha: reusing its C++ kernels {found} (built from the same sources, torch, compiler and "
                  f"flags; delete it to compile again)", flush=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not (target.exists() and target.samefile(found)):
                shutil.copy2(found, target)
                shutil.copy2(build.record_path(found), build.record_path(target))
            self.records = [*getattr(self, "records", []), build.record_path(target)]
            return True

        def copy_extensions_to_source(self):
            """Editable installs: the library goes beside its sources, and its record with it."""
            super().copy_extensions_to_source()
            for record in getattr(self, "records", []):
                self.copy_file(str(record), str(ROOT / KERNELS / record.name), level=self.verbose)

    sources = [str(KERNELS / name) for name in build.SOURCES if name.endswith(".cpp")]
    extension = CppExtension(build.MODULE, sources, py_limited_api=True,
                             extra_compile_args={"cxx": [*build.CXX_FLAGS, *build.torch_include_flags()]},
                             extra_link_args=list(build.LINK_FLAGS),
                             depends=[str(KERNELS / name) for name in build.SOURCES if name.endswith(".h")])
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildKernels},
            "options": {"bdist_wheel": {"py_limited_api": f"cp{sys.version_info.major}{sys.version_info.minor}"}}}


setup(**_kernels())
