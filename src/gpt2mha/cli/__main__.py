"""``python -m gpt2mha.cli ...``: the same as ``python -m gpt2mha`` / ``gpt2mha``."""

import sys

from . import main

sys.exit(main())
