"""Run the gpt2mha benchmark suite: ``python benchmarks/run.py [--quick] [--json] [--only ...]``.

The same as ``gpt2mha bench``; the code lives in ``benchmarks/bench.py``. The full run's table
and the machine it ran on are in ``benchmarks/RESULTS.md``.
"""

import sys

from bench import main     # benchmarks/bench.py, this script's directory

if __name__ == "__main__":
    sys.exit(main())
