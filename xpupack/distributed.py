"""Tensor-parallel models (``torch.distributed.tensor``) in tune, save and load (docs/multi-gpu.md).

A module sharded with ``parallelize_module`` holds DTensor parameters: each rank
keeps a shard and the forward runs collectives. Every rank tunes its own shard,
and every rank must make the same calls in the same order, or a collective waits
forever: so a speed-gated strategy, whose timing loops stop on a clock, is refused
for such modules. A package stores the full weights once: `save` gathers them on
every rank (``full_tensor``, a collective) and rank 0 alone writes. `load`
hands each rank its shard of the full weights (`local_shard`, no communication).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from .errors import SaveError, TuningError

T = TypeVar("T")


def _dtensor_type() -> type | None:
    """DTensor, where its module is imported: no tensor can be a DTensor before that. Importing it to ask
    costs 0.4 s on a 2-core CPU and 2 s on an H200 host, on every tune and load of a model that has none."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(tensor: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(tensor, cls)


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is a DTensor."""
    return any(is_dtensor(t) for t in (*module.parameters(), *module.buffers()))


def _group_active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check_strategy(selected: dict[str, nn.Module], strategy: Any) -> None:
    """Refuses a strategy that times candidates for a sharded module (see the module docstring)."""
    sharded = [path for path, module in selected.items() if is_sharded(module)]
    if sharded and _group_active() and (strategy.min_speedup is not None or strategy.times_candidates):
        raise TuningError(
            f"{sharded[0] or '<model>'} is tensor parallel (DTensor parameters): every rank must choose the same "
            f"backend with the same calls, and {type(strategy).__name__} times candidates against a clock — "
            "pass strategy=xpupack.Only(backend), or a strategy with min_speedup=None"
        )


def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every DTensor gathered into the full tensor (a collective: call it on every rank)."""
    return {
        name: tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
        for name, tensor in state.items()
    }


def local_shard(sharded: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as the DTensor ``sharded`` is (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    placed = distribute_tensor(
        full.to(sharded.device),
        sharded.device_mesh,  # type: ignore[attr-defined]
        sharded.placements,  # type: ignore[attr-defined]
        src_data_rank=None,
    )
    return placed.to_local()


def on_rank0(model_state: dict[str, torch.Tensor], write: Callable[[], T]) -> T | None:
    """Runs ``write`` on rank 0 only when ``model_state`` is tensor parallel; every rank returns once it is done.

    The other ranks wait for rank 0's outcome and raise `SaveError` if its write failed. Without DTensors
    (or without a process group), every process writes, as a single process does.
    """
    if not (_group_active() and any(is_dtensor(t) for t in model_state.values())):
        return write()
    import torch.distributed as dist

    outcome: list = [None]
    result = None
    if dist.get_rank() == 0:
        try:
            result = write()
        except BaseException as exc:
            outcome[0] = f"{type(exc).__name__}: {exc}"
            dist.broadcast_object_list(outcome, src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None and dist.get_rank() != 0:
        raise SaveError(f"rank 0 failed to write the package ({outcome[0]}); nothing was written")
    return result
