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
from typing import Any, ClassVar

# The backends' defaults that a package's options are read against, here so that the backends and the
# torch-free answers below read the same values.
#: environment keys AOTInductor's libraries depend on (`AOTIBackend.depends_on`): they are loaded as built,
#: and run their parallel loops with the thread count they were compiled for, whatever this process has
AOTI_DEPENDS_ON = ("torch", "triton", "python", "device_type", "device_name", "architecture")
#: environment keys the Inductor backend's own artifacts depend on (`InductorBackend.depends_on`): also the
#: CPU thread count, which its C++ kernels are generated for and its FX graph cache keys them on
INDUCTOR_DEPENDS_ON = (*AOTI_DEPENDS_ON, "cpu_threads")
#: environment keys a compiler keys its own caches on (Inductor's FX graph cache: the CPU thread count): where only
#: they differ, a load installs the carried caches all the same, and the compiler compiles what misses them
RECOMPILED_ON = ("cpu_threads",)
#: the modes `InductorBackend` takes besides None (written as no "mode" at all); any other would record CUDA graphs
INDUCTOR_MODES = ("default", "max-autotune-no-cudagraphs")
#: recordings per module that `GraphBackend` keeps unless given ``max_recordings`` (not written to a package)
GRAPH_MAX_RECORDINGS = 16


class Composition:
    """The rule of a backend that runs on top of another one (``base``), stated once for the real backends
    (`backends.base.ComposedBackend`) and for their torch-free facts (`BackendFacts`).

    A composition is its own part and its base together: it runs where both run (and says first why its
    own part does not), its artifacts depend on what either's do and are compiled code where either's
    are, and its label names both (``graph+torchao:int8-weight-only``). A subclass states only its own
    part: `own_depends_on`, `own_compiled_artifacts`, `_own_label`, `_own_available` and
    `_own_why_unavailable`.
    """

    name: ClassVar[str]
    #: the backend this one runs on top of, or None
    base: Any = None
    #: environment keys whose change invalidates this backend's own artifacts (its base adds its own)
    own_depends_on: tuple[str, ...] = ()
    #: True when this backend's own artifacts may unpickle or run native code
    own_compiled_artifacts: bool = False

    @property
    def depends_on(self) -> tuple[str, ...]:
        """Environment keys whose change invalidates the artifacts: its own, then the base's."""
        own = self.own_depends_on
        return own + tuple(key for key in self.base.depends_on if key not in own) if self.base else own

    @property
    def compiled_artifacts(self) -> bool:
        """Whether its own artifacts or the base's may unpickle or run native code."""
        return self.own_compiled_artifacts or bool(self.base and self.base.compiled_artifacts)

    @property
    def label(self) -> str:
        """How reports name the composition: its own label, then the base's (``graph+torchao``)."""
        own = self._own_label()
        return f"{own}+{self.base.label}" if self.base else own

    def available(self, device: Any) -> bool:
        """Whether its own part and the base (if any) both run on ``device``.

        Args:
            device: the device tuned or loaded on.

        Returns:
            True where both run.
        """
        return self._own_available(device) and (self.base is None or self.base.available(device))

    def why_unavailable(self, device: Any) -> str:
        """Why `available` is False on ``device``: its own part's reason first, else the base's.

        Args:
            device: the device tuned or loaded on.

        Returns:
            One sentence.
        """
        if not self._own_available(device):
            return self._own_why_unavailable(device)
        return self.base.why_unavailable(device) if self.base else f"{self.name} cannot run on {device.type}"

    def _own_label(self) -> str:
        return self.name

    def _own_available(self, device: Any) -> bool:
        return True

    def _own_why_unavailable(self, device: Any) -> str:
        return f"{self.name} cannot run on {device.type}"


@dataclass(frozen=True)
class BackendFacts(Composition):
    """A backend as `xpupack.plan` sees it: the attributes and questions of `backends.base.Backend` it uses,
    its own part's facts combined with its base's by `Composition`."""

    name: str  # type: ignore[misc]  # a field here, a class attribute of a real backend
    base: BackendFacts | None = None
    own_depends_on: tuple[str, ...] = ()
    own_compiled_artifacts: bool = False
    rebuildable: bool = True
    #: device types its own part runs on (None: all)
    runs_on: tuple[str, ...] | None = None
    #: why its own part does not run on other device types, where there is more to say than that
    not_elsewhere: str | None = None
    #: it runs only the recorded shapes and pads a smaller batch up to one (graph, Inductor)
    pads_calls: bool = False
    #: the settings its label shows (`settings_tag`)
    settings: str = ""

    def _own_label(self) -> str:
        return self.name + self.settings

    def _own_available(self, device: Any) -> bool:
        return self.runs_on is None or device.type in self.runs_on

    def _own_why_unavailable(self, device: Any) -> str:
        if self.not_elsewhere is not None:
            return self.not_elsewhere
        return no_graphs_on(device) if self.name == "graph" else super()._own_why_unavailable(device)


def no_graphs_on(device: Any) -> str:
    """Why the graph backend does not run on ``device`` (`GraphBackend.why_unavailable`)."""
    return f"no device graphs on {device.type}"


EAGER = BackendFacts("eager")


#: why the AOTInductor backend runs on a CPU only: a crash in torch's loader cannot be caught, and would take
#: the user's process down at tune or load time
AOTI_NOT_ON_GPUS = (
    "aoti runs on a CPU only: AOTInductor's package loader crashed the process (SIGSEGV) on CUDA with torch "
    "2.11.0+cu130 on an H100, for xpupack's package of a 2-layer MLP too (docs/hardware.md)"
)

#: the AOTInductor backend's facts (it takes no options)
AOTI = BackendFacts(
    "aoti",
    own_depends_on=AOTI_DEPENDS_ON,
    own_compiled_artifacts=True,
    pads_calls=True,
    runs_on=("cpu",),
    not_elsewhere=AOTI_NOT_ON_GPUS,
)


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
    if name == "aoti":
        return AOTI if not options else None
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
    return BackendFacts("graph", inner, runs_on=("cuda", "xpu"), pads_calls=True)


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
        own_depends_on=INDUCTOR_DEPENDS_ON,
        own_compiled_artifacts=True,
        pads_calls=True,
        settings=settings_tag(options),
    )
