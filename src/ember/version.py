"""The package version, in a module of its own so any layer can report it."""

__version__ = "0.1.0"
