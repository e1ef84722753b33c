"""The pure core: the machine, the coordinator on the in-memory store, the keeper and holder,
tokens, grants, the specs and models. Imports neither psycopg nor OpenTelemetry; runs with
``pip install -e . pytest hypothesis`` (see tests/core/test_core_room.py)."""
