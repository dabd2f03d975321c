"""``python -m xpupack`` runs the command line."""

import os
import sys

# `python -m` puts the current directory first on sys.path; in a package directory that would let its files
# shadow the modules xpupack imports later. MODULE:FACTORY arguments still import from the current directory
# where that is safe (cli._common.import_object).
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from .cli import main  # noqa: E402

main(prog_name="xpupack")
