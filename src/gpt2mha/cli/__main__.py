"""``python -m gpt2mha.cli``: the ``gpt2mha`` command, as ``python -m gpt2mha`` runs it."""

import sys

from . import main

sys.exit(main())
