"""KDA's Triton kernels (per-channel decays): numerics in interpret mode
(forward and the gradients of every input) against the golden, cuda lowering
of every config, and the PTX tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import LinearAttentionConfig, chunk_gated_delta_rule_op, chunk_kda_op
from stellax.ops.linear_attention import chunk_intra
from stellax.ops.linear_attention.triton_intra import kda_intra_forward
from stellax.ops.linear_attention.triton_kda_backward import kda_intra_backward
from stellax.ops.linear_attention.triton_scan import kda_state_forward
from stellax.ops.linear_attention.examples import make_inputs
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16
SMALL = LinearAttentionConfig(block_v=16, num_warps=4, num_stages=1)
ARGS = ("q", "k", "v", "g", "beta")


def _run(d, s):
    d = dict(d)
    args = [d.pop(n) for n in ARGS]
    return stellax.chunk_kda(*args, **d, **s, output_final_state=True, implementation="triton", config=SMALL)


def _golden(d, s):
    d = dict(d)
    args = [d.pop(n) for n in ARGS]
    return chunk_kda_op.reference(*args, **d, **s, output_final_state=True)


def _strong_channels(g, channels=3):
    """−20 per step on the first ``channels`` channels of every head."""
    return g.at[..., :channels].set(-20.0)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kda_interpret_matches_golden(dtype):
    """T = 70 (a full and a partial chunk), HV = 2H, K ≠ V not powers of two,
    −20 per step on some channels; forward, final state and every gradient."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), 1, 70, 1, 2, 24, 40, dtype=dtype,
                                       per_channel=True, decay=2.0)
    g = _strong_channels(g)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():  # the backward runs when the gradient is traced
        out = check_against_golden(_run, _golden, diff, dtype=dtype)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(out))


def test_kda_interpret_wide_heads_match_golden():
    """K = 100, V = 130 (padded to 128 and 256: several blocks of channels and
    value columns in the intra kernels, forward and backward), three chunks,
    l2-normalized q/k, −20 per step on some channels."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(4), 1, 150, 1, 2, 100, 130, per_channel=True,
                                       decay=2.0, normalized_keys=False)
    diff = {"q": q, "k": 0.2 * k, "v": v, "g": _strong_channels(g), "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():
        check_against_golden(lambda d, s: _run(d, {"use_qk_l2norm": True}),
                             lambda d, s: _golden(d, {"use_qk_l2norm": True}), diff, dtype=F32)


def test_kda_interpret_varlen_matches_golden():
    """Packed sequences (one empty, one crossing a chunk boundary), strong decays."""
    cu = jnp.array([0, 65, 65, 90], jnp.int32)
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(1), 1, 90, 1, 1, 16, 16, n_states=3,
                                       per_channel=True, decay=3.0)
    g = _strong_channels(g, 5)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():
        check_against_golden(_run, _golden, diff, {"cu_seqlens": cu}, dtype=F32)


def test_kda_interpret_fused_gate_matches_golden():
    """Kimi Linear's fused gate (A_log, dt_bias, lower_bound) and beta logits, through
    the Triton kernels; gradients of A_log and dt_bias too."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(2), 1, 40, 1, 2, 16, 16, per_channel=True)
    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    diff = {"q": q, "k": k, "v": v, "g": -g, "beta": beta, "initial_state": h0,
            "A_log": 0.3 * jax.random.normal(keys[0], (2,)), "dt_bias": 0.3 * jax.random.normal(keys[1], (32,))}
    options = {"use_gate_in_kernel": True, "lower_bound": -5.0, "use_beta_sigmoid_in_kernel": True}
    with stellax.interpret_mode():  # options closed over: check_against_golden traces its static dict
        check_against_golden(lambda d, s: _run(d, options), lambda d, s: _golden(d, options), diff, dtype=F32)


def test_kda_intra_kernel_channel_blocks():
    """The intra kernel at K = V = 128 (two blocks of channels and of value
    columns) and decays that make ``1/Γ`` overflow (−20 per step over 64
    steps): the scores equal the float64 decayed products, every factor
    equals `chunk.chunk_intra`'s, no NaN/inf."""
    rng = np.random.default_rng(0)
    c, kdim = 64, 128
    q, k = 0.3 * rng.normal(size=(2, 1, c, kdim))
    g = -rng.uniform(0.0, 1.0, size=(1, c, kdim))
    g[..., :4] = -20.0
    v = rng.normal(size=(1, c, 128))
    beta = rng.uniform(size=(1, c))
    args = [jnp.asarray(x, F32) for x in (q, k, v, g, beta)]
    with stellax.interpret_mode():
        u, w, p, qg, kg, gamma = kda_intra_forward(*args, chunk=c, config=SMALL)
    spans = np.zeros((c, c, kdim))  # spans[i, j] = Σ_{j<t≤i} g_t (float64)
    for i in range(c):
        for j in range(i):
            spans[i, j] = g[0, j + 1:i + 1].sum(0)
    ref = np.einsum("ic,jc,ijc->ij", q[0], k[0], np.exp(spans)) * np.tril(np.ones((c, c)))
    np.testing.assert_allclose(np.asarray(p[0]), ref, rtol=1e-5, atol=1e-6)
    parts = chunk_intra(*args)
    for name, got in (("U", u), ("W", w), ("qg", qg), ("kg", kg), ("gamma", gamma)):
        want = parts[name][..., 0] if name == "gamma" else parts[name]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want).reshape(got.shape), rtol=2e-5, atol=2e-6,
                                   err_msg=name)
    assert all(np.isfinite(np.asarray(x)).all() for x in (u, w, p, qg, kg, gamma))


def test_kda_intra_kernel_solve_outputs():
    """``with_solve``: the strictly lower k scores and ``T`` equal float64's
    ``S_k`` and ``(I + β⊙S_k)⁻¹`` per chunk (two chunks, K = 16, strong decays on
    some channels), and the other factors equal those without it."""
    rng = np.random.default_rng(1)
    c, nt, kdim = 64, 2, 16
    q, k = rng.normal(size=(2, 1, nt * c, kdim)) / np.sqrt(kdim)
    g = -rng.uniform(0.0, 1.0, size=(1, nt * c, kdim))
    g[..., :2] = -20.0
    v = rng.normal(size=(1, nt * c, 32))
    beta = rng.uniform(size=(1, nt * c))
    args = [jnp.asarray(x, F32) for x in (q, k, v, g, beta)]
    with stellax.interpret_mode():
        plain = kda_intra_forward(*args, chunk=c, config=SMALL)
        *factors, t, sk = kda_intra_forward(*args, chunk=c, config=SMALL, with_solve=True)
    for want, got in zip(plain, factors):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for n in range(nt):
        rows = slice(n * c, (n + 1) * c)
        kc, gc = k[0, rows], g[0, rows]
        ref = np.zeros((c, c))
        for i in range(c):
            for j in range(i):
                ref[i, j] = np.sum(kc[i] * kc[j] * np.exp(gc[j + 1:i + 1].sum(0)))
        np.testing.assert_allclose(np.asarray(sk[0, rows]), ref, rtol=1e-5, atol=1e-6)
        inv = np.linalg.inv(np.eye(c) + beta[0, rows, None] * ref)
        np.testing.assert_allclose(np.asarray(t[0, rows]), inv, rtol=1e-5, atol=1e-6)


def test_kda_intra_backward_matches_the_vjp_of_the_chunk_factors():
    """The intra-chunk backward kernels (WY, then the scores and decays by
    blocks of channels: K = 64 is two of them) against the XLA VJP of
    `chunk_intra` (stages 1–4 of two chunks) for random cotangents of every
    factor, with −20 per step on some channels (``1/Γ`` overflows): every
    gradient, and ``dg`` of the strong channels alone, to rel-L2 ≤ 1e-5."""
    rng = np.random.default_rng(2)
    bh, nt, c, kdim, vdim = 1, 2, 64, 64, 32
    tp = nt * c
    g = -rng.uniform(0.0, 1.0, size=(bh, tp, kdim))
    g[..., :4] = -20.0
    inputs = [jnp.asarray(x, F32) for x in (0.3 * rng.normal(size=(bh, tp, kdim)),
                                            rng.normal(size=(bh, tp, kdim)) / np.sqrt(kdim),
                                            rng.normal(size=(bh, tp, vdim)), g, rng.uniform(size=(bh, tp)))]
    lower = np.tril(np.ones((c, c)))
    cot = {"qg": rng.normal(size=(bh, tp, kdim)), "kg": rng.normal(size=(bh, tp, kdim)),
           "W": rng.normal(size=(bh, tp, kdim)), "gamma": rng.normal(size=(bh, nt, kdim)),
           "P": (rng.normal(size=(bh, nt, c, c)) * lower).reshape(bh, tp, c), "U": rng.normal(size=(bh, tp, vdim))}
    cot = {n: jnp.asarray(x, F32) for n, x in cot.items()}
    with stellax.interpret_mode():
        u, w, _, _, _, _, t, sk = kda_intra_forward(*inputs, chunk=c, config=SMALL, with_solve=True)
        got = kda_intra_backward(*inputs, t, sk, u, w, cot, chunk=c, config=SMALL)

    def factors(q, k, v, g, beta):
        out = chunk_intra(q, k, v, g, beta)
        return out["qg"], out["kg"], out["W"], out["gamma"][..., 0], out["P"], out["U"]

    per_chunk = lambda x: x.reshape((bh, nt, c) + x.shape[2:])
    _, vjp = jax.vjp(factors, *(per_chunk(x) for x in inputs))
    want = vjp(tuple(cot[n] if n == "gamma" else per_chunk(cot[n]) for n in ("qg", "kg", "W", "gamma", "P", "U")))
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert np.isfinite(np.asarray(a)).all(), name
        assert rel(a, b.reshape(a.shape)) <= 1e-5, (name, rel(a, b.reshape(a.shape)))
    dg_strong = rel(got[3][..., :4], want[3].reshape(got[3].shape)[..., :4])
    assert dg_strong <= 1e-5, dg_strong


def test_kda_kernels_name_bad_arguments():
    x = jnp.zeros((1, 64, 32))
    beta = jnp.zeros((1, 64))
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 64, 32\), got \(1, 64, 16\)"):
        kda_intra_forward(x, x, x, jnp.zeros((1, 64, 16)), beta, chunk=64, config=SMALL)
    with pytest.raises(ValueError, match="k: expected a padded length that is a multiple of 64, got 70"):
        y = jnp.zeros((1, 70, 32))
        kda_intra_forward(y, y, y, y, jnp.zeros((1, 70)), chunk=64, config=SMALL)
    with pytest.raises(ValueError, match="v: expected a value size that is a power of two >= 16, got 24"):
        kda_intra_forward(x, x, jnp.zeros((1, 64, 24)), x, beta, chunk=64, config=SMALL)
    with pytest.raises(ValueError, match="h0: expected shape"):
        kda_state_forward(x, x, x, jnp.zeros((1, 1, 32)), jnp.zeros((1, 32, 16)), None, chunk=64, heads=1,
                                 config=SMALL)


def test_kda_is_taken_by_triton_on_sm90_only():
    """sm_90 runs KDA's kernels; sm_80 has too little shared memory for the
    intra-chunk kernels (measured by the PTX tier), and says so."""
    q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(0), 1, 8, 1, 1, 16, 16, per_channel=True)
    call = chunk_kda_op.check(q, k, v, g, beta)
    with stellax.lowering_target("h100"):
        support = chunk_kda_op.implementations["triton"].supported(call)
    assert support, support.reason
    with stellax.lowering_target("a100"):
        support = chunk_kda_op.implementations["triton"].supported(call)
    assert not support and "sm_90" in support.reason
    gdn_call = chunk_gated_delta_rule_op.check(q, k, v, g[..., 0], beta)
    with stellax.lowering_target("a100"):
        assert chunk_gated_delta_rule_op.implementations["triton"].supported(gdn_call)


# -- lowering ---------------------------------------------------------------------
def _lowering_cases():
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(0), 1, 130, 2, 4, 128, 128, per_channel=True)
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    return [
        ((q, k, v, g, beta), {"initial_state": h0, "output_final_state": True}),
        ((q, k, v, g, beta), {"cu_seqlens": jnp.array([0, 60, 130], jnp.int32),
                              "initial_state": jnp.zeros((2, 4, 128, 128)), "output_final_state": True}),
        ((q, k, v, g, beta), {"use_gate_in_kernel": True, "A_log": jax.random.normal(keys[0], (4,)),
                              "dt_bias": jax.random.normal(keys[1], (4 * 128,)), "lower_bound": -5.0}),
    ]


@pytest.mark.parametrize("case", range(3), ids=["kda", "kda-varlen", "kda-gate"])
def test_kda_cuda_lowering_of_every_config(case):
    args, kwargs = _lowering_cases()[case]
    configs = chunk_kda_op.implementations["triton"].config_space(chunk_kda_op.check(*args, **kwargs))
    assert len(configs) >= 6
    assert check_op_lowering(chunk_kda_op, "triton", args, kwargs, configs=configs) == len(configs)
    assert check_op_lowering(chunk_kda_op, "triton", args, kwargs, configs=[None], grad=True) == 1


@pytest.mark.slow
@pytest.mark.parametrize("case", range(3), ids=["kda", "kda-varlen", "kda-gate"])
def test_kda_cuda_lowering_of_every_config_with_gradients(case):
    args, kwargs = _lowering_cases()[case]
    check_op_lowering(chunk_kda_op, "triton", args, kwargs, grad=True)


@pytest.mark.parametrize("kdim, vdim", [(256, 256), (64, 32)])
def test_kda_cuda_lowering_head_sizes(kdim, vdim):
    args = make_inputs(jax.random.PRNGKey(0), 1, 64, 1, 1, kdim, vdim, per_channel=True)
    assert check_op_lowering(chunk_kda_op, "triton", args[:5], {}, configs=[None], grad=True) == 1


# -- PTX tier ---------------------------------------------------------------------
KDA_KERNELS = {"stellax_kda_scores", "stellax_kda_intra", "stellax_kda_state", "stellax_kda_output"}


@pytest.mark.ptx
@pytest.mark.parametrize("kdim", [128, 256])
def test_kda_ptx_compiles_and_fits_shared_memory(kdim):
    """Every config's forward kernels, and the backward (its heuristic config),
    compile to PTX for sm_90 within its shared memory."""
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    q, k, v, g, beta, _ = make_inputs(jax.random.PRNGKey(0), 1, 128, 1, 2, kdim, kdim, per_channel=True)
    call = chunk_kda_op.check(q, k, v, g, beta)
    configs = chunk_kda_op.implementations["triton"].config_space(call)
    assert configs
    for config in configs:
        def forward(q, k, v, g, beta):
            return stellax.chunk_kda(q, k, v, g, beta, implementation="triton", config=config)[0]

        kernels = compile_triton_to_ptx(lower_for_gpu(forward, q, k, v, g, beta))
        assert {k_.name for k_ in kernels} == KDA_KERNELS
        assert_fits_smem(kernels, "9.0")

    def loss(q, k, v, g, beta):
        return jnp.sum(stellax.chunk_kda(q, k, v, g, beta, implementation="triton")[0])

    kernels = compile_triton_to_ptx(lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), q, k, v, g, beta))
    assert {"stellax_kda_state_bwd", "stellax_kda_wy_bwd", "stellax_kda_intra_bwd"} <= {k_.name for k_ in kernels}
    assert_fits_smem(kernels, "9.0")
