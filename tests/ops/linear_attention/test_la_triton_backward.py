"""The Triton intra-chunk backward kernels (`triton_backward.gdn_intra_backward`):
gradients of every input in interpret mode against the golden (the backward op
directly, also with the kernels' blocking below sm_90, and end to end through
GDN and SSD), cuda lowering of every config of the backward op, and the PTX tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.linear_attention import (LinearAttentionConfig, chunk_gated_delta_rule_op,
                                          gated_recurrence_backward_op, ssd_op)
from stellax.ops.linear_attention.examples import make_inputs
from stellax.ops.linear_attention.configs import TRITON_CHUNK
from stellax.ops.linear_attention.examples import make_ssd_inputs
from stellax.ops.linear_attention.triton_backward import MAX_BLOCK_V, column_block, gdn_intra_backward
from stellax.testing import (assert_close, assert_custom_call, assert_fits_smem, check_op_lowering,
                             compile_triton_to_ptx, lower_for_gpu, triton_compiler_available)

from la_helpers import check_against_golden

F32, BF16 = jnp.float32, jnp.bfloat16
#: block_v = 32 < V splits the value columns: the dq/dk/dg/dβ partials are summed.
SPLIT = LinearAttentionConfig(block_v=32, num_warps=4, num_stages=1)
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
INTRA = "stellax_linear_attention_intra_bwd"
#: The intra-chunk launches, in order (the delta rule's first two only with it).
INTRA_KERNELS = tuple(f"{INTRA}_{name}" for name in ("inverse", "values", "pairs", "states", "keys"))


def _core_inputs(key, *, bs, hv, nt, kdim, vdim, delta, packed, dtype, g_step=None, g_scale=1.0):
    """Backward-op arguments on the core layout ``[Bs, HV, Tp, ...]``; ``g_step``
    fixes every log decay (strong decays), else ``g = −g_scale·softplus(N(0, 1))``
    (weak decays for a small ``g_scale``: a chunk's total decay ``γ`` is then
    not negligible)."""
    keys = jax.random.split(key, 8)
    tp = nt * TRITON_CHUNK
    q = 0.3 * jax.random.normal(keys[0], (bs, hv, tp, kdim))
    k = jax.random.normal(keys[1], (bs, hv, tp, kdim)) / np.sqrt(kdim)
    v = jax.random.normal(keys[2], (bs, hv, tp, vdim))
    if g_step is None:
        g = -g_scale * jax.nn.softplus(jax.random.normal(keys[3], (bs, hv, tp)))
    else:
        g = jnp.full((bs, hv, tp), g_step, F32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (bs, hv, tp))) if delta else None
    n = 3 if packed else bs
    h0 = jax.random.normal(keys[5], (n, hv, kdim, vdim))
    do = jax.random.normal(keys[6], v.shape)
    dfinal = jax.random.normal(keys[7], h0.shape)
    args = [x if x is None else x.astype(dtype) for x in (q, k, v, g, beta, h0, do, dfinal)]
    meta = [None] * 3
    if packed:  # chunks: seq 0 = chunks 0-1, seq 1 = chunk 2, seq 2 = chunk 3
        assert nt == 4
        meta = [jnp.array(m, jnp.int32) for m in ([1, 0, 1, 1], [0, 0, 1, 2], [0, 1, 1, 1])]
    return tuple(args) + tuple(meta)


def _check_backward_op(args, dtype):
    """The Triton backward op (interpreted) against its golden, every gradient."""
    with stellax.interpret_mode():
        out = jax.jit(lambda *a: gated_recurrence_backward_op(*a, implementation="triton", config=SPLIT))(*args)
    ref = jax.jit(gated_recurrence_backward_op.reference)(*args)
    assert (out[4] is None) == (args[4] is None)
    for name, o, r, x in zip(NAMES, out, ref, args):
        if r is None:
            continue
        if name != "dh0":
            assert o.dtype == x.dtype, (name, o.dtype, x.dtype)
        assert_close(o, r, dtype=dtype, gradient=True, name=name)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "ssd"])
def test_backward_op_matches_golden(delta, dtype):
    """Three chunks, K = 128 in two of the kernel's key blocks, V = 64 in two
    value blocks (the partials summed), weak decays (γ ≈ 0.1 per chunk)."""
    args = _core_inputs(jax.random.PRNGKey(3), bs=1, hv=1, nt=3, kdim=128, vdim=64, delta=delta, packed=False,
                        dtype=dtype, g_scale=0.05)
    _check_backward_op(args, dtype)


@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "ssd"])
def test_backward_op_packed_strong_decay_matches_golden(delta):
    """Packed sequences and g = −20 per step: every cross-step decay underflows
    to 0 and none may overflow (an exp of a positive span would give inf/NaN)."""
    args = _core_inputs(jax.random.PRNGKey(4), bs=1, hv=1, nt=4, kdim=16, vdim=32, delta=delta, packed=True,
                        dtype=F32, g_step=-20.0)
    _check_backward_op(args, F32)


@pytest.mark.slow
@pytest.mark.parametrize("kdim, vdim", [(64, 16), (256, 128), (16, 256)])
@pytest.mark.parametrize("delta, packed", [(True, False), (True, True), (False, True)])
def test_backward_op_head_sizes_match_golden(kdim, vdim, delta, packed):
    """Head sizes up to 256 (four key blocks, one to eight value blocks), the
    heuristic config (block_v = 32 at K ≥ 128, else min(64, V)) and a mixed-decay strength."""
    args = list(_core_inputs(jax.random.PRNGKey(kdim + vdim), bs=1, hv=1, nt=4, kdim=kdim, vdim=vdim, delta=delta,
                             packed=packed, dtype=F32))
    args[3] = 4.0 * args[3]
    with stellax.interpret_mode():
        out = jax.jit(lambda *a: gated_recurrence_backward_op(*a, implementation="triton"))(*args)
    ref = jax.jit(gated_recurrence_backward_op.reference)(*args)
    for name, o, r in zip(NAMES, out, ref):
        if r is not None:
            assert_close(o, r, dtype=F32, gradient=True, name=name)


@pytest.mark.parametrize("delta, packed, kdim, vdim, g_step", [(True, False, 64, 64, None), (True, True, 16, 32, -20.0),
                                                             (False, True, 32, 16, -20.0)],
                         ids=["gdn-2x2-blocks", "gdn-varlen-strong", "ssd-varlen-strong"])
def test_backward_op_below_sm90_matches_golden(delta, packed, kdim, vdim, g_step):
    """The kernels as an A100 runs them (16-column blocks of the [C, C] gradients,
    T in blocks of 32 rows, its diagonal inverses not serialized): two key and two
    value blocks with weak decays; packed sequences with g = −20 per step."""
    args = _core_inputs(jax.random.PRNGKey(kdim + vdim), bs=1, hv=1, nt=4 if packed else 3, kdim=kdim, vdim=vdim,
                        delta=delta, packed=packed, dtype=F32, g_step=g_step, g_scale=0.05)
    with stellax.lowering_target("a100"):
        assert column_block(TRITON_CHUNK) == 16
        _check_backward_op(args, F32)


def test_intra_backward_rejects_bad_shapes():
    x = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    good = dict(q=x(1, 128, 32), k=x(1, 128, 32), v=x(1, 128, 32), g=x(1, 128), beta=None,
                states=x(1, 2, 32, 32), delta=x(1, 128, 32), d_states=x(1, 2, 32, 32), d_delta=x(1, 128, 32),
                do=x(1, 128, 32))
    run = lambda **kw: jax.eval_shape(lambda a: gdn_intra_backward(**a, chunk=TRITON_CHUNK, config=SPLIT),
                                      {**good, **kw})
    assert run()[0].shape == (1, 128, 32)
    with pytest.raises(ValueError, match="v: expected a last dimension that is a power of two >= 16"):
        run(v=x(1, 128, 24))
    with pytest.raises(ValueError, match="states, d_states: expected shape"):
        run(states=x(1, 1, 32, 32))


# -- end to end ---------------------------------------------------------------------
def _gdn(implementation):
    def run(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("q", "k", "v", "g", "beta")]
        if implementation is None:
            return chunk_gated_delta_rule_op.reference(*args, **d, **s, output_final_state=True)
        return stellax.chunk_gated_delta_rule(*args, **d, **s, output_final_state=True, implementation="triton",
                                              config=SPLIT)
    return run


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gdn_gradients_match_golden(dtype):
    """T = 70 (a partial chunk), grouped heads, K = 24, V = 40 (padded to 32, 64), weak decays."""
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(6), 1, 70, 1, 2, 24, 40, dtype=dtype, decay=0.05)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():
        check_against_golden(_gdn(True), _gdn(None), diff, dtype=dtype)


def test_gdn_varlen_strong_decay_gradients_match_golden():
    """Packed sequences (one empty, one spanning a chunk boundary), g = −20 per step."""
    cu = jnp.array([0, 70, 70, 100], jnp.int32)
    q, k, v, g, beta, h0 = make_inputs(jax.random.PRNGKey(7), 1, 100, 1, 1, 20, 36, n_states=3)
    g = jnp.full_like(g, -20.0)
    diff = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0}
    with stellax.interpret_mode():
        check_against_golden(_gdn(True), _gdn(None), diff, {"cu_seqlens": cu}, dtype=F32)


def _ssd(implementation):
    def run(d, s):
        d = dict(d)
        args = [d.pop(n) for n in ("x", "dt", "A", "B", "C")]
        if implementation is None:
            return ssd_op.reference(*args, **d, **s, dt_softplus=True, return_final_states=True)
        return stellax.ssd(*args, **d, **s, dt_softplus=True, return_final_states=True, implementation="triton",
                           config=SPLIT)
    return run


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_ssd_gradients_match_golden(dtype):
    """Head dim P = 40 (V, two value blocks), state size N = 24 (K)."""
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    diff = dict(zip(names, make_ssd_inputs(jax.random.PRNGKey(8), 1, 70, 2, 40, 1, 24, dtype=dtype)))
    with stellax.interpret_mode():
        check_against_golden(_ssd(True), _ssd(None), diff, dtype=dtype)


def test_ssd_varlen_gradients_match_golden():
    names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    diff = dict(zip(names, make_ssd_inputs(jax.random.PRNGKey(9), 1, 90, 1, 24, 1, 16, n_states=2)))
    with stellax.interpret_mode():
        check_against_golden(_ssd(True), _ssd(None), diff, {"cu_seqlens": jnp.array([0, 40, 90], jnp.int32)},
                             dtype=F32)


# -- lowering -------------------------------------------------------------------------
@pytest.mark.parametrize("delta, packed, kdim, vdim, dtype", [(True, False, 128, 128, F32),
                                                              (False, True, 64, 128, F32),
                                                              (True, True, 256, 256, BF16)],
                         ids=["gdn-128", "ssd-varlen-64x128", "gdn-varlen-256-bf16"])
def test_backward_op_cuda_lowering_of_every_config(delta, packed, kdim, vdim, dtype):
    args = _core_inputs(jax.random.PRNGKey(0), bs=1, hv=2, nt=4, kdim=kdim, vdim=vdim, delta=delta, packed=packed,
                        dtype=dtype)
    impl = gated_recurrence_backward_op.implementations["triton"]
    configs = impl.config_space(gated_recurrence_backward_op.check(*args))
    assert len(configs) >= 4
    assert check_op_lowering(gated_recurrence_backward_op, "triton", args, configs=configs) == len(configs)
    # The launches: the forward recomputation (WY with the delta rule, state
    # scan), the reverse scan and the intra-chunk kernels (T and dR_v with the delta rule).
    intra = INTRA_KERNELS if delta else INTRA_KERNELS[2:]
    for target in ("h100", "a100"):
        lowered = lower_for_gpu(lambda *a: gated_recurrence_backward_op(*a, implementation="triton"), *args,
                                target=target)
        assert assert_custom_call(lowered) == (3 if delta else 2) + len(intra)
        assert all(name in lowered.as_text() for name in intra)


# -- PTX tier -------------------------------------------------------------------------
@pytest.mark.ptx
@pytest.mark.parametrize("delta", [True, False], ids=["gdn", "ssd"])
@pytest.mark.parametrize("dim", [128, 256])
def test_ptx_intra_backward_fits_shared_memory(dim, delta):
    """The intra-chunk kernels compile for sm_90 (and, as an A100 lowers them,
    for sm_80) in every config of the backward op's space at K = V = ``dim``,
    within 227 KiB of shared memory, and within sm_80's 163 KiB like the forward
    kernels of the shared space (the other backward launches are the forward's
    and the reverse scan's kernels, which test_la_triton.py compiles)."""
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    bh, nt = 2, 2
    tp = nt * TRITON_CHUNK
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, F32)
    args = (f32(bh, tp, dim), f32(bh, tp, dim), f32(bh, tp, dim), f32(bh, tp), f32(bh, tp) if delta else None,
            f32(bh, nt, dim, dim), f32(bh, tp, dim), f32(bh, nt, dim, dim), f32(bh, tp, dim), f32(bh, tp, dim))
    core = _core_inputs(jax.random.PRNGKey(0), bs=1, hv=1, nt=nt, kdim=dim, vdim=dim, delta=delta, packed=False,
                        dtype=F32)
    configs = gated_recurrence_backward_op.implementations["triton"].config_space(
        gated_recurrence_backward_op.check(*core))
    assert configs
    # The kernels cap block_v at MAX_BLOCK_V and run one stage: compile each
    # distinct effective config once.
    effective = {(min(c.block_v, MAX_BLOCK_V), c.num_warps): c for c in configs}
    assert len(effective) >= 2
    for config in effective.values():
        for target, arch in (("h100", "9.0"), ("a100", "8.0")):
            lowered = lower_for_gpu(lambda *a: gdn_intra_backward(*a, chunk=TRITON_CHUNK, config=config), *args,
                                    target=target)
            kernels = compile_triton_to_ptx(lowered, arch)
            assert tuple(k_.name for k_ in kernels) == (INTRA_KERNELS if delta else INTRA_KERNELS[2:]), config
            print(f"K=V={dim} delta={delta} {config} sm_{arch}: {max(k_.smem_bytes for k_ in kernels)} B shared memory")
            assert_fits_smem(kernels, arch)
            assert_fits_smem(kernels, "8.0")  # as the forward kernels of the shared space
