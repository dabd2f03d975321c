"""The calls a tuned module serves padded up to a recorded batch or length (`xpupack.padding`,
docs/calls-and-fallback.md): which recording a call pads into, the padded run, and which recordings a
loaded package's padded call is still checked in against the original module. `TunedModule` holds one
where its backend pads calls and its spec has batch or length axes; the check itself, which may fall
back, is the tuned module's."""

from __future__ import annotations

from typing import Any

from .backends.base import Runner
from .module_spec import ModuleSpec
from .padding import PadTable, check_output_axes, cut_outputs, pad_call
from .signature import BatchAxes

#: what `PaddedCalls.fit` returns for a call it pads: (signature index, its axes, the call's size, the recorded size)
Padding = tuple[int, BatchAxes, int, int]


class PaddedCalls:
    """Padding into the recordings of ``spec``'s signatures ``supported`` (indices) by ``runner``.

    ``checked``: tuning checked every padded axis against the original module on its samples; a loaded
    package's axes are its claim, so each (signature, axes) is checked on its first padded call.
    """

    def __init__(self, spec: ModuleSpec, supported: set[int], runner: Runner, *, checked: bool):
        self.table = PadTable(spec, supported)
        self._runner = runner
        #: (signature, the axes it is padded along) whose padded calls are known to agree with the original module
        self.checked: set[tuple[int, BatchAxes]] = (
            {(i, axes) for kind in (spec.batch_axes, spec.length_axes) for i, axes in kind.items()}
            if checked
            else set()
        )
        #: every padded call checked against the original module (``verify_padding="always"``)
        self.verify_every = False

    def __bool__(self) -> bool:
        return bool(self.table)  # no recording left to pad into

    def fit(self, key: tuple, leaves: list) -> Padding | None:
        """The recording a call that fits no signature as it is pads into, or None."""
        return self.table.fit(key, leaves)

    def retire(self, index: int) -> None:
        """Signature ``index`` is no longer padded into (its backend failed, or its padding check did)."""
        self.table.retire(index)

    def needs_check(self, padding: Padding) -> bool:
        """Whether this padded call is run by the original module too and compared."""
        return self.verify_every or padding[:2] not in self.checked

    def run(self, padding: Padding, args: tuple, kwargs: dict, leaves: list) -> Any:
        """Runs a call padded up to the recorded size ``padding`` names and cuts the outputs back. A runner
        with ``run_padded`` (the graph backend) pads into its own static buffers; the others get a padded
        copy of the call."""
        index, axes, size, recorded = padding
        if self._runner.run_padded is not None:
            return self._runner.run_padded(index, leaves, axes, size)
        padded_args, padded_kwargs, padded_leaves = pad_call(args, kwargs, axes, recorded)
        padded = self._runner.run(index, padded_args, padded_kwargs, padded_leaves)
        check_output_axes(padded, axes, recorded)
        return cut_outputs(padded, axes, size)
