"""The PostgreSQL adapter's own layering: what a gateway imports at run time loads no
administration. Needs the pg extra (psycopg), so it lives beside the store's tests; the
core's layering is ``tests/core/test_layering.py``."""

from __future__ import annotations

import subprocess
import sys


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)


def test_a_gateway_importing_the_postgresql_store_loads_no_administration() -> None:
    """``mos_lease_pg`` and every run-time module of it imported, in a fresh interpreter:
    nothing of ``mos_lease_pg.admin`` (migrations, roles, checks, archive, commands) and no
    command-line machinery is loaded."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import mos_lease_pg\n"
        "for info in pkgutil.iter_modules(mos_lease_pg.__path__, 'mos_lease_pg.'):\n"
        "    if info.name not in ('mos_lease_pg.admin', 'mos_lease_pg.__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "bad = sorted(m for m in sys.modules if m.startswith('mos_lease_pg.admin')\n"
        "             or m in ('mos_lease.cli', 'argparse'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n")
    done = _run(code)
    assert done.returncode == 0, done.stdout + done.stderr
