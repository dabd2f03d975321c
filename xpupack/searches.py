"""xpupack's own candidates: the default strategy `xpupack.tune` uses when given none, and the thorough search
(``tune(search="thorough", quantize=...)``, ``xpupack build --search``), each a list of backends handed to a
strategy of `xpupack.strategies` (docs/tuning.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .backends.base import Backend, ComposedBackend
from .strategies import Fastest, FirstWins, Strategy

#: the device types that record device graphs
_GRAPH_DEVICES = ("cuda", "xpu")


def default_backends(device: torch.device | None = None) -> list[Backend]:
    """The default candidates: on a GPU the module compiled by Inductor recorded as a device graph first
    (what ``torch.compile(mode="reduce-overhead")`` does, shipped; its compile runs at load from the
    carried caches), then the plain device graph, Inductor and eager; elsewhere graph, Inductor, eager (no
    device graphs on CPU). AOTInductor, live when a load returns without a compile, is left out on a GPU:
    torch's loader crashed the process there (`xpupack.AOTIBackend`); on a CPU it is opt-in.

    Args:
        device: the device tuned on; None gives the list for a CPU.

    Returns:
        New backend objects, in the order they are tried.
    """
    from .backends.eager import EagerBackend
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend

    backends: list[Backend] = [GraphBackend(), InductorBackend(), EagerBackend()]
    if device is not None and device.type in _GRAPH_DEVICES:
        backends.insert(0, GraphBackend(base=InductorBackend()))
    return backends


#: how much faster than the plain device graph graph-over-Inductor must be to be the default's choice:
#: its compiled code costs seconds at load on a fresh server, the plain graph's capture milliseconds
DEFAULT_STARTUP_MARGIN = 1.05


def default_strategy(
    device: torch.device | None = None,
    *,
    min_speedup: float | None = 1.0,
    startup_margin: float | None = DEFAULT_STARTUP_MARGIN,
) -> Strategy:
    """The strategy `xpupack.tune` uses when given none (docs/tuning.md).

    ``FirstWins(default_backends(device), startup_margin=DEFAULT_STARTUP_MARGIN)``.

    Args:
        device: the device tuned on (decides whether graph-over-Inductor is tried first).
        min_speedup: the speed gate (`Strategy`); ``xpupack build --min-speedup``.
        startup_margin: what compiled code must gain over the lighter candidate after it (`Strategy`).

    Returns:
        A new `FirstWins`.

    Examples:
        >>> default_strategy(torch.device("cuda")).backends
        [GraphBackend(base={'name': 'inductor', 'options': {}}), GraphBackend(), InductorBackend(), EagerBackend()]
    """
    return FirstWins(default_backends(device), min_speedup=min_speedup, startup_margin=startup_margin)


#: what `xpupack.tune`'s ``search`` takes: ``"quick"``, the default strategy (`default_strategy`), or
#: ``"thorough"``, every candidate of `thorough_backends` timed (`thorough_strategy`)
SEARCHES = ("quick", "thorough")

#: the TorchAO configurations ``quantize=True`` tries: those whose weight-only kernels are fast at small
#: batches (decode), each where the device has it (float8: CUDA capability 8.9; int4: CUDA, bfloat16)
QUANTIZE_CONFIGS = ("int8-weight-only", "float8-weight-only", "int4-weight-only")

#: Inductor's coordinate descent: each Triton kernel's block sizes and warps tuned by timing its neighbours
COORDINATE_DESCENT = {"coordinate_descent_tuning": True}
#: whether Inductor's static CUDA launcher loses the mark that a cached kernel's block sizes came from
#: coordinate descent, so that a load tunes them again (torch 2.11; torch 2.13 keeps it; pytorch#172819)
_STATIC_LAUNCHER_RETUNES = torch.torch_version.TorchVersion(torch.__version__) < "2.13"


def coordinate_descent(device: torch.device | None) -> dict[str, Any]:
    """The compile options of a coordinate-descent candidate on ``device``: `COORDINATE_DESCENT`, and on
    CUDA with a torch whose static launcher loses the tuning (`_STATIC_LAUNCHER_RETUNES`) that launcher
    off, so that a load reads the carried block sizes as tuned. On the H200 (torch 2.11) a bf16 Llama
    package's load ran 276 coordinate-descent benchmarks with it and 22 without (docs/tuning.md). The
    decode step replays as a device graph, which launches its kernels without either launcher."""
    options = dict(COORDINATE_DESCENT)
    if device is not None and device.type == "cuda" and _STATIC_LAUNCHER_RETUNES:
        options["use_static_cuda_launcher"] = False
    return options


def inductor_settings(device: torch.device | None) -> list[dict[str, Any]]:
    """The `InductorBackend` arguments the thorough search tries on ``device``, each a candidate.

    The defaults, then on a GPU coordinate descent; on a CPU (whose C++ kernels coordinate descent does
    not tune) max-autotune without Inductor's own CUDA graphs. A GPU does not try max-autotune: on the
    H200 it was slower than coordinate descent on a decode step (2.98 against 2.16 ms per call), took
    the longest to tune, and its package retuned kernels when it loaded (docs/tuning.md). Nor does it
    try programmatic dependent launch (``triton.enable_pdl``): on the H200 two of four tunes with it
    gave outputs far from eager's where the same settings without it never did (docs/tuning.md).
    """
    settings: list[dict[str, Any]] = [{}]
    if device is not None and device.type in _GRAPH_DEVICES:
        settings.append({"compile_options": coordinate_descent(device)})
    else:
        settings.append({"mode": "max-autotune-no-cudagraphs"})
    return settings


def thorough_backends(
    device: torch.device | None = None, quantize: bool | Sequence[str | Backend] = False
) -> list[Backend]:
    """The thorough search's candidates: each of `inductor_settings` recorded as a device graph on a GPU
    (as the default's first candidate) and plain on a CPU, then what the default tries after it; with
    ``quantize``, each TorchAO configuration compiled and, on a GPU, recorded as a device graph.

    Args:
        device: where the module is tuned.
        quantize: False; True for `QUANTIZE_CONFIGS`; or config names / `TorchAOBackend` instances
            (``TorchAOBackend("int8-weight-only", min_sqnr_db=25)``). A configuration this device cannot
            run stays in the list: the report says why it was refused.
    """
    from .backends.eager import EagerBackend
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend

    graphs = device is not None and device.type in _GRAPH_DEVICES
    compiled: list[Backend] = [InductorBackend(**settings) for settings in inductor_settings(device)]
    quantized = quantized_candidates(device, quantize)
    if graphs:
        return [
            *(GraphBackend(base=backend) for backend in compiled),
            *quantized,
            GraphBackend(),
            InductorBackend(),
            EagerBackend(),
        ]
    torchao = [backend.base for backend in quantized if backend.base is not None]  # TorchAO alone, uncompiled
    return [GraphBackend(), *compiled, *quantized, *torchao, EagerBackend()]


def quantized_candidates(
    device: torch.device | None, quantize: bool | Sequence[str | Backend]
) -> list[ComposedBackend]:
    """Each TorchAO configuration of ``quantize`` as the thorough search tries it: compiled by Inductor, on a
    GPU with coordinate descent (without it Inductor's int8 weight-only products are slower than bfloat16's:
    0.46x on Llama-3-8B's shapes, H100, docs/quantization.md) and recorded as a device graph.

    Args:
        device: where the module is tuned.
        quantize: as `thorough_backends` takes it.

    Returns:
        ``graph+inductor+torchao:CONFIG`` for each configuration on a GPU, ``inductor+torchao:CONFIG`` elsewhere.
    """
    from .backends.graph import GraphBackend
    from .backends.inductor import InductorBackend

    on_gpu = device is not None and device.type in _GRAPH_DEVICES
    compiled: list[ComposedBackend] = [
        InductorBackend(base=backend, compile_options=coordinate_descent(device) if on_gpu else None)
        for backend in quantized_backends(quantize)
    ]
    return [GraphBackend(base=backend) for backend in compiled] if on_gpu else compiled


def quantized_backends(quantize: bool | Sequence[str | Backend]) -> list[Backend]:
    """The `TorchAOBackend` of each configuration ``quantize`` names (True: `QUANTIZE_CONFIGS`).

    Raises:
        UnknownConfigError: a name xpupack's TorchAO configs do not have.
        TypeError: an item is neither a config name nor a `TorchAOBackend`.
    """
    from .backends.torchao import TorchAOBackend

    if quantize is False or quantize is None:
        return []
    items = QUANTIZE_CONFIGS if quantize is True else [quantize] if isinstance(quantize, (str, Backend)) else quantize
    backends: list[Backend] = []
    for item in items:
        backend = TorchAOBackend(item) if isinstance(item, str) else item
        if not isinstance(backend, TorchAOBackend):
            raise TypeError(
                f"quantize: {item!r} is neither a TorchAO config name ({', '.join(QUANTIZE_CONFIGS)}, "
                "...) nor an xpupack.TorchAOBackend; give True, names or backends"
            )
        backends.append(backend)
    return backends


def thorough_strategy(
    device: torch.device | None = None,
    quantize: bool | Sequence[str | Backend] = False,
    *,
    min_speedup: float | None = 1.0,
    startup_margin: float | None = DEFAULT_STARTUP_MARGIN,
) -> Strategy:
    """``Fastest(thorough_backends(device, quantize), startup_margin=DEFAULT_STARTUP_MARGIN)``: every
    candidate checked and timed against eager, the fastest kept, compiled code only where it is worth its
    start-up against the plain device graph (the gate and margin as `default_strategy` takes them)."""
    return Fastest(thorough_backends(device, quantize), min_speedup=min_speedup, startup_margin=startup_margin)


def check_search(search: Any, quantize: Any) -> None:
    """Raises ``ValueError`` unless ``search`` is one of `SEARCHES` and ``quantize`` comes with the thorough one."""
    if search not in SEARCHES:
        raise ValueError(
            f"search={search!r}: choose 'quick' (the default strategy) or 'thorough' (every candidate timed, "
            "Inductor settings and, with quantize=, TorchAO configurations)"
        )
    if quantize and search != "thorough":
        raise ValueError(
            f"quantize={quantize!r} adds TorchAO configurations to the thorough search: pass "
            "search='thorough' too, or put xpupack.TorchAOBackend in a strategy"
        )


def search_strategy(
    search: str,
    device: torch.device | None = None,
    quantize: bool | Sequence[str | Backend] = False,
    *,
    min_speedup: float | None = 1.0,
    startup_margin: float | None = DEFAULT_STARTUP_MARGIN,
) -> Strategy:
    """The strategy ``xpupack.tune(..., search=search, quantize=quantize)`` uses when given none, and
    ``xpupack build --search`` with its ``--min-speedup`` and ``--startup-margin``: the one place a search
    becomes a strategy."""
    check_search(search, quantize)
    gate = {"min_speedup": min_speedup, "startup_margin": startup_margin}
    return thorough_strategy(device, quantize, **gate) if search == "thorough" else default_strategy(device, **gate)
