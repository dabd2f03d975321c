"""xpupack's version, written once: the package metadata takes it from here (pyproject.toml's dynamic
version), and the CLI's ``--version``, the manifest and the Hub client read it without anything heavy."""

__version__ = "0.1.0"
