"""Run the gpt2mha benchmark suite: ``python benchmarks/run.py [--quick] [--json] [--only ...]``.

The same as ``gpt2mha bench``; the code lives in ``src/gpt2mha/bench.py``. The full run's table
and the machine it ran on are in ``benchmarks/RESULTS.md``.
"""

import sys

from gpt2mha.bench import main

if __name__ == "__main__":
    sys.exit(main())
