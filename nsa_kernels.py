"""Triton kernels for the compressed branch, block selection, the sliding window and the decode step, and the pieces
that sel_kernel.py's selection kernels share with them. nsa_attention.py's backend="triton" ("auto" on CUDA) calls the
public functions at the bottom; test_nsa_kernels.py and test_decode.py check them against its reference."""
# Compressed and window attention are one kernel family ("range attention"): query row t reads the keys [lo(t), hi(t))
# of a packed key array; key c is read by the queries [qlo(c), qhi(c)) (the same relation, seen from the key side).
# - compressed: keys are the Tc compressed tokens; lo = first compressed key of t's sequence, hi = lo + visible blocks.
# - window: keys are the raw tokens; lo = max(sequence start, t - w + 1), hi = t + 1.
# Forward and dq are query-centric: one program = BT = M // G tokens x the G heads of one kv group (an [M, D] Q tile,
# token major, so every key tile is loaded once for the whole group). dk/dv is key-centric: one program = BN keys of
# one kv head walking the queries that read them (split into token chunks when keys are few); no atomics, so the
# backward is deterministic. Steps that every row reads in full skip the mask. Softmax in base 2, lse stored fp32
# (natural log). Key tiles come as TMA boxes where tma_boxes applies (Hopper): a masked step then reads its BN keys
# whole, and keys no row of the tile reads get probability 0, exact for finite values; by pointers (other GPUs, and
# the compressed keys of var-length input, whose padding is never read) it reads none past the tile's last key.
#
# Block selection (Eq. 8-10) streams the compressed keys again with the compressed branch's lse: per chunk of NP
# selection blocks (causally masked only where a token of the tile does not see the whole chunk) it computes p_cmp
# [BT*BG, BKC] (heads padded to BG, rows in the order _head_rows gives, so that each thread sums its token's heads
# mostly by itself), sums the group's heads (Eq. 10), maps compressed to selection blocks with the overlap weights
# (Eq. 9: two weighted sums over each selection block's columns; a carry holds the part of the last compressed blocks
# that spills into the next chunk), packs (score bits, -j) into one int64 and merges it into a running sorted top-NP
# list (bitonic merge: the top-NP of two sorted lists is max(a_desc, b_asc)). Only the (B, T, H, n) int32 indices are
# written. On Hopper from G = 8 (_ws_select_applies) a warp-specialised kernel writes the block scores instead, for
# windows of tokens, and _ws_top_kernel merges them into the top n the same way, one token a thread (the merge off
# the tensor cores' path).
#
# Decode: one query token per row over nsa_attention.nsa_cache in four launches (see "decode kernels" below).
# The file reads: shared pieces -> range attention kernels -> their Hopper versions (Gluon) -> selection kernel ->
# decode kernels -> host launchers -> torch.library ops -> public functions. Ops: nsa::range_attn_fwd / _bwd,
# nsa::select, nsa::decode.
import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

# launch parameters: M = query rows (whole tokens x their G heads, packed) per program, BN = keys per step (dk/dv:
# BN keys per program, M query rows per step); picked on one H100 by bench.py's layer-mode sweep at T = 65536, HQ = 64
# (G = 16), H = 4, D = 128, bf16 (dq: at 8k too, with its key tiles as boxes). For G < SMALL_G the "*_small_g" entries
# replace them (the same sweep, gated, at HQ = 16 and at Track B's shape, T = 8192), and for heads at most SMALL_D
# wide the "*_small_d" ones (Track B's shape: D = 64; launch_entry); in the forward's and dq's, maxnreg (Triton's cap
# on registers per thread) fits four blocks per multiprocessor instead of three without spilling (it spills at
# D = 128).
# "select": 256 rows (G = 16: 16 tokens) share each compressed key tile, in 4 warps, at every G from 8; below, 32
# tokens a tile, at least 64 rows (picked on one H200 by a sweep of rows and stages at T = 16k and 64k, G = 1..32:
# RESULTS, "Block selection's Eq. 9 as sums, and one tile layout at every G"); its third stage only where two
# programs still share a multiprocessor (SELECT_SMEM_PAIR: at G = 16 and 32, not at G = 8).
CONFIG = {
    "fwd": dict(M=128, BN=64, num_warps=4, num_stages=2),
    "fwd_small_g": dict(M=64, BN=64, num_warps=4, num_stages=2),
    "fwd_small_d": dict(M=64, BN=64, num_warps=4, num_stages=2, maxnreg=128),
    "dq": dict(M=64, BN=64, num_warps=4, num_stages=2),
    "dq_small_d": dict(M=64, BN=64, num_warps=4, num_stages=2, maxnreg=128),
    "dkv": dict(M=64, BN=64, num_warps=4, num_stages=2),
    "dkv_few": dict(M=128, BN=64, num_warps=8, num_stages=2),  # "dkv" on grids below DKV_FEW_PROGRAMS programs
    "dkv_small_d": dict(M=64, BN=64, num_warps=4, num_stages=3),
    "select": dict(M=256, num_warps=4, num_stages=3),
    "select_small_g": dict(tokens=32, num_warps=4, num_stages=3),  # tokens per program, >= 64 rows
}
SMALL_G = 8
SELECT_SMEM = 176 * 1024  # "select": bytes of its tiles at most (_select_smem) (a Hopper block has 227 KiB of shared
#                           memory; the kernel's reductions took up to 32 KiB more in the shapes that failed)
SELECT_SMEM_PAIR = 113 * 1024  # "select": two programs share a Hopper multiprocessor (228 KiB, 1 KiB a block
#                                reserved) up to this many bytes each (_select_smem)
SELECT_WS_MIN_G = 8  # block selection on Hopper takes _ws_score_kernel from this G (at G = 4 it was slower, RESULTS)
SELECT_SCORE_BYTES = 2 ** 29  # and its block scores are held for windows of tokens of at most this many bytes
SMALL_D = 64  # heads at most this wide (max(D, Dv)) take the "*_small_d" entries, here and in sel_kernel.py
DKV_CHUNK = 256  # compressed dk/dv: fewest tokens per query chunk, and the grid aims at DKV_PROGRAMS programs
DKV_PROGRAMS = 2048
DKV_FEW_PROGRAMS = 256  # range dk/dv grids below this (about two 4-warp programs per H100 SM) take "dkv_few"
# Hopper (_ws_applies): the forward and dq of both range branches (not with var-length input) and their dk/dv take
# the warp-specialised kernels ("range attention on Hopper" below), where they were faster or tied on one H100 and one
# H200 (T = 8k-64k, G = 4 and 16; the window's dk/dv, whose consumers skip the steps their keys do not read, from
# G = 2 on an H200: slower at G = 1), as do two of sel_kernel.py's kernels; HOPPER_WS = False keeps Triton's
# everywhere (bench.py --hopper_ws)
HOPPER_WS = True
# launch settings of the decode kernels: programs = split-K target of the compressed kernel, cmp_keys = compressed
# keys per tile, window_keys = ring slots per window program, score_blocks = selection blocks per score program,
# attend_blocks = selected blocks per attend program (one gathered tile), *_warps / cmp_stages = Triton options (the
# combine kernel loads all partials of a head at once and takes one warp per 4096 of them). Picked by a sweep of one
# decode step on one H100 (S = 64k and 128k, B = 8, HQ = 64, H = 4, D = 128, bf16).
DECODE_CONFIG = dict(programs=512, cmp_keys=64, cmp_warps=4, cmp_stages=3, window_keys=64, score_blocks=32,
                     score_warps=4, attend_blocks=2, attend_warps=8)
INT_MAX = tl.constexpr(2 ** 31 - 1)  # "no key" sentinel and the low word of the packed selection keys


# ----------------------------------------------------------------------------------------------------------------
# shared pieces, used by the kernels of this file and of sel_kernel.py: the rows of a packed [M, D] query tile, row
# loads and stores, the online-softmax step, and on the host the head sizes, token positions, packing
# and the registration of an attention op with its backward

@triton.jit
def group_rows(M: tl.constexpr, G: tl.constexpr):
    """The M rows of a query tile packed as (item, query head of the kv group): row r is item r // G (a token, or a
    reverse-index pair) and head r % G, so a non-power-of-2 G wastes only the M % G rows past the last whole item.
    Returns the item and head of each row and the rows that are not that padding."""
    r = tl.arange(0, M)
    return r // G, r % G, r < M // G * G


@triton.jit
def tile_rows(t_r, g_r, m_t, i_h, H: tl.constexpr, G: tl.constexpr):
    """Row addressing of a query tile: t_r, g_r [M] the token and head in the group of each row (g_r >= G: padding),
    m_t: the rows that are real. Returns the row mask, the token offset token * HQ (int64: T * HQ * D may pass
    2^31) and the query head of each row: row t_off + hq_r of a (tokens, HQ, ...) array."""
    return m_t & (g_r < G), t_r.to(tl.int64) * (H * G), i_h * G + g_r


@triton.jit
def load_rows(ptr, rows, m, D: tl.constexpr, BD: tl.constexpr):
    """[R, BD] tile of rows `rows` (R,) of a row-major (..., D) array; 0 where m is false or past D."""
    o_d = tl.arange(0, BD)
    return tl.load(ptr + rows.to(tl.int64)[:, None] * D + o_d[None, :], mask=m[:, None] & (o_d < D)[None, :],
                   other=0.)


@triton.jit
def store_rows(ptr, rows, m, x, D: tl.constexpr, BD: tl.constexpr):
    """Stores the [R, BD] tile x (converted to ptr's dtype) into rows `rows` (R,) of a row-major (..., D) array."""
    o_d = tl.arange(0, BD)
    tl.store(ptr + rows.to(tl.int64)[:, None] * D + o_d[None, :], x.to(ptr.dtype.element_ty),
             mask=m[:, None] & (o_d < D)[None, :])


@triton.jit
def key_rows(k, k0, k_end, i_h, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr,
             BOXES: tl.constexpr):
    """[BN, BD] tile of the packed keys (or values) k0 .. k0 + BN - 1 of kv head i_h: with BOXES (a tma_boxes
    descriptor of [BN, 1, BD]) one box, all BN rows (zeros past the array's end); else by pointers, zeros from row
    k_end on."""
    if BOXES:
        b_k = k.load([k0, i_h, 0]).reshape(BN, BD)
    else:
        c = k0 + tl.arange(0, BN)
        b_k = load_rows(k, c.to(tl.int64) * H + i_h, c < k_end, D, BD)
    return b_k


@triton.jit
def key_tile(k, v, k0, k_end, i_h, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
             BDV: tl.constexpr, BN: tl.constexpr, BOXES: tl.constexpr):
    """K [BN, BD] and V [BN, BDV] of the packed keys k0 .. k0 + BN - 1 of kv head i_h (key_rows)."""
    return key_rows(k, k0, k_end, i_h, H, D, BD, BN, BOXES), key_rows(v, k0, k_end, i_h, H, DV, BDV, BN, BOXES)


@triton.jit
def softmax_rescale(b_s, m_i, scale):
    """The online softmax (base 2) meets one more key tile: b_s [M, BN] scores before the scale (> 0: the scale is
    one multiply-add with the max in the exponent, as in flash attention), -inf where masked; m_i [M] the running
    max, scaled. Returns the new max, alpha [M] (the factor of the old sum and accumulator) and p [M, BN]. A row with
    no key yet keeps max -inf and p = 0."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1) * scale)
    m_use = tl.where(m_new == float("-inf"), 0., m_new)
    alpha = tl.exp2(m_i - m_use)
    return m_new, alpha, tl.exp2(b_s * scale - m_use[:, None])


@triton.jit
def softmax_step(b_s, scale, b_v, m_i, l_i, acc):
    """One online-softmax step over a key tile: scores b_s [M, BN] before the scale (-inf where masked), values b_v
    [BN, BDV]; the running max m_i, sum l_i [M] and fp32 accumulator acc [M, BDV] are rescaled and extended."""
    m_new, alpha, b_p = softmax_rescale(b_s, m_i, scale)                                  # b_p [M, BN]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)                           # [M, BDV]
    return m_new, l_i, acc


@triton.jit
def softmax_finish(m_i, l_i, acc):
    """o = acc / l (0 for a row that read no key) and the base-2 lse (-inf there)."""
    l_safe = tl.where(l_i == 0., 1., l_i)
    return acc * (1. / l_safe)[:, None], tl.where(l_i == 0., float("-inf"), m_i + tl.log2(l_safe))


@triton.jit
def gate_rows(gate, rows, m, GATED: tl.constexpr):
    """The gate weight [M] of each row (gate: fp32, one value per (token, query head) row; 1 without a gate). The
    helpers below take it, so a kernel loads it once, where it likes (the Hopper dq a tile ahead)."""
    if GATED:
        return tl.load(gate + rows, mask=m, other=1.)
    else:
        return tl.where(m, 1., 1.)


@triton.jit
def gate_out(b_o, g, GATED: tl.constexpr):
    """A branch's output tile [M, BDV] times its rows' gate weights g (Eq. 5 applied by the branch kernel, so the mix
    is a plain sum); b_o as it is without a gate."""
    if GATED:
        b_o = b_o * g[:, None]
    return b_o


@triton.jit
def gate_lse(b_lse, g, GATED: tl.constexpr):
    """The base-2 lse [M] the backward reads for a gated output: p = 2^(s - (lse - log2 g)) = g * p, so its dv and ds
    are those of g * o_branch with the incoming do as it is (no g * do tensor); p = 0 where g = 0."""
    if GATED:
        b_lse = tl.where(g > 0, b_lse - tl.log2(tl.where(g > 0, g, 1.)), float("inf"))
    return b_lse


@triton.jit
def gate_delta(b_delta, g, GATED: tl.constexpr):
    """The backward's delta [M] of a gated output o = g * o_branch: rowsum(o * do) / g = rowsum(o_branch * do),
    which is also dL/dg (0 where g = 0, where a softmax or sigmoid gate passes no gradient to its logits anyway)."""
    if GATED:
        b_delta = tl.where(g > 0, b_delta / tl.where(g > 0, g, 1.), 0.)
    return b_delta


@triton.jit
def cmp_seen(p, A, BB, TC):
    """Compressed keys a query at position p reads (A = l, BB = d, TC = the sequence's compressed keys): blocks i
    with i*d + l - 1 <= p."""
    return tl.minimum(tl.where(p + 1 < A, 0, (p + 1 - A) // BB + 1), TC)


def head_sizes(HQ, H, D, DV):
    """The kernels' head constexprs: G = HQ / H query heads per kv head; BD, BDV = D, Dv padded to powers of 2 (at
    least 16 for tl.dot)."""
    return dict(H=H, G=HQ // H, D=D, DV=DV, BD=max(16, triton.next_power_of_2(D)),
                BDV=max(16, triton.next_power_of_2(DV)))


def tile_m(rows, G):
    """Rows M of a packed query tile (group_rows): `rows` (a power of 2), or one group's padded to a power of 2 if
    more; the tile holds M // G tokens (or pairs)."""
    return max(rows, triton.next_power_of_2(G))


def sequences(B, T, cu_seqlens, device):
    """Packed token layout: cu (N+1,) int64 offsets, seq (B*T,) the sequence of each token and pos (B*T,) its position
    inside it. Without cu_seqlens the B rows are B sequences of length T. No host sync."""
    t = torch.arange(B * T, device=device)
    if cu_seqlens is None:
        return torch.arange(B + 1, device=device) * T, t // T, t % T
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], t, right=True)
    return cu, seq, t - cu[seq]


def pack(x):
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()   # (B, T, ...) -> (B*T, ...)


def tma_boxes(x, y, box_x, box_y):
    """x, y: packed (N, H, D) arrays, as tensor descriptors whose loads are boxes of box_x / box_y elements (e.g.
    [BN, 1, D]: BN consecutive keys of one head; zeros past the arrays' ends), read by TMA on Hopper, and True; or x,
    y themselves and False where boxes do not apply to both (a GPU before Hopper, rows not 16-byte aligned, no
    rows): the kernels then load by pointers."""
    def aligned(a):
        return a.numel() > 0 and a.data_ptr() % 16 == 0 and a.stride(1) * a.element_size() % 16 == 0
    if not (aligned(x) and aligned(y)) or (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9):
        return x, y, False
    return (TensorDescriptor(x, list(x.shape), list(x.stride()), box_x),
            TensorDescriptor(y, list(y.shape), list(y.stride()), box_y), True)


def _ws_applies(q, k, v, *rows):
    """Whether the warp-specialised kernels take these packed q (NT, HQ, D), k (NK, H, D), v (NK, H, Dv) (and rows
    such as do, o): Hopper, 16-bit, D = Dv = 64 or 128, G a power of 2 up to 64, keys, 16-byte aligned for TMA."""
    G = q.shape[1] // k.shape[1]
    return (HOPPER_WS and q.is_cuda and k.shape[0] > 0 and torch.cuda.get_device_capability(q.device)[0] == 9 and
            q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] == v.shape[2] in (64, 128) and
            G & (G - 1) == 0 and G <= 64 and all(x.data_ptr() % 16 == 0 for x in (q, k, v, *rows)))


def _ws_rows_apply(geo):
    """Whether the warp-specialised forward and dq take these rows (_ranges' geo): not with var-length input (its
    compressed padding keys may hold NaN, which a key tile read whole would carry into o and dq through 0 * NaN)."""
    return not geo["VARLEN"]


@functools.cache
def _sm_count(device):
    """Multiprocessors of a CUDA device: the persistent kernels' grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def _ws_desc(x, box, shape=None, strides=None):
    """A Gluon TMA descriptor of x (or of the view of x's memory with these shape and strides) whose loads are boxes
    of `box` elements (zeros past x's end)."""
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16)
    return GluonDescriptor(x, shape or list(x.shape), strides or list(x.stride()), box, layout)


def pack_gate(gate):
    """gate (B, T, HQ) -> (B*T, HQ) fp32 for the kernels (None stays None: no gate)."""
    return None if gate is None else pack(gate.float())


def gate_grad(delta, gate):
    """An op's dgate: the backward's delta (fp32, one value per row, = rowsum(o_branch * do) with a gate) in the
    gate's shape and dtype, or an empty tensor without a gate (an op returns tensors)."""
    return delta.new_empty(0) if gate is None else delta.view_as(gate).to(gate.dtype)


def attention_op(name, fwd, bwd):
    """Registers fwd(q, k, v, gate, *args) -> (o (B, T, HQ, Dv), lse (B, T, HQ) fp32) as the op nsa::{name}_fwd and
    bwd(do, q, k, v, gate, o, lse, *args) -> (dq, dk, dv, dgate) as nsa::{name}_bwd (schemas from their
    annotations): opaque to torch.compile (fakes give the shapes), autograd from one to the other (lse has no
    gradient). gate (B, T, HQ) or None: o is the branch's output times it per row, and dgate its gradient ((0,)
    without a gate). Returns both ops."""
    fwd_op = torch.library.custom_op(f"nsa::{name}_fwd", fwd, mutates_args=())
    bwd_op = torch.library.custom_op(f"nsa::{name}_bwd", bwd, mutates_args=())

    @fwd_op.register_fake
    def _(q, k, v, gate, *args):
        B, T, HQ, _ = q.shape
        return q.new_empty(B, T, HQ, v.shape[3]), q.new_empty(B, T, HQ, dtype=torch.float32)

    @bwd_op.register_fake
    def _(do, q, k, v, gate, *args):
        dgate = q.new_empty(0, dtype=torch.float32) if gate is None else torch.empty_like(gate)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dgate

    def setup_context(ctx, inputs, output):
        q, k, v, gate, *args = inputs
        ctx.mark_non_differentiable(output[1])
        # each arg: a tensor (or None, for Optional[Tensor]) is saved; a list of tensors is saved flat, its length
        # kept; anything else is kept as it is
        ctx.kinds = ["tensor" if a is None or isinstance(a, torch.Tensor) else len(a) if isinstance(a, list)
                     else "const" for a in args]
        saved = [[a] if kind == "tensor" else a if isinstance(kind, int) else [] for a, kind in zip(args, ctx.kinds)]
        ctx.save_for_backward(q, k, v, gate, *output, *[t for ts in saved for t in ts])
        ctx.consts = [a for a, kind in zip(args, ctx.kinds) if kind == "const"]

    def backward(ctx, do, dlse):
        q, k, v, gate, o, lse, *tensors = ctx.saved_tensors
        tensors, consts = iter(tensors), iter(ctx.consts)
        args = [next(tensors) if kind == "tensor" else next(consts) if kind == "const"
                else [next(tensors) for _ in range(kind)] for kind in ctx.kinds]
        dq, dk, dv, dgate = bwd_op(do.contiguous(), q, k, v, gate, o, lse, *args)
        return dq, dk, dv, (None if gate is None else dgate), *[[None] * kind if isinstance(kind, int) else None
                                                                  for kind in ctx.kinds]

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op, bwd_op


# ----------------------------------------------------------------------------------------------------------------
# key ranges: packed arrays with var-length input, else computed here (no per-call index tensors to build).
# KIND 0 = compressed (A = l, BB = d; keys are the SEQ_TK compressed tokens of each length-SEQ_T row),
# KIND 1 = window (A = w; keys are the raw tokens).

@triton.jit
def _range(x, m, lo, hi, KIND: tl.constexpr, VARLEN: tl.constexpr, SEQ_T, SEQ_TK, A, BB, FROM_KEY: tl.constexpr):
    """[lo, hi) for each x (empty where m is false): the keys query token x reads, or with FROM_KEY the query tokens
    that read key x (the same relation, seen from the key side)."""
    if VARLEN:
        b_lo = tl.load(lo + x, mask=m, other=INT_MAX)
        b_hi = tl.load(hi + x, mask=m, other=0)
    else:
        if not FROM_KEY:                                  # query token x at position p of row s
            s, p = x // SEQ_T, x % SEQ_T
            if KIND == 0:
                b_lo = s * SEQ_TK
                b_hi = b_lo + cmp_seen(p, A, BB, SEQ_TK)
            else:
                b_lo = tl.maximum(s * SEQ_T, x - A + 1)
                b_hi = x + 1
        elif KIND == 0:                                   # compressed key x of row s
            s = x // SEQ_TK
            b_lo = s * SEQ_T + (x % SEQ_TK) * BB + A - 1
            b_hi = (s + 1) * SEQ_T
        else:                                             # raw key x
            b_lo = x
            b_hi = tl.minimum((x // SEQ_T + 1) * SEQ_T, x + A)
        b_lo = tl.where(m, b_lo, INT_MAX)
        b_hi = tl.where(m, b_hi, 0)
    return b_lo, b_hi


@triton.jit
def _key_tile(i_k, r, NK, VARLEN: tl.constexpr, SEQ_T, SEQ_TK, BN: tl.constexpr):
    """Key tile i_k of BN keys for the dk/dv kernels: the ids c of its keys r (offsets in the tile), which are real
    (m), its first key and the first token of its row (its query chunks start there). Var-length: BN keys of the
    packed keys; else BN keys of one row (SEQ_TK keys, SEQ_T tokens each)."""
    if VARLEN:
        c0 = i_k * BN
        m = c0 + r < NK
        q0 = 0
    else:
        n_kt = tl.cdiv(SEQ_TK, BN)
        c0 = (i_k // n_kt) * SEQ_TK + (i_k % n_kt) * BN
        m = (i_k % n_kt) * BN + r < SEQ_TK
        q0 = (i_k // n_kt) * SEQ_T
    return c0 + r, m, c0, q0


# ----------------------------------------------------------------------------------------------------------------
# range attention forward: o = softmax(scale * q k^T) v over keys [lo[t], hi[t]), base-2 softmax, fp32 accumulate

@triton.jit
def _read_by_all(lo, hi, valid):
    """[f_lo, f_hi): the keys every valid row reads (lo, hi: per-row ranges, valid: the rows that count); a step
    inside it needs no mask."""
    return tl.max(tl.where(valid, lo, -1), 0), tl.min(tl.where(valid, hi, INT_MAX), 0)


@triton.jit
def _in_ranges(x, lo, hi):
    """[rows, cols] mask: column value x[j] lies in row i's range [lo[i], hi[i])."""
    return (x[None, :] >= lo[:, None]) & (x[None, :] < hi[:, None])


@triton.jit
def _split(lo, hi, valid, BN: tl.constexpr):
    """Cut [min lo, max hi) into [start, a) masked, [a, b) unmasked (every valid row reads every key of each BN-step,
    aligned on start), [b, end) masked. lo, hi: per-row ranges, valid: the rows that count."""
    start, end = tl.min(lo, 0), tl.max(hi, 0)
    f_lo, f_hi = _read_by_all(lo, hi, valid)
    a = tl.minimum(start + (tl.maximum(f_lo - start, 0) + BN - 1) // BN * BN, end)
    b = a + tl.maximum(tl.minimum(f_hi, end) - a, 0) // BN * BN
    return start, a, b, end


@triton.jit
def _fwd_loop(b_q, k, v, m_i, l_i, acc, b_lo, b_hi, k_from, k_to, k_end, scale_log2, i_h,
              H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
              BN: tl.constexpr, MASK: tl.constexpr, BOXES: tl.constexpr):
    o_n = tl.arange(0, BN)
    for k0 in range(k_from, k_to, BN):
        c = k0 + o_n                                                                      # [BN] key ids
        b_k, b_v = key_tile(k, v, k0, k_end, i_h, H, D, DV, BD, BDV, BN, BOXES)          # [BN, BD], [BN, BDV]
        b_s = tl.dot(b_q, tl.trans(b_k))                                                  # [M, BN]
        if MASK:
            b_s = tl.where(_in_ranges(c, b_lo, b_hi), b_s, float("-inf"))
        m_i, l_i, acc = softmax_step(b_s, scale_log2, b_v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _range_fwd_kernel(q, k, v, o, lse, gate, lo, hi, scale_log2, NT,
                      KIND: tl.constexpr, VARLEN: tl.constexpr, SEQ_T, SEQ_TK, A, BB,
                      H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                      D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                      BOXES: tl.constexpr, GATED: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    BT: tl.constexpr = M // G                                                             # tokens per tile
    p_r, g_r, m_g = group_rows(M, G)
    t_r = i_t * BT + p_r                                                                  # [M] token of each row
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_g & (t_r < NT), i_h, H, G)
    b_lo, b_hi = _range(t_r, m_r, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)   # [M] key ranges
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                                          # [M, BD]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    k0, ka, kb, k_end = _split(b_lo, b_hi, m_r, BN)
    m_i, l_i, acc = _fwd_loop(b_q, k, v, m_i, l_i, acc, b_lo, b_hi, k0, ka, k_end, scale_log2, i_h,
                              H, D, DV, BD, BDV, BN, MASK=True, BOXES=BOXES)
    m_i, l_i, acc = _fwd_loop(b_q, k, v, m_i, l_i, acc, b_lo, b_hi, ka, kb, k_end, scale_log2, i_h,
                              H, D, DV, BD, BDV, BN, MASK=False, BOXES=BOXES)
    m_i, l_i, acc = _fwd_loop(b_q, k, v, m_i, l_i, acc, b_lo, b_hi, kb, k_end, k_end, scale_log2, i_h,
                              H, D, DV, BD, BDV, BN, MASK=True, BOXES=BOXES)
    b_o, b_lse = softmax_finish(m_i, l_i, acc)
    store_rows(o, t_off + hq_r, m_r, gate_out(b_o, gate_rows(gate, t_off + hq_r, m_r, GATED), GATED), DV, BDV)
    tl.store(lse + t_off + hq_r, b_lse * 0.6931471805599453, mask=m_r)                    # natural log


# ----------------------------------------------------------------------------------------------------------------
# range attention backward: dq (query-centric; also writes delta = rowsum(o * do)), then dk/dv (key-centric)

@triton.jit
def _dq_loop(b_q, b_do, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, k_from, k_to, k_end, scale_log2, i_h,
             H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
             BN: tl.constexpr, MASK: tl.constexpr, BOXES: tl.constexpr):
    o_n = tl.arange(0, BN)
    for k0 in range(k_from, k_to, BN):
        c = k0 + o_n
        b_k, b_v = key_tile(k, v, k0, k_end, i_h, H, D, DV, BD, BDV, BN, BOXES)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2                                     # [M, BN]
        b_p = tl.exp2(b_s - b_lse[:, None])
        if MASK:
            b_p = tl.where(_in_ranges(c, b_lo, b_hi), b_p, 0.)
        b_dp = tl.dot(b_do, tl.trans(b_v))                                                # [M, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)                                           # [M, BD]
    return b_dq


@triton.jit
def _range_bwd_dq_kernel(q, k, v, o, do, lse, lse2, delta, dq, gate, lo, hi, scale_log2, scale, NT,
                         KIND: tl.constexpr, VARLEN: tl.constexpr, SEQ_T, SEQ_TK, A, BB,
                         H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                         D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                         BOXES: tl.constexpr, GATED: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    p_r, g_r, m_g = group_rows(M, G)
    t_r = i_t * (M // G) + p_r
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_g & (t_r < NT), i_h, H, G)
    b_lo, b_hi = _range(t_r, m_r, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                                          # [M, BD]
    b_do = load_rows(do, t_off + hq_r, m_r, DV, BDV)                                      # [M, BDV]
    b_o = load_rows(o, t_off + hq_r, m_r, DV, BDV)
    b_g = gate_rows(gate, t_off + hq_r, m_r, GATED)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)                        # [M]
    b_delta = gate_delta(b_delta, b_g, GATED)
    tl.store(delta + t_off + hq_r, b_delta, mask=m_r)
    b_lse = tl.load(lse + t_off + hq_r, mask=m_r, other=0.) * 1.4426950408889634          # base 2
    b_lse = gate_lse(tl.where(b_lse == float("-inf"), 0., b_lse), b_g, GATED)            # no key: masked
    tl.store(lse2 + t_off + hq_r, b_lse, mask=m_r)                                        # for the dk/dv kernel
    b_dq = tl.zeros([M, BD], tl.float32)
    k0, ka, kb, k_end = _split(b_lo, b_hi, m_r, BN)
    b_dq = _dq_loop(b_q, b_do, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, k0, ka, k_end, scale_log2, i_h,
                    H, D, DV, BD, BDV, BN, MASK=True, BOXES=BOXES)
    b_dq = _dq_loop(b_q, b_do, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, ka, kb, k_end, scale_log2, i_h,
                    H, D, DV, BD, BDV, BN, MASK=False, BOXES=BOXES)
    b_dq = _dq_loop(b_q, b_do, b_lse, b_delta, b_dq, k, v, b_lo, b_hi, kb, k_end, k_end, scale_log2, i_h,
                    H, D, DV, BD, BDV, BN, MASK=True, BOXES=BOXES)
    store_rows(dq, t_off + hq_r, m_r, b_dq * scale, D, BD)


@triton.jit
def _dkv_loop(b_k, b_v, b_dk, b_dv, q, do, lse, delta, b_qlo, b_qhi, t_from, t_to, t_end, scale_log2, i_h,
              H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
              DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, MASK: tl.constexpr):
    p_r, g_r, m_g = group_rows(M, G)
    for t0 in range(t_from, t_to, M // G):
        t_r = t0 + p_r                                                                    # [M] query tokens
        m_r, t_off, hq_r = tile_rows(t_r, g_r, m_g & (t_r < t_end), i_h, H, G)
        b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                                      # [M, BD]
        b_do = load_rows(do, t_off + hq_r, m_r, DV, BDV)                                  # [M, BDV]
        b_lse = tl.load(lse + t_off + hq_r, mask=m_r, other=0.)                           # base 2, gated
        b_delta = tl.load(delta + t_off + hq_r, mask=m_r, other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2                                     # [M, BN]
        if MASK:
            m_s = m_r[:, None] & (t_r[:, None] >= b_qlo[None, :]) & (t_r[:, None] < b_qhi[None, :])
            b_p = tl.where(m_s, tl.exp2(b_s - b_lse[:, None]), 0.)
        else:                                             # padding rows have q = do = 0: they add nothing
            b_p = tl.exp2(b_s - b_lse[:, None])
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)                                # [BN, BDV]
        b_dp = tl.dot(b_do, tl.trans(b_v))                                                # [M, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        if MASK:                                          # where, not 0 * dp: an unread key may hold NaN
            b_ds = tl.where(m_s, b_ds, 0.)
        b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q)                                 # [BN, BD]
    return b_dk, b_dv


@triton.jit
def _range_bwd_dkv_kernel(q, k, v, do, lse, delta, dk, dv, qlo, qhi, scale_log2, scale, NK, QCH,
                          KIND: tl.constexpr, VARLEN: tl.constexpr, SEQ_T, SEQ_TK, A, BB,
                          H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                          D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr):
    """One program: BN keys x the queries of token chunk i_q ([i_q*QCH, (i_q+1)*QCH) of the keys' row, or of all
    tokens with var-length input); with several chunks dk/dv are fp32 partials (NQC, NK, H, D) that the launcher
    sums in chunk order."""
    i_k, i_q, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, m_k, _, q0 = _key_tile(i_k, tl.arange(0, BN), NK, VARLEN, SEQ_T, SEQ_TK, BN)                # [BN] key ids
    b_qlo, b_qhi = _range(c, m_k, qlo, qhi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=True)  # [BN] query ranges
    k_off = c.to(tl.int64) * H + i_h
    b_k = load_rows(k, k_off, m_k, D, BD)                                                 # [BN, BD]
    b_v = load_rows(v, k_off, m_k, DV, BDV)                                               # [BN, BDV]
    b_dk = tl.zeros([BN, BD], tl.float32)
    b_dv = tl.zeros([BN, BDV], tl.float32)
    c_lo = tl.maximum(b_qlo, q0 + i_q * QCH)              # this program's token chunk
    c_hi = tl.minimum(b_qhi, q0 + (i_q + 1) * QCH)
    t0, ta, tb, t_end = _split(c_lo, c_hi, m_k, M // G)                                 # steps of M // G tokens
    b_dk, b_dv = _dkv_loop(b_k, b_v, b_dk, b_dv, q, do, lse, delta, b_qlo, b_qhi, t0, ta, t_end, scale_log2, i_h,
                           H, G, M, D, DV, BD, BDV, MASK=True)
    tr = ta
    if KIND == 1:  # window: neighbouring key tiles read the same queries from starts BN tokens apart, and L2
        # evicts them in between; so the unmasked steps begin at a phase all programs share (iteration i reads the
        # step that is i modulo the step count), and overlapping ranges read each query tile in the same iteration
        n_mid = tl.maximum((tb - ta) // (M // G), 1)
        tr = ta + (n_mid - (ta // (M // G)) % n_mid) % n_mid * (M // G)
    b_dk, b_dv = _dkv_loop(b_k, b_v, b_dk, b_dv, q, do, lse, delta, b_qlo, b_qhi, tr, tb, t_end, scale_log2, i_h,
                           H, G, M, D, DV, BD, BDV, MASK=False)
    b_dk, b_dv = _dkv_loop(b_k, b_v, b_dk, b_dv, q, do, lse, delta, b_qlo, b_qhi, ta, tr, t_end, scale_log2, i_h,
                           H, G, M, D, DV, BD, BDV, MASK=False)
    b_dk, b_dv = _dkv_loop(b_k, b_v, b_dk, b_dv, q, do, lse, delta, b_qlo, b_qhi, tb, t_end, t_end, scale_log2,
                           i_h, H, G, M, D, DV, BD, BDV, MASK=True)
    p_off = i_q.to(tl.int64) * NK * H + k_off
    store_rows(dk, p_off, m_k, b_dk * scale, D, BD)
    store_rows(dv, p_off, m_k, b_dv, DV, BDV)


@triton.jit
def _range_sum_chunks_kernel(dk_part, dv_part, dk, dv, NQC, NK_D, NK_DV, BE: tl.constexpr):
    """dk, dv = the dk/dv kernel's NQC fp32 chunk partials summed in chunk order, cast to dk's / dv's dtype; one
    program = BE elements of each (one launch for both, instead of a sum and a cast per tensor)."""
    e = tl.program_id(0).to(tl.int64) * BE + tl.arange(0, BE)
    m_k, m_v = e < NK_D, e < NK_DV
    b_dk = tl.zeros([BE], tl.float32)
    b_dv = tl.zeros([BE], tl.float32)
    for i_q in range(NQC):
        b_dk += tl.load(dk_part + i_q * NK_D + e, mask=m_k, other=0.)
        b_dv += tl.load(dv_part + i_q * NK_DV + e, mask=m_v, other=0.)
    tl.store(dk + e, b_dk.to(dk.dtype.element_ty), mask=m_k)
    tl.store(dv + e, b_dv.to(dv.dtype.element_ty), mask=m_v)


# ----------------------------------------------------------------------------------------------------------------
# range attention on Hopper: warp-specialised forward, dq and dk/dv (Gluon; _ws_applies and _ws_rows_apply say where).
# The same tiles and masks as the kernels above, but each program is three partitions: a loader warp streams tiles into
# shared memory by TMA (an mbarrier ring of STAGES buffers, each freed when both consumers arrive), and two consumer
# warpgroups take 64 rows each, issuing asynchronous wgmma; while one waits on its softmax the other's matmuls run.
# Forward and dq (one kernel, _ws_range_kernel): persistent, one program per multiprocessor walking tiles of 128 query
# rows (a [128 / G tokens, G, D] box of Q, and of dO for dq, in one of two buffers), K/V tiles of BN keys over the union
# of their ranges; the loader fetches the next tile's Q and keys while the consumers finish this one, so short rows (the
# window's 512 keys, the compressed keys of short sequences) do not pay a program's start and end per tile; a tile's few
# values (its key range) are reduced in a copy each warp holds (no barrier), and the forward's o leaves by TMA from a
# shared buffer while its consumer goes on. dq first writes delta (from the tile's o, which the loader brings in by TMA
# too) and the base-2 lse for dk/dv, as _range_bwd_dq_kernel does (their lse and gate loaded a tile ahead, hidden behind
# the previous tile). dk/dv: 128 keys (K/V loaded once), Q/dO tiles of 64 rows (M // G tokens, a [tokens, G, D] box)
# over the tokens any of them reads; each step's lse and delta are loaded straight into the layout of its s^T columns
# (loading them a step ahead was slower, RESULTS.md). The window's key tiles step in a phase all programs share
# (_ws_dkv_step), and each consumer skips the steps none of its 64 keys reads (64 tokens at either end of the tile's
# 640; skipping the compressed branch's few was slower). The key ranges and their masks, key tiles, softmax step and
# end, and gate terms are the Triton helpers above (_range, _in_ranges, _key_tile, softmax_rescale, softmax_finish,
# gate_rows, gate_lse, gate_delta, gate_out), which Gluon kernels call as they are. A buffer a consumer reads with plain
# loads (not wgmma) takes fence_async_shared before its release, or the loader's next TMA may overwrite it first. Gluon
# does not run in the CPU interpreter: the GPU tests check these against the reference.

@gluon.constexpr_function
def _ws_mma(N):
    """Register layout of a warpgroup's [64, N] wgmma result."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def _ws_rows(i_t, i_h, half, NT, H: gl.constexpr, G: gl.constexpr, layout: gl.constexpr):
    """The 64 query rows of consumer `half` in program i_t's 128 (tokens i_t * 128 / G on, the G heads of kv head
    i_h), in `layout`: the token of each row, whether it is real, and its row of a (tokens, HQ, ...) array."""
    r = half * 64 + gl.arange(0, 64, layout=layout)
    t_r = i_t * (128 // G) + r // G
    return t_r, t_r < NT, t_r.to(gl.int64) * (H * G) + i_h * G + r % G


@gluon.constexpr_function
def _ws_warp_copy(N):
    """A layout of N values (N >= 32) for a 4-warp partition in which every warp holds all N: reductions over them
    stay inside each warp (no shared memory, no barrier)."""
    return gl.BlockedLayout([N // 32], [32], [4], [0])


@gluon.jit
def _ws_read_by_all(i_t, i_h, half, NT, lo, hi, KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB,
                    H: gl.constexpr, G: gl.constexpr):
    """_read_by_all over consumer `half`'s 64 rows, reduced in a copy of the rows in each warp."""
    t_r, m_r, _ = _ws_rows(i_t, i_h, half, NT, H, G, _ws_warp_copy(64))
    b_lo, b_hi = _range(t_r, m_r, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)
    return _read_by_all(b_lo, b_hi, m_r)


@gluon.jit
def _ws_load_rows(ptr, rows, m, D: gl.constexpr, layout: gl.constexpr):
    """[64, D] rows `rows` of a row-major (..., D) array (0 where m is false), in `layout`."""
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    rows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    m = gl.convert_layout(m, gl.SliceLayout(1, layout))
    return gl.load(ptr + rows[:, None] * D + o_d[None, :], mask=m[:, None], other=0.)


@gluon.jit
def _ws_store_rows(ptr, rows, m, x, D: gl.constexpr, layout: gl.constexpr):
    """Stores the [64, D] tile x (in `layout`, converted to ptr's dtype) into rows `rows` of a (..., D) array."""
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    rows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    m = gl.convert_layout(m, gl.SliceLayout(1, layout))
    gl.store(ptr + rows[:, None] * D + o_d[None, :], x.to(ptr.dtype.element_ty), mask=m[:, None])


@gluon.jit
def _ws_barriers(N: gl.constexpr, count: gl.constexpr):
    """N mbarriers, each completing a phase when `count` arrivals (plus the bytes expected of it) have come."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(N):
        mbarrier.init(bars.index(i), count=count)
    return bars


@gluon.jit
def _ws_tile(tile, n_tiles, NT, lo, hi, KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB,
             H: gl.constexpr, G: gl.constexpr, BN: gl.constexpr, layout: gl.constexpr):
    """A persistent program's tile number `tile`: its (i_t, i_h), the last tokens' tiles first (they read the most
    compressed keys, so the short ones fill the end), and the keys its 128 query rows read: the first, and the
    number of BN-key steps to the last (computed in `layout`, 128 values over the calling partition's warps)."""
    u = n_tiles - 1 - tile
    i_t, i_h = u // H, u % H
    t_r = i_t * (128 // G) + gl.arange(0, 128, layout=layout) // G
    b_lo, b_hi = _range(t_r, t_r < NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)
    k_start = gl.min(b_lo, 0)
    return i_t, i_h, k_start, gl.maximum(gl.cdiv(gl.max(b_hi, 0) - k_start, BN), 0)


@gluon.jit
def _ws_range_loader(q_desc, do_desc, o_desc, k_desc, v_desc, q_bufs, do_bufs, o_buf, k_bufs, v_bufs, q_ready,
                     q_free, o_ready, o_free, k_ready, v_ready, kv_free, n_tiles, NT, lo, hi, KIND: gl.constexpr,
                     VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                     DV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, BWD: gl.constexpr):
    """Per tile: its Q (and dO) into one of two buffers (and o into o_buf, which the consumers free once they have
    their delta), then its K/V steps into the STAGES-deep ring; so the next tile's loads run while the consumers
    finish this one."""
    step = 0
    n_done = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        i_t, i_h, k_start, n_steps = _ws_tile(tile, n_tiles, NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G,
                                              BN, gl.BlockedLayout([4], [32], [1], [0]))
        b = n_done % 2
        mbarrier.wait(q_free.index(b), ((n_done // 2) & 1) ^ 1)      # a fresh barrier passes phase 1: both free
        if BWD:
            mbarrier.expect(q_ready.index(b), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [i_t * (128 // G), i_h * G, 0], q_ready.index(b),
                                            do_bufs.index(b))
        else:
            mbarrier.expect(q_ready.index(b), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [i_t * (128 // G), i_h * G, 0], q_ready.index(b), q_bufs.index(b))
        if BWD:
            mbarrier.wait(o_free, (n_done & 1) ^ 1)
            mbarrier.expect(o_ready, o_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(o_desc, [i_t * (128 // G), i_h * G, 0], o_ready, o_buf)
        for j in range(n_steps):
            s, ph = step % STAGES, (step // STAGES) & 1
            mbarrier.wait(kv_free.index(s), ph ^ 1)
            k0 = k_start + j * BN
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k0, i_h * D], k_ready.index(s), k_bufs.index(s))
            mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [k0, i_h * DV], v_ready.index(s), v_bufs.index(s))
            step += 1
        n_done += 1


@gluon.jit
def _ws_fwd_finish(lse, gate, rows, m, m_i, l_i, acc, lse_scale, GATED: gl.constexpr, o_l: gl.constexpr):
    """A consumer's forward epilogue in acc's layout o_l: stores lse_scale x the base-2 lse and returns o = acc / l
    (times the gate), with rows and m in o_l's rows, through the Triton helpers softmax_finish and gate_out."""
    rows, m = gl.convert_layout(rows, gl.SliceLayout(1, o_l)), gl.convert_layout(m, gl.SliceLayout(1, o_l))
    m_i, l_i = gl.convert_layout(m_i, gl.SliceLayout(1, o_l)), gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
    b_o, b_lse = softmax_finish(m_i, l_i, acc)
    gl.store(lse + rows, b_lse * lse_scale, mask=m)
    return gate_out(b_o, gate_rows(gate, rows, m, GATED), GATED), rows, m


@gluon.jit
def _ws_fwd_consumer(o_desc, o_buf, lse, gate, lo, hi, q_bufs, k_bufs, v_bufs, q_ready, q_free, k_ready, v_ready,
                     kv_free, half, n_tiles, scale_log2, NT, KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK,
                     A, BB, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BN: gl.constexpr,
                     STAGES: gl.constexpr, GATED: gl.constexpr):
    s_l: gl.constexpr = _ws_mma(BN)
    o_l: gl.constexpr = _ws_mma(DV)
    o_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    step = 0
    n_done = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        i_t, i_h, k_start, n_steps = _ws_tile(tile, n_tiles, NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G,
                                              BN, _ws_warp_copy(128))
        t_r, m_r, rows = _ws_rows(i_t, i_h, half, NT, H, G, gl.SliceLayout(1, s_l))
        b_lo, b_hi = _range(t_r, m_r, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)
        f_lo, f_hi = _ws_read_by_all(i_t, i_h, half, NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G)
        m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
        l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_l))
        acc = gl.zeros([64, DV], gl.float32, o_l)
        b = n_done % 2
        mbarrier.wait(q_ready.index(b), (n_done // 2) & 1)
        q_rows = q_bufs.index(b).reshape([128, D]).slice(half * 64, 64)                   # this warpgroup's 64 rows
        for j in range(n_steps):
            s, ph = step % STAGES, (step // STAGES) & 1
            k0 = k_start + j * BN
            mbarrier.wait(k_ready.index(s), ph)
            b_s = warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), gl.zeros([64, BN], gl.float32, s_l),
                                use_acc=False, is_async=True)
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))                      # [64, BN]
            if (k0 < f_lo) | (k0 + BN > f_hi):
                c = k0 + o_n
                b_s = gl.where(_in_ranges(c, b_lo, b_hi), b_s, float("-inf"))
            m_i, alpha, b_p = softmax_rescale(b_s, m_i, scale_log2)                      # [64, BN]
            l_i = l_i * alpha + gl.sum(b_p, 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
            b_p = gl.convert_layout(b_p.to(q_bufs.dtype), gl.DotOperandLayout(0, o_l, 2))
            mbarrier.wait(v_ready.index(s), ph)
            acc = warpgroup_mma(b_p, v_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))                      # [64, DV]
            mbarrier.arrive(kv_free.index(s), count=1)
            step += 1
        mbarrier.arrive(q_free.index(b), count=1)
        b_o, _, _ = _ws_fwd_finish(lse, gate, rows, m_r, m_i, l_i, acc, 0.6931471805599453, GATED, o_l)  # natural log
        tma.store_wait(0)                                 # this consumer's previous tile has left o_buf
        o_buf.reshape([64, DV]).store(b_o.to(o_buf.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [i_t * (128 // G) + half * (64 // G), i_h * G, 0], o_buf)
        n_done += 1
    tma.store_wait(0)


@gluon.jit
def _ws_dq_rows(lse, gate, tile, n_tiles, half, NT, H: gl.constexpr, G: gl.constexpr, GATED: gl.constexpr,
                layout: gl.constexpr):
    """The natural-log lse and the gate (gate_rows) of consumer `half`'s rows of persistent tile number `tile`
    (_ws_tile; none past the last), in `layout`: the dq loads them a tile ahead."""
    u = n_tiles - 1 - tile
    _, m_r, rows = _ws_rows(u // H, u % H, half, NT, H, G, layout)
    m_r = m_r & (tile < n_tiles)
    return gl.load(lse + rows, mask=m_r, other=0.), gate_rows(gate, rows, m_r, GATED)


@gluon.jit
def _ws_dq_consumer(o_buf, lse, lse2, delta, dq, gate, lo, hi, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, q_free,
                    o_ready, o_free, k_ready, v_ready, kv_free, half, n_tiles, scale_log2, scale, NT,
                    KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB, H: gl.constexpr, G: gl.constexpr,
                    D: gl.constexpr, DV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):
    s_l: gl.constexpr = _ws_mma(BN)
    q_l: gl.constexpr = _ws_mma(D)
    rows_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    o_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_l))
    zero = gl.zeros([64, BN], gl.float32, s_l)
    step = 0
    n_done = 0
    next_lse, next_g = _ws_dq_rows(lse, gate, gl.program_id(0), n_tiles, half, NT, H, G, GATED,
                                   gl.SliceLayout(1, rows_l))
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        i_t, i_h, k_start, n_steps = _ws_tile(tile, n_tiles, NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G,
                                              BN, _ws_warp_copy(128))
        t_r, m_r, rows = _ws_rows(i_t, i_h, half, NT, H, G, gl.SliceLayout(1, rows_l))
        b_lse, b_g = next_lse * 1.4426950408889634, next_g
        next_lse, next_g = _ws_dq_rows(lse, gate, tile + gl.num_programs(0), n_tiles, half, NT, H, G, GATED,
                                       gl.SliceLayout(1, rows_l))
        b_lse = gate_lse(gl.where(b_lse == float("-inf"), 0., b_lse), b_g, GATED)
        gl.store(lse2 + rows, b_lse, mask=m_r)                                            # for the dk/dv kernel
        b = n_done % 2
        mbarrier.wait(q_ready.index(b), (n_done // 2) & 1)
        q_rows = q_bufs.index(b).reshape([128, D]).slice(half * 64, 64)
        do_rows = do_bufs.index(b).reshape([128, DV]).slice(half * 64, 64)
        mbarrier.wait(o_ready, n_done & 1)
        b_o = o_buf.reshape([128, DV]).slice(half * 64, 64).load(rows_l)
        b_do = do_rows.load(rows_l)
        fence_async_shared()      # these reads before the loader's next TMA writes there (without it: wrong deltas)
        mbarrier.arrive(o_free, count=1)
        b_delta = gl.sum(b_o.to(gl.float32) * b_do.to(gl.float32), 1)
        b_delta = gate_delta(b_delta, b_g, GATED)                                         # as _range_bwd_dq_kernel
        gl.store(delta + rows, b_delta, mask=m_r)
        b_delta = gl.convert_layout(b_delta, gl.SliceLayout(1, s_l))
        b_lse = gl.convert_layout(b_lse, gl.SliceLayout(1, s_l))
        t_r, m_r, rows = _ws_rows(i_t, i_h, half, NT, H, G, gl.SliceLayout(1, s_l))
        b_lo, b_hi = _range(t_r, m_r, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=False)
        f_lo, f_hi = _ws_read_by_all(i_t, i_h, half, NT, lo, hi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G)
        b_dq = gl.zeros([64, D], gl.float32, q_l)
        for j in range(n_steps):
            s, ph = step % STAGES, (step // STAGES) & 1
            k0 = k_start + j * BN
            mbarrier.wait(k_ready.index(s), ph)
            b_s = warpgroup_mma(q_rows, k_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(s), ph)
            b_dp = warpgroup_mma(do_rows, v_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            b_s = warpgroup_mma_wait(num_outstanding=1, deps=(b_s,))                      # [64, BN]
            b_p = gl.exp2(b_s * scale_log2 - b_lse[:, None])
            if (k0 < f_lo) | (k0 + BN > f_hi):
                c = k0 + o_n
                b_p = gl.where(_in_ranges(c, b_lo, b_hi), b_p, 0.)
            b_dp = warpgroup_mma_wait(num_outstanding=0, deps=(b_dp,))                    # [64, BN]
            b_ds = gl.convert_layout((b_p * (b_dp - b_delta[:, None])).to(dq.dtype.element_ty),
                                     gl.DotOperandLayout(0, q_l, 2))
            b_dq = warpgroup_mma(b_ds, k_bufs.index(s), b_dq, is_async=True)
            b_dq = warpgroup_mma_wait(num_outstanding=0, deps=(b_dq,))                    # [64, D]
            mbarrier.arrive(kv_free.index(s), count=1)
            step += 1
        mbarrier.arrive(q_free.index(b), count=1)
        _ws_store_rows(dq, rows, m_r, b_dq * scale, D, q_l)
        n_done += 1


@gluon.jit
def _ws_range_kernel(q_desc, do_desc, o, k_desc, v_desc, lse, lse2, delta, dq, gate, lo, hi, scale_log2, scale, NT,
                     n_tiles, KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB, H: gl.constexpr,
                     G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                     GATED: gl.constexpr, BWD: gl.constexpr):
    """Persistent: each program walks tiles of 128 query rows (_ws_tile) and writes their forward (o, lse) or, with
    BWD, dq (and delta, lse2 for dk/dv). o is a TMA descriptor: in the forward of [64 / G tokens, G, DV] boxes, each
    consumer storing its rows from shared memory while it goes on to the next tile; with BWD of the tile's
    [128 / G, G, DV], which the loader brings in for delta."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = _ws_barriers(2, 1)
    q_free = _ws_barriers(2, 2)                           # both consumers
    k_ready = _ws_barriers(STAGES, 1)
    v_ready = _ws_barriers(STAGES, 1)
    kv_free = _ws_barriers(STAGES, 2)
    if BWD:
        do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        o_buf = gl.allocate_shared_memory(o.dtype, o.block_type.shape, o.layout)
        o_ready = _ws_barriers(1, 1).index(0)
        o_free = _ws_barriers(1, 2).index(0)                # both consumers
        fence_async_shared()
        gl.warp_specialize([
            (_ws_dq_consumer, (o_buf, lse, lse2, delta, dq, gate, lo, hi, q_bufs, do_bufs, k_bufs, v_bufs,
                               q_ready, q_free, o_ready, o_free, k_ready, v_ready, kv_free, 0, n_tiles, scale_log2,
                               scale, NT, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G, D, DV, BN, STAGES, GATED)),
            (_ws_dq_consumer, (o_buf, lse, lse2, delta, dq, gate, lo, hi, q_bufs, do_bufs, k_bufs, v_bufs,
                               q_ready, q_free, o_ready, o_free, k_ready, v_ready, kv_free, 1, n_tiles, scale_log2,
                               scale, NT, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, H, G, D, DV, BN, STAGES, GATED)),
            (_ws_range_loader, (q_desc, do_desc, o, k_desc, v_desc, q_bufs, do_bufs, o_buf, k_bufs, v_bufs, q_ready,
                                q_free, o_ready, o_free, k_ready, v_ready, kv_free, n_tiles, NT, lo, hi, KIND,
                                VARLEN, SEQ_T, SEQ_TK, A, BB, H, G, D, DV, BN, STAGES, BWD)),
        ], [4, 1], [240, 24])
    else:
        o_bufs = gl.allocate_shared_memory(o.dtype, [2] + o.block_type.shape, o.layout)       # one per consumer
        fence_async_shared()
        gl.warp_specialize([
            (_ws_fwd_consumer, (o, o_bufs.index(0), lse, gate, lo, hi, q_bufs, k_bufs, v_bufs, q_ready, q_free,
                                k_ready, v_ready, kv_free, 0, n_tiles, scale_log2, NT, KIND, VARLEN, SEQ_T, SEQ_TK, A,
                                BB, H, G, D, DV, BN, STAGES, GATED)),
            (_ws_fwd_consumer, (o, o_bufs.index(1), lse, gate, lo, hi, q_bufs, k_bufs, v_bufs, q_ready, q_free,
                                k_ready, v_ready, kv_free, 1, n_tiles, scale_log2, NT, KIND, VARLEN, SEQ_T, SEQ_TK, A,
                                BB, H, G, D, DV, BN, STAGES, GATED)),
            (_ws_range_loader, (q_desc, do_desc, None, k_desc, v_desc, q_bufs, None, None, k_bufs, v_bufs, q_ready,
                                q_free, None, None, k_ready, v_ready, kv_free, n_tiles, NT, lo, hi, KIND, VARLEN,
                                SEQ_T, SEQ_TK, A, BB, H, G, D, DV, BN, STAGES, BWD)),
        ], [4, 1], [240, 24])


@gluon.jit
def _ws_dkv_step(j, t_start, n_steps, KIND: gl.constexpr, BT: gl.constexpr):
    """The first token of a dk/dv program's j-th step of BT tokens (of n_steps from t_start). The window's steps go
    round from the one whose index in the row is j modulo n_steps, so programs at work together (neighbouring key
    tiles, which read nearly the same tokens) read each step in the same iteration, while L2 holds it, as
    _range_bwd_dkv_kernel's do; the compressed branch's go in order."""
    if KIND == 1:
        return t_start + (j + n_steps - t_start // BT % n_steps) % n_steps * BT
    return t_start + j * BT


@gluon.jit
def _ws_dkv_loader(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free,
                   i_h, c0, t_start, n_steps, D: gl.constexpr, DV: gl.constexpr, G: gl.constexpr, BT: gl.constexpr,
                   STAGES: gl.constexpr, KIND: gl.constexpr):
    for h in gl.static_range(2):                          # each consumer's 64 keys, once
        mbarrier.expect(kv_ready.index(h), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [c0 + h * 64, i_h * D], kv_ready.index(h), k_smem.index(h))
        tma.async_copy_global_to_shared(v_desc, [c0 + h * 64, i_h * DV], kv_ready.index(h), v_smem.index(h))
    for j in range(n_steps):
        s, ph = j % STAGES, (j // STAGES) & 1
        mbarrier.wait(qd_free.index(s), ph ^ 1)
        t0 = _ws_dkv_step(j, t_start, n_steps, KIND, BT)
        mbarrier.expect(qd_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [t0, i_h * G, 0], qd_ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [t0, i_h * G, 0], qd_ready.index(s), do_bufs.index(s))


@gluon.jit
def _ws_dkv_consumer(lse, delta, dk, dv, qlo, qhi, k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free,
                     i_k, i_q, i_h, half, t_start, n_steps, scale_log2, scale, NK, NT, QCH, KIND: gl.constexpr,
                     VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                     DV: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    M: gl.constexpr = BT * G                                                              # query rows per step: 64
    s_l: gl.constexpr = _ws_mma(M)
    k_l: gl.constexpr = _ws_mma(D)
    v_l: gl.constexpr = _ws_mma(DV)
    c, m_k, _, q0 = _key_tile(i_k, half * 64 + gl.arange(0, 64, gl.SliceLayout(1, s_l)), NK, VARLEN, SEQ_T, SEQ_TK,
                              128)
    b_qlo, b_qhi = _range(c, m_k, qlo, qhi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=True)
    b_qlo = gl.maximum(b_qlo, q0 + i_q * QCH)                                             # this program's chunk
    b_qhi = gl.minimum(b_qhi, q0 + (i_q + 1) * QCH)
    f_lo, f_hi = _read_by_all(b_qlo, b_qhi, m_k)                                          # tokens every key reads
    a_lo, a_hi = gl.min(b_qlo, 0), gl.max(b_qhi, 0)                                       # tokens any key reads
    b_dk = gl.zeros([64, D], gl.float32, k_l)
    b_dv = gl.zeros([64, DV], gl.float32, v_l)
    # a step's M query rows are the columns of s^T, which every warp holds: their lse and delta are loaded in that
    # layout, as a compact load would need a shared-memory exchange with barriers each step
    r = gl.arange(0, M, layout=gl.SliceLayout(0, s_l))
    mbarrier.wait(kv_ready.index(half), 0)
    for j in range(n_steps):
        s, ph = j % STAGES, (j // STAGES) & 1
        t0 = _ws_dkv_step(j, t_start, n_steps, KIND, BT)
        t_r = t0 + r // G                                                                 # [M] token of each row
        off_r = t_r.to(gl.int64) * (H * G) + i_h * G + r % G
        b_lse = gl.load(lse + off_r, mask=t_r < NT, other=0.)                             # base 2, gated
        b_delta = gl.load(delta + off_r, mask=t_r < NT, other=0.)
        mbarrier.wait(qd_ready.index(s), ph)
        live = True
        if KIND == 1:                                     # the window's consumers: only the steps their keys read
            live = (t0 + BT > a_lo) & (t0 < a_hi)
        if live:
            q_s = q_bufs.index(s).reshape([M, D])
            do_s = do_bufs.index(s).reshape([M, DV])
            zero = gl.zeros([64, M], gl.float32, s_l)
            b_st = warpgroup_mma(k_smem.index(half), q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
            b_dpt = warpgroup_mma(v_smem.index(half), do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
            b_st = warpgroup_mma_wait(num_outstanding=1, deps=(b_st,))                        # s^T [64 keys, M]
            b_pt = gl.exp2(b_st * scale_log2 - b_lse[None, :])
            masked = (t0 < f_lo) | (t0 + BT > f_hi)
            if masked:
                b_pt = gl.where(_in_ranges(t_r, b_qlo, b_qhi), b_pt, 0.)
            b_dv = warpgroup_mma(gl.convert_layout(b_pt.to(q_s.dtype), gl.DotOperandLayout(0, v_l, 2)), do_s, b_dv,
                                 is_async=True)
            b_dpt = warpgroup_mma_wait(num_outstanding=1, deps=(b_dpt,))                      # dp^T [64 keys, M]
            b_dst = b_pt * (b_dpt - b_delta[None, :])
            if masked:                                        # where, not 0 * dp: an unread key may hold NaN
                b_dst = gl.where(_in_ranges(t_r, b_qlo, b_qhi), b_dst, 0.)
            b_dk = warpgroup_mma(gl.convert_layout(b_dst.to(q_s.dtype), gl.DotOperandLayout(0, k_l, 2)), q_s, b_dk,
                                 is_async=True)
            b_dv, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dv, b_dk))
        mbarrier.arrive(qd_free.index(s), count=1)
    p_off = i_q.to(gl.int64) * NK * H                                                     # chunk partials
    ck = gl.convert_layout(c, gl.SliceLayout(1, k_l)).to(gl.int64) * H + i_h
    mk = gl.convert_layout(m_k, gl.SliceLayout(1, k_l))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, k_l))
    gl.store(dk + (p_off + ck)[:, None] * D + o_d[None, :], (b_dk * scale).to(dk.dtype.element_ty), mask=mk[:, None])
    cv = gl.convert_layout(c, gl.SliceLayout(1, v_l)).to(gl.int64) * H + i_h
    mv = gl.convert_layout(m_k, gl.SliceLayout(1, v_l))
    o_e = gl.arange(0, DV, layout=gl.SliceLayout(0, v_l))
    gl.store(dv + (p_off + cv)[:, None] * DV + o_e[None, :], b_dv.to(dv.dtype.element_ty), mask=mv[:, None])


@gluon.jit
def _ws_dkv_kernel(q_desc, do_desc, k_desc, v_desc, lse, delta, dk, dv, qlo, qhi, scale_log2, scale, NK, NT, QCH,
                   KIND: gl.constexpr, VARLEN: gl.constexpr, SEQ_T, SEQ_TK, A, BB, H: gl.constexpr, G: gl.constexpr,
                   D: gl.constexpr, DV: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    i_k, i_q, i_h = gl.program_id(0), gl.program_id(1), gl.program_id(2)
    c, m_k, c0, q0 = _key_tile(i_k, gl.arange(0, 128, gl.BlockedLayout([1], [32], [4], [0])), NK, VARLEN, SEQ_T,
                               SEQ_TK, 128)
    b_qlo, b_qhi = _range(c, m_k, qlo, qhi, KIND, VARLEN, SEQ_T, SEQ_TK, A, BB, FROM_KEY=True)
    t_start = gl.maximum(gl.min(b_qlo, 0), q0 + i_q * QCH)                                # the tile's token span
    n_steps = gl.maximum(gl.cdiv(gl.minimum(gl.max(b_qhi, 0), q0 + (i_q + 1) * QCH) - t_start, BT), 0)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_ready = _ws_barriers(2, 1)                         # each consumer's keys
    qd_ready = _ws_barriers(STAGES, 1)
    qd_free = _ws_barriers(STAGES, 2)                     # both consumers
    fence_async_shared()
    gl.warp_specialize([
        (_ws_dkv_consumer, (lse, delta, dk, dv, qlo, qhi, k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free,
                            i_k, i_q, i_h, 0, t_start, n_steps, scale_log2, scale, NK, NT, QCH, KIND, VARLEN, SEQ_T,
                            SEQ_TK, A, BB, H, G, D, DV, BT, STAGES)),
        (_ws_dkv_consumer, (lse, delta, dk, dv, qlo, qhi, k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free,
                            i_k, i_q, i_h, 1, t_start, n_steps, scale_log2, scale, NK, NT, QCH, KIND, VARLEN, SEQ_T,
                            SEQ_TK, A, BB, H, G, D, DV, BT, STAGES)),
        (_ws_dkv_loader, (k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready,
                          qd_free, i_h, c0, t_start, n_steps, D, DV, G, BT, STAGES, KIND)),
    ], [4, 1], [240, 24])


# ----------------------------------------------------------------------------------------------------------------
# block selection: Eq. 8 (p_cmp from the lse), Eq. 10 (sum over the group), Eq. 9 (overlap weights), top-n

@triton.jit
def _indicator(N_DIMS: tl.constexpr, j: tl.constexpr):
    return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(x, flip, i: tl.constexpr, N_DIMS: tl.constexpr):
    y = tl.sum(x, N_DIMS - 1 - i, keep_dims=True) - x     # partner along axis i of the hypercube (a + b - a)
    return tl.where((x > y) != (flip ^ _indicator(N_DIMS, i)), y, x)


@triton.jit
def sort_rows(x, DESC: tl.constexpr, LOG_N: tl.constexpr, N_DIMS: tl.constexpr, MERGE_ONLY: tl.constexpr = 0):
    """Bitonic sort of each row of x [R, 2**LOG_N] (x.numel == 2**N_DIMS); tl.sort's network with the partner taken
    by a sum instead of an xor-reduce (which the interpreter runs element by element). MERGE_ONLY: the rows are
    already bitonic, so only the last merge stage runs (LOG_N compare-swaps instead of LOG_N (LOG_N + 1) / 2)."""
    h = tl.reshape(x, [2] * N_DIMS)
    for stage in tl.static_range(LOG_N if MERGE_ONLY else 1, LOG_N + 1):
        if stage < LOG_N:
            flip = _indicator(N_DIMS, stage)
        else:
            flip = DESC
        for i in tl.static_range(stage):
            h = _compare_swap(h, flip, stage - 1 - i, N_DIMS)
    return tl.reshape(h, x.shape)


@triton.jit
def _overlap(start, block, L, LS, DS):
    """Eq. 9's weights: tokens shared by the compressed block at `start` (L tokens) and the selection block at
    `block` (LS tokens), in units of the stride DS (broadcasts)."""
    return tl.maximum(tl.minimum(start + L, block + LS) - tl.maximum(start, block), 0).to(tl.float32) / DS


@triton.jit
def _head_rows(M: tl.constexpr, BG: tl.constexpr, QB: tl.constexpr):
    """The token (in the tile) and the head (in the group) of each row of an [M, keys] score tile. QB = 0: token
    major, heads minor. QB > 0 orders them for a Hopper wgmma accumulator, whose threads each hold rows
    64 s + 16 w + 8 h + q for every s and h (w: the thread's warp, q: its lane // 4): a token's BG heads take all
    (s, h) and QB of the q, so that their sum (_head_sum) is adds inside the thread and log2(QB) shuffle levels, where
    token major rows take up to three. Any order gives the same sums; only the speed depends on the layout."""
    o_m = tl.arange(0, M)
    if QB == 0:
        t_m, g_r = o_m // BG, o_m % BG
    else:
        q = o_m % 8
        t_m, g_r = (o_m // 16) % 4 * (8 // QB) + q // QB, ((o_m // 64) * 2 + (o_m // 8) % 2) * QB + q % QB
    return t_m, g_r


@triton.jit
def _head_sum(b_p, M: tl.constexpr, BT: tl.constexpr, BG: tl.constexpr, BKC: tl.constexpr, QB: tl.constexpr):
    """Eq. 10: [M, BKC] scores -> [BT, BKC], the sum of each token's rows as _head_rows orders them."""
    if QB == 0:
        b_pg = tl.sum(tl.reshape(b_p, [BT, BG, BKC]), 1)
    else:
        b_p = tl.reshape(b_p, [M // 64, 4, 2, 8 // QB, QB, BKC])    # [s, w, h, q // QB, q % QB, keys]
        b_pg = tl.reshape(tl.sum(tl.sum(tl.sum(b_p, 4), 2), 0), [BT, BKC])
    return b_pg


@triton.jit
def _block_scores(b_pg, carry, w_own, w_next, BT: tl.constexpr, NP: tl.constexpr, CPP: tl.constexpr):
    """Eq. 9 over one chunk of NP selection blocks, CPP columns each: b_pg [BT, NP * CPP] -> [BT, NP] block scores.
    Block j gets its own columns weighted by w_own and block j - 1's by w_next (block 0 the previous chunk's last:
    carry [BT]). Returns the scores and this chunk's carry."""
    o_j = tl.arange(0, NP)
    own = tl.sum(tl.reshape(b_pg * w_own[None, :], [BT, NP, CPP]), 2)                    # [BT, NP]
    spill = tl.sum(tl.reshape(b_pg * w_next[None, :], [BT, NP, CPP]), 2)
    prev = tl.gather(spill, tl.broadcast_to(tl.maximum(o_j - 1, 0)[None, :], [BT, NP]), 1)
    b_sc = own + tl.where(o_j[None, :] == 0, carry[:, None], prev)
    return b_sc, tl.sum(tl.where(o_j[None, :] == NP - 1, spill, 0.), 1)


@triton.jit
def _select_kernel(q, k, lse, idx, pos, seq, cu_cmp, scale_log2, NT, VARLEN: tl.constexpr, SEQ_T, SEQ_TK,
                   H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, BT: tl.constexpr,
                   D: tl.constexpr, BD: tl.constexpr, L: tl.constexpr, DS: tl.constexpr, LS: tl.constexpr,
                   NS: tl.constexpr, NP: tl.constexpr, BKC: tl.constexpr, N_INIT: tl.constexpr,
                   N_LOCAL: tl.constexpr, LOG_NP: tl.constexpr, N_DIMS: tl.constexpr, QB: tl.constexpr):
    # later tokens score more chunks: the last tiles launch first, so the short ones fill the end of the grid
    i_t, i_h = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    M: tl.constexpr = BT * BG
    CPS: tl.constexpr = LS // DS                          # compressed blocks starting in one selection block
    CPP: tl.constexpr = BKC // NP                         # a chunk's columns per selection block (CPS, padded)
    o_b, o_c, o_j = tl.arange(0, BT), tl.arange(0, BKC), tl.arange(0, NP)
    o_cb, o_cc = o_c // CPP, o_c % CPP                    # [BKC] each column's selection block, block in it
    t_m, g_r = _head_rows(M, BG, QB)                      # [M] each row's token in the tile, head (padded to BG)
    t_r = i_t * BT + t_m
    m_r, t_off, hq_r = tile_rows(t_r, g_r, t_r < NT, i_h, H, G)
    t_b = i_t * BT + o_b                                  # [BT] tokens of the tile
    m_b = t_b < NT
    if VARLEN:                                            # packed sequences: position and sequence id arrays
        pos_r = tl.load(pos + t_r, mask=m_r, other=0)
        seq_r = tl.load(seq + t_r, mask=m_r, other=-1)
        pos_b = tl.load(pos + t_b, mask=m_b, other=0)
        seq_b = tl.load(seq + t_b, mask=m_b, other=-1)
        s_first = tl.load(seq + i_t * BT)
        s_last = tl.load(seq + tl.minimum(i_t * BT + BT - 1, NT - 1))
    else:                                                 # B rows of SEQ_T tokens
        pos_r, seq_r = t_r % SEQ_T, tl.where(m_r, t_r // SEQ_T, -1)
        pos_b, seq_b = t_b % SEQ_T, tl.where(m_b, t_b // SEQ_T, -1)
        s_first = (i_t * BT) // SEQ_T
        s_last = tl.minimum(i_t * BT + BT - 1, NT - 1) // SEQ_T
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                                          # [M, BD]
    b_lse = tl.load(lse + t_off + hq_r, mask=m_r, other=0.) * 1.4426950408889634          # [M] base 2
    tb = pos_b // LS                                                                      # [BT] own block
    # Eq. 9: the compressed block of column c starts o_cc * DS into selection block o_cb and, as l <= l', overlaps
    # only that block and the next; a chunk's block scores are the two weighted sums over each block's columns
    w_own = tl.where(o_cc < CPS, _overlap(o_cc * DS, 0, L, LS, DS), 0.)                  # [BKC]
    w_next = tl.where(o_cc < CPS, _overlap(o_cc * DS, LS, L, LS, DS), 0.)
    top = tl.full([BT, NP], -1, tl.int64)                 # running top-NP keys, sorted descending
    for s in range(s_first, s_last + 1):                  # a tile may straddle packed sequences
        if VARLEN:
            c_bos = tl.load(cu_cmp + s)
            n_c = tl.load(cu_cmp + s + 1) - c_bos
        else:
            c_bos = s * SEQ_TK
            n_c = SEQ_TK
        m_rs = m_r & (seq_r == s)
        m_bs = m_b & (seq_b == s)
        lse_s = tl.where(m_rs, b_lse, float("inf"))       # p = 0 on rows of other sequences and padding rows
        carry = tl.zeros([BT], tl.float32)                # weight spilling into the next chunk's first block
        pos_min = tl.min(tl.where(m_bs, pos_b, INT_MAX), 0)                               # the tile's first token
        for j0 in range(0, tl.max(tl.where(m_bs, tb + 1, 0), 0), NP):
            ic = (j0 + o_cb) * CPS + o_cc                                                 # [BKC] relative ids
            m_c = (o_cc < CPS) & (ic < n_c)
            # no mask where each token of sequence s sees every key of the chunk: only its last chunks need one
            c_end = (j0 + NP) * CPS
            seen = (CPP == CPS) & (c_end <= n_c) & ((c_end - 1) * DS + L - 1 <= pos_min)
            k_off = (c_bos + ic).to(tl.int64) * H + i_h
            b_k = load_rows(k, k_off, m_c, D, BD)                                         # [BKC, BD]
            b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2                                 # [M, BKC]
            b_p = tl.exp2(b_s - lse_s[:, None])                                           # Eq. 8
            if not seen:
                vis = m_c[None, :] & (ic[None, :] * DS + L - 1 <= pos_r[:, None])
                b_p = tl.where(vis, b_p, 0.)
            b_pg = _head_sum(b_p, M, BT, BG, BKC, QB)                                     # [BT, BKC] Eq. 10
            b_sc, carry = _block_scores(b_pg, carry, w_own, w_next, BT, NP, CPP)          # [BT, NP] Eq. 9
            top = _merge_top(top, b_sc, j0 + o_j, m_bs, tb, N_INIT, N_LOCAL, LOG_NP, N_DIMS)
    _store_top(idx, top, t_b, m_b, i_h, H, NS, NP, LOG_NP, N_DIMS)


@triton.jit
def _top_keys(b_sc, jj, tb, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """The sort keys of blocks jj (broadcast against the scores b_sc [BT, NP]) for tokens whose own block is tb [BT]:
    (score bits, INT_MAX - j) in one int64, the forced blocks (the first N_INIT, the N_LOCAL up to tb) scoring +inf.
    Scores are >= 0, so their bits order like the floats; the low word makes ties go to the lower j."""
    b_sc = tl.where((jj < N_INIT) | (jj > tb[:, None] - N_LOCAL), float("inf"), b_sc)
    return (b_sc.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (-jj + INT_MAX).to(tl.int64)


@triton.jit
def _merge_top(top, b_sc, jj, m_b, tb, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr, LOG_NP: tl.constexpr,
               N_DIMS: tl.constexpr):
    """Merges the block scores b_sc [BT, NP] of blocks jj [NP] into the tokens' running top-NP keys (sorted
    descending): blocks after a token's own (tb) are no candidates."""
    cand = m_b[:, None] & (jj[None, :] <= tb[:, None])
    key = sort_rows(tl.where(cand, _top_keys(b_sc, jj[None, :], tb, N_INIT, N_LOCAL), -1), DESC=0, LOG_N=LOG_NP,
                    N_DIMS=N_DIMS)                                                            # ascending
    return sort_rows(tl.maximum(top, key), DESC=1, LOG_N=LOG_NP, N_DIMS=N_DIMS, MERGE_ONLY=1)


@triton.jit
def _store_top(idx, top, t_b, m_b, i_h, H: tl.constexpr, NS: tl.constexpr, NP: tl.constexpr, LOG_NP: tl.constexpr,
               N_DIMS: tl.constexpr):
    """The first NS of each token's top keys as block ids, ascending, -1 after the valid ones, into idx."""
    o_s = tl.arange(0, NP)
    valid = (o_s[None, :] < NS) & (top >= 0)
    j = tl.where(valid, (-(top & INT_MAX) + INT_MAX).to(tl.int32), INT_MAX)
    j = sort_rows(j, 0, LOG_NP, N_DIMS)                                                   # ascending, padding last
    j = tl.where(j == INT_MAX, -1, j)
    tl.store(idx + (t_b.to(tl.int64) * H + i_h)[:, None] * NS + o_s[None, :], j,
             mask=m_b[:, None] & (o_s < NS)[None, :])


# block scores on Hopper (_ws_select_applies): a warp-specialised Gluon kernel writes Eq. 9's two parts of every
# block's score and _ws_top_kernel picks the top n (the merge is off the tensor cores' path). Persistent over tiles of
# 256 / G tokens x the G heads of one kv head; a loader warp brings the tile's Q (one TMA box of a strided view whose
# rows come in the order below) and chunks of BK compressed keys; two consumer warpgroups take 128 query rows each
# and compute s^T = K Q^T [BK, 128] (keys on the rows): a thread of a wgmma accumulator holds the columns
# 8 j + 2 r + e (r: its lane % 4) for every j and e, so with column 8 (jh G / 2 + jl) + 2 r + e holding token 4 jh + r
# and head 2 jl + e, a thread holds all G heads of its tokens and Eq. 10's sum is adds inside it. Eq. 9's sums over a
# block's keys stay inside a warp.

@gluon.jit
def _ws_score_tile(tile, n_tiles, T0, SEQ_T, H: gl.constexpr, G: gl.constexpr, LS: gl.constexpr, NP: gl.constexpr):
    """A persistent program's tile number `tile` (the longest first): its (i_t, i_h) and its BK-key steps."""
    u = n_tiles - 1 - tile
    i_t, i_h = u // H, u % H
    p_last = (T0 + (i_t + 1) * (256 // G) - 1) % SEQ_T                   # position of the tile's last token
    return i_t, i_h, gl.cdiv(p_last // LS + 1, NP)


@gluon.jit
def _ws_head_sum(b_p, BK: gl.constexpr, G: gl.constexpr, TC: gl.constexpr):
    """Eq. 10: [BK, 128] probabilities, columns in the order above -> [BK, TC] sums over each token's G heads."""
    return gl.reshape(gl.sum(gl.sum(gl.reshape(b_p, [BK, 32 // G, G // 2, 4, 2]), 4), 2), [BK, TC])


@gluon.jit
def _ws_score_loader(q_desc, k_desc, q_bufs, k_bufs, q_ready, q_free, k_ready, k_free, n_tiles, T0, SEQ_T, SEQ_TK,
                     H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
                     LS: gl.constexpr, NP: gl.constexpr):
    """Per tile: its Q into one of two buffers, then its key chunks into the STAGES-deep ring."""
    TT: gl.constexpr = 256 // G
    step = 0
    n_done = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        i_t, i_h, n_steps = _ws_score_tile(tile, n_tiles, T0, SEQ_T, H, G, LS, NP)
        b = n_done % 2
        mbarrier.wait(q_free.index(b), ((n_done // 2) & 1) ^ 1)
        mbarrier.expect(q_ready.index(b), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [(T0 + i_t * TT) // 4, i_h * (G // 2), 0, 0, 0], q_ready.index(b),
                                        q_bufs.index(b))
        k_bos = ((T0 + i_t * TT) // SEQ_T) * SEQ_TK       # the row's first compressed key
        for j in range(n_steps):
            s, ph = step % STAGES, (step // STAGES) & 1
            mbarrier.wait(k_free.index(s), ph ^ 1)
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k_bos + j * BK, i_h * D], k_ready.index(s), k_bufs.index(s))
            step += 1
        n_done += 1


@gluon.jit
def _ws_score_consumer(scores, lse, q_bufs, k_bufs, q_ready, q_free, k_ready, k_free, half, n_tiles, scale_log2,
                       T0, NT, SEQ_T, SEQ_TK, NB, H: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                       BK: gl.constexpr, STAGES: gl.constexpr, L: gl.constexpr, DS: gl.constexpr, LS: gl.constexpr,
                       NP: gl.constexpr):
    s_l: gl.constexpr = _ws_mma(128)                      # s^T [BK keys, 128 query rows]
    TT: gl.constexpr = 256 // G                           # tokens a tile, TC a consumer
    TC: gl.constexpr = 128 // G
    CPS: gl.constexpr = LS // DS
    col = gl.arange(0, 128, layout=gl.SliceLayout(0, s_l))
    p_c = (col // (4 * G)) * 4 + (col // 2) % 4           # [128] each column's token in the consumer's TC
    g_c = ((col // 8) % (G // 2)) * 2 + col % 2           # and head in the group
    key = gl.arange(0, BK, layout=gl.SliceLayout(1, s_l))
    zero = gl.zeros([BK, 128], gl.float32, s_l)
    pg_l: gl.constexpr = _ws_head_sum(zero, BK, G, TC).type.layout                    # Eq. 10's sums' layout
    key_pg = gl.arange(0, BK, layout=gl.SliceLayout(1, pg_l))
    w_own = _overlap((key_pg % CPS) * DS, 0, L, LS, DS)   # [BK] Eq. 9's weights of each key's block and the next
    w_next = _overlap((key_pg % CPS) * DS, LS, L, LS, DS)
    step = 0
    n_done = 0
    for tile in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        i_t, i_h, n_steps = _ws_score_tile(tile, n_tiles, T0, SEQ_T, H, G, LS, NP)
        t_c = i_t * TT + half * TC + p_c                  # [128] window token of each column
        m_c = t_c < NT
        b_lse = gl.load(lse + ((T0 + t_c).to(gl.int64) * H + i_h) * G + g_c, mask=m_c, other=float("inf"))
        b_lse = b_lse * 1.4426950408889634                # base 2; padding columns get p = 0
        pos_c = (T0 + t_c) % SEQ_T
        p_min = (T0 + i_t * TT) % SEQ_T                   # steps of keys every token sees need no mask
        n_all = gl.minimum(gl.maximum((p_min - L + 1) // DS + 1, 0), SEQ_TK)
        b = n_done % 2
        mbarrier.wait(q_ready.index(b), (n_done // 2) & 1)
        q_rows = q_bufs.index(b).reshape([256, D]).slice(half * 128, 128)
        for j in range(n_steps):
            s, ph = step % STAGES, (step // STAGES) & 1
            mbarrier.wait(k_ready.index(s), ph)
            b_s = warpgroup_mma(k_bufs.index(s), q_rows.permute((1, 0)), zero, use_acc=False, is_async=True)
            b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))                      # [BK, 128]
            mbarrier.arrive(k_free.index(s), count=1)
            b_p = gl.exp2(b_s * scale_log2 - b_lse[None, :])                              # Eq. 8
            if (j + 1) * BK > n_all:
                ic = j * BK + key                                                         # [BK] relative key ids
                vis = (ic[:, None] * DS + L - 1 <= pos_c[None, :]) & (ic < SEQ_TK)[:, None]
                b_p = gl.where(vis, b_p, 0.)
            b_pg = _ws_head_sum(b_p, BK, G, TC)                                           # [BK, TC] Eq. 10
            own = gl.sum(gl.reshape(b_pg * w_own[:, None], [NP, CPS, TC]), 1)               # [NP, TC] Eq. 9
            spill = gl.sum(gl.reshape(b_pg * w_next[:, None], [NP, CPS, TC]), 1)
            sc_l: gl.constexpr = own.type.layout                                          # stored as reduced
            o_b = j * NP + gl.arange(0, NP, layout=gl.SliceLayout(1, sc_l))               # [NP] blocks
            t_o = i_t * TT + half * TC + gl.arange(0, TC, layout=gl.SliceLayout(0, sc_l))  # [TC] window tokens
            at = (t_o.to(gl.int64) * H + i_h)[None, :] * (2 * NB) + o_b[:, None]
            m_o = (t_o < NT)[None, :] & (o_b < NB)[:, None]
            gl.store(scores + at, own, mask=m_o)
            gl.store(scores + at + NB, spill, mask=m_o)
            step += 1
        mbarrier.arrive(q_free.index(b), count=1)
        n_done += 1


@gluon.jit
def _ws_score_kernel(q_desc, k_desc, scores, lse, scale_log2, T0, NT, n_tiles, SEQ_T, SEQ_TK, NB, H: gl.constexpr,
                     G: gl.constexpr, D: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, L: gl.constexpr,
                     DS: gl.constexpr, LS: gl.constexpr, NP: gl.constexpr):
    """Eq. 9's own and spill parts of the block scores of tokens T0 .. T0 + NT into scores (NT, H, 2, NB)."""
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    q_ready = _ws_barriers(2, 1)
    q_free = _ws_barriers(2, 2)                           # both consumers
    k_ready = _ws_barriers(STAGES, 1)
    k_free = _ws_barriers(STAGES, 2)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_score_consumer, (scores, lse, q_bufs, k_bufs, q_ready, q_free, k_ready, k_free, 0, n_tiles, scale_log2,
                              T0, NT, SEQ_T, SEQ_TK, NB, H, G, D, BK, STAGES, L, DS, LS, NP)),
        (_ws_score_consumer, (scores, lse, q_bufs, k_bufs, q_ready, q_free, k_ready, k_free, 1, n_tiles, scale_log2,
                              T0, NT, SEQ_T, SEQ_TK, NB, H, G, D, BK, STAGES, L, DS, LS, NP)),
        (_ws_score_loader, (q_desc, k_desc, q_bufs, k_bufs, q_ready, q_free, k_ready, k_free, n_tiles, T0, SEQ_T,
                            SEQ_TK, H, G, D, BK, STAGES, LS, NP)),
    ], [4, 1], [240, 24])


# the top n on Hopper: one token a thread, so that each step of the bitonic network is a compare-exchange between two
# registers of that thread (sort_rows' network, with no shuffles); the scores arrive in a coalesced layout and move
# to that one (through shared memory)

@gluon.jit
def _row_pairs(x, d: gl.constexpr):
    """x [R, NP] -> (its columns j with j & d == 0, their partners j + d), [R, NP / 2d, d] each."""
    R: gl.constexpr = x.shape[0]
    NP: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [R, NP // (2 * d), 2, d]), (0, 1, 3, 2)))


@gluon.jit
def _row_sort(x, jj, DESC: gl.constexpr, MERGE_ONLY: gl.constexpr, LOG_NP: gl.constexpr):
    """sort_rows for x [R, NP] whose rows each lie in one thread; jj [R, NP] the column numbers."""
    for s in gl.static_range(LOG_NP if MERGE_ONLY else 1, LOG_NP + 1):
        if s < LOG_NP:
            up = ((jj >> s) & 1) == 0                     # blocks of 2^s columns ascending, descending, ...
        else:
            up = (jj >= 0) != DESC
        for i in gl.static_range(s):
            a, b = _row_pairs(x, 1 << (s - 1 - i))
            up_a, _ = _row_pairs(up, 1 << (s - 1 - i))
            swap = (a > b) == up_a
            x = gl.permute(gl.join(gl.where(swap, b, a), gl.where(swap, a, b)), (0, 1, 3, 2))
            x = gl.convert_layout(gl.reshape(x, [jj.shape[0], jj.shape[1]]), jj.type.layout)
    return x


@gluon.jit
def _ws_top_kernel(scores, idx, T0, NT, SEQ_T, NB, H: gl.constexpr, LS: gl.constexpr, NS: gl.constexpr,
                   NP: gl.constexpr, N_INIT: gl.constexpr, N_LOCAL: gl.constexpr, LOG_NP: gl.constexpr):
    """Top-n of the block scores _ws_score_kernel wrote for tokens T0 .. T0 + NT (scores (NT, H, 2, NB): Eq. 9's own
    and spill parts, block j's score own[j] + spill[j - 1]), 32 tokens a warp, of one kv head a program. The merge
    is _merge_top's; _store_top's store."""
    row_l: gl.constexpr = gl.BlockedLayout([1, NP], [32, 1], [gl.num_warps(), 1], [1, 0])   # a token a thread
    load_l: gl.constexpr = gl.BlockedLayout([1, 4], [128 // NP, NP // 4], [gl.num_warps(), 1], [1, 0])  # NP 16, 32
    BT: gl.constexpr = 32 * gl.num_warps()
    i_t, i_h = gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1)    # the longest rows first
    t_w = i_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, row_l))     # [BT] tokens of the window
    m_b = t_w < NT
    tb = ((T0 + t_w) % SEQ_T) // LS
    o_j = gl.arange(0, NP, layout=gl.SliceLayout(0, row_l))[None, :] + 0 * t_w[:, None]   # [BT, NP] columns
    t_l = i_t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, load_l))    # the same tokens in the load layout
    m_l = t_l < NT
    tb_l = ((T0 + t_l) % SEQ_T) // LS
    row = ((t_l.to(gl.int64) * H + i_h) * (2 * NB))[:, None]
    c_l = gl.arange(0, NP, layout=gl.SliceLayout(0, load_l))[None, :]
    # _top_keys as doubles: a positive int64's bits order like the finite double they spell, and a double
    # compare-exchange takes fewer instructions (no candidate: 0, not -1, which would spell a NaN)
    top = gl.full([BT, NP], 0., gl.float64, row_l)
    for j0 in range(0, gl.max(gl.where(m_b, tb + 1, 0), 0), NP):
        jj = j0 + c_l
        m_j = m_l[:, None] & (jj <= tb_l[:, None])
        b_sc = gl.load(scores + row + jj, mask=m_j, other=0.)
        b_sc += gl.load(scores + row + NB - 1 + jj, mask=m_j & (jj >= 1), other=0.)
        jj = j0 + o_j
        key = _top_keys(gl.convert_layout(b_sc, row_l), jj, tb, N_INIT, N_LOCAL)
        key = gl.where(m_b[:, None] & (jj <= tb[:, None]), key, 0).to(gl.float64, bitcast=True)
        top = _row_sort(gl.maximum(top, _row_sort(key, o_j, 0, 0, LOG_NP)), o_j, 1, 1, LOG_NP)
    top = top.to(gl.int64, bitcast=True)
    j = gl.where((o_j < NS) & (top > 0), (INT_MAX - (top & INT_MAX)).to(gl.int32), INT_MAX)
    j = _row_sort(j, o_j, 0, 0, LOG_NP)                    # ascending, padding last
    gl.store(idx + ((T0 + t_w).to(gl.int64) * H + i_h)[:, None] * NS + o_j, gl.where(j == INT_MAX, -1, j),
             mask=m_b[:, None] & (o_j < NS))


# ----------------------------------------------------------------------------------------------------------------
# decode kernels: one query token per row over nsa_attention.nsa_cache, all G heads of a KV group in one [BG, D] Q
# tile. Four launches, each parallel over its work; the reference is nsa_attention.decode_attention's torch path.
# Each group's partial softmaxes (m, l, acc) share one buffer: [compressed splits | window chunks | selected tiles].
#  1. _dec_cmp_kernel: split-K over the compressed cache (partials, and the raw scores s, base 2, for step 2), plus
#     programs over chunks of the window ring, which needs no selection and so runs here, off the dependent chain.
#  2. _dec_score_kernel: per group and chunk of selection blocks: lse from the compressed partials, p = 2^(s - lse)
#     summed over the heads (Eq. 10) and mapped to selection blocks (Eq. 9); then the chunk's own top-n candidates
#     (the group's top-n are among the union of its chunks' top-n).
#  3. _dec_attend_kernel: per group and attend_blocks selected blocks: top-n over the candidates (forced first, then
#     by score, ties to the lower block), then one online-softmax step over those blocks' tokens <= pos.
#  4. _dec_combine_kernel: per query head, one softmax merge per branch of its partials, mixed by the gate.

@triton.jit
def _dec_step(b_q, b_k, b_v, valid, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """softmax_step for a [BG, D] query tile over a [BN, D] key tile, with dots in PREC: "ieee" for fp32 caches (a
    decode step is memory-bound, so exact fp32 costs nothing), else "tf32"; the accumulator is updated before the
    sum (the other order takes more registers with fp32 caches). Returns the scores too (scaled)."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale_log2
    b_s = tl.where(valid[None, :], b_s, float("-inf"))                    # [BG, BN]
    m_new, alpha, b_p = softmax_rescale(b_s, m_i, 1.)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PREC)     # [BG, BDV]
    return b_s, m_new, l_i * alpha + tl.sum(b_p, 1), acc


@triton.jit
def _dec_store_partial(m_out, l_out, acc_out, part, m_i, l_i, acc, G: tl.constexpr, BG: tl.constexpr,
                       DV: tl.constexpr, BDV: tl.constexpr):
    o_g = tl.arange(0, BG)
    tl.store(m_out + part * G + o_g, m_i, mask=o_g < G)
    tl.store(l_out + part * G + o_g, l_i, mask=o_g < G)
    store_rows(acc_out, part * G + o_g, o_g < G, acc, DV, BDV)


@triton.jit
def _dec_cmp_kernel(q, k, v, k_win, v_win, pos, s_out, m_out, l_out, acc_out, scale_log2, TC, PER_SPLIT, NSPLIT, A,
                    BB, W, WN, NPART, H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, D: tl.constexpr,
                    DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)                         # i_s < NSPLIT: compressed, else window
    p = tl.load(pos + i_bh // H)
    o_g, o_n = tl.arange(0, BG), tl.arange(0, BN)
    b_q = load_rows(q + i_bh * G * D, o_g, o_g < G, D, BD)                # [BG, BD]
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    is_cmp = i_s < NSPLIT
    if is_cmp:                                                             # compressed keys [start, end)
        start = i_s * PER_SPLIT
        end = tl.minimum(start + PER_SPLIT, cmp_seen(p, A, BB, TC)).to(tl.int32)
        k_g, v_g = k + i_bh.to(tl.int64) * TC * D, v + i_bh.to(tl.int64) * TC * DV
    else:                                                                  # window ring slots [start, end)
        start = (i_s - NSPLIT) * WN
        end = tl.minimum(start + WN, W).to(tl.int32)
        k_g, v_g = k_win + i_bh.to(tl.int64) * W * D, v_win + i_bh.to(tl.int64) * W * DV
    for c0 in range(start, end, BN):
        c = c0 + o_n                                                       # [BN] compressed keys / ring slots
        # ring slot c holds a position >= 0 iff c <= p; a compressed key c < seen always has c <= p
        valid = (c < end) & (c <= p)
        b_k = load_rows(k_g, c, valid, D, BD)                              # [BN, BD]
        b_v = load_rows(v_g, c, valid, DV, BDV)                            # [BN, BDV]
        b_s, m_i, l_i, acc = _dec_step(b_q, b_k, b_v, valid, m_i, l_i, acc, scale_log2, PREC)
        tl.store(s_out + (i_bh * G + o_g).to(tl.int64)[:, None] * TC + c[None, :], b_s,
                 mask=(o_g < G)[:, None] & (c < end)[None, :] & is_cmp)
    _dec_store_partial(m_out, l_out, acc_out, i_bh * NPART + i_s, m_i, l_i, acc, G, BG, DV, BDV)


@triton.jit
def _dec_score_kernel(s_in, m_in, l_in, pos, score_out, cand_out, TC, NSPLIT, NPART, NB, NCHUNK, A, BB, LS, N_INIT,
                      N_LOCAL, G: tl.constexpr, BG: tl.constexpr, H: tl.constexpr, BS: tl.constexpr,
                      BJ: tl.constexpr, NS: tl.constexpr, BNS: tl.constexpr):
    i_bh, i_j = tl.program_id(0), tl.program_id(1)
    p = tl.load(pos + i_bh // H)
    seen = cmp_seen(p, A, BB, TC)
    o_s, o_g = tl.arange(0, BS), tl.arange(0, BG)
    part = (i_bh * NPART + o_s)[:, None] * G + o_g[None, :]                    # [BS, BG] compressed partials
    m_p = tl.load(m_in + part, mask=(o_s < NSPLIT)[:, None] & (o_g < G)[None, :], other=float("-inf"))
    l_p = tl.load(l_in + part, mask=(o_s < NSPLIT)[:, None] & (o_g < G)[None, :], other=0.)
    m = tl.max(m_p, 0)
    m = tl.where(m == float("-inf"), 0., m)
    l_sum = tl.sum(l_p * tl.exp2(m_p - m[None, :]), 0)
    lse2 = m + tl.log2(tl.where(l_sum > 0., l_sum, 1.))                        # [BG] log2 softmax denominators
    j = i_j * BJ + tl.arange(0, BJ)                                            # [BJ] selection blocks
    R, L = LS // BB, A // BB
    score = tl.zeros([BJ], tl.float32)
    for kk in range(R + L - 1):                                 # Eq. 9: block j reads c = j*R - L + 1 + kk
        c = j * R - L + 1 + kk
        start = (kk - L + 1) * BB
        wt = _overlap(start, 0, A, LS, BB)
        b_s = tl.load(s_in + (i_bh * G + o_g).to(tl.int64)[:, None] * TC + c[None, :],
                      mask=(o_g < G)[:, None] & ((c >= 0) & (c < seen) & (j < NB))[None, :], other=float("-inf"))
        score += wt * tl.sum(tl.exp2(b_s.to(tl.float32) - lse2[:, None]), 0)  # Eq. 10: sum over the group
    tl.store(score_out + i_bh * NB + j, score, mask=j < NB)
    # candidates: an int64 key per block (score bits, then the lower block; forced blocks score inf, blocks after
    # the query's own -1), and this chunk's top-n keys by counting the larger keys of each (no serial passes)
    tb = p // LS                                                               # block of the query itself
    forced = (j < N_INIT) | ((j > tb - N_LOCAL) & (j <= tb))
    score = tl.where(forced, float("inf"), score)
    key = (score.to(tl.int32, bitcast=True).to(tl.int64) << 20) + ((1 << 20) - 1 - j)   # score >= 0: bits order
    key = tl.where((j <= tb) & (j < NB), key, -1)                              # [BJ]
    larger = tl.sum((key[:, None] > key[None, :]).to(tl.int32), 0)            # [BJ] keys above each key
    top = (larger < NS) & (key >= 0)
    rank = tl.cumsum(top.to(tl.int32), 0) - 1
    out = cand_out + (i_bh * NCHUNK + i_j) * NS                                # ascending blocks, then -1
    tl.store(out + rank, key, mask=top)
    o_n = tl.arange(0, BNS)
    tl.store(out + o_n, tl.full([BNS], -1, tl.int64), mask=(o_n >= tl.sum(top.to(tl.int32), 0)) & (o_n < NS))


@triton.jit
def _dec_attend_kernel(q, k_slc, v_slc, pos, cand, idx_out, reads_out, m_out, l_out, acc_out, scale_log2, S, W, LS,
                       NCAND, A, BB, TC, FIRST, NPART, H: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
                       NS: tl.constexpr, BNS: tl.constexpr, SB: tl.constexpr, BCAND: tl.constexpr,
                       D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BN: tl.constexpr,
                       PREC: tl.constexpr):
    i_bh, i_p = tl.program_id(0), tl.program_id(1)                         # selected blocks SB*i_p .. SB*i_p + SB-1
    p = tl.load(pos + i_bh // H)
    o_c = tl.arange(0, BCAND)
    key = tl.load(cand + i_bh * NCAND + o_c, mask=o_c < NCAND, other=-1)      # [BCAND] ascending blocks, -1 holes
    j = ((1 << 20) - 1 - (key & ((1 << 20) - 1))).to(tl.int32)                # [BCAND] their block ids
    chosen = o_c < 0
    # top-n, one max at a time: counting larger keys as the score kernel does would compare [BCAND, BCAND] pairs,
    # which measured slower with hundreds of candidates
    for _ in range(NS):
        top = tl.max(key, 0)
        hit = (key == top) & (top >= 0)
        chosen = chosen | hit
        key = tl.where(hit, -1, key)
    rank = tl.cumsum(chosen.to(tl.int32), 0) - 1                               # [BCAND] order of the chosen blocks
    if i_p == 0:                                                               # idx ascending then -1, and reads
        tl.store(idx_out + i_bh * NS + rank, j, mask=chosen)
        o_n = tl.arange(0, BNS)
        tl.store(idx_out + i_bh * NS + o_n, tl.full([BNS], -1, tl.int32),
                 mask=(o_n >= tl.sum(chosen.to(tl.int32), 0)) & (o_n < NS))
        # tokens this group read per branch: visible compressed blocks, the chosen blocks' tokens <= p, the window
        tl.store(reads_out + i_bh * 3, cmp_seen(p, A, BB, TC).to(tl.int64))
        tl.store(reads_out + i_bh * 3 + 1,
                 tl.sum(tl.where(chosen, tl.minimum(tl.maximum(p + 1 - j * LS, 0), LS), 0), 0).to(tl.int64))
        tl.store(reads_out + i_bh * 3 + 2, tl.minimum(p + 1, W).to(tl.int64))
    o_g, o_r = tl.arange(0, BG), tl.arange(0, SB * BN)
    blk = tl.full([SB * BN], -1, tl.int32)                                     # [SB*BN] block of each tile row
    for b in tl.static_range(SB):
        blk = tl.where(o_r // BN == b, tl.max(tl.where(chosen & (rank == SB * i_p + b), j, -1), 0), blk)
    rows = blk * LS + o_r % BN                                                 # [SB*BN] tokens: those <= p
    valid = (o_r % BN < LS) & (rows <= p) & (blk >= 0)
    b_q = load_rows(q + i_bh * G * D, o_g, o_g < G, D, BD)                    # [BG, BD]
    b_k = load_rows(k_slc + i_bh.to(tl.int64) * S * D, rows, valid, D, BD)    # [SB*BN, BD]
    b_v = load_rows(v_slc + i_bh.to(tl.int64) * S * DV, rows, valid, DV, BDV)
    m_i = tl.full([BG], float("-inf"), tl.float32)
    l_i = tl.zeros([BG], tl.float32)
    acc = tl.zeros([BG, BDV], tl.float32)
    _, m_i, l_i, acc = _dec_step(b_q, b_k, b_v, valid, m_i, l_i, acc, scale_log2, PREC)
    _dec_store_partial(m_out, l_out, acc_out, i_bh * NPART + FIRST + i_p, m_i, l_i, acc, G, BG, DV, BDV)


@triton.jit
def _dec_combine_kernel(gate, gate_out, o, m_in, l_in, acc_in, NSPLIT, NWIN, NPART, G: tl.constexpr,
                        DV: tl.constexpr, BP: tl.constexpr, BDV: tl.constexpr):
    i_hq = tl.program_id(0)                                                    # one query head
    i_bh, g = i_hq // G, i_hq % G
    o_r, o_dv = tl.arange(0, BP), tl.arange(0, BDV)
    row = (i_bh * NPART + o_r) * G + g                                         # [BP] this head's partials
    m_p = tl.load(m_in + row, mask=o_r < NPART, other=float("-inf"))
    l_p = tl.load(l_in + row, mask=o_r < NPART, other=0.)
    acc = tl.load(acc_in + row.to(tl.int64)[:, None] * DV + o_dv[None, :],
                  mask=(o_r < NPART)[:, None] & (o_dv < DV)[None, :], other=0.)   # [BP, BDV]
    branch = tl.where(o_r < NSPLIT, 0, tl.where(o_r < NSPLIT + NWIN, 2, 1))    # gate column: cmp 0, slc 1, win 2
    out = tl.zeros([BDV], tl.float32)
    for b in tl.static_range(3):                                               # softmax merge of one branch
        in_b = (branch == b) & (o_r < NPART)
        m = tl.max(tl.where(in_b, m_p, float("-inf")), 0)
        w = tl.where(in_b, tl.exp2(m_p - tl.where(m == float("-inf"), 0., m)), 0.)   # [BP]
        l_b = tl.sum(w * l_p, 0)
        g_b = tl.load(gate + i_hq * 3 + b)
        tl.store(gate_out + i_hq * 3 + b, g_b)                                 # the cache keeps the step's gate
        out += g_b * tl.sum(w[:, None] * acc, 0) / tl.where(l_b == 0., 1., l_b)   # 0 if the branch read no key
    tl.store(o + i_hq * DV + o_dv, out, mask=o_dv < DV)


# ----------------------------------------------------------------------------------------------------------------
# host launchers (no host syncs: every size comes from shapes, so torch.compile and CUDA graphs can capture them)

def _i32(*xs):
    return [x.to(torch.int32).contiguous() for x in xs]


def _cmp_ranges(B, T, Tc, l, d, cu_seqlens, cu_seqlens_cmp, device):
    """Compressed branch: query t reads compressed keys [lo, hi) (its sequence's first blocks, i*d + l - 1 <= pos);
    compressed key c is read by queries [qlo, qhi). Keys past cu_seqlens_cmp[-1] (padding) are read by none."""
    cu, seq, pos = sequences(B, T, cu_seqlens, device)
    cu_c, seq_c, pos_c = sequences(B, Tc, cu_seqlens_cmp, device)
    lo = cu_c[seq]
    nv = torch.where(pos + 1 < l, 0, torch.div(pos + 1 - l, d, rounding_mode="floor") + 1)
    hi = torch.minimum(lo + nv, cu_c[seq + 1])
    inside = seq_c < cu_c.numel() - 1
    cs = seq_c.clamp_max(cu_c.numel() - 2)
    qlo = torch.where(inside, cu[cs] + pos_c * d + l - 1, 0)
    qhi = torch.where(inside, cu[cs + 1], 0)
    return _i32(lo, hi, qlo, qhi)


def _win_ranges(B, T, w, cu_seqlens, device):
    """Window: query t reads keys [max(bos, t - w + 1), t + 1); key u is read by queries [u, min(eos, u + w))."""
    cu, seq, pos = sequences(B, T, cu_seqlens, device)
    t = torch.arange(B * T, device=device)
    bos, eos = cu[seq], cu[seq + 1]
    return _i32(torch.maximum(bos, t - w + 1), t + 1, t, torch.minimum(eos, t + w))


def _ranges(kind, B, T, Tk, a, b, cu_seqlens, cu_seqlens_cmp, device):
    """(geo kwargs of the kernels, lo, hi, qlo, qhi): index arrays only for var-length input."""
    geo = dict(KIND=kind, VARLEN=cu_seqlens is not None, SEQ_T=T, SEQ_TK=Tk, A=a, BB=b)
    if cu_seqlens is None:
        return (geo, *[torch.empty(1, device=device, dtype=torch.int32)] * 4)
    if kind == 0:
        return (geo, *_cmp_ranges(B, T, Tk, a, b, cu_seqlens, cu_seqlens_cmp, device))
    return (geo, *_win_ranges(B, T, a, cu_seqlens, device))


def _sizes(q, k, v, rows):
    """head_sizes plus the tile rows M (tile_m) and BT = M // G tokens per tile (a host-side value, not a kernel
    argument), for q (..., HQ, D), k (..., H, D), v (..., H, Dv)."""
    c = head_sizes(q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1])
    M = tile_m(rows, c["G"])
    return dict(c, M=M), M // c["G"]


def launch_entry(name, G, width, table=None):
    """The entry of `table` (this file's CONFIG, or sel_kernel's) kernel `name` launches with at G query heads per kv
    head and heads width = max(D, Dv) wide: "{name}_small_d" up to SMALL_D wide, else "{name}_small_g" below SMALL_G,
    where the table has them, else name."""
    table = CONFIG if table is None else table
    for entry, applies in ((f"{name}_small_d", width <= SMALL_D), (f"{name}_small_g", G < SMALL_G)):
        if applies and entry in table:
            return entry
    return name


def wide_rows(width, elem):
    """Whether heads `width` wide of elem-byte values take halved tiles (so that they fit in shared memory): rows of
    more than 256 bytes, i.e. wider than 128 in 16 bits, than 64 in fp32."""
    return width * elem > 256


def _launch_cfg(name, q, k, v):
    """(M, launch kwargs) for a kernel on q (..., HQ, D), k (..., H, D), v (..., H, Dv): the CONFIG entry of its
    G = HQ / H and head width; wide rows (wide_rows) halve the tiles and take at most 2 stages."""
    width = max(q.shape[-1], v.shape[-1])
    c = dict(CONFIG[launch_entry(name, q.shape[-2] // k.shape[-2], width)])
    M = c.pop("M", 0)
    if wide_rows(width, q.element_size()):
        M = max(16, M // 2)
        if "BN" in c:
            c["BN"] = max(16, c["BN"] // 2)
        c["num_stages"] = min(c["num_stages"], 2)
    return M, c


def _range_keys(k, v, geo, BN, c):
    """K and V of the forward and dq kernels as key_tile loads them (tma_boxes), but by pointers for compressed keys
    with var-length input: past cu_seqlens_cmp[-1] they may be padding, which no kernel reads."""
    if geo["KIND"] == 0 and geo["VARLEN"]:
        return k, v, False
    return tma_boxes(k, v, [BN, 1, c["BD"]], [BN, 1, c["BDV"]])


def _range_fwd(q, k, v, gate, geo, lo, hi, scale):
    """q (NT, HQ, D), k (NK, H, D), v (NK, H, Dv), gate (NT, HQ) fp32 or None, packed -> o (NT, HQ, Dv) (times the
    gate), lse (NT, HQ) fp32 natural log (of the branch's own softmax)."""
    NT, HQ, _ = q.shape
    o = torch.empty(NT, HQ, v.shape[2], device=q.device, dtype=q.dtype)
    lse = torch.empty(NT, HQ, device=q.device, dtype=torch.float32)
    if NT == 0:
        return o, lse
    H, G = k.shape[1], HQ // k.shape[1]
    if _ws_rows_apply(geo) and _ws_applies(q, k, v):
        D, DV = q.shape[2], v.shape[2]
        n_tiles = triton.cdiv(NT, 128 // G) * H
        _ws_range_kernel[(min(n_tiles, _sm_count(q.device)),)](
            _ws_desc(q, [128 // G, G, D]), None, _ws_desc(o, [64 // G, G, DV]),
            _ws_desc(k.view(-1, H * D), [128, D]), _ws_desc(v.view(-1, H * DV), [128, DV]), lse, None, None, None,
            gate, lo, hi, scale * math.log2(math.e), 1., NT, n_tiles, **geo, H=H, G=G, D=D, DV=DV, BN=128, STAGES=2,
            GATED=gate is not None, BWD=False, num_warps=4)
        return o, lse
    M, launch = _launch_cfg("fwd", q, k, v)
    c, BT = _sizes(q, k, v, M)
    kb, vb, boxes = _range_keys(k, v, geo, launch["BN"], c)
    _range_fwd_kernel[(triton.cdiv(NT, BT), c["H"])](q, kb, vb, o, lse, gate, lo, hi, scale * math.log2(math.e), NT,
                                                          **geo, **c, **launch, BOXES=boxes, GATED=gate is not None)
    return o, lse


def _range_bwd(do, q, k, v, gate, o, lse, geo, lo, hi, qlo, qhi, scale):
    """dq, dk, dv and delta = rowsum(o_branch * do) (dgate with a gate). The compressed branch's dk/dv splits each key
    block's queries into token chunks (parallelism where keys are few): fp32 partials summed in a fixed order, so
    still deterministic."""
    NT, HQ, _ = q.shape
    NK = k.shape[0]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty(NT, HQ, device=q.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)                        # the dq kernel's base-2 gated lse (gate_lse), for dk/dv
    sl2 = scale * math.log2(math.e)
    if NT > 0 and _ws_rows_apply(geo) and _ws_applies(q, k, v, do, o):
        H, G, D, DV = k.shape[1], HQ // k.shape[1], q.shape[2], v.shape[2]
        n_tiles = triton.cdiv(NT, 128 // G) * H
        _ws_range_kernel[(min(n_tiles, _sm_count(q.device)),)](
            _ws_desc(q, [128 // G, G, D]), _ws_desc(do, [128 // G, G, DV]), _ws_desc(o, [128 // G, G, DV]),
            _ws_desc(k.view(-1, H * D), [64, D]), _ws_desc(v.view(-1, H * DV), [64, DV]), lse, lse2, delta, dq, gate,
            lo, hi, sl2, scale, NT, n_tiles, **geo, H=H, G=G, D=D, DV=DV, BN=64, STAGES=2, GATED=gate is not None,
            BWD=True, num_warps=4)
    elif NT > 0:
        M, launch = _launch_cfg("dq", q, k, v)
        c, BT = _sizes(q, k, v, M)
        kb, vb, boxes = _range_keys(k, v, geo, launch["BN"], c)
        _range_bwd_dq_kernel[(triton.cdiv(NT, BT), c["H"])](q, kb, vb, o, do, lse, lse2, delta, dq, gate, lo, hi, sl2,
                                                                 scale, NT, **geo, **c, **launch, BOXES=boxes,
                                                                 GATED=gate is not None)
    if NK > 0 and NT > 0:
        H = k.shape[1]
        # Gluon: 128 keys, steps of 64 rows (the window's at G = 1 stays Triton's, which was faster there)
        ws = _ws_applies(q, k, v, do) and (geo["KIND"] == 0 or HQ > H)
        M, launch = (64, dict(BN=128)) if ws else _launch_cfg("dkv", q, k, v)
        rows = 1 if geo["VARLEN"] else NK // geo["SEQ_TK"]  # key tiles stay inside a row without var-length input
        q_span = NT // rows                                 # the tokens a key's queries lie in
        key_tiles = rows * triton.cdiv(NK // rows, launch["BN"])
        # compressed keys are few (T / d): chunks of at least DKV_CHUNK tokens, so the grid aims at DKV_PROGRAMS
        n_chunks = 1 if geo["KIND"] == 1 else min(triton.cdiv(q_span, DKV_CHUNK),
                                                  triton.cdiv(DKV_PROGRAMS, key_tiles * H))
        width = max(q.shape[2], v.shape[2])
        if not ws and key_tiles * n_chunks * H < DKV_FEW_PROGRAMS and launch_entry("dkv", HQ // H, width) == "dkv":
            M, launch = _launch_cfg("dkv_few", q, k, v)     # (the same BN: the grid stays)
        c, BT = _sizes(q, k, v, M)
        qch = triton.cdiv(triton.cdiv(q_span, n_chunks), BT) * BT
        nqc = triton.cdiv(q_span, qch)
        dk_p, dv_p = (dk, dv) if nqc == 1 else (k.new_empty(nqc, *k.shape, dtype=torch.float32),
                                                 v.new_empty(nqc, *v.shape, dtype=torch.float32))
        if ws:
            G, D, DV = c["G"], c["D"], c["DV"]
            _ws_dkv_kernel[(key_tiles, nqc, H)](
                _ws_desc(q, [BT, G, D]), _ws_desc(do, [BT, G, DV]), _ws_desc(k.view(NK, H * D), [64, D]),
                _ws_desc(v.view(NK, H * DV), [64, DV]), lse2, delta, dk_p, dv_p, qlo, qhi, sl2, scale, NK, NT, qch,
                **geo, H=H, G=G, D=D, DV=DV, BT=BT, STAGES=2, num_warps=4)
        else:
            _range_bwd_dkv_kernel[(key_tiles, nqc, c["H"])](
                q, k, v, do, lse2, delta, dk_p, dv_p, qlo, qhi, sl2, scale, NK, qch, **geo, **c, **launch)
        if nqc > 1:
            BE = 1024
            _range_sum_chunks_kernel[(triton.cdiv(max(dk.numel(), dv.numel()), BE),)](
                dk_p, dv_p, dk, dv, nqc, dk.numel(), dv.numel(), BE=BE)
    elif NK > 0:
        dk.zero_()
        dv.zero_()
    return dq, dk, dv, delta


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops: opaque to torch.compile (fake impls give shapes), autograd through the backward op.
# range attention: kind 0 = compressed (a, b = cmp_block, cmp_stride), kind 1 = window (a = window).

def _range_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Optional[torch.Tensor], kind: int,
                    a: int, b: int, scale: float, cu_seqlens: Optional[torch.Tensor],
                    cu_seqlens_cmp: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, HQ, _ = q.shape
    geo, lo, hi, _, _ = _ranges(kind, B, T, k.shape[1], a, b, cu_seqlens, cu_seqlens_cmp, q.device)
    o, lse = _range_fwd(pack(q), pack(k), pack(v), pack_gate(gate), geo, lo, hi, scale)
    return o.view(B, T, HQ, v.shape[3]), lse.view(B, T, HQ)


def _range_attn_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    gate: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor, kind: int, a: int, b: int,
                    scale: float, cu_seqlens: Optional[torch.Tensor], cu_seqlens_cmp: Optional[torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, HQ, _ = q.shape
    geo, lo, hi, qlo, qhi = _ranges(kind, B, T, k.shape[1], a, b, cu_seqlens, cu_seqlens_cmp, q.device)
    dq, dk, dv, delta = _range_bwd(pack(do), pack(q), pack(k), pack(v), pack_gate(gate), pack(o), pack(lse), geo, lo,
                                   hi, qlo, qhi, scale)
    return dq.view_as(q), dk.view_as(k), dv.view_as(v), gate_grad(delta, gate)


range_attn_fwd, range_attn_bwd = attention_op("range_attn", _range_attn_fwd, _range_attn_bwd)


def _head_bits(M, BG):
    """_head_rows' QB for a tile of M query rows and BG heads a token: BG / (2 * M / 64) where that is 1..8, else 0
    (token major)."""
    s = M // 64
    return BG // (2 * s) if M % 64 == 0 and 2 * s <= BG <= 16 * s else 0


def _select_smem(BT, BG, BKC, BD, NP, num_stages, itemsize):
    """_select_kernel's shared memory on sm_90 as Triton allocates it: the Q tile, num_stages key chunks and one
    [BT, NP] fp32 layout change (tests/compile_hopper.py holds the compiler to it)."""
    return (BT * BG + num_stages * BKC) * BD * itemsize + BT * NP * 4


def _ws_select_applies(qf, kf, T, cmp_stride, sel_block, n_select, cu_seqlens):
    """Whether block selection takes _ws_score_kernel and _ws_top_kernel for packed qf (B*T, HQ, D), kf (B*Tc, H, D):
    the warp-specialised kernels' inputs (_ws_applies), G from SELECT_WS_MIN_G to 32, no var-length input, whole
    tiles of 256 / G tokens in each row of T, l' / d = 2, 4 or 8 compressed keys a selection block (a chunk of 64
    keys holds whole blocks; the ones the GPU tests run) and n <= 32 (a token's top n in one thread's registers)."""
    G = qf.shape[1] // kf.shape[1]
    return (cu_seqlens is None and SELECT_WS_MIN_G <= G <= 32 and T % (256 // G) == 0
            and sel_block // cmp_stride in (2, 4, 8) and n_select <= 32 and _ws_applies(qf, kf, kf))


def _ws_select(qf, kf, lse, idx, T, l, d, ls, n, n_init, n_local, scale):
    """Block selection by _ws_score_kernel and _ws_top_kernel into idx (B*T, H, n) for packed qf (B*T, HQ, D), kf
    (B*Tc, H, D), lse (B*T, HQ) in rows of T tokens, in windows of tokens whose scores take at most
    SELECT_SCORE_BYTES."""
    NT, HQ, D = qf.shape
    H = kf.shape[1]
    Tc, G, NB = kf.shape[0] // (NT // T), HQ // H, triton.cdiv(T, ls)
    TT = 256 // G                                         # tokens a tile
    # a strided view of Q whose [TT / 4, G / 2, 4, 2, D] box holds a tile's rows in the order _ws_score_consumer reads
    q_desc = _ws_desc(qf, [TT // 4, G // 2, 4, 2, D], [NT // 4, HQ // 2, 4, 2, D], [4 * HQ * D, 2 * D, HQ * D, D, 1])
    k_desc = _ws_desc(kf.view(-1, H * D), [64, D])
    window = max(TT, SELECT_SCORE_BYTES // (H * 2 * NB * 4) // TT * TT)
    scores = torch.empty(min(window, NT), H, 2, NB, device=qf.device, dtype=torch.float32)
    for t0 in range(0, NT, window):
        nt = min(window, NT - t0)
        n_tiles = nt // TT * H
        _ws_score_kernel[(min(n_tiles, _sm_count(qf.device)),)](
            q_desc, k_desc, scores, lse, scale * math.log2(math.e), t0, nt, n_tiles, T, Tc, NB, H=H, G=G, D=D,
            BK=64, STAGES=4, L=l, DS=d, LS=ls, NP=64 // (ls // d), num_warps=4)
        _select_top(scores, idx, t0, nt, T, ls, n, n_init, n_local)


def _select_top(scores, idx, t0, nt, T, ls, n, n_init, n_local):
    """_ws_top_kernel: tokens t0 .. t0 + nt of idx (B*T, H, n) from their block scores' parts scores (>= nt, H, 2, NB)
    in rows of T tokens."""
    H, NB = scores.shape[1], scores.shape[3]
    NP = max(16, triton.next_power_of_2(n))
    _ws_top_kernel[(triton.cdiv(nt, 32), H)](scores, idx, t0, nt, T, NB, H=H, LS=ls, NS=n, NP=NP, N_INIT=n_init,
                                              N_LOCAL=n_local, LOG_NP=int(math.log2(NP)), num_warps=1)


@torch.library.custom_op("nsa::select", mutates_args=())
def select_op(q: torch.Tensor, k_cmp: torch.Tensor, lse: torch.Tensor, cmp_block: int, cmp_stride: int,
              sel_block: int, n_select: int, n_init: int, n_local: int, scale: float,
              cu_seqlens: Optional[torch.Tensor], cu_seqlens_cmp: Optional[torch.Tensor]) -> torch.Tensor:
    B, T, HQ, D = q.shape
    Tc, H = k_cmp.shape[1], k_cmp.shape[2]
    idx = torch.empty(B * T, H, n_select, device=q.device, dtype=torch.int32)
    if B * T == 0:
        return idx.view(B, T, H, n_select)
    qf, kf = pack(q), pack(k_cmp)                         # (B*T, HQ, D), (B*Tc, H, D)
    if _ws_select_applies(qf, kf, T, cmp_stride, sel_block, n_select, cu_seqlens):
        _ws_select(qf, kf, pack(lse), idx, T, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale)
        return idx.view(B, T, H, n_select)
    if cu_seqlens is None:                                # the kernel computes positions itself
        seq = pos = cu_c = idx
    else:
        _, seq, pos = sequences(B, T, cu_seqlens, q.device)
        seq, pos, cu_c = _i32(seq, pos, cu_seqlens_cmp)
    c = head_sizes(HQ, H, D, D)
    M, launch = _launch_cfg("select", q, k_cmp, k_cmp)
    BG = triton.next_power_of_2(c["G"])                   # padded rows: the kernel sums a token's heads by reshape
    tokens = launch.pop("tokens", 0)                      # "select_small_g": tokens per tile, at least 64 rows
    BT = max(64, tokens * BG) // BG if tokens else max(1, M // BG)
    NP = max(16, triton.next_power_of_2(n_select))
    BKC = max(16, triton.next_power_of_2(NP * (sel_block // cmp_stride)))
    # within SELECT_SMEM: a wide chunk (n or l' / d large) takes fewer stages, then fewer tokens a tile; and no stage
    # that costs the second program on a multiprocessor
    smem = lambda stages: _select_smem(BT, BG, BKC, c["BD"], NP, stages, q.element_size())
    while smem(launch["num_stages"]) > SELECT_SMEM and launch["num_stages"] > 2:
        launch["num_stages"] -= 1
    while smem(launch["num_stages"]) > SELECT_SMEM and BT > 1:
        BT //= 2
    if launch["num_stages"] > 2 and smem(launch["num_stages"]) > SELECT_SMEM_PAIR >= smem(launch["num_stages"] - 1):
        launch["num_stages"] -= 1
    _select_kernel[(triton.cdiv(B * T, BT), H)](
        qf, kf, pack(lse), idx, pos, seq, cu_c, scale * math.log2(math.e), B * T,
        VARLEN=cu_seqlens is not None, SEQ_T=T, SEQ_TK=Tc,
        H=H, G=c["G"], BG=BG, BT=BT, D=D, BD=c["BD"], L=cmp_block, DS=cmp_stride, LS=sel_block,
        NS=n_select, NP=NP, BKC=BKC, N_INIT=n_init, N_LOCAL=n_local, LOG_NP=int(math.log2(NP)),
        N_DIMS=int(math.log2(NP * BT)), QB=_head_bits(BT * BG, BG),
        **launch)
    return idx.view(B, T, H, n_select)


@select_op.register_fake
def _(q, k_cmp, lse, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale, cu_seqlens, cu_seqlens_cmp):
    B, T, _, _ = q.shape
    return q.new_empty(B, T, k_cmp.shape[2], n_select, dtype=torch.int32)


@torch.library.custom_op("nsa::decode", mutates_args=("idx", "score", "reads", "gate_out"))
def decode_op(q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, k_slc: torch.Tensor, v_slc: torch.Tensor,
              k_win: torch.Tensor, v_win: torch.Tensor, pos: torch.Tensor, gate: torch.Tensor, idx: torch.Tensor,
              score: torch.Tensor, reads: torch.Tensor, gate_out: torch.Tensor, cmp_block: int, cmp_stride: int,
              sel_block: int, n_select: int, n_init: int, n_local: int, scale: float) -> torch.Tensor:
    B, HQ, D = q.shape
    H, TC, DV = k_cmp.shape[1], k_cmp.shape[2], v_cmp.shape[3]
    S, W = k_slc.shape[2], k_win.shape[2]
    dev, f32, num_blocks = q.device, torch.float32, score.shape[-1]
    if B == 0:
        return q.new_empty(0, HQ, DV, dtype=f32)
    dims = dict(head_sizes(HQ, H, D, DV), PREC="ieee" if q.dtype == f32 else "tf32")
    G = dims["G"]
    dims["BG"] = max(16, triton.next_power_of_2(G))                    # one [BG, D] tile per group: tl.dot rows
    cfg = DECODE_CONFIG
    BC, WN, BJ, SB = cfg["cmp_keys"], cfg["window_keys"], cfg["score_blocks"], cfg["attend_blocks"]
    nsplit = min(triton.cdiv(TC, BC), triton.cdiv(cfg["programs"], B * H))
    per_split = triton.cdiv(triton.cdiv(TC, nsplit), BC) * BC
    nsplit = triton.cdiv(TC, per_split)                                # compressed partials per group
    nwin, nsel = triton.cdiv(W, WN), triton.cdiv(n_select, SB)         # window and selected partials per group
    npart, nchunk = nsplit + nwin + nsel, triton.cdiv(num_blocks, BJ)
    o = torch.empty(B, HQ, DV, device=dev, dtype=f32)
    # raw scores: fp16 for bf16/fp16 caches (rounding 2^-11 relative, 8x below that of the bf16 keys they come from)
    s = torch.empty(B * H, G, TC, device=dev, dtype=f32 if q.dtype == f32 else torch.float16)
    m_p, l_p = (torch.empty(B * H, npart, G, device=dev, dtype=f32) for _ in range(2))
    acc_p = torch.empty(B * H, npart, G, DV, device=dev, dtype=f32)
    cand = torch.empty(B * H, nchunk, n_select, device=dev, dtype=torch.int64)   # each chunk's top-n keys
    BNS = max(2, triton.next_power_of_2(n_select))
    scale_log2 = scale * math.log2(math.e)
    q, pos, gate = q.contiguous(), pos.contiguous(), gate.float().contiguous()
    _dec_cmp_kernel[(B * H, nsplit + nwin)](q, k_cmp, v_cmp, k_win, v_win, pos, s, m_p, l_p, acc_p, scale_log2, TC,
                                            per_split, nsplit, cmp_block, cmp_stride, W, WN, npart, BN=BC,
                                            **dims, num_warps=cfg["cmp_warps"], num_stages=cfg["cmp_stages"])
    _dec_score_kernel[(B * H, nchunk)](s, m_p, l_p, pos, score, cand, TC, nsplit, npart, num_blocks, nchunk,
                                       cmp_block, cmp_stride, sel_block, n_init, n_local, G=G, BG=dims["BG"], H=H,
                                       BS=max(2, triton.next_power_of_2(nsplit)), BJ=BJ, NS=n_select, BNS=BNS,
                                       num_warps=cfg["score_warps"])
    _dec_attend_kernel[(B * H, nsel)](q, k_slc, v_slc, pos, cand, idx, reads, m_p, l_p, acc_p, scale_log2, S, W,
                                      sel_block, nchunk * n_select, cmp_block, cmp_stride, TC, nsplit + nwin, npart,
                                      NS=n_select, BNS=BNS, SB=SB,
                                      BCAND=max(16, triton.next_power_of_2(nchunk * n_select)),
                                      BN=max(16, triton.next_power_of_2(sel_block)), **dims,
                                      num_warps=cfg["attend_warps"])
    BP = max(2, triton.next_power_of_2(npart))                         # combine: one warp per 4096 partial values
    _dec_combine_kernel[(B * HQ,)](gate, gate_out, o, m_p, l_p, acc_p, nsplit, nwin, npart, G=G, DV=DV,
                                   BP=BP, BDV=dims["BDV"], num_warps=max(1, min(8, BP * dims["BDV"] // 4096)))
    return o


@decode_op.register_fake
def _(q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, pos, gate, idx, score, reads, gate_out, cmp_block, cmp_stride,
      sel_block, n_select, n_init, n_local, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_cmp.shape[3], dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# public functions (nsa_attention.py validates inputs before calling these)

def compressed_attention_triton(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, cu_seqlens=None, cu_seqlens_cmp=None,
                                gate=None):
    """Attention over compressed tokens (the definition in nsa_attention.py, "Compressed"), differentiable in q,
    k_cmp, v_cmp and gate. q (B, T, HQ, D), k_cmp (B, Tc, H, D), v_cmp (B, Tc, H, Dv) fp16/bf16/fp32; query t sees
    block i iff i*d + l - 1 <= t (relative to its sequence with cu_seqlens int32 (N+1,), B == 1, and cu_seqlens_cmp
    int32 (N+1,)); gate (B, T, HQ) or None scales each row of o. Returns o (B, T, HQ, Dv) in q's dtype and lse
    (B, T, HQ) fp32 of the ungated softmax (no gradient; -inf and o = 0 where no block)."""
    if cu_seqlens is not None and cu_seqlens_cmp is None:
        raise ValueError("cu_seqlens_cmp is needed with cu_seqlens (nsa_attention.cmp_cu_seqlens builds it)")
    return range_attn_fwd(q, k_cmp, v_cmp, gate, 0, int(cmp_block), int(cmp_stride), float(scale), cu_seqlens,
                          cu_seqlens_cmp)


def window_attention_triton(q, k, v, window, scale, cu_seqlens=None, gate=None):
    """Sliding-window causal attention (the definition in nsa_attention.py, "Window"): query t sees keys
    max(bos, t - window + 1) .. t. q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv); cu_seqlens int32 (N+1,) with
    B == 1 for packed sequences; gate (B, T, HQ) or None scales each row of o. Returns o (B, T, HQ, Dv) in q's dtype,
    differentiable in q, k, v and gate (deterministic backward)."""
    return range_attn_fwd(q, k, v, gate, 1, int(window), 0, float(scale), cu_seqlens, None)[0]


def select_blocks_triton(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale,
                         cu_seqlens=None, cu_seqlens_cmp=None, lse=None):
    """Top-n selection blocks (the definition in nsa_attention.py, "Selected", Eq. 8-10) without materialising
    scores. q (B, T, HQ, D), k_cmp (B, Tc, H, D); lse (B, T, HQ) fp32 from compressed_attention (computed here when
    None). Returns int32 (B, T, H, n_select): valid block ids ascending (forced blocks included), then -1. No
    gradient."""
    if cu_seqlens is not None and cu_seqlens_cmp is None:
        raise ValueError("cu_seqlens_cmp is needed with cu_seqlens (nsa_attention.cmp_cu_seqlens builds it)")
    q, k_cmp = q.detach(), k_cmp.detach()
    if lse is None:
        lse = range_attn_fwd(q, k_cmp, k_cmp[..., :1], None, 0, int(cmp_block), int(cmp_stride), float(scale),
                             cu_seqlens, cu_seqlens_cmp)[1]
    return select_op(q, k_cmp, lse.detach().float(), int(cmp_block), int(cmp_stride), int(sel_block), int(n_select),
                     int(n_init), int(n_local), float(scale), cu_seqlens, cu_seqlens_cmp)


def decode_attention_triton(q, cache, pos, gate, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale):
    """One decode step of the three branches and the gate over an nsa_attention.nsa_cache (its reference is
    nsa_attention.decode_attention's torch path; the definition in nsa_attention.py, "Decode reads"). q (B, HQ, D)
    with RoPE, pos (B,) int64, gate (B, HQ, 3). Returns o (B, HQ, Dv) fp32 and writes the cache's sel_idx (B, H, n),
    sel_score (B, H, nb) (Eq. 10), reads (B, H, 3) and gate (B, HQ, 3)."""
    c = cache
    if c.sel_score.shape[-1] >= 1 << 20:
        raise ValueError(f"decode supports fewer than 2^20 selection blocks, got {c.sel_score.shape[-1]}")
    return decode_op(q, c.k_cmp, c.v_cmp, c.k_slc, c.v_slc, c.k_win, c.v_win, pos, gate, c.sel_idx, c.sel_score,
                     c.reads, c.gate, int(cmp_block), int(cmp_stride), int(sel_block), int(n_select), int(n_init),
                     int(n_local), float(scale))
