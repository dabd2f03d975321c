"""Where a decode step's time goes: the kernels of a few profiled steps, grouped, with achieved bandwidth.

Pure Python on (name, start µs, duration µs) triples, so that the summary can be checked without a GPU;
``llm_decode.py --profile`` feeds it torch.profiler's device kernels (on a CPU: its operators, by self time).

Bytes moved are estimated per category only where a decode step makes them plain: matrix products read
every Linear weight once per step (at batch 1 to 8 that is nearly all they move), attention reads the
key/value cache. Fused pointwise and reduction kernels, copies and the rest get time and count only.
"""

from __future__ import annotations

import re
from collections import defaultdict

#: categories in the order a kernel name is tested against them (attention before matrix products:
#: a fused attention kernel may name its own matmuls)
CATEGORIES = {
    "attention": re.compile(r"fmha|flash|attention|attn|sdpa", re.IGNORECASE),
    "matmul": re.compile(
        r"gemm|gemv|nvjet|cutlass|xmma|cublas|tinygemm|int4pack|int8pack|splitk|matmul"
        r"|(?:^|[_:])(?:mm|addmm|bmm|tem)(?:_|$)",
        re.IGNORECASE,
    ),
    "cache_update": re.compile(r"index_copy|index_put|scatter", re.IGNORECASE),
    "copy": re.compile(r"memcpy|memset|copy_kernel|elementwise_kernel.*copy|CatArrayBatched", re.IGNORECASE),
    "triton_fused": re.compile(r"^triton_|^cpp_fused", re.IGNORECASE),
}


def classify(name: str) -> str:
    """The category of a kernel by its name (``other`` when none fits)."""
    for category, pattern in CATEGORIES.items():
        if pattern.search(name):
            return category
    return "other"


def summarize(
    kernels: list[tuple[str, float, float]],
    steps: int,
    *,
    bytes_per_step: dict[str, float] | None = None,
    bandwidth_bytes_per_s: float | None = None,
    step_us: float | None = None,
    top: int = 15,
    name_chars: int = 140,
) -> dict:
    """Per-step time of ``kernels`` (``(name, start_us, duration_us)`` over ``steps`` decode steps).

    Args:
        kernels: every kernel (or operator) the profiled steps ran.
        steps: how many decode steps they cover.
        bytes_per_step: estimated bytes a step moves per category (e.g. ``{"matmul": ..., "attention": ...,
            "step": ...}``); ``step`` is the whole step's, set against the span.
        bandwidth_bytes_per_s: the device's memory bandwidth, for the share of it each estimate reaches.
        step_us: the step time measured without the profiler (``1e6 / tokens_per_s`` at batch 1), shown beside.
        top: how many kernels to list.
        name_chars: kernel names are cut to this length.

    Returns:
        ``span_us_per_step`` (first kernel start to last kernel end, per step), ``busy_us_per_step`` (kernel
        time), ``idle_share`` (of the span, no kernel running: launch gaps, host work), ``top_kernels`` (time,
        calls and share of the span per step, category) and ``categories`` (the same per category, with
        ``bytes_per_step``, ``achieved_bytes_per_s`` and ``share_of_bandwidth`` where estimated).
    """
    steps = max(steps, 1)
    bytes_per_step = bytes_per_step or {}
    if not kernels:
        return {"steps": steps, "kernels": 0, "note": "the profiler saw no kernels"}
    span = (max(start + duration for _, start, duration in kernels) - min(start for _, start, _ in kernels)) / steps
    busy = sum(duration for _, _, duration in kernels) / steps
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_category: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, _, duration in kernels:
        for table, key in ((by_name, name), (by_category, classify(name))):
            table[key][0] += duration
            table[key][1] += 1

    def share(us: float) -> float:
        return round(us / span, 4) if span > 0 else 0.0

    top_kernels = [
        {
            "name": name[:name_chars],
            "category": classify(name),
            "us_per_step": round(total / steps, 2),
            "calls_per_step": round(count / steps, 2),
            "share_of_step": share(total / steps),
        }
        for name, (total, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    ]
    categories = {}
    for category, (total, count) in sorted(by_category.items(), key=lambda item: -item[1][0]):
        row = {
            "us_per_step": round(total / steps, 2),
            "calls_per_step": round(count / steps, 2),
            "share_of_step": share(total / steps),
        }
        row.update(_bandwidth(bytes_per_step.get(category), total / steps, bandwidth_bytes_per_s))
        categories[category] = row
    summary = {
        "steps": steps,
        "kernels": len(kernels),
        "distinct_kernels": len(by_name),
        "span_us_per_step": round(span, 2),
        "busy_us_per_step": round(busy, 2),
        "idle_share": round(max(span - busy, 0.0) / span, 4) if span > 0 else 0.0,
    }
    if step_us is not None:
        summary["unprofiled_step_us"] = round(step_us, 2)
    summary.update(
        {
            f"step_{key}": value
            for key, value in _bandwidth(bytes_per_step.get("step"), step_us or span, bandwidth_bytes_per_s).items()
        }
    )
    summary["categories"] = categories
    summary["top_kernels"] = top_kernels
    return summary


def _bandwidth(moved: float | None, us: float, bandwidth: float | None) -> dict:
    if not moved or us <= 0:
        return {}
    achieved = moved / (us * 1e-6)
    row = {"bytes_per_step": int(moved), "achieved_bytes_per_s": round(achieved, -6)}
    if bandwidth:
        row["share_of_bandwidth"] = round(achieved / bandwidth, 4)
    return row
