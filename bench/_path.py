"""Make ``python bench/run.py`` measure the checkout it lives in.

Imported first by every entry point: puts the repository root on ``sys.path`` right after
``bench/`` itself, so ``mos_lease``, ``mos_lease_pg`` and ``tests.pg_support`` come from this
working tree (a scratch copy of the repository benchmarks its own code, not the installed one).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

if str(REPO) not in sys.path[:2]:
    sys.path.insert(1, str(REPO))
