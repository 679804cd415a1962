"""pplab's version: written once, here (pyproject.toml reads it from this file, and every floor
that records it imports it from here, not from the package above it)."""

__version__ = "0.1.0"
