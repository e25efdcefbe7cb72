"""Blockwise attention (`lrmq.model.attention`) against the dense reference `lrmq.model.decoder.attend`.

* Values and gradients w.r.t. q, k and v equal the dense path's (f32: float noise; bf16: bf16 rounding) for
  causal rows, left and right padding (every batch below has a left-padded and a right-padded row, whose
  fully masked padding rows get a random cotangent too), packed segments, sliding windows, GQA, T not a
  multiple of the block, in f32 and bf16: the XLA path (CPU), splash (Pallas interpret mode) and the
  rotated `jax.nn.dot_product_attention` call the cuDNN path makes (checked through its XLA implementation).
* The compiled CPU program of the XLA path (forward + backward, T = S = 1024, blocks of 128) holds no
  [T, S]-sized buffer; the dense program does.
* The decoder's training forward goes through it: a tiny Qwen3 with a sliding-window layer, scanned and
  rematerialised, with packed segments, gives the dense decoder's log-probs and parameter gradients.
* `impl="auto"` follows the compile target: splash for TPU, cuDNN for GPU where it can take the call.
* Splash compiles through libtpu (no TPU needed) for v5e, v5p and v6e, forward + backward, with causal,
  segment and sliding-window masks.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from lrmq.model import attention as attn_mod  # noqa: E402
from lrmq.model import decoder as decoder_mod  # noqa: E402
from lrmq.model.attention import attention, choose_impl  # noqa: E402
from lrmq.model.config import ModelConfig  # noqa: E402
from lrmq.model.decoder import Decoder, attend, positions_from_mask  # noqa: E402


def _inputs(b, t, h, kvh, d, dtype, *, padding=True, packed=None, seed=0):
    """q, k, v, positions, segments, cotangent. Row 0 left-padded, row 1 right-padded (padding=True);
    `packed`: per row, the lengths of the sequences packed into it (then positions restart per segment and
    the rest of the row is padding)."""
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((b, t, h, d)), dtype)
    k = jnp.asarray(r.standard_normal((b, t, kvh, d)), dtype)
    v = jnp.asarray(r.standard_normal((b, t, kvh, d)), dtype)
    ct = jnp.asarray(r.standard_normal((b, t, h, d)), dtype)
    segments = None
    if packed is not None:
        seg, pos = np.zeros((b, t), np.int32), np.full((b, t), -1, np.int32)
        for row, lengths in enumerate(packed):
            col = 0
            for sid, n in enumerate(lengths, start=1):
                seg[row, col:col + n], pos[row, col:col + n] = sid, np.arange(n)
                col += n
        return q, k, v, jnp.asarray(pos), jnp.asarray(seg), ct
    mask = np.ones((b, t), np.int32)
    if padding:
        mask[0, : t // 5] = 0
        mask[1 % b, t - t // 4:] = 0
    return q, k, v, positions_from_mask(jnp.asarray(mask)), segments, ct


def _value_and_grads(f, q, k, v, ct):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(ct)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    scale = float(np.abs(want).max())
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(scale, 1.0))


def _check(impl_fn, q, k, v, pos, seg, window, ct):
    dense = lambda q, k, v: attend(q, k, v, pos, pos, window, segments=seg)  # noqa: E731
    want = jax.jit(lambda *a: _value_and_grads(dense, *a))(q, k, v, ct)
    got = jax.jit(lambda *a: _value_and_grads(impl_fn, *a))(q, k, v, ct)
    _close(got[0], want[0], q.dtype)
    for g, w in zip(got[1], want[1]):
        _close(g, w, q.dtype)


# (name, dtype, B, T, H, KVH, D, window, padding, packed, block)
CASES = [
    ("causal", jnp.float32, 1, 128, 2, 2, 16, None, False, None, 32),
    ("padded_gqa_ragged_T", jnp.float32, 2, 150, 4, 2, 16, None, True, None, 64),
    ("window_gqa", jnp.float32, 2, 150, 4, 1, 16, 20, True, None, 64),
    ("segments", jnp.float32, 2, 160, 4, 2, 16, None, False, [[70, 50, 30], [100, 45]], 64),
    ("segments_window", jnp.float32, 2, 160, 4, 2, 16, 24, False, [[70, 50, 30], [100, 45]], 64),
    ("bf16_padded_window", jnp.bfloat16, 2, 150, 4, 2, 16, 20, True, None, 64),
    ("bf16_segments", jnp.bfloat16, 2, 160, 4, 2, 16, None, False, [[70, 50, 30], [100, 45]], 64),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_blockwise_xla_matches_dense(case):
    _, dtype, b, t, h, kvh, d, window, padding, packed, block = case
    q, k, v, pos, seg, ct = _inputs(b, t, h, kvh, d, dtype, padding=padding, packed=packed)
    _check(lambda q, k, v: attention(q, k, v, pos, pos, window, seg, impl="xla", block_q=block, block_k=block),
           q, k, v, pos, seg, window, ct)


def test_blockwise_xla_cross_attention_positions():
    """Queries and keys of different lengths and positions (a chunk of queries over a longer key range),
    and uneven query / key blocks: masks by position, exact for any positions."""
    r = np.random.default_rng(1)
    b, t, s, h, kvh, d = 2, 40, 100, 4, 2, 16
    q = jnp.asarray(r.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(r.standard_normal((b, s, kvh, d)), jnp.float32)
    v = jnp.asarray(r.standard_normal((b, s, kvh, d)), jnp.float32)
    ct = jnp.asarray(r.standard_normal((b, t, h, d)), jnp.float32)
    k_pos = jnp.asarray(np.stack([np.arange(s) - 10, np.where(np.arange(s) % 7 == 3, -1, np.arange(s))]), jnp.int32)
    q_pos = jnp.asarray(np.stack([np.arange(t) + 50, np.arange(t) - 5]), jnp.int32)  # row 1 starts with padding
    assert choose_impl("auto", q.shape, k.shape, q.dtype, self_attn=False, segments=False) == ("xla", False)
    blk = lambda q, k, v: attention(q, k, v, q_pos, k_pos, 16, impl="xla", block_q=16, block_k=32)  # noqa: E731
    dense = lambda q, k, v: attend(q, k, v, q_pos, k_pos, 16)  # noqa: E731
    want = jax.jit(lambda *a: _value_and_grads(dense, *a))(q, k, v, ct)
    got = jax.jit(lambda *a: _value_and_grads(blk, *a))(q, k, v, ct)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _close(g, w, jnp.float32)


SPLASH_CASES = [
    ("f32_segments_window", jnp.float32, 2, 256, 4, 2, 16, 40, False, [[100, 90, 60], [150, 100]]),
    ("bf16_padded", jnp.bfloat16, 2, 200, 4, 2, 16, None, True, None),
]


@pytest.mark.parametrize("case", SPLASH_CASES, ids=[c[0] for c in SPLASH_CASES])
def test_splash_interpret_matches_dense(case):
    """The splash kernel (Pallas interpret mode on CPU), its index masks and padding segment included."""
    _, dtype, b, t, h, kvh, d, window, padding, packed = case
    q, k, v, pos, seg, ct = _inputs(b, t, h, kvh, d, dtype, padding=padding, packed=packed)
    assert choose_impl("splash", q.shape, k.shape, dtype, self_attn=True, segments=seg is not None) == ("splash", True)
    _check(lambda q, k, v: attention(q, k, v, pos, pos, window, seg, impl="splash"), q, k, v, pos, seg, window, ct)


@pytest.mark.parametrize("window", [None, 20])
def test_rotated_dot_product_attention_matches_dense(window):
    """The cuDNN path's arithmetic (rows rotated so real tokens come first, lengths as padding, causal and
    window by index), run through jax.nn.dot_product_attention's XLA implementation: no GPU here."""
    q, k, v, pos, seg, ct = _inputs(2, 150, 4, 2, 16, jnp.float32)
    _check(lambda q, k, v: attn_mod._rolled_dot_product_attention(q, k, v, pos, window, "xla"),
           q, k, v, pos, seg, window, ct)


def test_auto_follows_the_compile_target(monkeypatch):
    bf16, f32 = jnp.bfloat16, jnp.float32
    q, kv = (2, 64, 8, 128), (2, 64, 2, 128)
    assert choose_impl("auto", q, kv, bf16, self_attn=True, segments=True) == ("xla", False)  # CPU host
    with pk.target("tpu", "TPU v5 lite"):
        assert choose_impl("auto", q, kv, bf16, self_attn=True, segments=True) == ("splash", False)
        assert choose_impl("auto", q, kv, f32, self_attn=True, segments=False) == ("splash", False)
        assert choose_impl("auto", q, kv, bf16, self_attn=False, segments=False) == ("xla", False)
    with pk.target("gpu"):
        # no cuDNN in this process (a GPU compile from a CPU host): XLA's blockwise attention, and a forced
        # cuDNN path says why it cannot
        assert not attn_mod.cudnn_loaded()
        assert choose_impl("auto", q, kv, bf16, self_attn=True, segments=False) == ("xla", False)
        with pytest.raises(ValueError, match="cuDNN is not loaded in this process"):
            choose_impl("cudnn", q, kv, bf16, self_attn=True, segments=False)
        monkeypatch.setattr(attn_mod, "cudnn_loaded", lambda: True)  # a GPU machine's process
        assert choose_impl("auto", q, kv, bf16, self_attn=True, segments=False) == ("cudnn", False)
        for args in ((q, kv, bf16, True, True), (q, kv, f32, True, False), ((2, 64, 8, 256), (2, 64, 2, 256),
                                                                             bf16, True, False)):
            assert choose_impl("auto", *args[:3], self_attn=args[3], segments=args[4]) == ("xla", False), args
        with pytest.raises(ValueError, match="packed segments"):
            choose_impl("cudnn", q, kv, bf16, self_attn=True, segments=True)
    with pytest.raises(ValueError):
        choose_impl("flash", q, kv, bf16, self_attn=True, segments=False)
    with pytest.raises(ValueError, match="self-attention"):
        choose_impl("splash", q, kv, bf16, self_attn=False, segments=False)


# ------------------------------------------------------------------------ no [T, S] intermediate
_SHAPE = re.compile(r"\b(?:f32|bf16|f16|s32|pred|u8|s8)\[([0-9,]+)\]")


def _hlo_shapes(text):
    return [tuple(int(x) for x in m.group(1).split(",")) for m in _SHAPE.finditer(text)]


def test_xla_path_never_holds_a_t_by_s_buffer():
    b, t, h, kvh, d = 1, 1024, 4, 2, 32
    q, k, v, pos, seg, ct = _inputs(b, t, h, kvh, d, jnp.float32, padding=False)
    blk = lambda q, k, v: attention(q, k, v, pos, pos, None, impl="xla", block_q=128, block_k=128)  # noqa: E731
    dense = lambda q, k, v: attend(q, k, v, pos, pos, None)  # noqa: E731

    def shapes(f):
        fn = jax.jit(lambda q, k, v, ct: _value_and_grads(f, q, k, v, ct))
        jaxpr_shapes = [tuple(var.aval.shape) for eqn in _all_eqns(jax.make_jaxpr(fn)(q, k, v, ct).jaxpr)
                        for var in eqn.outvars if hasattr(var.aval, "shape")]
        return jaxpr_shapes + _hlo_shapes(fn.lower(q, k, v, ct).compile().as_text())

    def t_by_s(shape):
        return sum(1 for x in shape if x >= t) >= 2 or int(np.prod(shape, dtype=np.int64)) >= b * h * t * t // 8

    assert any(t_by_s(s) for s in shapes(dense)), "the check must see the dense path's scores"
    big = [s for s in shapes(blk) if t_by_s(s)]
    assert not big, f"[T, S]-sized buffers in the blockwise program: {sorted(set(big))[:5]}"


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _subjaxprs(eqn):
            yield from _all_eqns(sub)


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for x in (p if isinstance(p, (list, tuple)) else [p]):
            if hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
                yield x.jaxpr
            elif hasattr(x, "eqns"):
                yield x


# ------------------------------------------------------------------------------------ in the decoder
TINY = dict(model_type="olmo3", vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            sliding_window=12, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


def test_decoder_training_forward_is_blockwise_and_matches_dense(monkeypatch):
    """Packed segments through a scanned, rematerialised Olmo-3-style decoder (a sliding and a full layer),
    blocks smaller than the rows: log-probs and every parameter gradient equal the dense decoder's."""
    cfg = ModelConfig.from_hf_dict(dict(TINY), dtype="float32", param_dtype="float32")
    model = Decoder(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    t = 96
    r = np.random.default_rng(0)
    tokens = jnp.asarray(r.integers(1, 200, (2, t)), jnp.int32)
    seg, pos = np.zeros((2, t), np.int32), np.full((2, t), -1, np.int32)
    for row, lengths in enumerate([[40, 30, 20], [60, 25]]):
        col = 0
        for sid, n in enumerate(lengths, start=1):
            seg[row, col:col + n], pos[row, col:col + n] = sid, np.arange(n)
            col += n
    seg, pos = jnp.asarray(seg), jnp.asarray(pos)
    w = jnp.asarray(r.standard_normal((2, t, 200)), jnp.float32) * (pos >= 0)[..., None]

    def run(params):
        def loss(params):
            m = nnx.merge(graphdef, params)
            h, _ = m.hidden(tokens, pos, remat="full", scan=True, segments=seg)
            return jnp.sum(jax.nn.log_softmax(m.logits(h)) * w)

        return jax.jit(jax.value_and_grad(loss))(params)

    seen = []
    real = attn_mod.attention
    monkeypatch.setattr(decoder_mod, "attention",
                        lambda *a, **kw: seen.append(1) or real(*a, **kw, block_q=32, block_k=32))
    got = run(params)
    assert seen, "the decoder's no-cache path does not call lrmq.model.attention"
    monkeypatch.setattr(decoder_mod, "attention", lambda q, k, v, qp, kp, window, segments=None, **kw:
                        attend(q, k, v, qp, kp, window, segments=segments))
    want = run(params)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for (path, a), (_, b) in zip(nnx.to_flat_state(got[1]), nnx.to_flat_state(want[1])):
        a, b = np.asarray(a.get_value()), np.asarray(b.get_value())
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1.0, float(np.abs(b).max())), err_msg=str(path))


# ------------------------------------------------------------------------------ TPU ahead of time
TOPOLOGIES = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


@functools.lru_cache(maxsize=None)
def _tpu_devices(topology):
    try:
        import libtpu  # noqa: F401
    except ImportError:
        if sys.version_info < (3, 12):
            raise  # the test extra installs libtpu here: a missing one is a broken environment
        pytest.skip("libtpu is not installed (the test extra pins it for Python < 3.12 only)")
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


def _compile_splash(gen, window):
    """Compile jax.grad of splash attention (its forward and fused backward kernels) with segment ids,
    causal (window None) or sliding-window masks, for one chip of `gen`: None or the error."""
    mesh = Mesh(np.array(_tpu_devices(TOPOLOGIES[gen])[:1]), ("x",), axis_types=(AxisType.Auto,))
    sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))  # noqa: E731
    b, t, h, kvh, d = 2, 384, 4, 2, 128  # T not a multiple of the 256-token tile: padded inside
    f = lambda q, k, v, pos, seg: attention(q, k, v, pos, pos, window, seg)  # noqa: E731
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    try:
        with jax.set_mesh(mesh):
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
                sd((b, t, h, d), jnp.bfloat16), sd((b, t, kvh, d), jnp.bfloat16), sd((b, t, kvh, d), jnp.bfloat16),
                sd((b, t), jnp.int32), sd((b, t), jnp.int32)).compile().as_text()
        n = text.count("tpu_custom_call")
        return None if n >= 2 else f"{n} Mosaic calls (want the forward and the backward kernel)"
    except Exception as e:  # collect every failure, report them together
        return str(e).strip().splitlines()[0][:300]


def test_splash_compiles_for_tpu_forward_and_backward(monkeypatch):
    monkeypatch.setattr(attn_mod, "SPLASH_BLOCK", 256)  # two tiles per row at this small shape
    _tpu_devices(TOPOLOGIES["v5e"])
    cases = [(gen, window) for gen in TOPOLOGIES for window in (None, 64)]
    with ThreadPoolExecutor(max_workers=2) as ex:  # compiles release the GIL: both cores
        errors = list(ex.map(lambda c: _compile_splash(*c), cases))
    failures = [f"{g} window={w}: {e}" for (g, w), e in zip(cases, errors) if e]
    assert not failures, "\n".join(failures)
