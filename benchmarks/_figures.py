"""The benchmark figures name the data they are drawn from, in their PNG metadata.

``tests/test_figures.py`` checks every PNG under ``docs/benchmarks/``: its ``Source`` file lies
beside it and hashes to its ``Source-SHA256``, and ``--replot`` redraws it from that file alone.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def metadata(source: Path) -> dict[str, str]:
    """PNG metadata (``savefig(metadata=...)``) for a figure drawn from the file ``source``."""
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    return {"Source": source.name, "Source-SHA256": digest}
