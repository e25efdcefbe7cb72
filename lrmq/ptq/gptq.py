"""GPTQ (Frantar et al.), a faithful numpy port of IST-DASLab ``gptq.py::GPTQ.fasterquant``.

Orientation: lrmq weights are ``[K, N] = [in, out]``; the reference's column i of the torch
``[out, in]`` weight is our row i, so "quantize column i and push its error onto the later
columns" becomes "quantize row i and push its error onto the later rows".  ``H`` is ``[K, K]``.

Numerics: the column loop is sequential (one ``[N]`` row and a ``[block, N]`` rank-1 update per step);
:func:`_quantize_block_numpy` writes it in numpy, line by line as the reference, in float32 as the
reference, and :func:`_quantize_block` is the same loop compiled with numba (the same float32 operations
in the same order, no fast-math: bit-identical, tested), without numpy's temporaries and per-row
interpreter overhead.  ``Hinv = chol_upper(inv(H + damp I))`` is done in float64 (more robust for
near-singular H) as one reversed-order Cholesky and one triangular inverse (no explicit inverse, see
:func:`_inverse_cholesky_upper`) and cast to float32; :func:`prepare_hessian` computes it once per
Hessian (shared by the Linears that read one input).

Reference behaviours kept on purpose:
* dead inputs (``diag(H) == 0``): ``H_ii = 1`` and the weight row is zeroed;
* damping ``percdamp * mean(diag(H))`` after the dead fix;
* group parameters are found at each group start on the *error-updated* weights held in the full
  matrix ``W``; lazy within-block updates live in the block copy only, so when ``group_size`` is not a
  multiple of ``block_size`` a group starting mid-block sees weights without the current block's
  updates -- exactly as the reference;
* ``group_size=None`` (reference ``-1``): one set of per-output-channel params found on the original
  weights before the dead-input zeroing;
* quantizer (``quant.py::Quantizer``, perchannel, mse off): min/max *including 0*; asymmetric
  ``scale = (xmax-xmin)/maxq, zero = round(-xmin/scale)``; symmetric ``xmax = max(|xmin|, xmax)``,
  ``xmin = -xmax`` (if xmin < 0), ``zero = (maxq+1)/2``; all-zero ranges become [-1, 1];
  ``q = clamp(round(w/scale) + zero, 0, maxq)``, ``w' = scale * (q - zero)``;
* act-order: ``perm = argsort(diag(H), descending)`` (stable here); with ``static_groups`` the group
  params are found on the unpermuted weights (natural groups), otherwise on consecutive
  ``group_size`` rows in permuted order, giving a non-monotone ``g_idx``.
"""

from __future__ import annotations

from typing import NamedTuple

import numba as nb
import numpy as np
from scipy.linalg import lapack


class GPTQResult(NamedTuple):
    w_q: np.ndarray  # float32 [K, N], fake-quantized, natural row order
    scales: np.ndarray  # float32 [n_groups, N]
    zeros: np.ndarray  # uint8 [n_groups, N] unsigned zero points
    g_idx: np.ndarray  # int32 [K]: group of each input channel (row)


def hessian_accumulate(H, n: int, x) -> tuple[np.ndarray, int]:
    """Running average ``H = 2/n sum x x^T`` as the reference ``add_batch``.

    ``x`` is ``[T, K]`` (one sample, as the reference counts a 2-D input) or ``[B, T, K]`` (B samples).
    ``H=None`` starts from zeros.  The scale of H does not change GPTQ's result; only its shape does.
    """
    x = np.asarray(x, np.float32)
    b = 1 if x.ndim == 2 else x.shape[0]
    x = x.reshape(-1, x.shape[-1])
    K = x.shape[1]
    H = np.zeros((K, K), np.float32) if H is None else np.asarray(H, np.float32)
    if H.shape != (K, K):
        raise ValueError(f"H has shape {H.shape}, expected {(K, K)} for inputs of width {K}")
    H = H * np.float32(n / (n + b))
    n = n + b
    x = np.float32(np.sqrt(2.0 / n)) * x
    return H + x.T @ x, n


def find_params(w: np.ndarray, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Reference min/max quantizer params per output channel over the rows of ``w`` [rows, N]."""
    maxq = np.float32(2**bits - 1)
    xmin = np.minimum(w.min(axis=0), 0).astype(np.float32)
    xmax = np.maximum(w.max(axis=0), 0).astype(np.float32)
    if symmetric:
        xmax = np.maximum(np.abs(xmin), xmax)
        xmin = np.where(xmin < 0, -xmax, xmin)
    both0 = (xmin == 0) & (xmax == 0)
    xmin = np.where(both0, np.float32(-1), xmin)
    xmax = np.where(both0, np.float32(1), xmax)
    scale = (xmax - xmin) / maxq
    if symmetric:
        zero = np.full_like(scale, (maxq + 1) / 2)
    else:
        zero = np.round(-xmin / scale)
    return scale.astype(np.float32), zero.astype(np.float32)


def quantize_codes(w, scale, zero, bits: int) -> np.ndarray:
    """Integer codes ``clamp(round(w/scale) + zero, 0, maxq)`` (float32 arithmetic, half-to-even)."""
    return np.clip(np.round(w / scale) + zero, 0, 2**bits - 1)


def fake_quant(w, scale, zero, bits: int) -> np.ndarray:
    return scale * (quantize_codes(w, scale, zero, bits) - zero)


@nb.njit(nogil=True, cache=True)
def _reversed_into(H, A):
    """``A[i, j] = H[K-1-i, K-1-j]`` (``A`` Fortran-ordered, as LAPACK takes it), copied in tiles that
    stay in cache (numpy's strided copy of the reversed view misses cache on every element)."""
    K = H.shape[0]
    t = 64
    for jb in range(0, K, t):
        for ib in range(0, K, t):
            for j in range(jb, min(jb + t, K)):
                for i in range(ib, min(ib + t, K)):
                    A[i, j] = H[K - 1 - i, K - 1 - j]


def _inverse_cholesky_upper(H: np.ndarray) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``U^T U = H^-1``), the reference's
    ``chol_upper(cholesky_inverse(chol(H)))``, without forming ``H^-1``.

    With ``J`` the order reversal, ``J H J = L L^T`` (lower ``L``) gives ``H = V V^T`` with ``V = J L J``
    upper, so ``H^-1 = V^-T V^-1`` and, the Cholesky factor being unique, ``U = V^-1 = J L^-1 J``:
    one Cholesky and one triangular inverse (``2/3 K^3`` flops instead of ``~5 K^3``), float64.
    """
    A = np.empty(H.shape, np.float64, order="F")  # the one working copy: LAPACK overwrites it in place
    _reversed_into(np.ascontiguousarray(H, np.float64), A)
    L, info = lapack.dpotrf(A, lower=1, clean=1, overwrite_a=1)
    if info == 0:
        Linv, info = lapack.dtrtri(L, lower=1, overwrite_c=1)
    if info != 0:
        raise ValueError("GPTQ: the damped Hessian is not positive definite; raise percdamp or "
                         "use more calibration tokens")
    return Linv[::-1, ::-1]


def _quantize_block_numpy(W1, Hinv1, scales, zeros, g_rows, maxq, Q1, Err1) -> None:
    """One block's column loop in numpy (the reference's expressions, row by row): quantize row i of
    ``W1`` with the params of group ``g_rows[i]`` into ``Q1[i]``, ``Err1[i] = (w - q) / Hinv1[i, i]``,
    then ``W1[i+1:] -= outer(Hinv1[i, i+1:], Err1[i])`` (row i is not read again). Kept as the
    specification :func:`_quantize_block` is tested against bit for bit."""
    buf = np.empty_like(W1)
    for i in range(W1.shape[0]):
        row, q, err = W1[i], Q1[i], Err1[i]
        scale, zero = scales[g_rows[i]], zeros[g_rows[i]]
        np.divide(row, scale, out=q)
        np.round(q, out=q)
        q += zero
        np.clip(q, 0, maxq, out=q)
        q -= zero
        q *= scale
        np.subtract(row, q, out=err)
        err /= Hinv1[i, i]
        rest = W1[i + 1 :]
        upd = buf[: len(rest)]
        np.multiply(Hinv1[i, i + 1 :, None], err, out=upd)
        rest -= upd


@nb.njit(nogil=True, cache=True)
def _quantize_block(W1, Hinv1, scales, zeros, g_rows, maxq, Q1, Err1):
    """:func:`_quantize_block_numpy` compiled: every float32 operation the same, in the same order
    (no fast-math, so no fused multiply-add; clip as numpy's: ``x > 0 ? x : 0``, then ``x < maxq ? x :
    maxq``, NaN kept), so results are bit-identical; one pass over the block per row instead of
    numpy's temporaries, and no per-row interpreter overhead."""
    B, N = W1.shape
    lo = np.float32(0.0)
    for i in range(B):
        g = g_rows[i]
        d = Hinv1[i, i]
        for n in range(N):
            w = W1[i, n]
            s = scales[g, n]
            z = zeros[g, n]
            c = np.rint(w / s) + z
            if not np.isnan(c):
                c = c if c > lo else lo
                c = c if c < maxq else maxq
            q = (c - z) * s
            Q1[i, n] = q
            Err1[i, n] = (w - q) / d
        for k in range(i + 1, B):
            h = Hinv1[i, k]
            for n in range(N):
                W1[k, n] -= h * Err1[i, n]


class PreparedHessian(NamedTuple):
    """What GPTQ derives from ``H`` alone (:func:`prepare_hessian`), shared by the Linears that read one
    input (q/k/v, gate/up): one ``Hinv`` instead of one per Linear."""

    dead: np.ndarray  # bool [K]: diag(H) == 0 (those weight rows are zeroed)
    perm: np.ndarray  # int [K]: act-order permutation (identity without act_order)
    hinv: np.ndarray  # float32 [K, K]: chol_upper(inv(H_perm + damp I)), upper
    percdamp: float
    act_order: bool


def prepare_hessian(H, *, percdamp: float = 0.01, act_order: bool = False) -> PreparedHessian:
    """Dead inputs (``H_ii = 1``), act-order permutation, damping ``percdamp * mean(diag H)`` and
    ``Hinv`` (see the module docstring), from ``H`` ``[K, K]`` alone."""
    H = np.array(H, dtype=np.float64)
    if H.ndim != 2 or H.shape[0] != H.shape[1]:
        raise ValueError(f"H has shape {H.shape}, expected a square [K, K]")
    K = H.shape[0]
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    perm = np.arange(K)
    if act_order:
        perm = np.argsort(-np.diag(H), kind="stable")
        H = H[perm][:, perm]
    H[np.diag_indices(K)] += percdamp * np.mean(np.diag(H))
    hinv = _inverse_cholesky_upper(H).astype(np.float32)
    return PreparedHessian(dead=dead, perm=perm, hinv=hinv, percdamp=percdamp, act_order=act_order)


def gptq_quantize(
    w,
    H,
    *,
    bits: int,
    group_size: int | None = 128,
    symmetric: bool = False,
    block_size: int = 128,
    percdamp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
) -> GPTQResult:
    """GPTQ-quantize ``w`` ``[K, N]`` given the input Hessian ``H`` ``[K, K]``; see module docstring.

    ``H`` may also be :func:`prepare_hessian`'s result for it (with the same ``percdamp`` and
    ``act_order``). ``group_size=None`` (or -1) means per output channel (one group of K rows).
    """
    W = np.array(w, dtype=np.float32)  # copy
    K, N = W.shape
    if not isinstance(H, PreparedHessian):
        H = prepare_hessian(H, percdamp=percdamp, act_order=act_order) if np.shape(H) == (K, K) else np.asarray(H)
    elif (H.percdamp, H.act_order) != (percdamp, act_order):
        raise ValueError(f"H was prepared with percdamp={H.percdamp}, act_order={H.act_order}; "
                         f"this call has percdamp={percdamp}, act_order={act_order}")
    if not isinstance(H, PreparedHessian) or H.hinv.shape != (K, K):
        shape = H.hinv.shape if isinstance(H, PreparedHessian) else H.shape
        raise ValueError(f"H has shape {shape}, expected {(K, K)} for a weight of shape {W.shape}")
    dead, perm, Hinv = H.dead, H.perm, H.hinv
    if group_size in (None, -1):
        group_size, per_channel = K, True
    else:
        per_channel = False
        if group_size <= 0 or K % group_size:
            raise ValueError(f"K={K} is not a multiple of group_size={group_size}")
    n_groups = K // group_size

    scales = np.zeros((n_groups, N), np.float32)
    zeros = np.zeros((n_groups, N), np.float32)
    if per_channel:
        scales[0], zeros[0] = find_params(W, bits, symmetric)  # before the dead zeroing, as the reference

    W[dead] = 0

    if static_groups and not per_channel:
        for g in range(n_groups):
            scales[g], zeros[g] = find_params(W[g * group_size : (g + 1) * group_size], bits, symmetric)

    if act_order:
        W = W[perm]

    Q = np.zeros_like(W)
    maxq = np.float32(2**bits - 1)
    g_of_pos = np.zeros(K, np.int64)  # group of permuted position j
    for i1 in range(0, K, block_size):
        i2 = min(i1 + block_size, K)
        if per_channel:
            g_rows = np.zeros(i2 - i1, np.int64)
        elif static_groups:
            g_rows = (perm[i1:i2] // group_size).astype(np.int64)
        else:
            g_rows = np.arange(i1, i2, dtype=np.int64) // group_size
            # groups starting in this block: params from the error-updated weights of the full matrix W,
            # which changes only between blocks (stale within the block, as the reference), so finding
            # them here at the block start gives what the reference finds at each group's first row
            for j in range(-(-i1 // group_size) * group_size, i2, group_size):
                scales[j // group_size], zeros[j // group_size] = find_params(W[j : j + group_size], bits, symmetric)
        g_of_pos[i1:i2] = g_rows
        W1 = W[i1:i2].copy()
        Err1 = np.zeros_like(W1)
        _quantize_block(W1, np.ascontiguousarray(Hinv[i1:i2, i1:i2]), scales, zeros, g_rows, maxq, Q[i1:i2], Err1)
        W[i2:] -= Hinv[i1:i2, i2:].T @ Err1

    g_idx = np.empty(K, np.int32)
    g_idx[perm] = g_of_pos
    w_q = np.empty_like(Q)
    w_q[perm] = Q
    return GPTQResult(w_q=w_q, scales=scales, zeros=zeros.astype(np.uint8), g_idx=g_idx)


def gptq_codes(res: GPTQResult, bits: int) -> np.ndarray:
    """Exact uint8 codes ``[K, N]`` of a result: ``w_q = scale * (code - zero)`` row by row."""
    s = res.scales[res.g_idx]
    z = res.zeros[res.g_idx].astype(np.float32)
    return np.clip(np.round(res.w_q / s + z), 0, 2**bits - 1).astype(np.uint8)
