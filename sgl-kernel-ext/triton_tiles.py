"""Triton building blocks shared by the AP MoE and AP linear kernels: weight tiles rebuilt from planes.

A weight tile is W[BN rows, BK inputs] of one expert at its committed bitwidth q, rebuilt in registers
from the q planes the page-table row points to, then fed to `tl.dot`. The tile's columns come out in a
permuted input order (`permuted_position`), and the activations are stored in that order, so no data
movement is spent undoing the bit layout and activation tiles load contiguously.

Binary-coded (bcq) tiles, W = off + sum_p alpha_p * (2 * bit_p - 1), cost 1.5 instructions per weight
and plane: a plane word (32 inputs) is shifted so the bits of inputs s and s + 16 land on the two fp16
sign positions (1 shift), the packed pair (alpha, alpha) has its signs flipped where the bit is 0 (1 LOP3)
and is added to the running pair with one packed half2 add. Plane order is irrelevant to the sum, the
bitwidth q is a run-time value (planes p >= q are neither loaded nor added), and the packed add is the
only instruction that needs inline PTX; USE_ASM=False emulates it with plain Triton ops (the path that
TRITON_INTERPRET=1 runs).

k-means tiles build the q-bit code four inputs per 32-bit register (SWAR: one shift, one AND and one
shift-or per plane word and 4 inputs) and gather W from the per-row LUT.
"""

from __future__ import annotations

import triton
import triton.language as tl

# 0x80008000 as a signed int32: the sign bits of both halves of a packed half2.
_SIGN2 = tl.constexpr(-2147450880)


@triton.jit
def _pack2(v):
    """fp16/bf16 tensor -> int32 holding the value in both halves."""
    b = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _half(a, CD: tl.constexpr):
    """Low 16 bits of an int32 as a CD value."""
    return a.to(tl.int16).to(CD, bitcast=True)


@triton.jit
def _round_bits(f, CD: tl.constexpr):
    """fp32 -> CD rounded to nearest-even, as int32 holding the 16-bit pattern (sign-extended)."""
    if CD == tl.float16:
        r = f.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    else:
        b = f.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16).to(tl.int32)
    return r


@triton.jit
def _add2(a, b, CD: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed add of two half2 (CD = float16 or bfloat16) held in int32 lanes."""
    if USE_ASM:
        if CD == tl.float16:
            r = tl.inline_asm_elementwise(
                "add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            r = tl.inline_asm_elementwise(
                "add.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
    else:
        # add in fp32 and round once to nearest-even, like add.rn: the interpreter's bf16 + bf16 is broken
        # and its fp32 -> bf16 cast truncates (Triton 3.6), so bf16 rounding is done by hand
        lo = _round_bits(_half(a, CD).to(tl.float32) + _half(b, CD).to(tl.float32), CD) & 0xFFFF
        hi = _round_bits(_half(a >> 16, CD).to(tl.float32) + _half(b >> 16, CD).to(tl.float32), CD)
        r = (hi << 16) | lo
    return r


@triton.jit
def permuted_position(k, KIND: tl.constexpr):
    """Tile column that input k (an index into K, K % 32 == 0) occupies: activations are stored permuted
    (the MoE input by the launcher, the w13 -> w2 intermediate by the w13 kernel) so tiles load them
    contiguously. bcq/ubcq: input 32c + 16h + s -> column 32c + 2s + h; kmeans: 32c + 8i + s -> 32c + 4s + i."""
    c = k // 32
    r = k % 32
    if KIND != 1:
        pos = c * 32 + (r % 16) * 2 + r // 16
    else:
        pos = c * 32 + (r % 8) * 4 + r // 8
    return pos


@triton.jit
def plane_pointer(row_ptr, p: tl.constexpr, q):
    """Address of plane p of a row as an int32 pointer (null, never dereferenced, when p >= q)."""
    addr = tl.load(row_ptr + 2 + p, mask=p < q, other=0)
    return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def _words(plane, p: tl.constexpr, q, word_off, mask):
    """[BN, BK/32] int32 words of one plane (no memory traffic when p >= q)."""
    return tl.load(plane + word_off, mask=mask & (p < q), other=0)


@triton.jit
def tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, k0, K, in_range,
               BK: tl.constexpr, P_MAX: tl.constexpr):
    """The plane words of one tile, every load issued before any is used (q loads in flight at once).
    `in_range` (scalar) masks a prefetch past the last K step."""
    c = tl.arange(0, BK // 32)
    word_off = offs_n[:, None].to(tl.int64) * (K // 32) + (k0 // 32 + c)[None, :]
    mask = mask_n[:, None] & in_range
    w0 = _words(p0, 0, q, word_off, mask)
    w1 = _words(p1, 1, q, word_off, mask) if P_MAX > 1 else w0
    w2 = _words(p2, 2, q, word_off, mask) if P_MAX > 2 else w0
    w3 = _words(p3, 3, q, word_off, mask) if P_MAX > 3 else w0
    w4 = _words(p4, 4, q, word_off, mask) if P_MAX > 4 else w0
    w5 = _words(p5, 5, q, word_off, mask) if P_MAX > 5 else w0
    w6 = _words(p6, 6, q, word_off, mask) if P_MAX > 6 else w0
    w7 = _words(p7, 7, q, word_off, mask) if P_MAX > 7 else w0
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _alpha(table_ptr, p: tl.constexpr, q, plane_stride, alpha_off, mask_n, step, CD: tl.constexpr, ROW: tl.constexpr,
           UNIFORM: tl.constexpr):
    """Packed (alpha_p, alpha_p) per row ([BN, 1], ROW) or per (row, word) of the tile; zeros when p >= q.
    UNIFORM (ubcq): alpha_p = step * 2^(q-1-p) from the one float32 scale `step` (exact: a power of two)."""
    if UNIFORM:
        a = tl.where(p < q, step * tl.exp2((q - 1 - p).to(tl.float32)), 0.0)
    elif ROW:
        a = tl.load(table_ptr + p * plane_stride + alpha_off, mask=mask_n & (p < q), other=0.0)[:, None]
    else:
        a = tl.load(table_ptr + p * plane_stride + alpha_off, mask=mask_n[:, None] & (p < q), other=0.0)
    return _pack2(a.to(CD))


@triton.jit
def _bcq_plane_step(acc, p: tl.constexpr, q, words, alpha2, CD: tl.constexpr, USE_ASM: tl.constexpr):
    if p < q:
        shl = 15 - tl.arange(0, 16)
        t = words[:, :, None] << shl[None, None, :]  # bits of inputs s, s+16 -> bits 15, 31
        term = alpha2[:, :, None] ^ (~t & _SIGN2)  # -alpha where the bit is 0
        acc = _add2(acc, term, CD, USE_ASM)
    return acc


@triton.jit
def bcq_tile_from(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n, k0, N, K, G: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, P_MAX: tl.constexpr, CD: tl.constexpr, USE_ASM: tl.constexpr,
                  UNIFORM: tl.constexpr):
    """W[BN, BK] (dtype CD, columns in permuted order) of a binary-coded block at bitwidth q from its words.
    UNIFORM: a ubcq table [2, N, K/G] (scale, offset) instead of bcq's [q + 1, N, K/G] (scales, offset)."""
    ng = K // G
    off_row = 1 if UNIFORM else q
    if BK > G:  # a tile spans several groups: one scale per (row, 32-input word)
        c = tl.arange(0, BK // 32)
        alpha_off = offs_n[:, None] * ng + ((k0 + 32 * c) // G)[None, :]
        off = tl.load(table_ptr + off_row * N * ng + alpha_off, mask=mask_n[:, None], other=0.0)
        step = tl.load(table_ptr + alpha_off, mask=mask_n[:, None], other=0.0).to(tl.float32) if UNIFORM else 0.0
    else:  # one scale per row
        alpha_off = offs_n * ng + k0 // G
        off = tl.load(table_ptr + off_row * N * ng + alpha_off, mask=mask_n, other=0.0)[:, None]
        step = tl.load(table_ptr + alpha_off, mask=mask_n, other=0.0)[:, None].to(tl.float32) if UNIFORM else 0.0
    ps = N * ng
    # all table loads first (one exposed latency per tile, not one per plane)
    a0 = _alpha(table_ptr, 0, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM)
    a1 = _alpha(table_ptr, 1, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 1 else a0
    a2 = _alpha(table_ptr, 2, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 2 else a0
    a3 = _alpha(table_ptr, 3, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 3 else a0
    a4 = _alpha(table_ptr, 4, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 4 else a0
    a5 = _alpha(table_ptr, 5, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 5 else a0
    a6 = _alpha(table_ptr, 6, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 6 else a0
    a7 = _alpha(table_ptr, 7, q, ps, alpha_off, mask_n, step, CD, BK <= G, UNIFORM) if P_MAX > 7 else a0
    # plane 0 always exists (q >= 1): start from off + term_0, no materialized copies of off
    shl = 15 - tl.arange(0, 16)
    term0 = a0[:, :, None] ^ (~(w0[:, :, None] << shl[None, None, :]) & _SIGN2)
    acc = _add2(tl.broadcast_to(_pack2(off.to(CD))[:, :, None], term0.shape), term0, CD, USE_ASM)
    if P_MAX > 1:
        acc = _bcq_plane_step(acc, 1, q, w1, a1, CD, USE_ASM)
    if P_MAX > 2:
        acc = _bcq_plane_step(acc, 2, q, w2, a2, CD, USE_ASM)
    if P_MAX > 3:
        acc = _bcq_plane_step(acc, 3, q, w3, a3, CD, USE_ASM)
    if P_MAX > 4:
        acc = _bcq_plane_step(acc, 4, q, w4, a4, CD, USE_ASM)
    if P_MAX > 5:
        acc = _bcq_plane_step(acc, 5, q, w5, a5, CD, USE_ASM)
    if P_MAX > 6:
        acc = _bcq_plane_step(acc, 6, q, w6, a6, CD, USE_ASM)
    if P_MAX > 7:
        acc = _bcq_plane_step(acc, 7, q, w7, a7, CD, USE_ASM)
    lo = _half(acc, CD)
    hi = _half(acc >> 16, CD)
    return tl.join(lo, hi).reshape(BN, BK)


@triton.jit
def _lut_code_step(code, p: tl.constexpr, q, words):
    if p < q:
        s8 = tl.arange(0, 8)
        code = (code << 1) | ((words[:, :, None] >> s8[None, None, :]) & 0x01010101)
    return code


@triton.jit
def lut_tile_from(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n,
                  BN: tl.constexpr, BK: tl.constexpr, P_MAX: tl.constexpr, CD: tl.constexpr):
    """W[BN, BK] (dtype CD, columns in permuted order) of a k-means block: per-row LUT at the q-bit codes."""
    # code of input 32c + 8i + s sits in byte i of code[n, c, s]; plane 0 is the most significant bit
    code = tl.zeros([BN, BK // 32, 8], dtype=tl.int32)
    code = _lut_code_step(code, 0, q, w0)
    if P_MAX > 1:
        code = _lut_code_step(code, 1, q, w1)
    if P_MAX > 2:
        code = _lut_code_step(code, 2, q, w2)
    if P_MAX > 3:
        code = _lut_code_step(code, 3, q, w3)
    if P_MAX > 4:
        code = _lut_code_step(code, 4, q, w4)
    if P_MAX > 5:
        code = _lut_code_step(code, 5, q, w5)
    if P_MAX > 6:
        code = _lut_code_step(code, 6, q, w6)
    if P_MAX > 7:
        code = _lut_code_step(code, 7, q, w7)
    byte_shift = tl.arange(0, 4) * 8
    codes = (code[:, :, :, None] >> byte_shift[None, None, None, :]) & 0xFF
    lut_row = (offs_n.to(tl.int64) << q)[:, None, None, None]
    w = tl.load(table_ptr + lut_row + codes, mask=mask_n[:, None, None, None], other=0.0)
    return w.to(CD).reshape(BN, BK)


@triton.jit
def tile_from_words(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n, k0, N, K, G: tl.constexpr,
                    KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P_MAX: tl.constexpr,
                    CD: tl.constexpr, USE_ASM: tl.constexpr):
    """KIND: 0 bcq, 1 kmeans, 2 ubcq (weights.KERNEL_KIND)."""
    if KIND == 1:
        w = lut_tile_from(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n, BN, BK, P_MAX, CD)
    else:
        w = bcq_tile_from(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n, k0, N, K, G,
                          BN, BK, P_MAX, CD, USE_ASM, KIND == 2)
    return w


@triton.jit
def weight_tile(p0, p1, p2, p3, p4, p5, p6, p7, q, table_ptr, offs_n, mask_n, k0, N, K, G: tl.constexpr,
                KIND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, P_MAX: tl.constexpr,
                CD: tl.constexpr, USE_ASM: tl.constexpr):
    """Load and rebuild one tile (loads pipelined by Triton when num_stages > 1)."""
    w0, w1, w2, w3, w4, w5, w6, w7 = tile_words(p0, p1, p2, p3, p4, p5, p6, p7, q, offs_n, mask_n, k0, K, True,
                                                BK, P_MAX)
    return tile_from_words(w0, w1, w2, w3, w4, w5, w6, w7, q, table_ptr, offs_n, mask_n, k0, N, K, G,
                           KIND, BN, BK, P_MAX, CD, USE_ASM)


@triton.jit
def load_row(pt_ptr, e, PT_STRIDE):
    """(row pointer, q, table pointer) of page-table row e."""
    row = pt_ptr + e.to(tl.int64) * PT_STRIDE
    q = tl.load(row).to(tl.int32)
    table = tl.load(row + 1).to(tl.pointer_type(tl.float16))
    return row, q, table


@triton.jit
def act_tile(ptr, rows, stride, k0, valid, BK: tl.constexpr):
    """[BK, BM] activation tile of the given rows: loaded row-major (vectorized along k), then transposed."""
    kk = tl.arange(0, BK)
    t = tl.load(ptr + rows[:, None].to(tl.int64) * stride + (k0 + kk)[None, :], mask=valid[:, None], other=0.0)
    return tl.trans(t)


@triton.jit
def tile_dot(w, x, acc, DOT_F32: tl.constexpr):
    """acc += w @ x. DOT_F32 upcasts the operands: Triton 3.6's interpreter computes bf16 dots wrongly."""
    if DOT_F32:
        acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc)
    else:
        acc = tl.dot(w, x, acc)
    return acc
