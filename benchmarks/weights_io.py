"""Weights at disk speed: `xpupack.save` and `xpupack.load` against safetensors' own ``save_file`` and
``load_file`` + ``load_state_dict``, on the same tensors, side by side in one run.

The model is a stack of ``hidden x hidden`` linear layers of about ``--size-gb`` GB (GB = 1e9 bytes),
its first layer tuned with the eager backend (so a package holds little besides the weights). Every
measurement runs ``--repeat`` times, alternating the two sides; the medians are reported, with GB/s of
weights. Files are read back from the page cache (they were just written).

- save: xpupack writes a complete package (shards, their sha256, manifest, fsync, rename into place);
  safetensors' ``save_file`` writes one file (no digest, no fsync); ``safetensors_save_sha256_fsync`` is
  ``save_file`` then the file's sha256 and ``fsync``, what a package promises done the plain way.
- load into a freshly built model on the device: xpupack with every digest checked
  (``load_checked``: ``XPUPACK_REMEMBER_VERIFIED=0``), and with the verification of the unchanged
  files remembered from an earlier load (``load_remembered``); safetensors: ``load_file(path,
  device=...)`` then ``model.load_state_dict``.
- on CUDA, the device memory each load allocates beyond the model's own
  (``torch.cuda.max_memory_allocated`` during the load less the memory before it).

    python benchmarks/weights_io.py                                  # CPU, 0.5 GB
    python benchmarks/weights_io.py --device cuda --size-gb 4 --max-shard-size 1GB
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import xpupack
from xpupack.digests import sha256_of

#: a file whose change time is at least this old may be remembered as verified (xpupack's rule)
SETTLE_S = 2.5


def build(layers: int, hidden: int, dtype: torch.dtype, device: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        return nn.Sequential(*[nn.Linear(hidden, hidden, dtype=dtype) for _ in range(layers)])


def sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


def measured(device: str, action, *args) -> tuple[float, int | None]:
    """Seconds ``action(*args)`` took, and on CUDA the device memory it allocated at its peak beyond what was
    allocated before it. Dirty pages are written out first: neither side pays for flushing the other's files."""
    os.sync()
    sync(device)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    action(*args)
    sync(device)
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - before if device != "cpu" else None)


def save_durably(state: dict, path: Path) -> None:
    """What a package promises beyond ``save_file``, done the plain way: the file's sha256 (a second read) and
    ``fsync``."""
    save_file(state, str(path))
    sha256_of(path)
    with path.open("rb") as stream:
        os.fsync(stream.fileno())


def load_plain(model: nn.Module, path: Path, device: str) -> None:
    """safetensors' own load, then PyTorch's."""
    model.load_state_dict(load_file(str(path), device=device))


def load_checked(model: nn.Module, root: Path) -> None:
    """xpupack's load hashing every file, whatever it remembers."""
    os.environ["XPUPACK_REMEMBER_VERIFIED"] = "0"
    try:
        xpupack.load(model, root)
    finally:
        os.environ.pop("XPUPACK_REMEMBER_VERIFIED")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 elsewhere")
    parser.add_argument("--max-shard-size", default=None, help="xpupack.save's max_shard_size (default: 5GB, its own)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    device = args.device
    dtype = getattr(torch, args.dtype or ("float32" if device == "cpu" else "bfloat16"))
    per_layer = (args.hidden * args.hidden + args.hidden) * dtype.itemsize
    layers = max(1, round(args.size_gb * 1e9 / per_layer))
    work = Path(tempfile.mkdtemp(prefix="weights-io-", dir=args.dir))
    shard_size = args.max_shard_size or "5GB"  # xpupack.save's default
    try:
        model = build(layers, args.hidden, dtype, device, seed=0)
        sample = torch.randn(2, args.hidden, dtype=dtype, device=device)
        model = xpupack.tune(model, [sample], modules=["0"], strategy=xpupack.Only(xpupack.EagerBackend()))
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
        size = sum(tensor.nbytes for tensor in state.values())
        seconds: dict[str, list[float]] = {}
        memory: dict[str, int | None] = {}

        def measure(name: str, action, *args) -> None:
            took, memory[name] = measured(device, action, *args)
            seconds.setdefault(name, []).append(took)

        for _ in range(args.repeat):  # the two sides alternate: machine noise hits both alike
            shutil.rmtree(work / "pkg", ignore_errors=True)
            (work / "plain.safetensors").unlink(missing_ok=True)
            measure("safetensors_save", save_file, state, str(work / "plain.safetensors"))
            measure("xpupack_save", functools.partial(xpupack.save, max_shard_size=shard_size), model, work / "pkg")
            (work / "plain.safetensors").unlink()
            measure("safetensors_save_sha256_fsync", save_durably, state, work / "plain.safetensors")
        shards = len(list((work / "pkg").glob("*.safetensors")))
        written = time.time()
        for round_ in range(args.repeat):
            fresh = build(layers, args.hidden, dtype, device, seed=1 + round_)
            measure("safetensors_load", load_plain, fresh, work / "plain.safetensors", device)
            fresh = build(layers, args.hidden, dtype, device, seed=1 + round_)
            measure("xpupack_load_checked", load_checked, fresh, work / "pkg")
            assert all(torch.equal(fresh.state_dict()[name], tensor) for name, tensor in state.items())
            del fresh
        time.sleep(max(0.0, written + SETTLE_S - time.time()))  # files this new are never remembered
        xpupack.load(build(layers, args.hidden, dtype, device, seed=9), work / "pkg")  # remembers the digests
        for round_ in range(args.repeat):
            fresh = build(layers, args.hidden, dtype, device, seed=1 + round_)
            measure("xpupack_load_remembered", xpupack.load, fresh, work / "pkg")
            del fresh
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        result = {
            "device": device if device == "cpu" else torch.cuda.get_device_name(),
            "dtype": str(dtype).removeprefix("torch."),
            "weights_gb": round(size / 1e9, 3),
            "tensors": len(state),
            "shards": shards,
            "max_shard_size": args.max_shard_size or "default",
            "repeat": args.repeat,
            "cpu_count": os.cpu_count(),
            "seconds": {name: [round(s, 3) for s in values] for name, values in seconds.items()},
            "median_s": {name: round(s, 3) for name, s in medians.items()},
            "gb_per_s": {name: round(size / 1e9 / s, 2) for name, s in medians.items()},
            "xpupack_over_safetensors": {
                "save": round(medians["xpupack_save"] / medians["safetensors_save"], 2),
                "save_vs_sha256_fsync": round(medians["xpupack_save"] / medians["safetensors_save_sha256_fsync"], 2),
                "load_checked": round(medians["xpupack_load_checked"] / medians["safetensors_load"], 2),
                "load_remembered": round(medians["xpupack_load_remembered"] / medians["safetensors_load"], 2),
            },
        }
        if device != "cpu":
            result["extra_device_memory_at_load_bytes"] = {name: memory[name] for name in seconds if "load" in name}
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
