"""xpupack's version, importable without anything heavy (the CLI's ``--version``, the manifest)."""

__version__ = "0.1.0"
