"""The core never imports the PostgreSQL driver: it must run where psycopg is absent."""

from __future__ import annotations

import subprocess
import sys


def test_core_and_memory_store_do_not_import_psycopg() -> None:
    code = ("import sys, mos_lease, mos_lease.testing, mos_lease_memory, mos_lease.keeper, "
            "mos_lease.token, mos_lease.fencing, mos_lease.adapter, mos_lease.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('psycopg', 'psycopg_pool', 'mos_lease_pg')); print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
