"""Progress bars with an ETA for the long stages of a draft build, on stderr.

tqdm (installed with transformers) draws them; they are off when stderr is not a terminal
(logs and CI get the stage lines alone) or when the build is run with --quiet.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def bar(total: int, unit: str, *, enabled: bool = True, **options: Any) -> tqdm:  # type: ignore[type-arg]
    """A bar over `total` units (its rate and ETA beside it); drawn only when `enabled` and
    stderr is a terminal. A disabled bar takes every call and draws nothing."""
    shown = enabled and sys.stderr.isatty()
    return tqdm(
        total=total,
        unit=unit,
        file=sys.stderr,
        disable=not shown,
        dynamic_ncols=True,
        mininterval=1.0,
        leave=False,
        **options,
    )
