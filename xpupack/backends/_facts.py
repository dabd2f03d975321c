"""What `xpupack.plan` asks of a backend, answered without importing torch (inspect, verify).

`xpupack inspect` and `xpupack verify` decide, as `xpupack.load` would, what
runs each module of a package here. On a CPU, for the backends named below,
the answers need nothing from torch: whether the backend runs on a CPU, which
environment keys its artifacts depend on, whether they are compiled code.
`describe` answers for exactly those cases and returns None for anything else
(a torchao config, an option it does not recognise, another device), and the
caller then asks the real backend (`backends.base.backend_from_json`), which
imports torch. The real classes stay the reference: ``tests/test_lean_import.py``
checks these facts against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The backends' defaults that a package's options are read against, here so that the backends and the
# torch-free answers below read the same values.
#: environment keys the Inductor backend's own artifacts depend on (`InductorBackend.depends_on`)
INDUCTOR_DEPENDS_ON = ("torch", "triton", "python", "device_type", "device_name", "architecture")
#: the modes `InductorBackend` takes besides None (written as no "mode" at all); any other would record CUDA graphs
INDUCTOR_MODES = ("default", "max-autotune-no-cudagraphs")
#: recordings per module that `GraphBackend` keeps unless given ``max_recordings`` (not written to a package)
GRAPH_MAX_RECORDINGS = 16


@dataclass(frozen=True)
class BackendFacts:
    """A backend as `xpupack.plan` sees it: the attributes and questions of `backends.base.Backend` it uses."""

    name: str
    base: BackendFacts | None = None
    depends_on: tuple[str, ...] = ()
    compiled_artifacts: bool = False
    rebuildable: bool = True
    #: device types it runs on (None: all)
    runs_on: tuple[str, ...] | None = None
    #: it runs only the recorded shapes and pads a smaller batch up to one (graph, Inductor)
    pads_calls: bool = False
    #: the settings its label shows (`settings_tag`)
    settings: str = ""

    @property
    def label(self) -> str:
        own = self.name + self.settings
        return f"{own}+{self.base.label}" if self.base else own

    def available(self, device: Any) -> bool:
        own = self.runs_on is None or device.type in self.runs_on
        return own and (self.base is None or self.base.available(device))

    def why_unavailable(self, device: Any) -> str:
        if self.runs_on is not None and device.type not in self.runs_on:
            return (
                f"no device graphs on {device.type}"
                if self.name == "graph"
                else f"{self.name} cannot run on {device.type}"
            )
        return self.base.why_unavailable(device) if self.base else f"{self.name} cannot run on {device.type}"


EAGER = BackendFacts("eager")


def settings_tag(options: dict) -> str:
    """The Inductor settings a backend's label shows, from its options: ``[max-autotune-no-cudagraphs]``,
    ``[coordinate_descent_tuning]`` (a setting turned on), ``[max_fusion_size=32]``; "" for the defaults."""
    mode = options.get("mode")
    parts = [mode] if mode not in (None, "default") else []
    parts += [
        key if value is True else f"{key}={value!r}"
        for key, value in sorted((options.get("compile_options") or {}).items())
    ]
    return f"[{','.join(parts)}]" if parts else ""


def describe(name: Any, options: Any, device: Any) -> BackendFacts | None:
    """The facts of the backend a manifest names with ``options``, for a CPU ``device``; None when only
    the real backend can say (or refuse the options with its own message)."""
    if getattr(device, "type", None) != "cpu" or not isinstance(options, dict):
        return None
    if name == "eager":
        return EAGER if not options else None
    if name == "graph":
        return _describe_graph(options, device)
    if name == "inductor":
        return _describe_inductor(options)
    return None


#: the graph backend's own options -> whether a value is one it writes (None: the option left out); a
#: default is never written, so a package that spells one out came from elsewhere and the real backend judges it
_GRAPH_OPTIONS = {
    "max_recordings": lambda value: type(value) is int and value >= 1 and value != GRAPH_MAX_RECORDINGS,
    "copy_outputs": lambda value: value is False,
    "record_collectives": lambda value: value is True,
    "max_memory": lambda value: type(value) is int and value >= 1,
}


def _describe_graph(options: dict, device: Any) -> BackendFacts | None:
    """The graph backend's facts: its own, and its base's through it (what it records)."""
    if not _graph_options_known(options):
        return None
    inner = None
    if options.get("base") is not None:
        inner = _describe_graph_base(options["base"], device)
        if inner is None:
            return None
    # a CPU has no device graphs (tests emulate them in-process, where torch is loaded and the
    # real backend answers)
    return BackendFacts(
        "graph",
        inner,
        inner.depends_on if inner else (),
        bool(inner and inner.compiled_artifacts),
        runs_on=("cuda", "xpu"),
        pads_calls=True,
    )


def _graph_options_known(options: dict) -> bool:
    """Whether each of the graph backend's options besides ``base`` is one it takes, with a value it writes."""
    return all(
        key in _GRAPH_OPTIONS and (value is None or _GRAPH_OPTIONS[key](value))
        for key, value in options.items()
        if key != "base"
    )


def _describe_graph_base(base: Any, device: Any) -> BackendFacts | None:
    """The facts of the backend a graph backend's ``base`` option names; None for a malformed entry or a
    graph inside a graph, which the real backend refuses with its own message."""
    if not isinstance(base, dict) or set(base) - {"name", "options"} or base.get("name") == "graph":
        return None
    return describe(base.get("name"), base.get("options", {}), device)


def _describe_inductor(options: dict) -> BackendFacts | None:
    """The Inductor backend's facts, for options that name a mode at most; any other (a base, compile
    options) is for the real backend to judge."""
    if set(options) - {"mode"} or ("mode" in options and options["mode"] not in INDUCTOR_MODES):
        return None  # a base (torchao), or an option the real backend refuses or would not write
    return BackendFacts(
        "inductor",
        None,
        INDUCTOR_DEPENDS_ON,
        compiled_artifacts=True,
        pads_calls=True,
        settings=settings_tag(options),
    )
