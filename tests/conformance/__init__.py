"""The store and guard contract kit (``mos_lease.testing``) and the stateful spec against each
shipped store, the in-memory reference and PostgreSQL."""
