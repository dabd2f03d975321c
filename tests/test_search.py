"""The thorough search (`xpupack.tune(..., search="thorough")`, `xpupack build --search thorough`), the
candidate entries it leaves (`xpupack.candidate.Candidate`) and what `xpupack inspect` shows of them."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner

import xpupack
import xpupack.searches
from support.backends import (
    CountingBackend,
    CountingRunner,
    CpuOnlyNever,
    FastArtifactBackend,
    ShortcutBackend,
)
from support.models import SlowEager, make_stack, stack_samples
from xpupack.backends.base import Backend, register_backend
from xpupack.candidate import Candidate
from xpupack.cli import main
from xpupack.errors import TuningError
from xpupack.examples import tiny_transformer, tiny_transformer_samples
from xpupack.searches import (
    COORDINATE_DESCENT,
    DEFAULT_STARTUP_MARGIN,
    QUANTIZE_CONFIGS,
    default_strategy,
    search_strategy,
    thorough_backends,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@register_backend
class FastWrongBackend(Backend):
    """Faster than eager (the module's ``shortcut``, `SlowEager`) and wrong by construction."""

    name = "fast-wrong"

    def build(self, target, spec, device):
        return CountingRunner(target.module.shortcut, set(range(len(spec.signatures))), offset=1.0)


@register_backend
class SleepyShortcutBackend(Backend):
    """The module's ``shortcut`` (`SlowEager`) after ``delay`` seconds: faster than eager, slower than the
    shortcut alone, by construction; no compiled artifacts."""

    name = "sleepy-shortcut"

    def __init__(self, delay: float = 0.001):
        self.delay = delay

    def options(self):
        return {"delay": self.delay}

    def build(self, target, spec, device):
        def run(*args, **kwargs):
            time.sleep(self.delay)
            return target.module.shortcut(*args, **kwargs)

        return CountingRunner(run, set(range(len(spec.signatures))))


def candidates(model, path=""):
    return xpupack.tuned.session_of(model).modules[path].report


# -- what each search tries ------------------------------------------------------------------------------


def test_the_quick_search_is_the_default_strategy_unchanged(monkeypatch):
    for device in (CPU, CUDA):
        assert repr(search_strategy("quick", device)) == repr(default_strategy(device))
    asked = []
    monkeypatch.setattr(
        xpupack.searches,
        "default_strategy",  # what tune uses unless told otherwise
        lambda device, **gate: asked.append(device) or xpupack.FirstWins([xpupack.EagerBackend()]),
    )
    for options in ({}, {"search": "quick"}):
        xpupack.tune(make_stack(), stack_samples(), modules=["layers.0.mlp"], **options)
    assert asked == [CPU, CPU]


def test_the_thorough_search_on_a_gpu_records_each_inductor_setting_then_the_quantized_configs():
    labels = [backend.label for backend in thorough_backends(CUDA, quantize=True)]
    assert labels == [
        "graph+inductor",
        "graph+inductor[coordinate_descent_tuning]",
        *(f"graph+inductor[coordinate_descent_tuning]+torchao:{name}" for name in QUANTIZE_CONFIGS),
        "graph",
        "inductor",
        "eager",
    ]
    strategy = search_strategy("thorough", CUDA)
    assert isinstance(strategy, xpupack.Fastest) and strategy.startup_margin == DEFAULT_STARTUP_MARGIN
    assert not any("torchao" in backend.label for backend in strategy.backends)  # quantization is opt-in


@pytest.mark.parametrize("retunes", [True, False])
def test_coordinate_descent_on_cuda_turns_the_static_launcher_off_where_it_loses_the_tuning(monkeypatch, retunes):
    """Regression (H200, torch 2.11): Inductor's static CUDA launcher forgets that a carried kernel's block
    sizes came from coordinate descent, and a bf16 Llama package's load ran 276 benchmarks to tune them
    again; with the launcher off, 22. Where torch keeps the mark (2.13) the candidates stay as they were,
    and off CUDA (no static launcher) too."""
    monkeypatch.setattr(xpupack.searches, "_STATIC_LAUNCHER_RETUNES", retunes)
    expected = {"coordinate_descent_tuning": True, **({"use_static_cuda_launcher": False} if retunes else {})}
    cuda = [backend.base for backend in thorough_backends(CUDA, quantize=["int8-weight-only"])[1:3]]
    assert [backend.options()["compile_options"] for backend in cuda] == [expected, expected]
    xpu = [backend.base for backend in thorough_backends(torch.device("xpu"), quantize=["int8-weight-only"])[1:3]]
    assert [backend.options()["compile_options"] for backend in xpu] == [dict(COORDINATE_DESCENT)] * 2


def test_the_thorough_search_on_a_gpu_tries_neither_dependent_launch_nor_max_autotune():
    """Dependent launch (``triton.enable_pdl``): on the H200 two of four tunes with it gave outputs far
    from eager's (24.6 dB where 33 dB is usual, 11.4 dB for int8) and the check refused them, where the
    same settings without it never were. Max-autotune: slower than coordinate descent on a decode step,
    and retuned at load. Both stay a user's choice (``compile_options``, a strategy of their own)."""
    labels = [backend.label for backend in thorough_backends(CUDA, quantize=True)]
    assert not any("enable_pdl" in label or "max-autotune" in label for label in labels), labels


def test_the_thorough_search_on_a_cpu_compiles_without_graphs_and_skips_coordinate_descent():
    """A CPU's kernels are C++, which coordinate descent (a Triton tuner) leaves as they are."""
    labels = [backend.label for backend in thorough_backends(CPU, quantize=["int8-weight-only"])]
    assert labels == [
        "graph",
        "inductor",
        "inductor[max-autotune-no-cudagraphs]",
        "inductor+torchao:int8-weight-only",
        "torchao:int8-weight-only",
        "eager",
    ]


def test_a_quantized_config_of_ones_own_keeps_its_settings():
    own = xpupack.TorchAOBackend("int8-weight-only", min_sqnr_db=20)
    backends = thorough_backends(CUDA, quantize=[own])
    assert [b.base.base for b in backends if "torchao" in b.label] == [own]


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"search": "exhaustive"}, "search='exhaustive'"),
        ({"quantize": True}, "pass search='thorough' too"),
        ({"search": "thorough", "strategy": xpupack.Only(xpupack.EagerBackend())}, "names its candidates itself"),
        ({"search": "thorough", "quantize": ["int3-weight-only"]}, "unknown torchao config 'int3-weight-only'"),
        ({"search": "thorough", "quantize": [xpupack.EagerBackend()]}, "neither a TorchAO config name"),
    ],
)
def test_search_options_that_do_not_fit_are_refused_before_any_recording(arguments, message):
    def never(model, item):
        raise AssertionError("recorded")

    with pytest.raises(TuningError, match=message.replace("(", r"\(").replace("[", r"\[")):
        xpupack.tune(make_stack(), [1], run=never, **arguments)


def test_inductor_labels_show_their_settings():
    assert xpupack.InductorBackend().label == "inductor"
    assert xpupack.InductorBackend("default").label == "inductor"
    assert (
        xpupack.GraphBackend(
            base=xpupack.InductorBackend(compile_options={"coordinate_descent_tuning": True, "max_fusion_size": 32})
        ).label
        == "graph+inductor[coordinate_descent_tuning,max_fusion_size=32]"
    )
    assert (
        xpupack.InductorBackend("max-autotune-no-cudagraphs", base=xpupack.TorchAOBackend()).label
        == "inductor[max-autotune-no-cudagraphs]+torchao:int8-weight-only"
    )


# -- how the fastest is chosen ----------------------------------------------------------------------------


def test_a_candidate_that_fails_correctness_never_wins_however_fast():
    model = SlowEager(delay=0.005)
    strategy = xpupack.Fastest([FastWrongBackend(), ShortcutBackend(), xpupack.EagerBackend()], iterations=3)
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = {entry.backend: entry for entry in candidates(model)}
    assert entries["fast-wrong"].status == "rejected" and "max abs difference" in entries["fast-wrong"].reason
    assert entries["fast-wrong"].median_us is None  # refused before it was timed
    assert entries["shortcut"].status == "chosen" and xpupack.stats(model)[""]["backend"] == "shortcut"


def test_the_fastest_compiled_candidate_gives_way_to_a_plain_one_within_the_margin_and_every_loser_says_why(
    monkeypatch,
):
    from xpupack import _timing

    def within_the_margin(self, heavy, light, threshold, **options):  # side by side: 1.02x, 1.0-1.04x
        return _timing.Comparison(_timing.Timing(100.0, 100.0, 5), _timing.Timing(102.0, 102.0, 5), 1.02, 1.0, 1.04, 5)

    monkeypatch.setattr(xpupack.strategies.checks.SpeedGate, "between", within_the_margin)
    model = SlowEager(delay=0.005)
    strategy = xpupack.Fastest(
        [FastArtifactBackend(), CpuOnlyNever(), SleepyShortcutBackend(), xpupack.EagerBackend()],
        iterations=3,
        startup_margin=1.05,
    )
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = {entry.backend: entry for entry in candidates(model)}
    assert list(entries) == ["fast-artifact", "never", "sleepy-shortcut", "eager"]  # the order tried
    assert entries["fast-artifact"].status == "rejected" and entries["fast-artifact"].startup_ratio == 1.02
    assert "not clearly above the start-up margin 1.05x" in entries["fast-artifact"].reason
    assert (
        entries["sleepy-shortcut"].status == "chosen" and "with no compiled code" in entries["sleepy-shortcut"].reason
    )
    assert entries["never"].status == "rejected" and "never available" in entries["never"].reason
    assert entries["eager"].status == "accepted"
    assert entries["eager"].reason.startswith("passed at 1x eager's speed; fast-artifact was faster")
    assert all(entries[name].median_us > 0 for name in ("fast-artifact", "sleepy-shortcut", "eager"))
    assert xpupack.stats(model)[""]["backend"] == "sleepy-shortcut"


def test_the_two_fastest_by_speedup_over_eager_are_timed_head_to_head_and_the_faster_of_them_wins(monkeypatch):
    # speedups over eager are timed minutes apart, beside an eager that slows with the machine's CPU load
    from xpupack import _timing

    timed = []

    def second_is_faster(self, heavy, light, threshold, **options):  # side by side: 0.6x, 0.55-0.65x
        timed.append((heavy, light))
        return _timing.Comparison(_timing.Timing(100.0, 100.0, 5), _timing.Timing(60.0, 60.0, 5), 0.6, 0.55, 0.65, 5)

    monkeypatch.setattr(xpupack.strategies.checks.SpeedGate, "between", second_is_faster)
    model = SlowEager(delay=0.005)
    strategy = xpupack.Fastest(
        [ShortcutBackend(), SleepyShortcutBackend(delay=0.002), xpupack.EagerBackend()],
        iterations=3,
        startup_margin=None,
    )
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = {entry.backend: entry for entry in candidates(model)}
    by_speedup = sorted(("shortcut", "sleepy-shortcut"), key=lambda name: -entries[name].speedup)
    assert len(timed) == 1  # one head-to-head, of the two best
    winner, loser = entries[by_speedup[1]], entries[by_speedup[0]]
    assert winner.status == "chosen" and winner.reason.startswith("fastest timed head to head")
    assert loser.status == "accepted" and "faster timed head to head" in loser.reason and "0.600x" in loser.head_to_head
    assert xpupack.stats(model)[""]["backend"] == winner.backend
    assert Candidate.from_json(loser.to_json()) == loser  # stored in the package, and read back


class _Kept(xpupack.backends.base.Runner):
    def __init__(self, name):
        super().__init__({0})
        self.name = name


class _HeadToHead:
    """A `_SpeedGate` stand-in whose head-to-head says which runner is faster, by name."""

    def __init__(self, faster):
        self.faster, self.timed = faster, []

    def between(self, heavy, light, threshold, **options):
        from xpupack import _timing

        self.timed.append((heavy.name, light.name))
        ratio = 0.7 if light.name == self.faster else 1.3  # below 1: the second (the challenger) was faster
        return _timing.Comparison(
            _timing.Timing(100.0, 100.0, 5), _timing.Timing(70.0, 70.0, 5), ratio, ratio - 0.05, ratio + 0.05, 5
        )


def test_the_runoff_also_challenges_the_quickest_by_its_own_time_where_eagers_drift_ranked_it_third():
    """On the H200, eager's step drifted from 13 to 29 ms across one thorough search: the quickest candidate
    (2.2 ms per call) came third by speedup behind one at 3.0 ms, and the runner-up by speedup was neither."""
    from xpupack.strategies.fastest import _runoff

    report = [
        Candidate("max-autotune", "accepted", median_us=2984.0, speedup=6.87),
        Candidate("default", "accepted", median_us=3494.0, speedup=6.31),
        Candidate("coordinate-descent", "accepted", median_us=2160.0, speedup=6.22),
        Candidate("eager", "accepted", median_us=20525.0),
    ]
    backends = [ShortcutBackend(), ShortcutBackend(), ShortcutBackend(), xpupack.EagerBackend()]
    alive = {index: (backend, _Kept(entry.backend)) for index, (backend, entry) in enumerate(zip(backends, report))}
    gate = _HeadToHead(faster="coordinate-descent")
    assert report[_runoff(report, alive, gate)].backend == "coordinate-descent"
    assert gate.timed == [("max-autotune", "default"), ("max-autotune", "coordinate-descent")]
    assert all(report[index].head_to_head for index in range(3))  # each timed head to head says so
    assert report[3].head_to_head is None


def test_the_runoff_keeps_the_best_by_speedup_when_no_challenger_beats_it_head_to_head():
    from xpupack.strategies.fastest import _runoff

    report = [
        Candidate("a", "accepted", median_us=2000.0, speedup=7.0),
        Candidate("b", "accepted", median_us=2500.0, speedup=6.0),
    ]
    alive = {index: (ShortcutBackend(), _Kept(entry.backend)) for index, entry in enumerate(report)}
    gate = _HeadToHead(faster="nobody")
    assert _runoff(report, alive, gate) == 0
    assert gate.timed == [("a", "b")]  # the quickest is the champion itself: one head-to-head


def test_the_fastest_compiled_candidate_clearly_ahead_of_the_plain_one_is_kept():
    model = SlowEager(delay=0.005)
    strategy = xpupack.Fastest(
        [SleepyShortcutBackend(delay=0.002), FastArtifactBackend(), xpupack.EagerBackend()],
        iterations=3,
        startup_margin=1.05,
    )
    xpupack.tune(model, [torch.randn(2, 8)], strategy=strategy)
    entries = {entry.backend: entry for entry in candidates(model)}
    assert entries["fast-artifact"].status == "chosen" and entries["fast-artifact"].startup_ratio > 1.05
    assert entries["sleepy-shortcut"].status == "rejected"
    assert "at least the start-up margin" in entries["sleepy-shortcut"].reason
    assert entries["fast-artifact"].speedup > entries["sleepy-shortcut"].speedup > 1
    assert xpupack.stats(model)[""]["backend"] == "fast-artifact"


# -- candidate entries -------------------------------------------------------------------------------------

OLD_ENTRIES = [  # as xpupack wrote them before entries were a dataclass (and one from a newer xpupack)
    {"backend": "graph", "status": "rejected", "reason": "no device graphs on cpu"},
    {
        "backend": "inductor",
        "status": "rejected",
        "median_us": 120.5,
        "speedup": 0.91,
        "speedup_interval": [0.85, 0.97],
        "rounds": 40,
        "noisy": False,
        "reason": "not faster than eager: ...",
    },
    {
        "backend": "graph+inductor",
        "status": "chosen",
        "reason": "first to pass",
        "median_us": 12.0,
        "speedup": 2.5,
        "speedup_interval": [2.4, 2.6],
        "rounds": 20,
        "noisy": False,
        "startup_ratio": 1.2,
        "startup_ratio_interval": [1.1, 1.3],
    },
    {"backend": "eager", "status": "accepted"},
    {"backend": "future", "status": "rejected", "reason": "x", "energy_j": 3.5},
]


@pytest.mark.parametrize("entry", OLD_ENTRIES)
def test_a_stored_candidate_reads_and_writes_back_as_it_was(entry):
    assert Candidate.from_json(entry).to_json() == entry


def test_a_candidate_status_must_be_one_a_manifest_allows():
    with pytest.raises(ValueError, match="status='won'"):
        Candidate("graph", "won")


def test_inspect_lists_every_candidate_with_its_timing_and_reason_also_from_an_older_package(tmp_path):
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(xpupack.EagerBackend())
    )
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = json.loads((root / "xpupack.json").read_text())
    manifest["modules"][0]["candidates"] = OLD_ENTRIES
    (root / "xpupack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["inspect", str(root)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # the table folds long lines
    assert "graph: rejected — no device graphs on cpu" in text
    assert "inductor: rejected — not faster than eager: ... (120.5 µs, 0.91x eager, 0.85-0.97x)" in text
    assert "graph+inductor: chosen — first to pass (12 µs, 2.5x eager, 2.4-2.6x)" in text
    assert "eager: accepted" in text and "future: rejected — x" in text
    json_result = CliRunner().invoke(main, ["inspect", str(root), "--json"])
    assert json.loads(json_result.output)["modules"][0]["candidates"] == OLD_ENTRIES


def test_inspect_shows_settings_in_brackets_as_text(tmp_path):
    """Rich reads ``[...]`` as markup: a label's settings must still print."""
    model = xpupack.tune(
        make_stack(), stack_samples(), modules=["layers.0.mlp"], strategy=xpupack.Only(xpupack.EagerBackend())
    )
    root = xpupack.save(model, tmp_path / "pkg")
    manifest = json.loads((root / "xpupack.json").read_text())
    manifest["modules"][0]["candidates"] = [
        {"backend": "graph+inductor[coordinate_descent_tuning]", "status": "chosen", "reason": "fastest"}
    ]
    (root / "xpupack.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["inspect", str(root)])
    assert "graph+inductor[coordinate_descent_tuning]: chosen" in " ".join(result.output.split())


# -- the command line ---------------------------------------------------------------------------------------

DEMO = [
    "xpupack.examples:tiny_transformer",
    "--samples",
    "xpupack.examples:tiny_transformer_samples",
    "--modules",
    "layers.0.mlp",
]


def test_build_search_thorough_times_every_candidate_and_inspect_lists_them(tmp_path, monkeypatch):
    asked = []

    def cheap_candidates(device, quantize=False):  # stands in for the Inductor compiles
        asked.append((device.type, quantize))
        return [CpuOnlyNever(), CountingBackend(offset=1.0), CountingBackend(), xpupack.EagerBackend()]

    monkeypatch.setattr(xpupack.searches, "thorough_backends", cheap_candidates)
    out = tmp_path / "pkg"
    result = CliRunner().invoke(
        main, ["build", *DEMO, "--out", str(out), "--device", "cpu", "--search", "thorough", "--min-speedup", "none"]
    )
    assert result.exit_code == 0, result.output
    assert asked == [("cpu", False)]
    stored = json.loads((out / "xpupack.json").read_text())["modules"][0]["candidates"]
    assert [(entry["backend"], entry["status"] != "rejected") for entry in stored] == [
        ("never", False),
        ("counting", False),
        ("counting", True),
        ("eager", True),
    ]
    assert [entry["status"] for entry in stored].count("chosen") == 1
    assert all("median_us" in entry for entry in stored[2:])  # every passing candidate was timed
    text = " ".join(CliRunner().invoke(main, ["inspect", str(out)]).output.split())
    assert "never: rejected — never available" in text and "x eager" in text and "µs" in text


@pytest.mark.parametrize(
    "options, message",
    [
        (["--quantize", "int8-weight-only"], "add --search thorough"),
        (["--search", "thorough", "--backends", "graph,eager"], "pass one or the other"),
        (["--search", "thorough", "--quantize", "int3"], "unknown torchao config 'int3'"),
    ],
)
def test_build_refuses_search_options_that_do_not_fit(tmp_path, options, message):
    result = CliRunner().invoke(main, ["build", *DEMO, "--out", str(tmp_path / "pkg"), *options])
    assert result.exit_code == 2 and message in result.output


def test_build_search_quantize_all_asks_for_every_named_config(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(
        xpupack.searches,
        "thorough_backends",
        lambda device, quantize=False: asked.append(quantize) or [xpupack.EagerBackend()],
    )
    result = CliRunner().invoke(
        main,
        [
            "build",
            *DEMO,
            "--out",
            str(tmp_path / "pkg"),
            "--device",
            "cpu",
            "--search",
            "thorough",
            "--quantize",
            "all",
        ],
    )
    assert result.exit_code == 0, result.output
    assert asked == [True]


# -- with Inductor (slow: real compiles) ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_thorough_search_on_a_cpu_compiles_each_setting_and_records_each_with_a_timing_or_a_reason(tmp_path):
    model = xpupack.tune(
        tiny_transformer(),
        tiny_transformer_samples(),
        modules=["layers.0.mlp"],
        device="cpu",
        search="thorough",
        quantize=["int4-weight-only"],
    )
    entries = {entry.backend: entry for entry in candidates(model, "layers.0.mlp")}
    assert list(entries) == [
        "graph",
        "inductor",
        "inductor[max-autotune-no-cudagraphs]",
        "inductor+torchao:int4-weight-only",
        "torchao:int4-weight-only",
        "eager",
    ]
    assert "no device graphs on cpu" in entries["graph"].reason
    assert "needs CUDA" in entries["torchao:int4-weight-only"].reason
    for name in ("inductor", "inductor[max-autotune-no-cudagraphs]"):  # built, checked and timed
        assert entries[name].median_us is not None and entries[name].speedup is not None, entries[name]
    assert [entry.status for entry in entries.values()].count("chosen") == 1
    assert all(entry.reason for entry in entries.values())
    root = xpupack.save(model, tmp_path / "pkg")
    stored = json.loads((root / "xpupack.json").read_text())["modules"][0]["candidates"]
    assert stored == [entry.to_json() for entry in entries.values()]


LOAD_AND_COUNT = """
    import json, torch, xpupack
    from torch._dynamo.utils import counters
    from xpupack.examples import tiny_transformer
    model = xpupack.load(tiny_transformer(), {root!r}, device={device!r}, defer_compile=False)
    with torch.inference_mode():
        model(torch.randint(0, 256, (1, 16), device={device!r}))
    print(json.dumps(dict(counters["inductor"])))
"""

TUNE_TWICE = """
    import torch, xpupack
    from xpupack.examples import tiny_transformer, tiny_transformer_samples
    from xpupack.searches import coordinate_descent  # the thorough search's settings on this device

    def tuned():
        compiled = xpupack.InductorBackend(compile_options=coordinate_descent(torch.device({device!r})))
        backend = compiled if {device!r} == "cpu" else xpupack.GraphBackend(base=compiled)
        return xpupack.tune(tiny_transformer(), tiny_transformer_samples(), modules=["layers.0.mlp"],
                            device={device!r}, strategy=xpupack.Only(backend))

    tuned()  # an earlier candidate: the same kernels compiled and tuned before
    xpupack.save(tuned(), {root!r})
"""

#: Inductor's counters of benchmarks run while compiling or at a kernel's first launch
BENCHMARKS = ("coordesc_tuning_bench", "select_algorithm_autotune", "combo_autotune_bench", "pad_mm_bench")


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_a_package_tuned_with_coordinate_descent_loads_on_a_fresh_machine_without_compiling_or_tuning(
    tmp_path, run_python, device
):
    """The settings travel (a loader compiling with others would miss the carried graphs) and so do the
    tuning results: a fresh process with empty caches compiles nothing and runs no benchmark. The same
    kernels are compiled and tuned once before in the tuning process, as a thorough search's earlier
    candidates do: the package must carry their results all the same. On a CPU coordinate descent has
    no Triton kernel to tune: there the test shows the settings travel; on CUDA, that the tuned block
    sizes do too (``coordesc_tuning_bench``)."""
    # tuned in a process of its own: this one's Inductor settings are whatever earlier tests (torchao's
    # process-wide ones among them) left, which a compile's cache key includes and a fresh loader lacks
    root = tmp_path / "pkg"
    run_python(
        TUNE_TWICE.format(root=str(root), device=device),
        env={
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"),
            "TRITON_CACHE_DIR": str(tmp_path / "build-triton"),
        },
    )
    empty = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    result = run_python(LOAD_AND_COUNT.format(root=str(root), device=device), env=empty)
    counters = json.loads(result.stdout.strip().splitlines()[-1])
    assert counters.get("fxgraph_cache_miss", 0) == 0 and counters.get("fxgraph_cache_hit", 0) >= 1, counters
    assert {name: counters.get(name, 0) for name in BENCHMARKS} == dict.fromkeys(BENCHMARKS, 0), counters


@pytest.mark.slow  # the build compiles the demo's blocks with Inductor
def test_build_and_tune_map_a_search_to_a_strategy_in_one_place(tmp_path, monkeypatch):
    """``xpupack build --search`` and ``tune(search=...)`` both go through `searches.search_strategy`
    (written once, with the CLI's gate and margin), not a mapping of their own."""
    asked = []
    real = xpupack.searches.search_strategy

    def recording(search, device=None, quantize=False, **gate):
        asked.append((search, quantize, gate))
        return real(search, device, quantize, **gate)

    monkeypatch.setattr(xpupack.searches, "search_strategy", recording)
    monkeypatch.setattr("xpupack.tuning.search_strategy", recording)
    out = tmp_path / "pkg"
    result = CliRunner().invoke(
        main,
        [
            "build",
            *DEMO,
            "--modules",
            "layers.*.mlp",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--min-speedup",
            "none",
            "--startup-margin",
            "1.2",
        ],
    )
    assert result.exit_code == 0, result.output
    xpupack.tune(make_stack(), stack_samples(), modules=["layers.0.mlp"], search="quick")
    assert asked == [
        ("quick", False, {"min_speedup": None, "startup_margin": 1.2}),
        ("quick", False, {}),
    ]
