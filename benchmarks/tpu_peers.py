"""The peers `benchmarks/tpu_suite.py` measures stellax against on a TPU: the
kernels that ship inside jax (splash attention, megablox gmm/tgmm, ragged paged
attention) and ``jax.lax.ragged_dot``, each wrapped to take the stellax op's
arguments (so a peer and the op time the same math; `tests/test_tpu_suite.py`
checks them against the golden in interpret mode). A peer refuses what is not
its contract with `UnsupportedError` (recorded as skipped)."""

from __future__ import annotations


def splash_peer(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, **options):
    """jax's bundled splash attention on the op's ``[B, T, H, D]`` arguments, at `splash_block`
    tiles (fused backward): full or causal mask, as many KV heads as query heads, T = S. Anything
    else is not its contract here: `UnsupportedError` (recorded as skipped)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    from stellax.core import UnsupportedError, interpret_enabled

    extra = sorted(k for k, v in options.items() if v not in (None, False))
    if bias is not None or mask is not None or extra or key.shape[2] != query.shape[2] \
            or key.shape[1] != query.shape[1]:
        raise UnsupportedError(f"jax_splash peer: only full/causal MHA with T = S (got options {extra}, "
                               f"{query.shape[2]} query / {key.shape[2]} KV heads)")
    _, t, heads, d = query.shape
    kind = masks.CausalMask if is_causal else masks.FullMask
    block = splash_block(t)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    kernel = splash.make_splash_mha(masks.MultiHeadMask([kind((t, t)) for _ in range(heads)]), block_sizes=sizes,
                                    head_shards=1, q_seq_shards=1, interpret=interpret_enabled())
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)
    q_scale = (1.0 / d ** 0.5) if scale is None else scale
    out = jax.vmap(kernel)(heads_first(query) * jnp.asarray(q_scale, query.dtype), heads_first(key),
                           heads_first(value))
    return jnp.swapaxes(out, 1, 2)


#: Splash's tile here: its usual 512 (its own default, 128, ran the T=S=16384 forward at 8 % of a
#: v5e's peak against 82 % for stellax; benchmarks/attention_tpu.py searches 512 and 1024).
SPLASH_BLOCK = 512


def splash_block(t: int) -> int:
    """`SPLASH_BLOCK`, or the largest of 256 / 128 dividing ``t``, or ``t`` itself."""
    return next((b for b in (SPLASH_BLOCK, 256, 128) if t % b == 0 and b <= t), t)


def _megablox():
    import importlib

    return importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


def _megablox_tile(dim: int) -> int:
    """512 when it divides ``dim`` (transformer sizes), else 128."""
    return 512 if dim % 512 == 0 else 128


def _rows_padded(x, axis: int, tm: int):
    """``x`` zero-padded along ``axis`` to a multiple of megablox's row tile ``tm``."""
    import jax.numpy as jnp

    extra = -x.shape[axis] % tm
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def megablox_gmm_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                      activation=None, transpose_rhs=False):
    """jax's bundled megablox ``gmm`` on a `ragged_dot` call: ``lhs [M, K]``, ``rhs [G, K, N]``
    (``[G, N, K]`` transposed), local groups from ``group_offset``. M is padded to its
    row tile (128); rows outside the local groups are set to zeros (megablox leaves
    them unspecified), so the result is the op's. Gated weights and fused
    activations are not megablox's contract: `UnsupportedError`."""
    import jax.numpy as jnp

    from stellax.core import UnsupportedError, interpret_enabled

    if rhs.ndim != 3 or activation is not None:
        raise UnsupportedError(f"jax_megablox_gmm peer: plain rhs [G, K, N] without activation only (got rhs "
                               f"{tuple(rhs.shape)}, activation {activation!r})")
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = preferred_element_type or lhs.dtype
    offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    out = _megablox().gmm(_rows_padded(lhs, 0, 128), rhs, group_sizes.astype(jnp.int32),
                          preferred_element_type=out_dtype, tiling=(128, _megablox_tile(k), _megablox_tile(n)),
                          group_offset=offset, transpose_rhs=transpose_rhs, interpret=interpret_enabled())[:m]
    ends = jnp.cumsum(group_sizes)
    first = 0 if offset is None else offset
    begin = jnp.where(first > 0, ends[jnp.maximum(first - 1, 0)], 0)
    end = ends[first + rhs.shape[0] - 1]
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= begin) & (rows < end), out, jnp.zeros((), out.dtype))


def megablox_tgmm_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                       num_local_groups=None, transpose_lhs=False):
    """jax's bundled megablox ``tgmm`` on a `ragged_dot_tgmm` call: ``lhs [K, M]``
    (``[M, K]`` with ``transpose_lhs``: transposed by XLA first), ``rhs [M, N]`` →
    ``[G_local, K, N]``. M is zero-padded to its row tile (128)."""
    import jax.numpy as jnp

    from stellax.core import interpret_enabled

    a = lhs.T if transpose_lhs else lhs
    k, n = a.shape[0], rhs.shape[1]
    offset = None if group_offset is None else jnp.asarray(group_offset, jnp.int32).reshape(())
    return _megablox().tgmm(_rows_padded(a, 1, 128), _rows_padded(rhs, 0, 128), group_sizes.astype(jnp.int32),
                            preferred_element_type=preferred_element_type or lhs.dtype,
                            tiling=(128, _megablox_tile(k), _megablox_tile(n)), group_offset=offset,
                            num_actual_groups=num_local_groups, interpret=interpret_enabled())


def ragged_dot_peer(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None, *,
                    activation=None, transpose_rhs=False):
    """``jax.lax.ragged_dot`` on a plain `ragged_dot` call (all groups local)."""
    import jax
    import jax.numpy as jnp

    from stellax.core import UnsupportedError

    if rhs.ndim != 3 or activation is not None or group_offset is not None:
        raise UnsupportedError("jax.lax.ragged_dot peer: plain rhs [G, K, N], no activation or group offset")
    weights = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    return jax.lax.ragged_dot(lhs, weights, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type)


def ragged_paged_peer(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scale=None,
                      logits_soft_cap=None, local_window_size=None, sinks=None):
    """jax's bundled ragged paged attention on the op's arguments: dense
    ``k_pages`` / ``v_pages [NP, PS, K, H]`` interleaved into its combined
    ``[NP, PS, 2K, H]`` pool (k0 v0 k1 v1 ...; the copy is part of its time),
    soft cap and left window. Quantized pools and sinks are not its contract,
    and it does not run interpreted on jax 0.10.2: `UnsupportedError`."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as bundled

    from stellax.core import UnsupportedError, interpret_enabled
    from stellax.ops.paged_attention import QuantizedPages

    if interpret_enabled():
        raise UnsupportedError("jax_ragged_paged_attention peer: jax 0.10.2's kernel does not run interpreted")
    if sinks is not None or v_pages is None or isinstance(k_pages, QuantizedPages) \
            or isinstance(v_pages, QuantizedPages) or k_pages.shape != v_pages.shape:
        raise UnsupportedError("jax_ragged_paged_attention peer: dense k/v pools of one shape, no sinks")
    if isinstance(local_window_size, (tuple, list)):
        local_window_size = local_window_size[0]
    num_pages, page_size, kv_heads, h = k_pages.shape
    kv = jnp.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * kv_heads, h)
    try:
        return bundled.ragged_paged_attention(
            q, kv, kv_lens, block_tables, cu_q_lens, jnp.asarray(num_seqs, jnp.int32).reshape(1),
            sm_scale=(1.0 / h ** 0.5) if scale is None else scale, soft_cap=logits_soft_cap,
            sliding_window=None if local_window_size is None else local_window_size + 1)
    except (ValueError, NotImplementedError) as e:  # its static checks (head counts it cannot tile, ...)
        raise UnsupportedError(f"jax_ragged_paged_attention peer: {e}") from e


#: The MoE ops' peers on a TPU (op name → {peer name: function}).
MOE_PEERS = {"ragged_dot": {"jax.lax.ragged_dot": ragged_dot_peer, "jax_megablox_gmm": megablox_gmm_peer},
             "ragged_dot_tgmm": {"jax_megablox_tgmm": megablox_tgmm_peer}}


def install(ops) -> None:
    """Register the peers on the ops they compare with (``op.peers``)."""
    for op in ops:
        if op.name == "dot_product_attention" or op.name == "attention":
            op.peers.setdefault(f"jax_splash_{SPLASH_BLOCK}", splash_peer)
        for name, fn in MOE_PEERS.get(op.name, {}).items():
            op.peers[name] = fn
        if op.name == "ragged_paged_attention":
            op.peers.setdefault("jax_ragged_paged_attention", ragged_paged_peer)
