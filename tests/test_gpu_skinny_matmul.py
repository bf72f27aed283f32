"""scripts/gpu_skinny_matmul.py --cpu-smoke: the sweep runs end to end in interpret mode, checks
every variant against XLA, and the Mosaic GPU variants (jax's Hopper matmul, not runnable off a
GPU) lower for CUDA with the jax at hand."""

import json

import pytest


@pytest.mark.slow  # 17 s in interpret mode; the bf16 skinny route is off (layers.SKINNY_MATMUL)
def test_skinny_matmul_script_smoke(tmp_path):
    from scripts.gpu_skinny_matmul import MGPU_CONFIGS, main

    out = tmp_path / "skinny.json"
    assert main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mgpu_lowering"] == {name: "ok" for name in MGPU_CONFIGS}
    passes = {r["pass"] for r in report["rows"]}
    assert passes == {"sweep", "all"}
    for r in report["rows"]:
        assert r["xla_us"] > 0
        assert all(v < 2e-2 for key, v in r.items() if key.endswith("_err")), r


def test_weight_layout_script_cpu_smoke(tmp_path):
    """scripts/gpu_weight_layout.py --cpu-smoke: both weight orientations give the same product and
    a time per shape and row count."""
    import json

    from scripts.gpu_weight_layout import main

    out = tmp_path / "wl.json"
    assert main(["--cpu-smoke", "--rows", "1,5", "--int8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4 and all(r["out_in_err"] < 1e-5 and r["in_out_us"] > 0 and r["out_in_us"] > 0 for r in rows)
    # the int8 forms (--int8): both orientations give the same product, near the bf16 one
    assert all(r["int8_in_out_err"] < 5e-2 and abs(r["int8_out_in_err"] - r["int8_in_out_err"]) < 1e-2
               and r["int8_out_in_us"] > 0 for r in rows)


def test_int8_matmul_script_cpu_smoke(tmp_path):
    """scripts/gpu_int8_matmul.py --cpu-smoke: every kernel variant (both weight layouts, both MMA
    layouts, both widenings) agrees with XLA's int8 product, and each row names its fastest; the W8A8
forms (int8, e4m3) run beside them."""
    from scripts.gpu_int8_matmul import main

    out = tmp_path / "int8.json"
    assert main(["--cpu-smoke", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["shape"] for r in report["rows"]} == {"a", "b"}
    for r in report["rows"]:
        assert r["xla_int8_us"] > 0 and r["best"] and r["default_err"] < 1e-2
        assert {"in_out", "out_in"} == {c["w_layout"] for key, c in r.items() if key.endswith("_config")}
        # the W8A8 forms ran and agree with the weight-only product up to the activations' rounding
        assert r["xla_w8a8_t_us"] > 0 and r["xla_w8a8_t_err"] < 5e-2 and r["xla_fp8_t_err"] < 2e-1
