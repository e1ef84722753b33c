"""Fault, race and attack scenarios of mos-lease (``pytest -m faults``; see RESULTS.md)."""
