"""``python -m gpt2mha.cli``: the ``gpt2mha`` command (as ``python -m gpt2mha``)."""

import sys

from . import main

sys.exit(main())
