"""``python -m xpupack`` runs the command line."""

from .cli import main

main(prog_name="xpupack")
