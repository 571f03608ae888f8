"""sguard runtime: the command line, the demo job and the Spark integration.

Dependency direction: sguard (runtime) -> ioservice -> mmm; peace depends on neither.
"""
__all__ = ["__version__"]

__version__ = "0.2.0"
"""The package version; ``pyproject.toml`` reads it from here (one source)."""
