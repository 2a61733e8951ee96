r"""The Triton kernels of :mod:`linear_ce.engine.triton_rows` (imported on first use only:
it imports Triton, and Triton reads ``TRITON_INTERPRET`` as the kernels are decorated).

Each program takes ``BLOCK_R`` rows of a ``(B, V)`` tile (any strides) and walks their
classes ``BLOCK_V`` at a time. The math is ``native_rows.c``'s, in fp32:
:math:`v_j = x_j c`, :math:`u_j = v_j - m`, :math:`e^{u}` by the same Cody-Waite reduction
and degree-7 Taylor polynomial (:func:`_exp`: within 2 ulp over :math:`u \le 0`, 0 below the
smallest normal's log, NaN for NaN), so the interpreter and a GPU give what the compiled
loops give to the ulp of a sum's order. bf16 tiles come as ``int16`` views and are widened
and rounded by their bits (:func:`_load`, :func:`_store`): exact, and to nearest even, on
any backend (the interpreter's own bf16 cast truncates).

- :func:`stats_kernel`: one read of each row with an online max: per block its max
  :math:`m'`, the sums so far rescaled by :math:`r = e^{m - m'}` (:math:`S' = rS`,
  :math:`D' = r(D - (m' - m)S)`), then the block's terms added.
- :func:`grad_kernel`: one read and one write: :math:`g = e^u(a + b(u - \mu)) + \gamma[j = t]`.
- :func:`fused_kernel`: the statistics, then the gradient with :math:`a = (c_0 + c_1
  \mathrm{lse}) / Z`: two reads, one write.
- :func:`pair_kernel`: the distillation pair loops: both maxima and the sums in one read
  (each sum rescaled as a block raises a max, e.g. reverse KL's
  :math:`C' = r_s(C - (\delta_s - \delta_t) Z_s)`, forward's
  :math:`C' = r_t(C - (\delta_t - \delta_s) Z_t)`, the entropy's
  :math:`E' = r_s(E - \delta_s Z_s)`), the mixture's terms in a second once :math:`Z_s, Z_t`
  are known, the student's gradient in one more read and write.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fused_kernel", "grad_kernel", "interpreted", "pair_kernel", "stats_kernel"]

#: Whether these kernels run under Triton's interpreter (numpy, CPU tensors).
interpreted = bool(triton.knobs.runtime.interpret)

#: Block shapes tried on a GPU, per ``(V, dtype)``: one row per program over long classes
#: blocks, or a few rows over shorter ones (a chunk's rows are many, its classes 10⁴-10⁵).
_CONFIGS = [
    triton.Config({"BLOCK_R": r, "BLOCK_V": v}, num_warps=w)
    for r, v, w in [(1, 1024, 4), (1, 2048, 8), (1, 4096, 8), (2, 1024, 4), (4, 512, 4)]
]


def _tuned(restore: list[str]):
    """``triton.autotune`` over :data:`_CONFIGS` on a GPU (restoring ``restore``, the tiles
    a kernel writes, between its trials); the plain kernel under the interpreter, which
    its caller launches with one fixed block shape."""

    def wrap(fn):
        kernel = triton.jit(fn)
        if interpreted:
            return kernel
        return triton.autotune(_CONFIGS, key=["V", "BF16"], restore_value=restore)(kernel)

    return wrap


@triton.jit
def _exp(u):
    """:math:`e^u` for :math:`u \\le 0` as ``native_rows.c``'s ``exp_nonpositive``."""
    x = tl.maximum(u, -87.336544)
    n = (x * 1.44269504088896341 + 12582912.0) - 12582912.0
    r = x - n * 0.693145751953125
    r = r - n * 1.428606820309417232e-6
    p = r * (1.0 / 5040.0) + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    out = tl.where(u < -87.336544, 0.0, bits.to(tl.float32, bitcast=True))
    return tl.where(u != u, u, out)


@triton.jit
def _load(ptrs, mask, BF16: tl.constexpr):
    """fp32 values of a tile's elements (bf16: the ``int16`` bits shifted into place)."""
    if BF16:
        raw = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        return ((raw & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store(ptrs, g, mask, BF16: tl.constexpr):
    """``g`` written in the tile's dtype, rounded once to nearest even (bf16 by its bits; a
    NaN stays a quiet NaN)."""
    if BF16:
        b = g.to(tl.uint32, bitcast=True)
        rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        half = tl.where(g != g, (b >> 16) | 0x40, rounded)
        tl.store(ptrs, half.to(tl.int16), mask=mask)
    else:
        tl.store(ptrs, g.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _online(X, rows, rmask, stride_r, stride_c, V, scale, DOT: tl.constexpr, BF16: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """Per row: ``(m, S, D)`` with ``m`` the max (NaN where a value is), ``S`` and ``D``
    NaN where ``m`` is not finite (0 for an empty row), in one read."""
    base = X + rows[:, None].to(tl.int64) * stride_r
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    d = tl.zeros([BLOCK_R], tl.float32)
    nan = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        v = _load(base + cols[None, :].to(tl.int64) * stride_c, mask, BF16) * scale
        v = tl.where(mask, v, float("-inf"))
        bad = v != v
        nan = nan | tl.max(bad.to(tl.int32), 1)
        grown = tl.maximum(m, tl.max(tl.where(bad, float("-inf"), v), 1))
        # Rows whose max is not finite get NaN sums below: their terms here are any.
        ref = tl.where((grown > float("-inf")) & (grown < float("inf")), grown, 0.0)
        r = tl.where(m > float("-inf"), _exp(m - ref), 0.0)
        u = v - ref[:, None]
        e = _exp(u)
        if DOT:
            # Before s is rescaled: the shift takes the old s. While s is 0 so is d.
            d = tl.where(s == 0.0, 0.0, r * (d - (ref - m) * s))
            d += tl.sum(tl.where(e == 0.0, 0.0, e * u), 1)
        s = s * r + tl.sum(e, 1)
        m = grown
    finite = (m > float("-inf")) & (m < float("inf")) & (nan == 0)
    empty = tl.where(V == 0, 0.0, float("nan"))
    m = tl.where(nan != 0, float("nan"), m)
    return m, tl.where(finite, s, empty), tl.where(finite, d, empty)


@triton.jit
def _target_u(X, rows, rmask, stride_r, stride_c, t, m, scale, BF16: tl.constexpr):
    """``v_t − m`` per row, 0 where ``t < 0``."""
    owned = rmask & (t >= 0)
    ptrs = X + rows.to(tl.int64) * stride_r + tl.maximum(t, 0).to(tl.int64) * stride_c
    return tl.where(owned, _load(ptrs, owned, BF16) * scale - m, 0.0)


def _stats(X, stride_r, stride_c, B, V, scale, T, OUT, out_stride, HAS_T: tl.constexpr,
           DOT: tl.constexpr, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_V: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    m, s, d = _online(X, rows, rmask, stride_r, stride_c, V, scale, DOT, BF16, BLOCK_R, BLOCK_V)
    tl.store(OUT + rows, m, mask=rmask)
    tl.store(OUT + out_stride + rows, s, mask=rmask)
    if DOT:
        tl.store(OUT + 2 * out_stride + rows, d, mask=rmask)
    if HAS_T:
        t = tl.load(T + rows, mask=rmask, other=-1)
        u_t = _target_u(X, rows, rmask, stride_r, stride_c, t, m, scale, BF16)
        tl.store(OUT + 3 * out_stride + rows, u_t, mask=rmask)


def _grad(X, stride_r, stride_c, B, V, scale, M, A, Bv, MU, T, G, HAS_B: tl.constexpr,
          HAS_T: tl.constexpr, BF16: tl.constexpr, BLOCK_R: tl.constexpr,
          BLOCK_V: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    m = tl.load(M + rows, mask=rmask, other=0.0)[:, None]
    a = tl.load(A + rows, mask=rmask, other=0.0)[:, None]
    if HAS_B:
        b = tl.load(Bv + rows, mask=rmask, other=0.0)[:, None]
        mu = tl.load(MU + rows, mask=rmask, other=0.0)[:, None]
    t = tl.full([BLOCK_R], -1, tl.int64)
    gamma = tl.zeros([BLOCK_R], tl.float32)
    if HAS_T:
        t = tl.load(T + rows, mask=rmask, other=-1)
        gamma = tl.load(G + rows, mask=rmask, other=0.0)
    base = X + rows[:, None].to(tl.int64) * stride_r
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        ptrs = base + cols[None, :].to(tl.int64) * stride_c
        u = _load(ptrs, mask, BF16) * scale - m
        e = _exp(u)
        # A masked class (e = 0) gets 0 (the limit), times a NaN the coefficients hold.
        g = e * tl.where(e == 0.0, a + b + mu, a + b * (u - mu)) if HAS_B else e * a
        g = tl.where(cols[None, :] == t[:, None], g + gamma[:, None], g)
        _store(ptrs, g, mask, BF16)


def _fused(X, stride_r, stride_c, B, V, scale, T, C0, C1, G, OUT, out_stride,
           BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    m, z, _ = _online(X, rows, rmask, stride_r, stride_c, V, scale, False, BF16, BLOCK_R, BLOCK_V)
    t = tl.load(T + rows, mask=rmask, other=-1)
    u_t = _target_u(X, rows, rmask, stride_r, stride_c, t, m, scale, BF16)
    c1 = tl.load(C1 + rows, mask=rmask, other=0.0)
    lse = tl.where((m == float("inf")) | (m == float("-inf")), m, m + tl.log(z))
    a = tl.load(C0 + rows, mask=rmask, other=0.0) + tl.where(c1 != 0.0, c1 * lse, 0.0)
    a = a / z
    gamma = tl.load(G + rows, mask=rmask, other=0.0)
    tl.store(OUT + rows, m, mask=rmask)
    tl.store(OUT + out_stride + rows, z, mask=rmask)
    tl.store(OUT + 2 * out_stride + rows, u_t, mask=rmask)
    base = X + rows[:, None].to(tl.int64) * stride_r
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        ptrs = base + cols[None, :].to(tl.int64) * stride_c
        g = _exp(_load(ptrs, mask, BF16) * scale - m[:, None]) * a[:, None]
        g = tl.where(cols[None, :] == t[:, None], g + gamma[:, None], g)
        _store(ptrs, g, mask, BF16)


@triton.jit
def _log1p_unit(y):
    """:math:`\\log(1 + y)` for :math:`0 \\le y \\le 1`, as ``native_rows.c``'s."""
    x = 1.0 + y
    big = x >= 1.41421356
    mant = tl.where(big, 0.5 * x, x)
    f = (mant - 1.0) / (mant + 1.0)
    f2 = f * f
    p = f2 * (1.0 / 11.0) + 1.0 / 9.0
    p = p * f2 + 1.0 / 7.0
    p = p * f2 + 1.0 / 5.0
    p = p * f2 + 1.0 / 3.0
    p = p * f2 + 1.0
    log_x = tl.where(big, 0.693147180559945, 0.0) + 2.0 * f * p
    d = x - 1.0
    return tl.where(d == 0.0, y, log_x * (y / tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _mixture(delta, log_beta, log_rest):
    """The mixture's per-class terms ``(g, hq)`` from ``delta`` (``native_rows.c``'s
    ``mixture_terms``)."""
    lg = _log1p_unit(_exp(-tl.abs(delta)))
    lg = tl.where(delta != delta, delta, lg)
    g = -(tl.maximum(delta, 0.0) + lg + log_rest)
    hq = -(tl.maximum(-delta, 0.0) + lg + log_beta)
    return g, hq


def _pair(S, ss_r, ss_c, Tt, st_r, st_c, B, V, cs, ct, rest, log_beta, log_rest, power, h,
          TG, W, OUT, out_stride, MODE: tl.constexpr, ENTROPY: tl.constexpr,
          POWER: tl.constexpr, HAS_T: tl.constexpr, HAS_W: tl.constexpr, BF16: tl.constexpr,
          BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < B
    sbase = S + rows[:, None].to(tl.int64) * ss_r
    tbase = Tt + rows[:, None].to(tl.int64) * st_r
    ms = tl.full([BLOCK_R], float("-inf"), tl.float32)
    mt = tl.full([BLOCK_R], float("-inf"), tl.float32)
    nan = tl.zeros([BLOCK_R], tl.int32)
    zs = tl.zeros([BLOCK_R], tl.float32)
    zt = tl.zeros([BLOCK_R], tl.float32)
    c = tl.zeros([BLOCK_R], tl.float32)
    d = tl.zeros([BLOCK_R], tl.float32)
    z1 = tl.zeros([BLOCK_R], tl.float32)
    c2 = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        a = _load(sbase + cols[None, :].to(tl.int64) * ss_c, mask, BF16) * cs
        b = _load(tbase + cols[None, :].to(tl.int64) * st_c, mask, BF16) * ct
        bad = (a != a) | (b != b)
        nan = nan | tl.max(bad.to(tl.int32), 1)
        a = tl.where(mask, a, float("-inf"))
        b = tl.where(mask, b, float("-inf"))
        grown_s = tl.maximum(ms, tl.max(tl.where(a == a, a, float("-inf")), 1))
        grown_t = tl.maximum(mt, tl.max(tl.where(b == b, b, float("-inf")), 1))
        # The sums so far rescaled to the grown maxima (a max still -inf moves by 0: its
        # sums are 0, or the divergence's infinity, which stays).
        ds = tl.where(ms == float("-inf"), 0.0, grown_s - ms)
        dt = tl.where(mt == float("-inf"), 0.0, grown_t - mt)
        rs = _exp(-ds)
        rt = _exp(-dt)
        if MODE == 0:
            c = tl.where(zt == 0.0, c, rt * (c - (dt - ds) * zt))
        if MODE == 1:
            c = tl.where(zs == 0.0, c, rs * (c - (ds - dt) * zs))
        if ENTROPY:
            d = tl.where(zs == 0.0, d, rs * (d - ds * zs))
        if POWER:
            z1 = z1 * _exp(-power * ds)
        zs = zs * rs
        zt = zt * rt
        ms = grown_s
        mt = grown_t
        # While every class so far is -inf, so is this block's: its terms are 0.
        u = a - tl.where(ms == float("-inf"), 0.0, ms)[:, None]
        v = b - tl.where(mt == float("-inf"), 0.0, mt)[:, None]
        ea = _exp(u)
        eb = _exp(v)
        zs += tl.sum(ea, 1)
        zt += tl.sum(eb, 1)
        if MODE == 0:
            c += tl.sum(tl.where(eb == 0.0, 0.0, eb * (v - u)), 1)
        if MODE == 1:
            c += tl.sum(tl.where(ea == 0.0, 0.0, ea * (u - v)), 1)
        if ENTROPY:
            d += tl.sum(tl.where(ea == 0.0, 0.0, ea * u), 1)
        if POWER:
            z1 += tl.sum(_exp(power * u), 1)
    # A NaN logit makes the row's maxima and every sum formed NaN.
    bad = nan != 0
    ms = tl.where(bad, float("nan"), ms)
    mt = tl.where(bad, float("nan"), mt)
    zs = tl.where(bad, float("nan"), zs)
    zt = tl.where(bad, float("nan"), zt)
    c = tl.where(bad, float("nan"), c)
    if ENTROPY:
        d = tl.where(bad, float("nan"), d)
    if POWER:
        z1 = tl.where(bad, float("nan"), z1)
    shift = tl.log(zs) - tl.log(zt) + log_beta - log_rest
    if MODE == 2:
        c, c2 = _mixture_sums(sbase, ss_c, tbase, st_c, rmask, V, cs, ct, ms, mt, shift,
                              log_beta, log_rest, c, c2, BF16, BLOCK_V)  # fmt: skip
    tg = tl.full([BLOCK_R], -1, tl.int64)
    if HAS_T:
        tg = tl.load(TG + rows, mask=rmask, other=-1)
    u_t = _target_u(S, rows, rmask, ss_r, ss_c, tg, ms, cs, BF16)
    tl.store(OUT + rows, ms, mask=rmask)
    tl.store(OUT + out_stride + rows, zs, mask=rmask)
    tl.store(OUT + 2 * out_stride + rows, mt, mask=rmask)
    tl.store(OUT + 3 * out_stride + rows, zt, mask=rmask)
    tl.store(OUT + 4 * out_stride + rows, c, mask=rmask)
    tl.store(OUT + 5 * out_stride + rows, d, mask=rmask)
    tl.store(OUT + 6 * out_stride + rows, z1, mask=rmask)
    tl.store(OUT + 7 * out_stride + rows, u_t, mask=rmask)
    tl.store(OUT + 8 * out_stride + rows, c2, mask=rmask)
    if HAS_W:
        _pair_gradient(sbase, ss_c, tbase, st_c, rows, rmask, V, cs, ct, ms, mt, zs, zt, z1, c,
                       shift, tg, rest, log_beta, log_rest, power, h, W, MODE, POWER, HAS_T, BF16,
                       BLOCK_V)  # fmt: skip


@triton.jit
def _mixture_sums(sbase, ss_c, tbase, st_c, rmask, V, cs, ct, ms, mt, shift, log_beta, log_rest,
                  c, c2, BF16: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """The mixture's two sums over a row pair's classes, a second read of both tiles: its
    log-ratio needs the whole rows' normalisers, known only after the first."""
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        u = _load(sbase + cols[None, :].to(tl.int64) * ss_c, mask, BF16) * cs - ms[:, None]
        v = _load(tbase + cols[None, :].to(tl.int64) * st_c, mask, BF16) * ct - mt[:, None]
        ea = tl.where(mask, _exp(u), 0.0)
        eb = tl.where(mask, _exp(v), 0.0)
        g, hq = _mixture((v - u) + shift[:, None], log_beta, log_rest)
        c += tl.sum(tl.where(ea == 0.0, 0.0, ea * g), 1)
        c2 += tl.sum(tl.where(eb == 0.0, 0.0, eb * hq), 1)
    return c, c2


@triton.jit
def _pair_gradient(sbase, ss_c, tbase, st_c, rows, rmask, V, cs, ct, ms, mt, zs, zt, z1, c, shift,
                   tg, rest, log_beta, log_rest, power, h, W, MODE: tl.constexpr,
                   POWER: tl.constexpr, HAS_T: tl.constexpr, BF16: tl.constexpr,
                   BLOCK_V: tl.constexpr):  # fmt: skip
    """The student's gradient written over its tile, a last read of both tiles, from the
    row statistics the sums formed."""
    w = tl.load(W + rows, mask=rmask, other=0.0)
    # h' (the hard term without a normaliser of its own), the coefficients per row.
    soft = 0.0
    if HAS_T and not POWER:
        soft = h
    a_s = (w / zs)[:, None]
    a_t = (-w / zt)[:, None]
    mu = (c / zs)[:, None]
    a_z = (w * h * power / z1)[:, None]
    at_target = (w * h)[:, None]
    if POWER:
        at_target = at_target * power
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        ptrs = sbase + cols[None, :].to(tl.int64) * ss_c
        u = _load(ptrs, mask, BF16) * cs - ms[:, None]
        v = _load(tbase + cols[None, :].to(tl.int64) * st_c, mask, BF16) * ct - mt[:, None]
        ea = _exp(u)
        if MODE == 0:
            g = a_s * (1.0 + soft) * ea + a_t * _exp(v)
        elif MODE == 1:
            g = tl.where(ea == 0.0, 0.0, a_s * ea * (((u - v) - mu) + soft))
        else:
            gm, _ = _mixture((v - u) + shift[:, None], log_beta, log_rest)
            g = tl.where(ea == 0.0, 0.0, a_s * ea * (rest * (gm - mu) + soft))
        if POWER:
            g += a_z * _exp(power * u)
        g = tl.where(cols[None, :] == tg[:, None], g - at_target, g)
        _store(ptrs, g, mask, BF16)


stats_kernel = _tuned([])(_stats)
grad_kernel = _tuned(["X"])(_grad)
fused_kernel = _tuned(["X"])(_fused)
pair_kernel = _tuned(["S"])(_pair)
