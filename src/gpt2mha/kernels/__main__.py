"""``python -m gpt2mha.kernels``: which kernel library this process loads and how it was built
(compiler, flags, seconds, torch), or why none loads; exits 0 when one is loaded, 1 otherwise.
``python -m gpt2mha.kernels build [--sanitize LIST] OUT``: compiles the library into OUT
(:func:`.build.main`)."""

import json
import sys
import warnings

from . import build, dispatch, loader


def main() -> int:
    """Prints the library's state (see the module's docstring) and returns the exit status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", loader.KernelsUnavailable)   # said below instead
        try:
            why = loader.load()
        except ValueError as e:                                       # GPT2MHA_KERNELS or GPT2MHA_CPU_FEATURES
            why = str(e)
    if why:
        print(f"gpt2mha's C++ kernels: not loaded: {why}")
        return 1
    library = loader.loaded_library()
    print(f"gpt2mha's C++ kernels: {library}")
    try:
        record = json.loads(build.record_path(library).read_text())
    except (OSError, ValueError):
        record = {}
    if record:
        print(f"  built in {record.get('seconds')} s by {record.get('compiler')} against torch {record.get('torch')}")
        print(f"  flags: {' '.join(record.get('flags', []))}")
    print(f"  CPU features beyond AVX2: {', '.join(sorted(dispatch.cpu())) or 'none'}"
          + (f" (allowed: {', '.join(sorted(dispatch.allowed())) or 'none'})" if dispatch.allowed() < set(loader.FEATURES)
             else ""))
    print(f"  paths: {', '.join(f'{name} {path}' for name, path in dispatch.paths().items())}")
    return 0


if __name__ == "__main__":
    sys.exit(build.main(sys.argv[2:]) if sys.argv[1:2] == ["build"] else main())
