"""Examples: a two-gateway demo (``gateway.py``); HTTP gateways routing each binding to its
holder (``asgi_gateway.py``, ``wsgi_gateway.py``, sharing ``recipes/``); a store and a guard
of your own (``store_kit.py``, see ``docs/writing-a-store.md``)."""
