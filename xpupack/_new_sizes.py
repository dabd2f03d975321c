"""The new sizes a tuned module takes while serving (docs/calls-and-fallback.md): a call of a tuned signature's
family whose state has a new layout (a KV cache of another length, from ``generate(max_new_tokens=...)``)
becomes a signature of its own, up to `MAX_NEW_SIZES`. `TunedModule` holds one `NewSizes`; the runner
prepares each new signature (`Runner.add_signature`), off the caller's path where that needs a compile,
and the work stays `NewSizes.pending` until it is done."""

from __future__ import annotations

from concurrent.futures import Future

from .module_spec import ModuleSpec
from .signature import Signature, Unrecordable

#: signatures with state of new sizes a tuned module takes while serving (each may hold a recording)
MAX_NEW_SIZES = 16
#: fit keys remembered as no new size, at most (then forgotten, and looked at again)
_MAX_REFUSED = 1024


class NewSizes:
    """Which calls of ``spec``'s signatures ``supported`` (indices) are new sizes, and the work each still waits for."""

    def __init__(self, spec: ModuleSpec, supported: set[int]):
        #: family of each tuned signature with state -> the state layouts taken in it
        self.families: dict[tuple, set] = {}
        for index, signature in enumerate(spec.signatures):
            if signature.state_slots and index in supported:
                self.families.setdefault(signature.family, set()).add(signature.state_layout)
        #: fit keys of calls that are no new size (or whose signature was retired): never looked at again
        self.refused: set = set()
        #: new signature's index -> its runner's work off the caller's path, until it is done and looked at
        self.pending: dict[int, Future] = {}
        #: new sizes taken
        self.taken = 0

    def __bool__(self) -> bool:
        return bool(self.families)  # no tuned signature with state: no call is a new size

    def new_signature(self, key: tuple, args: tuple, kwargs: dict) -> Signature | None:
        """The signature of a call (fit key ``key``) that is a new size of a tuned family, counted as taken; None
        for one that is not (remembered: a layout tuned already is a different step, a prefill into a reused
        cache, which falls back like any unrecorded signature), or once `MAX_NEW_SIZES` were taken."""
        if key in self.refused or self.taken >= MAX_NEW_SIZES:
            return None
        try:
            signature = Signature.of_call(args, kwargs)
        except Unrecordable:
            signature = None
        layouts = self.families.get(signature.family) if signature is not None else None
        if signature is None or layouts is None or signature.state_layout in layouts:
            if len(self.refused) > _MAX_REFUSED:
                self.refused.clear()
            self.refused.add(key)
            return None
        layouts.add(signature.state_layout)
        self.taken += 1
        return signature
