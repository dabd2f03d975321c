"""benchmarks/llm_decode.py's own logic on a CPU: which tune() arguments each variant gets, the teacher-forced
check, quantized bytes, the step profile's summary, the time budget; and (slow) a tiny end-to-end run. Its
timings mean nothing here: the figures come from the H200 (docs/language-models.md)."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import _step_profile

import llm_decode


def settings(*options):
    return llm_decode.Settings(llm_decode.parser().parse_args(["--device", "cpu", "--tiny", *options]))


def tune_without_search(model, samples, modules=None, device=None, strategy=None, run=None):
    """A ``tune`` as it was before ``search=``: the benchmark reads its signature only."""


def tune_with_search_and_quantize(
    model, samples, modules=None, device=None, strategy=None, run=None, *, search="quick", quantize=None
):
    """A ``tune`` with ``search=`` and ``quantize=``."""


def test_the_thorough_variant_is_not_available_where_tune_has_no_search_parameter():
    kwargs, how = llm_decode.tune_arguments("xpupack_bf16_thorough", settings(), tune_without_search)
    assert kwargs is None and how.startswith("not available") and "search=" in how
    kwargs, how = llm_decode.tune_arguments("xpupack_bf16_thorough", settings(), tune_with_search_and_quantize)
    assert kwargs == {"search": "thorough"}


def test_quantized_variants_use_quantize_and_thorough_search_where_tune_has_them():
    kwargs, how = llm_decode.tune_arguments("xpupack_int8", settings(), tune_with_search_and_quantize)
    [torchao] = kwargs["quantize"]  # quantize= needs the thorough search; the benchmark's 20 dB floor goes along
    assert kwargs["search"] == "thorough" and torchao.label == "torchao:int8-weight-only"
    assert torchao.min_sqnr_db == 20 and how == "tune(search='thorough', quantize=[torchao:int8-weight-only])"
    kwargs, how = llm_decode.tune_arguments(
        "xpupack_int8", settings("--quant-search", "quick"), tune_with_search_and_quantize
    )
    assert set(kwargs) == {"strategy"} and "torchao:int8-weight-only" in how  # the one quantized chain


def test_without_quantize_a_quantized_variant_gets_the_torchao_strategy_of_the_readme():
    kwargs, how = llm_decode.tune_arguments("xpupack_int8", settings(), tune_without_search)
    assert set(kwargs) == {"strategy"}
    assert how == "tune(strategy=Only(inductor+torchao:int8-weight-only))"  # a CPU: no device graph over it


def test_the_teacher_forced_check_wants_eagers_argmax_in_the_top_3_at_every_step():
    eager = torch.zeros(10, 1, 8)
    eager[:, 0, 0] = 1.0  # eager's argmax: token 0 at every step
    tuned = eager.clone()
    tuned[:1, 0, 1:4] = 2.0  # one step where token 0 is fourth
    check = llm_decode.tokens_check(tuned, eager)
    assert not check["top3_contains_eager_argmax"] and not check["passed"] and check["argmax_agreement"] == 0.9
    tuned = eager.clone()
    tuned[:1, 0, 1] = 2.0  # second of the top 3 at one step: 90% agreement passes
    assert llm_decode.tokens_check(tuned, eager)["passed"]
    assert llm_decode.tokens_check(eager, eager)["logits_sqnr_db"] == 200.0


def test_a_quantized_package_passes_the_check_on_its_sqnr_floor_not_on_argmax_agreement():
    """The H200's int8 package: 23 dB from bf16 eager, 89% argmax agreement (this random model's top logits
    are close). The issue's bar for a quantized package is 20 dB, bf16's is the argmax one."""
    torch.manual_seed(0)
    eager = torch.randn(10, 1, 64)
    near = eager + 0.05 * torch.randn(10, 1, 64)  # about 26 dB
    far = eager + 0.2 * torch.randn(10, 1, 64)  # about 14 dB
    assert llm_decode.tokens_check(near, eager, quantized=True)["passed"]
    assert not llm_decode.tokens_check(far, eager, quantized=True)["passed"]
    eager[..., 0], eager[..., 1] = 5.0, 4.99  # two close top logits at every step
    swapped = eager.clone()
    swapped[..., 0], swapped[..., 1] = 4.99, 5.0  # the other one wins: no argmax agrees, the logits still close
    assert llm_decode.tokens_check(swapped, eager, quantized=True)["passed"]
    assert not llm_decode.tokens_check(swapped, eager)["passed"]


def test_quantized_weights_count_at_their_stored_size():
    torchao = pytest.importorskip("torchao.quantization")
    model = torch.nn.Sequential(torch.nn.Embedding(16, 64), torch.nn.Linear(64, 128, bias=False))
    before = llm_decode.weight_bytes(model)
    assert before == {"all": (16 * 64 + 64 * 128) * 4, "linear": 64 * 128 * 4, "embedding": 16 * 64 * 4}
    torchao.quantize_(model, torchao.Int8WeightOnlyConfig(), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))
    after = llm_decode.weight_bytes(model)
    assert 64 * 128 <= after["linear"] < 64 * 128 * 2  # int8 values and a scale per row
    assert after["all"] == after["linear"] + after["embedding"] and after["embedding"] == before["embedding"]


def test_the_step_profile_gives_shares_of_the_step_and_the_bandwidth_of_the_matrix_products():
    # two steps of 100 µs: a 60 µs GEMV and a 20 µs fused norm each, 20 µs idle
    kernels = [
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 0, 60),
        ("triton_red_fused_add_mean_mul_pow_rsqrt_0", 70, 20),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 100, 60),
        ("triton_red_fused_add_mean_mul_pow_rsqrt_0", 170, 20),
    ]
    summary = _step_profile.summarize(kernels, 2, bytes_per_step={"matmul": 3e6}, bandwidth_bytes_per_s=1e11)
    assert summary["span_us_per_step"] == 95 and summary["busy_us_per_step"] == 80
    top = summary["top_kernels"][0]
    assert (top["category"], top["us_per_step"], top["calls_per_step"]) == ("matmul", 60, 1)
    matmul = summary["categories"]["matmul"]
    assert matmul["achieved_bytes_per_s"] == 5e10 and matmul["share_of_bandwidth"] == 0.5
    assert "bytes_per_step" not in summary["categories"]["triton_fused"]


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, 128, 16, 4, 4, false>", "matmul"),
        ("triton_tem_fused_mm_0", "matmul"),
        ("aten::mm", "matmul"),
        ("triton_red_fused__to_copy_mm_mul_3", "matmul"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("flash_fwd_splitkv_kernel", "attention"),
        ("triton_poi_fused_index_copy_1", "cache_update"),
        ("triton_poi_fused_add_cos_mul_sin_2", "triton_fused"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("void at::native::vectorized_elementwise_kernel<4>", "other"),
    ],
)
def test_kernels_fall_into_categories_by_name(name, category):
    assert _step_profile.classify(name) == category


def test_a_spent_time_budget_skips_the_variants_and_says_why(tmp_path, capsys):
    out = tmp_path / "report.json"
    report = llm_decode.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--variants",
            "xpupack_bf16,hand_graph_inductor,xpupack_int4",
            "--time-budget",
            "1",
            "--workdir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    assert json.loads(capsys.readouterr().out) == report == json.loads(out.read_text())
    assert report["status"] == {
        "xpupack_bf16": "skipped: the time budget (1 s) ran out",
        "hand_graph_inductor": "skipped: needs device graphs (a CUDA or XPU device)",
        "xpupack_int4": "skipped: TorchAO int4 weight-only runs on CUDA only (README: Quantization (TorchAO))",
    }
    assert report["rows"] == [] and report["ratios"] == {}


@pytest.mark.slow  # two fresh processes, each importing torch and transformers
def test_a_tiny_run_tunes_loads_on_empty_caches_and_checks_tokens_against_eager(tmp_path, capsys):
    report = llm_decode.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--variants",
            "xpupack_bf16",
            "--batch",
            "1,2",
            "--new-tokens",
            "4",
            "--profile",
            "--workdir",
            str(tmp_path),
        ]
    )
    capsys.readouterr()
    assert report["status"] == {"xpupack_bf16": "ok"}, report["results"]
    tune, load = report["results"]["xpupack_bf16"]["tune"], report["results"]["xpupack_bf16"]["load"]
    assert tune["tune_s"] > 0 and tune["api"] == "tune() default strategy"
    assert load["load_s"] > 0 and set(load["first_generate_s"]) == {"batch1", "batch2"}
    for batch in (1, 2):
        row = load[f"batch{batch}"]
        assert row["check"]["passed"] and row["check"]["predictions"] == 5 * batch
        assert row["loop_tokens_per_s"] > 0 and row["hbm_limit_tokens_per_s"] == pytest.approx(
            batch * 4.8e12 / load["weight_bytes"]["all"], rel=1e-3
        )
    assert [row["batch"] for row in report["rows"]] == [1, 2]
    assert load["profile"]["steps"] == 8 and load["profile"]["top_kernels"] and not load["profile"].get("error")


def test_resume_keeps_finished_variants_and_loads_a_tuned_package_without_tuning_again(tmp_path):
    (tmp_path / "pkg-xpupack_int8").mkdir()
    results = {
        "xpupack_bf16": {"status": "ok", "tune": {"tune_s": 1}},
        "xpupack_bf16_thorough": {"status": "not available: this xpupack.tune has no search= parameter"},
        "xpupack_int8": {"status": "timed out in load", "tune": {"tune_s": 2, "package_bytes": 10}},
        "xpupack_int4": {"status": "timed out in load", "tune": {"tune_s": 2, "package_bytes": 10}},
        "xpupack_float8": {"status": "timed out in tune", "tune": {"error": "stopped"}},
    }
    (tmp_path / "report.json").write_text(json.dumps({"results": results}))
    kept = llm_decode.resumed([str(tmp_path / "missing.json"), str(tmp_path / "report.json")], tmp_path)
    assert kept == {
        "xpupack_bf16": results["xpupack_bf16"],
        "xpupack_bf16_thorough": results["xpupack_bf16_thorough"],
        "xpupack_int8": {"tune": {"tune_s": 2, "package_bytes": 10}, "status": "tuned"},
    }


def test_the_load_step_names_each_kernel_coordinate_descent_tunes_and_keeps_the_tuners_log_quiet(capsys):
    """A load that tunes again what its package should carry: which kernels, as Inductor's tuner names them."""
    import logging

    import _caches

    tuner = logging.getLogger("torch._inductor.runtime.coordinate_descent_tuner")
    saved = (tuner.level, tuner.propagate, list(tuner.handlers))
    try:
        names = _caches.watch_coordinate_descent()
        for kernel in ("triton_red_fused_mm_1", "triton_red_fused_mm_1", "triton_poi_fused_add_2"):
            tuner.debug("= Do coordinate descent tuning for %s =", kernel)
        tuner.debug("Try config %s", "XBLOCK: 8")
        assert names == ["triton_red_fused_mm_1", "triton_red_fused_mm_1", "triton_poi_fused_add_2"]
        assert "coordinate descent" not in capsys.readouterr().err
    finally:
        tuner.setLevel(saved[0])
        tuner.propagate = saved[1]
        tuner.handlers[:] = saved[2]


def test_llama3_8b_shapes_reach_every_process_of_a_run_and_exclude_tiny():
    """``--llama3-8b`` (quantized decode where users quantize): its shapes in the report and the model, the
    option handed to each child process, its own reference tokens; ``--tiny`` with it is refused."""
    chosen = settings("--llama3-8b")
    chosen.tiny = False
    assert llm_decode.model_config(llama3_8b=True)["hidden_size"] == 4096
    assert llm_decode.model_config(llama3_8b=True)["num_hidden_layers"] == 32
    assert llm_decode.model_config()["hidden_size"] == 2048 and llm_decode.model_config(tiny=True)["hidden_size"] == 64
    chosen.workdir = Path("w")
    assert chosen.reference_file(1).name == "reference-8b-b1-n128.pt"
    args = llm_decode.parser().parse_args(["--device", "cpu", "--llama3-8b"])
    assert "--llama3-8b" in llm_decode.Runner(args, chosen, {}).child_options()
    with torch.device("meta"):  # the shapes, not the weights
        model = llm_decode.build("meta", llama3_8b=True)
    assert model.config.hidden_size == 4096 and next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(SystemExit, match="two sizes"):
        llm_decode.main(["--device", "cpu", "--tiny", "--llama3-8b"])
