"""The ``xpupack`` command line: build, inspect, verify, bench, push."""

from __future__ import annotations

import click

from .._version import __version__
from .bench import bench
from .build import build
from .inspect import inspect, verify
from .push import push


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="xpupack")
def main() -> None:
    """Build, ship and load tuned PyTorch models for Intel GPUs (XPU), NVIDIA GPUs and CPU.

    \b
    Start with the demo model:
      xpupack build xpupack.examples:tiny_decoder \\
          --samples xpupack.examples:tiny_decoder_samples --modules 'layers.*' --out demo-pkg
      xpupack inspect demo-pkg
      xpupack bench demo-pkg --model xpupack.examples:tiny_decoder
      xpupack push demo-pkg ORG/NAME
    """


main.add_command(build)
main.add_command(inspect)
main.add_command(verify)
main.add_command(bench)
main.add_command(push)
