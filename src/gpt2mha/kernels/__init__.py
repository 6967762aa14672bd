"""gpt2mha's C++ kernels: their sources, their build and their loading.

One library, ``_kernels.abi3.so`` beside this file, compiled at install (``setup.py``, with
:mod:`.build`'s flags) on Linux x86-64 against the installed torch, holds the operators
``torch.ops.gpt2mha.*``: the int8 GEMV and W7A8 products (``products.cpp``), the int4 GEMV
and W4A8 (``int4_products.cpp``), prefill's causal attention (``causal_attention.cpp``) and the
forward in one call (``cached_forward.cpp``). Nothing is compiled while a program runs unless asked for
(``GPT2MHA_KERNELS=build``).

``GPT2MHA_KERNELS`` chooses what :func:`load` loads:

- unset or ``1``: the library built at install;
- ``0`` (``off``, ``false``, ``no``): none; every caller takes PyTorch's routes;
- ``build``: compile the sources beside this file into the cache (``$GPT2MHA_CACHE``, else
  ``$XDG_CACHE_HOME/gpt2mha`` or ``~/.cache/gpt2mha``) once, then load that (:mod:`.cache`):
  for source trees whose C++ was edited since the install;
- a path: that library (``python -m gpt2mha.kernels build``'s, e.g. CI's sanitizer build).

Which paths the kernels take is chosen at run time by the CPU's features (:mod:`.dispatch`:
AVX2 everywhere, AVX-512, AVX-512 VNNI and AVX-512 BF16 where the CPU has them, the same bits
either way); ``GPT2MHA_CPU_FEATURES`` narrows them (``avx2``: the AVX2 paths only; or a
comma-separated list of ``avx512``, ``avx512_vnni``, ``avx512_bf16``).

Where no library loads, gpt2mha says so once (a :class:`KernelsUnavailable` warning naming the
reason and the routes taken instead) and runs PyTorch's kernels. ``python -m gpt2mha.kernels``
prints which library is loaded, how it was built, or why none is.
"""

from . import dispatch
from .loader import ENV, KernelsUnavailable, available, load, loaded_library, unavailable_reason

__all__ = ["ENV", "KernelsUnavailable", "available", "dispatch", "load", "loaded_library", "unavailable_reason"]
