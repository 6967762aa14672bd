"""``python -m gpt2mha`` (and ``torchrun ... -m gpt2mha``): the ``gpt2mha`` command."""

import sys

from .cli import main

sys.exit(main())
