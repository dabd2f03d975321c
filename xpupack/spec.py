"""A module's ``spec.json`` (docs/format.md): `ModuleSpec` to and from its JSON, in one place.

`xpupack.manifest` reads and validates the file (torch-free); this module turns
the JSON into signatures, which needs torch.
"""

from __future__ import annotations

from pathlib import Path

from .errors import PackageFormatError
from .manifest import FORMAT_VERSION, read_spec
from .module_spec import ModuleSpec
from .padding import signature_batch
from .signature import BatchAxes, Signature


def spec_to_json(path: str, spec: ModuleSpec) -> dict:
    """The ``spec.json`` of the module at object path ``path``: its facts, never its samples."""
    return {
        "format_version": FORMAT_VERSION,
        "path": path,
        "calls": spec.calls,
        "unrecordable": dict(spec.unrecordable),
        "mutates_inputs": spec.mutates_inputs,
        "signatures": [signature.to_json() for signature in spec.signatures],
        "signature_calls": [
            spec.signature_calls[i] if i < len(spec.signature_calls) else 0 for i in range(len(spec.signatures))
        ],
        **_axes_json("batch_axes", spec.batch_axes, len(spec.signatures)),
        **({"padding_refused": spec.padding_refused} if spec.padding_refused else {}),
        **_axes_json("length_axes", spec.length_axes, len(spec.signatures)),
        **({"lengths_refused": spec.lengths_refused} if spec.lengths_refused else {}),
    }


def _axes_json(name: str, axes: dict[int, BatchAxes], count: int) -> dict:
    """``{name: one entry or null per signature}``, or nothing where no signature has axes."""
    return {name: [axes[i].to_json() if i in axes else None for i in range(count)]} if axes else {}


def read_module_spec(root: Path, entry: dict) -> ModuleSpec:
    """The recorded signatures of the manifest's module ``entry`` (tensor leaves on the build device).

    Raises:
        PackageFormatError: the spec file is not JSON, fails its schema, belongs to
            another module, or holds a signature that does not parse.
    """
    where = root / entry["spec"]
    data = read_spec(root, entry)
    try:
        trees: dict = {}  # parsed once per spec, shared by the signatures
        signatures = [Signature.from_json(s, trees) for s in data["signatures"]]
        counts = data.get("signature_calls", [])
        if counts and len(counts) != len(signatures):
            raise ValueError(f"signature_calls has {len(counts)} entries for {len(signatures)} signatures")
        batch_axes = _batch_axes(data.get("batch_axes", []), signatures)
        length_axes = _batch_axes(data.get("length_axes", []), signatures)
    except ValueError as exc:
        raise PackageFormatError(f"{where}: {exc}; the package is damaged — rebuild it", path=entry["spec"]) from None
    return ModuleSpec(
        tuple(signatures),
        calls=data["calls"],
        signature_calls=tuple(counts),
        unrecordable=data["unrecordable"],
        mutates_inputs=data.get("mutates_inputs", False),
        batch_axes=batch_axes,
        padding_refused=data.get("padding_refused"),
        length_axes=length_axes,
        lengths_refused=data.get("lengths_refused"),
    )


def _batch_axes(data: list, signatures: list[Signature]) -> dict[int, BatchAxes]:
    """The spec's ``batch_axes`` or ``length_axes`` (one entry or null per signature; `read_spec` checked
    that each fits its signature's leaves), each checked to give its signature one size."""
    found = {}
    for index, entry in enumerate(data):
        if entry is None:
            continue
        axes = BatchAxes.from_json(entry)
        signature_batch(signatures[index], axes)
        found[index] = axes
    return found
