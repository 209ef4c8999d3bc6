"""The package version: setup.py says the same; the compile cache keys on it."""

__version__ = "0.1.0"
