"""gpt2mha's build: the package (pyproject.toml says what it holds) and its C++ kernels
(src/gpt2mha/kernels/), compiled here at ``pip install`` by :mod:`gpt2mha.kernels.build`'s
``build_library``: the one build of the kernels, with the flags and compiler commands the opt-in
cache build and CI's sanitizer build use too (torch's ``cpp_extension`` gives its headers,
libraries and C++ ABI; the sources are compiled in parallel, ``$MAX_JOBS`` or a job per core).

On Linux x86-64 the kernels are built (or the install fails, saying why); elsewhere, or with
``GPT2MHA_KERNELS=0`` set for the install, the package installs without them and gpt2mha says so
when it runs (PyTorch's routes). A reinstall whose library beside the sources was built from the
same sources, torch, compiler and flags copies it instead of compiling (``build.reusable``).
``build.py`` is loaded by its path: the build environment has torch (``[build-system]``) but not
gpt2mha.
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup

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
    extension = Extension(build.MODULE, [str(KERNELS / name) for name in build.SOURCES if name.endswith(".cpp")],
                          depends=[str(KERNELS / name) for name in build.SOURCES if name.endswith(".h")],
                          py_limited_api=True)
    return {"ext_modules": [extension], "cmdclass": {"build_ext": build.setuptools_command(ROOT / KERNELS)},
            "options": {"bdist_wheel": {"py_limited_api": f"cp{sys.version_info.major}{sys.version_info.minor}"}}}


setup(**_kernels())
