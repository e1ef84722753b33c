"""The installed distribution's version, read from its metadata: ``pyproject.toml`` stays its
only source, and ``mos_lease.__version__`` and ``mos-lease --version`` report it."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "mos-lease"
# What a source tree that was never installed reports: a valid PEP 440 version that sorts
# below every release, so that a comparison with it never passes by accident.
UNKNOWN = "0+unknown"


def installed_version() -> str:
    """The version of the installed ``mos-lease`` distribution, else :data:`UNKNOWN`."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN
