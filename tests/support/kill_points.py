"""Kills `xpupack.save` at every file-system step, for tests/test_interrupted_save.py.

Runs in a fresh process (never inside pytest): for each step N, a forked
child saves a new package over an old one and SIGKILLs itself just before
its N-th file-system operation, as seen by Python's audit hooks (``open``,
``mkdir``, ``rename``, ``remove``, ``rmtree``, the lookup of ``renameat2``...).
The parent then reports what a loader finds at the destination and next to it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # no OpenMP pool: forking after it is not safe

import xpupack  # noqa: E402
from support.models import make_stack, stack_samples  # noqa: E402
from xpupack import _fsutil  # noqa: E402

EVENTS = {
    "open",
    "os.mkdir",
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "os.unlink",
    "shutil.rmtree",
    "shutil.copyfile",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "os.scandir",
    "os.listdir",
    "os.chmod",
    "os.truncate",
}
_state = {"count": 0, "kill_at": None, "armed": False}


def _hook(event, args):
    if not _state["armed"] or event not in EVENTS:
        return
    _state["count"] += 1
    if _state["count"] == _state["kill_at"]:
        _state["armed"] = False
        os.kill(os.getpid(), signal.SIGKILL)


def _tuned(seed):
    model = make_stack(seed=seed)
    return xpupack.tune(
        model, stack_samples(), modules=["layers.*.mlp"], strategy=xpupack.FirstWins([xpupack.EagerBackend()])
    )


def _in_child(model, root, kill_at, exchange, report):
    """Saves ``model`` at ``root`` in a forked child killed before step ``kill_at``; returns how it ended."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        if not exchange:
            _fsutil._exchange = lambda a, b: False  # the path taken where renameat2 is missing
        sys.addaudithook(_hook)
        _state.update(count=0, kill_at=kill_at, armed=True)
        xpupack.save(model, root)
        _state["armed"] = False
        os.write(write, json.dumps(_state["count"]).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        steps = pipe.read()
    _, status = os.waitpid(pid, 0)
    report["killed"] = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    return int(steps) if steps else None


def _which(model, old, new):
    x = torch.randn(3, 8)
    with torch.no_grad():
        out = model(x)
        return "old" if torch.equal(out, old(x)) else "new" if torch.equal(out, new(x)) else "neither"


def sweep(folder: str, exchange: bool = True) -> dict:
    parent = Path(folder)
    root = parent / "pkg"
    old, new = _tuned(0), _tuned(1)
    xpupack.save(old, root)
    steps = _in_child(new, root, None, exchange, {})  # a full save, counting its steps
    cases = []
    for kill_at in range(1, steps + 2):
        xpupack.save(old, root)  # the previous package; also clears the litter of the last round
        case = {"kill_at": kill_at}
        _in_child(new, root, kill_at, exchange, case)
        try:
            case["loads"] = _which(xpupack.load(make_stack(seed=7), root), old, new)
        except xpupack.XpupackError as exc:
            case["loads"] = f"{type(exc).__name__}: {exc}"
        case["litter"] = sorted(p.name for p in parent.iterdir() if p.name != "pkg")
        case["litter_loads"] = []
        for name in case["litter"]:
            try:
                xpupack.load(make_stack(), parent / name)
                case["litter_loads"].append("loaded")
            except xpupack.XpupackError as exc:
                case["litter_loads"].append(str(exc))
        if not root.exists():  # the next save puts the package moved aside back first
            _fsutil.temporary_sibling(root).rmdir()
            case["after_recovery"] = _which(xpupack.load(make_stack(seed=7), root), old, new)
        cases.append(case)
    xpupack.save(old, root)
    return {"steps": steps, "cases": cases, "final_litter": sorted(p.name for p in parent.iterdir() if p.name != "pkg")}


if __name__ == "__main__":
    print(json.dumps(sweep(sys.argv[1], exchange=sys.argv[2] == "exchange")))
