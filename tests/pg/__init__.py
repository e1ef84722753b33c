"""The PostgreSQL store and its administration (``mos_lease_pg``): needs the ``pg`` extra;
the tests that need a server are marked ``pg``."""
