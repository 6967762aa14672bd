"""The tables of every registered scheme, made once the scheme modules have registered their
layer classes with :mod:`.linear` (this module imports them: a new scheme adds its import here).
"""

from . import int8_linear, int4_linear  # noqa: F401  (each registers its classes, in SCHEMES' order)
from .linear import SCHEME_ACTIVATIONS

#: Schemes accepted by :meth:`gpt2mha.GPT2.quantize`.
SCHEMES = tuple(SCHEME_ACTIVATIONS)
#: Schemes the LM head takes (``quantize(..., head=)``): any; a scheme in groups only with blocks
#: of that scheme (:func:`~.linear.check_head`).
HEAD_SCHEMES = SCHEMES
#: Every activation treatment of any scheme (:data:`~.linear.SCHEME_ACTIVATIONS` says which scheme takes which).
ACTIVATIONS = tuple(dict.fromkeys(a for acts in SCHEME_ACTIVATIONS.values() for a in acts))
