"""Progress bars for the long steps (perplexity's windows, quantizing a model's layers, training):
tqdm on stderr, shown only when stderr is a terminal, so logs and pipes get no bar lines."""

from __future__ import annotations

import sys


def progress_bar(iterable=None, *, desc: str, total: int | None = None, unit: str = "it", enabled: bool = True,
                 **kwargs):
    """A tqdm bar over ``iterable`` (or ``total`` steps, advanced with ``update``) labelled ``desc``,
    written to stderr; disabled when ``enabled`` is false or stderr is not a terminal (tqdm's
    ``disable=None``). The bar goes away when done (``leave=False``) unless ``leave=True`` is passed."""
    from tqdm import tqdm

    kwargs.setdefault("leave", False)
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr, disable=None if enabled else True,
                dynamic_ncols=True, **kwargs)
