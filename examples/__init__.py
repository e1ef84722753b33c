"""Examples: a two-gateway demo (``gateway.py``); a store and a guard of your own
(``store_kit.py``, see ``docs/writing-a-store.md``)."""
