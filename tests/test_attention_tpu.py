"""The attention TPU benchmark (benchmarks/attention_tpu.py) runs on the CPU (--dry-run, interpreted
kernels, tiny shapes), so it is ready for the chip: stellax's default and explicit configs, jax's
splash attention and the XLA paths time both passes on every mask family, match the float32 golden,
and land as rows of the suite's results schema."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"op", "case", "pass", "contender", "default", "peer", "ms", "tflops", "pct_peak", "bound", "device",
          "date", "skipped", "error", "vs_splash", "vs_xla", "max_rel_err", "rel_l2", "config"}
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_cases_flop_model_and_names():
    import attention_tpu as bench

    names = [c.name for c in bench.CASES]
    assert len(set(names)) == len(names)
    full, causal = bench.CASES[1], bench.CASES[0]
    assert full.flops("fwd") == 4.0 * 16 * 8192 * 8192 * 128
    assert abs(causal.flops("fwd") / full.flops("fwd") - 0.5) < 1e-3  # causal counted at (about) half
    assert causal.flops("fwd+bwd") == 3.5 * causal.flops("fwd")
    docs = next(c for c in bench.CASES if c.documents)
    assert abs(docs.visible_fraction() - 1 / 16) < 1e-3  # 8 causal documents: 1/8 of the pairs, halved
    window = next(c for c in bench.CASES if c.window == 1024)
    assert abs(window.visible_fraction() - 1025 / 16384) < 2e-3
    # splash's tiles searched: 512 and 1024 by default, every SPLASH entry with 'all'
    assert bench.Run(bench.parse_args(["--out", "x.json"])).splash == ["512", "1024"]
    assert bench.Run(bench.parse_args(["--out", "x.json", "--splash", "all"])).splash == list(bench.SPLASH)
    assert {"2048x1024", "1024x2048"} <= set(bench.SPLASH)
    for value, flag in (("nope", "--configs"), ("nope", "--splash")):
        args = bench.parse_args(["--out", "x.json", flag, value])
        try:
            bench.Run(args)
        except SystemExit as e:
            assert flag in str(e)
        else:
            raise AssertionError(f"{flag} {value} accepted")


def test_dry_run_times_and_checks_every_contender(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    out = tmp_path / "attention.json"
    # a sliding window and sinks (every case's splash mask: test_splash_expresses_every_case)
    proc = subprocess.run([sys.executable, "benchmarks/attention_tpu.py", "--dry-run", "--out", str(out),
                           "--cases", "2,17", "--configs", "f1024-bkv1024,f1024-b512-fused", "--splash", "1024-kv512",
                           "--xla", "--budget", "1e9"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "summary" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-attention-tpu" and doc["environment"]["dry_run"]
    rows = doc["rows"]
    assert rows and all(SCHEMA <= set(r) for r in rows)
    assert len({r["case"] for r in rows}) == 2 and {r["pass"] for r in rows} == {"fwd", "fwd+bwd"}
    for r in rows:
        assert r["error"] is None, r
        if r["skipped"]:
            assert r["contender"] == "jax.nn.dot_product_attention[xla]", r
            continue
        assert r["ms"] > 0 and r["tflops"] > 0 and r["pct_peak"] > 0 and r["vs_splash"] > 0 and r["vs_xla"] > 0, r
        assert r["max_rel_err"] < 3e-2 and r["rel_l2"] < 1e-2, r
    for case in {r["case"] for r in rows}:
        for pass_ in ("fwd", "fwd+bwd"):
            group = [r for r in rows if r["case"] == case and r["pass"] == pass_]
            defaults = [r for r in group if r["default"]]
            assert len(defaults) == 1 and defaults[0]["config"].startswith("default(attention=mosaic_tpu:")
            if pass_ == "fwd+bwd":
                assert "attention_backward=mosaic_tpu:" in defaults[0]["config"]
                # the fused backward timed beside the unfused one (explicit configs)
                labels = [r["config"] for r in group if r["contender"] == "stellax:mosaic_tpu"]
                assert any(c.startswith("f1024-b512-fused [") and c.endswith("/True]") for c in labels), labels
                assert any(c.startswith("f1024-bkv1024 [") and c.endswith("/False]") for c in labels), labels
            contenders = {r["contender"] for r in group}
            assert {"stellax:mosaic_tpu", "jax:splash", "stellax:xla_chunked"} <= contenders, contenders
            assert any(r["config"].startswith("f1024") for r in group if r["contender"] == "stellax:mosaic_tpu")
            # the FLOP model is the same for every contender of a case and pass
            assert len({round(r["tflops"] * r["ms"], 6) for r in group if r["ms"]}) == 1


def test_splash_expresses_every_case():
    """jax's splash takes every case's mask (chunks, windows, GQA/MQA grouping included), and the
    explicit configs keep a step's rows: ``block_q`` over the query heads per kv head."""
    import attention_tpu as bench

    for case in bench.CASES:
        dry = case.dry()
        for name, blocks in bench.SPLASH.items():
            if any(bench._scaled(b, True) > dry.t for b in blocks[:5]):
                continue  # a 2048 tile scaled for the dry run (512) is longer than a T=4096 case's 256
            kernel = bench.splash_kernel(dry, name, True, 1.0)
            assert kernel is not None, (case.name, name)
    table = bench.explicit_table("f1024-b512", False, 4)
    fwd, bwd = table.values()
    assert (fwd.block_q, fwd.block_kv) == (256, 1024)
    assert (bwd.block_q_dq, bwd.block_kv_dq, bwd.block_q_dkv, bwd.block_kv_dkv) == (128, 512, 128, 512)
    mqa = bench.explicit_table("f1024-b512", False, 16)
    assert next(iter(mqa.values())).block_q == 128


def test_ratios_are_set_again_over_rows_from_several_runs():
    """XLA rows timed in a later run give the earlier rows their ``vs_xla``; a peer with no time
    leaves the ratio None; only the row's own case and pass count."""
    import attention_tpu

    row = lambda contender, ms, case="c", pass_="fwd", peer=True: {
        "case": case, "pass": pass_, "contender": contender, "ms": ms, "peer": peer}
    rows = [row("stellax:mosaic_tpu", 2.0, peer=False), row("jax:splash", 3.0), row("jax:splash", 2.5),
            row("stellax:xla_chunked", 8.0), row("jax.nn.dot_product_attention[xla]", None),
            row("stellax:mosaic_tpu", 1.0, pass_="fwd+bwd", peer=False),
            row("stellax:xla_chunked", 0.5, pass_="fwd+bwd", peer=False)]  # a default that picked XLA: no peer
    attention_tpu.set_ratios(rows[:3] + rows[5:])
    assert rows[0]["vs_splash"] == 1.25 and rows[0]["vs_xla"] is None
    attention_tpu.set_ratios(rows)
    assert rows[0]["vs_xla"] == 4.0 and rows[3]["vs_xla"] == 1.0 and rows[4]["vs_xla"] is None
    assert rows[5]["vs_splash"] is None and rows[5]["vs_xla"] is None
