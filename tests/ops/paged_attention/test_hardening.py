"""Bad sizes, NumPy operands and wrong argument kinds of the paged ops: a
clear error naming the argument, or the same result as with jnp arrays."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import paged_inputs


@pytest.mark.parametrize("args,kw,error,match", [
    ((4, 0, 1, 8), {}, ValueError, "page_size: expected an int >= 1, got 0"),
    ((4, 4, 0, 8), {}, ValueError, "num_kv_heads"),
    ((-4, 4, 1, 8), {}, ValueError, "num_pages: expected an int >= 1, got -4"),
    ((4, 4, 1, 0), {}, ValueError, "head_dim"),
    ((4, 4.0, 1, 8), {}, TypeError, "page_size"),
    ((4, 4, 1, 8), {"dtype": jnp.int32}, TypeError, "dtype: expected one of float32, bfloat16, float16, got int32"),
    ((4, 4, 1, 8), {"quant": 5}, TypeError, "quant: expected a KVQuant"),
    ((4, 4, 1, 8), {"value_head_dim": 0}, ValueError, "value_head_dim"),
    ((2**62, 4, 1, 8), {}, ValueError, "init_kv_cache: expected an array of at most 2\\*\\*44 bytes"),
    ((2**40, 2**40, 1, 8), {}, ValueError, "at most"),
])
def test_init_kv_cache_checks_sizes_before_building(args, kw, error, match):
    with pytest.raises(error, match=match):
        stellax.init_kv_cache(*args, **kw)


def test_init_kv_cache_huge_does_not_abort_the_process():
    code = "import stellax\ntry:\n stellax.init_kv_cache(2**62, 4, 1, 8)\nexcept ValueError as e:\n print('raised', e)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "raised init_kv_cache" in done.stdout, done.stderr[-2000:]


def test_numpy_operands_equal_jnp_operands():
    q, k, v, t, l = paged_inputs(0, lengths=[3, 20], page_size=16, kv_heads=1, q_heads=2, head_dim=16,
                                 dtype=jnp.float32)
    want = np.asarray(stellax.paged_attention(q, k, v, t, l))
    got = stellax.paged_attention(*(np.asarray(a) for a in (q, k, v, t, l)))
    np.testing.assert_array_equal(np.asarray(got), want)
    kp, vp = stellax.init_kv_cache(4, 4, 1, 8, dtype=jnp.float32)
    new = np.arange(16, dtype=np.float32).reshape(2, 1, 8)
    out_np = stellax.update_kv_cache(np.asarray(kp), np.asarray(vp), new, new, np.array([0, 5]))
    out_j = stellax.update_kv_cache(kp, vp, jnp.asarray(new), jnp.asarray(new), jnp.array([0, 5]))
    for a, b in zip(out_np, out_j):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_wrong_kinds_name_the_argument():
    q, k, v, t, l = paged_inputs(0, lengths=[3], page_size=16, kv_heads=1, q_heads=2, head_dim=16,
                                 dtype=jnp.float32)
    with pytest.raises(TypeError, match="implementation: expected None, a name"):
        stellax.paged_attention(q, k, v, t, l, implementation=5)
    with pytest.raises(TypeError, match="slot_mapping: expected an integer array, got float32"):
        stellax.update_kv_cache(k, v, k[0, :2], v[0, :2], jnp.array([0.0, 1.0]))
    with pytest.raises(TypeError, match="k_pages: expected an array or QuantizedPages, got list"):
        stellax.update_kv_cache([1], v, k[0, :2], v[0, :2], jnp.array([0, 1]))
