"""``python -m mos_lease_pg setup|roles|migrate|check|status|audit``: the PostgreSQL commands
on their own."""

import sys

from mos_lease_pg.admin.cli import main

sys.exit(main())
