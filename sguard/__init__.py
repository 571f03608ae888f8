"""sguard runtime: the command line, the demo job and (later) the Spark integration.

Dependency direction: sguard (runtime) -> ioservice -> mmm; peace depends on neither.
"""
__all__: list[str] = []
