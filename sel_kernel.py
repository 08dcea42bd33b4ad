"""Triton kernels for NSA's selected-block attention (the definition in nsa_attention.py, "Selected"; paper
Sec. 3.3.2 / 3.4): forward, dq, dk/dv, registered as the ops nsa::sel_attn_fwd / _bwd, which share nsa::sel_index
(the ids' index). nsa_attention.selection_attention (backend "auto" on CUDA, or "triton") calls
selection_attention_triton; row tiles, the online-softmax step, op registration and token positions come from the
shared pieces of nsa_kernels.py."""
import math
from typing import Optional

import torch
import triton
import triton.language as tl

import nsa_kernels
from nsa_kernels import (INT_MAX, attention_op, gate_delta, gate_grad, gate_lse, gate_out, gate_rows, group_rows,
                         head_sizes, key_rows, key_tile, launch_entry, load_rows, pack, pack_gate, sequences,
                         softmax_finish, softmax_rescale, softmax_step, sort_rows, store_rows, tile_m, tile_rows,
                         tma_boxes, wide_rows)
from nsa_kernels import _in_ranges
from nsa_kernels import (_ws_barriers, _ws_desc, _ws_fwd_finish, _ws_load_rows, _ws_mma, _ws_store_rows,
                         fence_async_shared, gl, gluon, mbarrier, tma, warpgroup_mma,
                         warpgroup_mma_wait)  # the warp-specialised pieces

# Layout of the work (NT = all packed tokens, H kv heads, G = HQ / H query heads per kv head, l' = sel_block, n slots):
# - forward and dq: query-centric. One program = BT = M // G consecutive tokens x the G heads of one kv group (an
#   [M, D] Q tile packed as group_rows does, M >= 16 for tl.dot); it walks the tokens' n slots and streams each
#   selected key block once for the whole group (paper Fig. 3, group-centric loading). Where nsa_kernels.tma_boxes
#   applies (Hopper, 16-byte aligned rows) the blocks come as whole boxes by TMA, which frees the program of address
#   arithmetic (a warp per token at G = 16): keys of the box past a token's position (in its own block, or past
#   its sequence's end) are read and get probability 0, exact for finite values, as in any tiled causal kernel;
#   an unused slot reads a box past the array's end (zeros). Else by masked pointer loads, none past the tile's last
#   token. Under "auto" at G = 16 (heads up to 128 wide) the forward's and dq's tiles hold 4 tokens and walk their
#   union list instead: each block once, for the rows whose token chose it (CONFIG["fwd_union"], ["dq_union"]). A
#   union tile costs about the length of its list, so its tokens are not neighbours but are grouped by the blocks
#   they share, inside spans of GROUP_TILES tiles (_group_kernel). On rows longer than UNION_MAX_T tokens the union
#   tiles split: those whose lists pass UNION_SPLIT x n run their tokens one to a tile, in a second launch; on GPUs
#   with at least SPLIT_MAX_L2 of L2 cache, rows longer than ONE_TOKEN_T tokens run one token a tile, no union.
# - forced blocks: where every forward tile holds one token (and CONFIG["forced"]'s tiles hold several: G <= 32) and
#   the caller says the ids hold the forced blocks (forced=(n_init, n_local), as select_blocks' ids do), those
#   blocks, which all tokens of a block share, run first as key ranges in tiles of several tokens
#   (_sel_forced_fwd_kernel: the first n_init blocks, then the n_local up to the token's own), loading each key once
#   per tile instead of once per token; the one-token kernel starts its online softmax from their o and lse and
#   walks only the other ids (_free_ids), one step each. The backward is the same either way: it reads the merged o
#   and lse, and every id.
# - dk/dv: key-block-centric and deterministic. A stable sort of the (kv head, block) of every (token, slot) pair
#   builds the reverse index (which (token, slot) pairs selected each block, tokens ascending) in O(NT*H*n) memory;
#   each list is cut into chunks of CONFIG's chunk_rows query rows (shorter on short inputs, so the grid fills the
#   GPU) so block 0 (selected by every token) does not serialise the launch; each chunk writes an fp32 partial
#   dK/dV tile and a reduction kernel adds a block's partials in chunk order. No atomics.
# - the query path's backward runs the dk/dv first where its score gradients ds = p * (dp - delta) fit in
#   DS_MAX_BYTES: it writes them (one row of l' per pair and query head), and the dq kernel that follows reads them
#   in the dq's tiles, one dot ds @ K per block, with no V to load and no softmax to recompute (_sel_ds_dq_kernel;
#   the same bits as recomputing them). Else the dq kernel recomputes them and runs first (it writes the delta
#   and lse that dk/dv read).
# - CONFIG["path"] = "key" (or "auto" at small G): a key-centric forward instead (its own section), whose backward is
#   the dk/dv kernel writing dq partials too (no query-centric dq pass). Its per-pair partials are held for one token
#   window at a time (KEY_WINDOW_ROWS): each window gets the reverse index of its own pairs, and dk/dv add up over
#   the windows in window order.
# - the ids' index is built once per call, before the forward, by the op nsa::sel_index, and kept for the backward:
#   the ids cleaned by a small kernel (out of [0, t // l'] or repeating an earlier slot's -> -1), which also writes
#   each pair's sort key, and each window's reverse index: one sort of its keys, then lists and chunks found by
#   binary search at the granularity of blocks and chunks (no pass over the pairs but the sort). The query path's
#   forward reads no reverse index, so there its backward builds it.
# - on Hopper (nsa_kernels._ws_applies: HOPPER_WS, 16-bit, heads of 64 or 128) two of these run as warp-specialised
#   Gluon kernels, as nsa_kernels' compressed branch does: the query path's dk/dv at G >= 8 and the forward's union
#   tiles where they run unsplit (their sections say how; RESULTS.md what they gain).
# The file reads: inner loops -> kernels -> host launchers (_fwd, _bwd) -> ops -> selection_attention_triton.

DS_MAX_BYTES = 2 ** 31  # query path: dq from the dk/dv kernel's score gradients while they take at most this much
#                         (2 GiB, as the key path's partials; T = 16k at HQ = 64, n = 16, l' = 64 in bf16)
KEY_WINDOW_ROWS = 2 ** 23  # key path: per-pair partial rows (token x query head x slot x sub-block) held at once;
#                            more tokens run in token windows of this many rows (2 GiB of bf16 partials at Dv = 128)
# launch parameters per kernel, picked on one H100 with bench.py's launch sweep (which may override them);
# rows: query rows M per program (a power of 2, at least 16 for tl.dot; M // G whole tokens or pairs, one group at
# least); union: a tile of several tokens loads a block listed by several of them once; chunk_rows: query rows
# (tokens x G) per work item of the block-centric kernels (scratch: T*H*n*G / chunk_rows + blocks tiles)
CONFIG = {
    "fwd": dict(rows=16, union=False, num_warps=1, num_stages=2),
    "dq": dict(rows=16, union=False, num_warps=2, num_stages=3),
    "fwd_union": dict(rows=64, union=True, num_warps=4, num_stages=3),  # "auto"'s forward at G = 16 (UNION_SPLIT)
    "dq_union": dict(rows=64, union=True, num_warps=4, num_stages=2),  # and its dq
    "dkv": dict(rows=64, chunk_rows=16384, num_warps=4, num_stages=3),
    "dq_ds": dict(num_warps=4, num_stages=2),  # the dq from the score gradients (DS_MAX_BYTES), in the dq's tiles
    "path": "auto",  # "query" (above), "key" (the key-centric forward) or "auto": _key_path's rule by G
    "key_fwd": dict(rows=64, num_warps=4, num_stages=3),  # its chunks are key_bwd's (one reverse index)
    "key_fwd_small_d": dict(rows=64, num_warps=4, num_stages=3, maxnreg=128),  # heads <= SMALL_D, as nsa_kernels'
    "key_bwd": dict(rows=128, chunk_rows=4096, num_warps=8, num_stages=3),  # dk/dv on the key path (dq partials too)
    "key_bwd_small_d": dict(rows=64, chunk_rows=2048, num_warps=4, num_stages=3),  # heads <= SMALL_D (nsa_kernels)
    "key_sum": dict(rows=16, num_warps=4),  # the merge of a token's o partials and the sum of its dq partials
    "forced": dict(rows=64, keys=32, union=False, num_warps=4, num_stages=2),  # the forced blocks (keys: a step;
    #                                                           picked on one H200, RESULTS.md)
}
DKV_CHUNKS = 1024  # the query path's reverse index aims at this many chunks at least (see _plan)
KEY_MAX_G = 8  # "auto" takes the key-centric path for G = HQ / H up to this, at any length (RESULTS.md)
UNION_MAX_T = dict(fwd=32768, dq=8192)  # and at G = 16 the forward / dq in union tiles (RESULTS.md); on rows of
#                                          more than so many tokens, union tiles that list more than
UNION_SPLIT = dict(fwd=3.0, dq=2.0)  # so many n blocks run one token a tile instead, in a second launch
SPLIT_MAX_L2 = 56 * 2 ** 20  # GPUs with at least this much L2 cache (an H200's 60 MB, not an H100's 50) run the
ONE_TOKEN_T = dict(fwd=32768, dq=57344)  # forward / dq one token a tile on rows longer than this, no union tiles:
#                                          faster there on random and trained ids alike (RESULTS.md)
GROUP_TILES = 16  # union tiles: their tokens are grouped by shared blocks inside spans of this many tiles
GROUP_WORDS = 8  # and a token's blocks a bitmask of at most this many 32-bit words (exact up to 16k tokens at l' 64)


# ----------------------------------------------------------------------------------------------------------------
# forward: o = softmax(scale * q k^T) v over the selected blocks, base-2 softmax, fp32 accumulate

@triton.jit
def _slot_rows(idx, pos, order, p_r, m_r, f, i_t, i_h, NT, H: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
               NS: tl.constexpr, ORDER: tl.constexpr):
    """Slot f = (token p, slot s) of a tile of BT tokens (ORDER: those at places i_t * BT .. of order[i_h]): its block
    id j, the sequence start, token p's rows (which use the block) and the last key position they may read. Ids are
    pre-cleaned (valid, no repeats, else -1)."""
    p = f // NS
    s = f % NS
    t_p = i_t * BT + p
    m_p = t_p < NT
    if ORDER:
        t_p = tl.load(order + i_h.to(tl.int64) * NT + t_p, mask=m_p, other=0)
    rel_p = tl.load(pos + t_p, mask=m_p, other=0)                           # position inside its sequence
    j = tl.load(idx + (t_p.to(tl.int64) * H + i_h) * NS + s, mask=m_p, other=-1)
    ok = m_p & (j >= 0) & (j <= rel_p // BS)                                # padding / future ids: no rows
    return j, t_p - rel_p, m_r & ok & (p_r == p), tl.where(ok, rel_p, -1)


@triton.jit
def _union_rows(lst, b_start, m_r, t_r, f, i_t, i_h, H: tl.constexpr, BT: tl.constexpr, NS: tl.constexpr):
    """Entry f of the tile's union list (union_tiles): the packed start token u0 of a block, the rows whose token
    selected it (b_start [M, BNS]: each row's selected blocks as packed starts, -1 for none), their positions
    relative to u0 and the largest of them."""
    u0 = tl.load(lst + (i_t * H + i_h).to(tl.int64) * (BT * NS) + f)
    m_row = m_r & (tl.max((b_start == u0).to(tl.int32), 1) > 0)            # [M]
    rel_u = t_r - u0                                                        # [M] key positions from u0 each may read
    return u0, m_row, rel_u, tl.max(tl.where(m_row, rel_u, -1))


@triton.jit
def _query_tile(idx, pos, order, i_t, i_h, NT, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                NS: tl.constexpr, BNS: tl.constexpr, UNION: tl.constexpr):
    """Tile i_t of M // G tokens x the G heads of kv head i_h: each row's token inside the tile, row mask, token
    offset and head (tile_rows), position and sequence start, and the tokens' block ids [M, BNS].
    Tile i_t holds tokens i_t * M // G onwards, or (UNION) those at these places of order[i_h] (union_tiles)."""
    p_r, g_r, m_g = group_rows(M, G)                      # [M] token of each row inside the tile, head in the group
    t_r = i_t * (M // G) + p_r                            # [M] global token (UNION: its place in order)
    if UNION:
        t_r = tl.load(order + i_h.to(tl.int64) * NT + t_r, mask=m_g & (t_r < NT), other=NT)
    m_t = m_g & (t_r < NT)
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_t, i_h, H, G)
    rel_r = tl.load(pos + t_r, mask=m_t, other=0)                          # [M] positions inside the sequences
    o_s = tl.arange(0, BNS)
    b_idx = tl.load(idx + (t_r.to(tl.int64) * H + i_h)[:, None] * NS + o_s[None, :],
                    mask=m_t[:, None] & (o_s < NS)[None, :], other=-1)      # [M, BNS]
    return p_r, m_r, t_off, hq_r, rel_r, t_r - rel_r, b_idx


@triton.jit
def _block_rows(j, bos, rel_max, kc, NT, BS: tl.constexpr):
    """The packed row of key kc of selected block j (of the sequence starting at token bos) and the row its reading
    stops at (rel_max: the largest position that reads it); row NT and 0 (nothing) for a block no row uses."""
    used = rel_max >= 0
    return tl.where(used, bos + j * BS + kc, NT), tl.where(used, bos + rel_max + 1, 0)


@triton.jit
def _block_keys(b_q, k, v, j, bos, m_row, rel_r, rel_max, kc, scale_log2, i_h, NT, H: tl.constexpr,
                D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr,
                BK: tl.constexpr, BOXES: tl.constexpr):
    """Keys kc .. kc + BK - 1 of selected block j (positions j*l' + kc .. of the sequence starting at token bos),
    read by the rows m_row up to their own positions rel_r (rel_max: the largest of them): K [BK, BD], V [BK, BDV],
    the scores [M, BK] before the scale and where they count. With BOXES, k and v are tma_boxes descriptors and the
    BK keys come whole (see "Masks"); else by pointers, none past rel_max."""
    u = j * BS + kc + tl.arange(0, BK)                                      # [BK] key positions (relative)
    m_k = (kc + tl.arange(0, BK) < BS) & (u >= 0) & (u <= rel_max)          # none when no row uses j
    row, k_end = _block_rows(j, bos, rel_max, kc, NT, BS)
    b_k, b_v = key_tile(k, v, row, k_end, i_h, H, D, DV, BD, BDV, BK, BOXES)  # [BK, BD], [BK, BDV]
    b_s = tl.dot(b_q, tl.trans(b_k))                                        # [M, BK]
    return b_k, b_v, b_s, m_row[:, None] & m_k[None, :] & (u[None, :] <= rel_r[:, None])  # causal inside the block


@triton.jit
def _fwd_inner(b_q, k, v, m_i, l_i, acc, j, bos, m_row, rel_r, rel_max, scale_log2, i_h, NT,
               H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
               BS: tl.constexpr, BK: tl.constexpr, BOXES: tl.constexpr):
    """The online softmax over the keys of selected block j in BK-steps."""
    for kc in tl.static_range(0, BS, BK):
        _, b_v, b_s, m_s = _block_keys(b_q, k, v, j, bos, m_row, rel_r, rel_max, kc, scale_log2, i_h, NT,
                                       H, D, DV, BD, BDV, BS, BK, BOXES)
        m_i, l_i, acc = softmax_step(tl.where(m_s, b_s, float("-inf")), scale_log2, b_v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _other_launch(cnt, i_t, i_h, LIMIT, H: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr, UT: tl.constexpr):
    """Whether tile i_t's rows belong to the split's other launch. The union tiles (of UT tokens) listing at most
    LIMIT blocks run in launch 1 (BT = UT), the tokens of the others one to a tile, slot by slot, in launch 2 (BT
    dividing UT)."""
    return (tl.load(cnt + (i_t * BT // UT) * H + i_h) > LIMIT) == (SPLIT == 1)


@triton.jit
def _sel_fwd_kernel(q, k, v, o, lse, gate, idx, pos, order, lst, cnt, scale_log2, NT,
                    H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                    BS: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr, BNS: tl.constexpr, UNION: tl.constexpr,
                    BOXES: tl.constexpr, GATED: tl.constexpr, LIMIT=0, SPLIT: tl.constexpr = 0, UT: tl.constexpr = 1,
                    FORCED: tl.constexpr = 0, N_INIT: tl.constexpr = 0, N_LOCAL: tl.constexpr = 0):
    """o (times the gate) and the base-2 lse of tile i_t of BT tokens x the G heads of kv head i_h, over the tokens'
    selected blocks: slot by slot, or (UNION) each block of the tile's union list once for all its rows. SPLIT:
    two launches share the union tiles, by the length of their lists (_other_launch). FORCED (BT = 1): from the
    forced blocks' part (_sel_forced_fwd_kernel's, in o and lse) on, over the ids that are not forced (_free_ids)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    BT: tl.constexpr = M // G
    if SPLIT:
        if _other_launch(cnt, i_t, i_h, LIMIT, H, BT, SPLIT, UT):
            return
    p_r, m_r, t_off, hq_r, rel_r, bos_r, b_idx = _query_tile(idx, pos, order, i_t, i_h, NT, H, G, M, NS, BNS,
                                                             UNION or SPLIT == 2)
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                             # [M, BD]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    if FORCED:  # start from the forced blocks' part: _sel_forced_fwd_kernel's o = acc / l and lse = m + log2 l
        m_i = tl.load(lse + t_off + hq_r, mask=m_r, other=float("-inf"))
        l_i = tl.where(m_i == float("-inf"), 0., 1.)
        acc = load_rows(o, t_off + hq_r, m_r, DV, BDV).to(tl.float32)
    if UNION:
        b_start = tl.where(b_idx >= 0, bos_r[:, None] + b_idx * BS, -1)                   # [M, BNS]
        for f in range(tl.load(cnt + i_t * H + i_h)):
            u0, m_row, rel_u, rel_max = _union_rows(lst, b_start, m_r, bos_r + rel_r, f, i_t, i_h, H, BT, NS)
            m_i, l_i, acc = _fwd_inner(b_q, k, v, m_i, l_i, acc, 0, u0, m_row, rel_u, rel_max, scale_log2, i_h,
                                       NT, H, D, DV, BD, BDV, BS, BK, BOXES)
    elif FORCED:                                          # one token a tile
        ids, rank, n_free, rel_p = _free_ids(b_idx, rel_r, m_r, BS, N_INIT, N_LOCAL)
        for f in range(n_free):                           # the f-th free id: one step each, none wasted on the rest
            j = tl.max(tl.where(rank == f, ids, -1))
            m_i, l_i, acc = _fwd_inner(b_q, k, v, m_i, l_i, acc, j, i_t - rel_p, m_r, rel_r, rel_p, scale_log2, i_h,
                                       NT, H, D, DV, BD, BDV, BS, BK, BOXES)
    else:
        for f in range(BT * NS):                          # slot f = (token f // n, slot f % n) of the tile
            j, bos, m_row, rel_max = _slot_rows(idx, pos, order, p_r, m_r, f, i_t, i_h, NT, H, BT, BS, NS, SPLIT == 2)
            m_i, l_i, acc = _fwd_inner(b_q, k, v, m_i, l_i, acc, j, bos, m_row, rel_r, rel_max, scale_log2, i_h,
                                       NT, H, D, DV, BD, BDV, BS, BK, BOXES)
    b_o, b_lse = softmax_finish(m_i, l_i, acc)            # lse: base 2, of the scaled scores
    store_rows(o, t_off + hq_r, m_r, gate_out(b_o, gate_rows(gate, t_off + hq_r, m_r, GATED), GATED), DV, BDV)
    tl.store(lse + t_off + hq_r, b_lse, mask=m_r)


@triton.jit
def _free_ids(b_idx, rel_r, m_r, BS: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr):
    """A one-token tile's ids [BNS] (out of b_idx [M, BNS], its rows' copies, cleaned: valid or -1), each one's place
    among its free ids (valid, not forced: neither one of the first N_INIT blocks nor one of the N_LOCAL up to its
    own), how many are free, and the token's position (rel_r [M]: its rows')."""
    ids = tl.max(tl.where(m_r[:, None], b_idx, -1), 0)                              # [BNS]
    rel_p = tl.max(tl.where(m_r, rel_r, -1))
    free = (ids >= 0) & (ids >= N_INIT) & (ids <= rel_p // BS - N_LOCAL)
    return ids, tl.where(free, tl.cumsum(free.to(tl.int32), 0) - 1, -1), tl.sum(free.to(tl.int32)), rel_p


@triton.jit
def _sel_forced_fwd_kernel(q, k, v, o, lse, pos, scale_log2, NT, H: tl.constexpr, G: tl.constexpr,
                           M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                           BS: tl.constexpr, BK: tl.constexpr, N_INIT: tl.constexpr, N_LOCAL: tl.constexpr,
                           BOXES: tl.constexpr):
    """o and the base-2 lse of tile i_t of BT tokens x the G heads of kv head i_h over their forced blocks, which
    every token of a block shares: two key ranges a row, the first N_INIT blocks, then the N_LOCAL up to its own
    (both up to the token), in one loop of BK-steps over the tile's two spans. _sel_fwd_kernel's FORCED launch adds
    the free blocks."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    p_r, g_r, m_g = group_rows(M, G)
    t_r = i_t * (M // G) + p_r                                                        # [M] token of each row
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_g & (t_r < NT), i_h, H, G)
    rel_r = tl.load(pos + t_r, mask=m_r, other=0)                                     # [M] positions
    bos_r = t_r - rel_r
    init_lo, init_hi = bos_r, bos_r + tl.minimum(N_INIT * BS, rel_r + 1)             # [M] each row's two ranges
    local_lo, local_hi = bos_r + tl.maximum(N_INIT, rel_r // BS - N_LOCAL + 1) * BS, t_r + 1
    m_init, m_local = m_r & (init_lo < init_hi), m_r & (local_lo < local_hi)
    a0, a1 = tl.min(tl.where(m_init, init_lo, INT_MAX)), tl.max(tl.where(m_init, init_hi, 0))   # the tile's spans
    b0, b1 = tl.min(tl.where(m_local, local_lo, INT_MAX)), tl.max(tl.where(m_local, local_hi, 0))
    n_a = tl.cdiv(tl.maximum(a1 - a0, 0), BK)
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                                      # [M, BD]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    for s in range(n_a + tl.cdiv(tl.maximum(b1 - b0, 0), BK)):
        init = s < n_a
        k0 = tl.where(init, a0 + s * BK, b0 + (s - n_a) * BK)
        b_k, b_v = key_tile(k, v, k0, tl.where(init, a1, b1), i_h, H, D, DV, BD, BDV, BK, BOXES)
        c = k0 + tl.arange(0, BK)                                                     # [BK] key ids
        lo, hi = tl.where(init, init_lo, local_lo), tl.where(init, init_hi, local_hi)
        m_s = m_r[:, None] & _in_ranges(c, lo, hi)
        b_s = tl.where(m_s, tl.dot(b_q, tl.trans(b_k)), float("-inf"))              # [M, BK]
        m_i, l_i, acc = softmax_step(b_s, scale_log2, b_v, m_i, l_i, acc)
    b_o, b_lse = softmax_finish(m_i, l_i, acc)
    store_rows(o, t_off + hq_r, m_r, b_o, DV, BDV)
    tl.store(lse + t_off + hq_r, b_lse, mask=m_r)


# ----------------------------------------------------------------------------------------------------------------
# backward: dq with delta = rowsum(o * do) (query path; the key path has a delta kernel, and its dq partials come from
# the dk/dv kernel), then dk/dv (block-centric partials + ordered reduction)

@triton.jit
def _row_stats(o, b_do, lse, delta, lse2, gate, rows, m, DV: tl.constexpr, BDV: tl.constexpr, GATED: tl.constexpr):
    """delta = rowsum(o_branch * do) and the lse the backward kernels read (gate_lse: gated, base 2) of rows [M]
    (b_do [M, BDV] their do), stored for the dk/dv kernel and returned."""
    b_o = load_rows(o, rows, m, DV, BDV).to(tl.float32)                    # [M, BDV]
    b_g = gate_rows(gate, rows, m, GATED)
    b_delta = gate_delta(tl.sum(b_o * b_do.to(tl.float32), 1), b_g, GATED)
    b_lse = gate_lse(tl.load(lse + rows, mask=m, other=0.), b_g, GATED)
    tl.store(delta + rows, b_delta, mask=m)
    tl.store(lse2 + rows, b_lse, mask=m)
    return b_delta, b_lse


@triton.jit
def _sel_bwd_delta_kernel(o, do, lse, delta, lse2, gate, NR, DV: tl.constexpr, BDV: tl.constexpr, BR: tl.constexpr,
                          GATED: tl.constexpr):
    """_row_stats of every row, where the dk/dv kernel runs first (the recomputing dq kernel computes its own)."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = o_r < NR
    _row_stats(o, load_rows(do, o_r, m_r, DV, BDV), lse, delta, lse2, gate, o_r, m_r, DV, BDV, GATED)


@triton.jit
def _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k, v, j, bos, m_row, rel_r, rel_max, scale_log2, i_h, NT,
              H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
              BS: tl.constexpr, BK: tl.constexpr, BOXES: tl.constexpr):
    """dq over the keys of selected block j, as _fwd_inner walks them."""
    for kc in tl.static_range(0, BS, BK):
        b_k, b_v, b_s, m_s = _block_keys(b_q, k, v, j, bos, m_row, rel_r, rel_max, kc, scale_log2, i_h, NT,
                                         H, D, DV, BD, BDV, BS, BK, BOXES)
        b_p = tl.where(m_s, tl.exp2(b_s * scale_log2 - b_lse[:, None]), 0.)
        b_dp = tl.dot(b_do, tl.trans(b_v))                                  # [M, BK]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)                             # [M, BD]
    return b_dq


@triton.jit
def _sel_bwd_dq_kernel(q, k, v, o, do, lse, lse2, delta, dq, gate, idx, pos, order, lst, cnt, scale_log2, scale,
                       NT, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                       D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                       BS: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr, BNS: tl.constexpr, UNION: tl.constexpr,
                       BOXES: tl.constexpr, GATED: tl.constexpr, LIMIT=0, SPLIT: tl.constexpr = 0,
                       UT: tl.constexpr = 1):
    """dq of tile i_t of BT tokens x the G heads of kv head i_h, walking the blocks as the forward does; first its
    rows' delta and lse for the dk/dv kernel (_row_stats)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    BT: tl.constexpr = M // G
    if SPLIT:
        if _other_launch(cnt, i_t, i_h, LIMIT, H, BT, SPLIT, UT):
            return
    p_r, m_r, t_off, hq_r, rel_r, bos_r, b_idx = _query_tile(idx, pos, order, i_t, i_h, NT, H, G, M, NS, BNS,
                                                             UNION or SPLIT == 2)
    b_q = load_rows(q, t_off + hq_r, m_r, D, BD)                             # [M, BD]
    b_do = load_rows(do, t_off + hq_r, m_r, DV, BDV)                        # [M, BDV]
    b_delta, b_lse = _row_stats(o, b_do, lse, delta, lse2, gate, t_off + hq_r, m_r, DV, BDV, GATED)  # [M] each
    b_dq = tl.zeros([M, BD], tl.float32)
    if UNION:
        b_start = tl.where(b_idx >= 0, bos_r[:, None] + b_idx * BS, -1)                   # [M, BNS]
        for f in range(tl.load(cnt + i_t * H + i_h)):
            u0, m_row, rel_u, rel_max = _union_rows(lst, b_start, m_r, bos_r + rel_r, f, i_t, i_h, H, BT, NS)
            b_dq = _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k, v, 0, u0, m_row, rel_u, rel_max, scale_log2, i_h,
                             NT, H, D, DV, BD, BDV, BS, BK, BOXES)
    else:
        for f in range(BT * NS):
            j, bos, m_row, rel_max = _slot_rows(idx, pos, order, p_r, m_r, f, i_t, i_h, NT, H, BT, BS, NS, SPLIT == 2)
            b_dq = _dq_inner(b_dq, b_q, b_do, b_lse, b_delta, k, v, j, bos, m_row, rel_r, rel_max, scale_log2, i_h,
                             NT, H, D, DV, BD, BDV, BS, BK, BOXES)
    store_rows(dq, t_off + hq_r, m_r, b_dq * scale, D, BD)


@triton.jit
def _ds_rows(t_r, i_h, slot, hq_r, H: tl.constexpr, G: tl.constexpr, NS: tl.constexpr):
    """Rows of the score gradients that the dk/dv kernel writes (WRITE_DS) for tokens t_r, kv head i_h, slots and
    query heads hq_r: (token, kv head, slot, head in the group), so that a pair's G rows lie together."""
    return ((t_r.to(tl.int64) * H + i_h) * NS + slot) * G + hq_r - i_h * G


@triton.jit
def _sel_ds_dq_kernel(k, ds, dq, idx, pos, order, lst, cnt, scale, NT, H: tl.constexpr, G: tl.constexpr,
                      M: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                      BSP: tl.constexpr, NS: tl.constexpr, BNS: tl.constexpr, UNION: tl.constexpr,
                      BOXES: tl.constexpr):
    """dq of tile i_t of BT tokens x the G heads of kv head i_h from the score gradients ds that the dk/dv kernel
    wrote (WRITE_DS): dq = scale * sum over the tokens' blocks of ds [M, l'] @ K, walking the blocks as the forward
    does (UNION: each block of the union list once). No softmax to recompute and no V to load."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    BT: tl.constexpr = M // G
    p_r, m_r, t_off, hq_r, rel_r, bos_r, b_idx = _query_tile(idx, pos, order, i_t, i_h, NT, H, G, M, NS, BNS, UNION)
    o_s = tl.arange(0, BNS)
    b_start = tl.where(b_idx >= 0, bos_r[:, None] + b_idx * BS, -1)                       # [M, BNS]
    b_dq = tl.zeros([M, BD], tl.float32)
    if UNION:
        n_f = tl.load(cnt + i_t * H + i_h)
    else:
        n_f = BT * NS
    for f in range(n_f):
        if UNION:   # entry f: a block (at u0), the rows whose token chose it and the slot it has there
            bos, m_row, _, rel_max = _union_rows(lst, b_start, m_r, bos_r + rel_r, f, i_t, i_h, H, BT, NS)
            j, slot = 0, tl.max(tl.where(b_start == bos, o_s[None, :], 0), 1)            # [M]
        else:       # slot f % n of the tile's token f // n
            j, bos, m_row, rel_max = _slot_rows(idx, pos, order, p_r, m_r, f, i_t, i_h, NT, H, BT, BS, NS, False)
            slot = f % NS
        ds_row = _ds_rows(bos_r + rel_r, i_h, slot, hq_r, H, G, NS)                      # [M]
        for kc in tl.static_range(0, BS, BK):
            row, k_end = _block_rows(j, bos, rel_max, kc, NT, BS)
            b_k = key_rows(k, row, k_end, i_h, H, D, BD, BK, BOXES)                      # [BK, BD]
            o_k = kc + tl.arange(0, BK)
            b_ds = tl.load(ds + ds_row[:, None] * BSP + o_k[None, :], mask=m_row[:, None] & (o_k < BS)[None, :],
                           other=0.)                                                      # [M, BK]
            b_dq += tl.dot(b_ds, b_k)
    store_rows(dq, t_off + hq_r, m_r, b_dq * scale, D, BD)


@triton.jit
def _key_block(k, v, pos, c_begin, c_end, c_key, i_c, i_kc, NT, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
               BD: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    """Chunk i_c of the reverse index (entries [e0, e1), all of kv head i_h and one selected block) and key sub-block
    i_kc of that block: key positions rel_k [BK], key mask m_k and the K [BK, BD] and V [BK, BDV] tiles, loaded once
    for the whole chunk."""
    e0 = tl.load(c_begin + i_c)                           # this chunk: entries [e0, e1) of the sorted lists
    e1 = tl.load(c_end + i_c)
    key = tl.load(c_key + i_c)                            # kv head * NT + global start of the block
    i_h = (key // NT).to(tl.int32)
    kst = key % NT
    o_k = tl.arange(0, BK)
    u = kst + i_kc * BK + o_k                             # [BK] global key tokens
    kst_pos = tl.load(pos + kst)                           # the block's first key's position inside the sequence
    rel_k = kst_pos + i_kc * BK + o_k                     # [BK] key positions inside the sequence
    m_k = (i_kc * BK + o_k < BS) & (u < NT) & (e0 < e1)
    m_k &= tl.load(pos + u, mask=m_k, other=-1) == rel_k  # keys of the next sequence are never loaded
    k_off = u * H + i_h
    b_k = load_rows(k, k_off, m_k, D, BD)                                   # [BK, BD]
    b_v = load_rows(v, k_off, m_k, DV, BDV)                                 # [BK, BDV]
    return e0, e1, i_h, rel_k, m_k, b_k, b_v


@triton.jit
def _key_pairs(q, perm, pos, e, e1, i_h, T0, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
               BD: tl.constexpr, NS: tl.constexpr):
    """Pairs [e, e + M // G) of a reverse-index chunk ending at e1 (of the token window from T0) as the M rows (pair,
    head) of a query tile: their tokens, row mask, token offsets and heads (as tile_rows), positions, Q tile [M, BD]
    and the row of each one's partials, laid out (token in the window, query head, slot, sub-block): pr * NKC +
    sub-block."""
    p_r, g_r, m_g = group_rows(M, G)
    e_r = e + p_r                                                          # [M] entry of each row, then the G heads
    m_e = m_g & (e_r < e1)
    pair = tl.load(perm + e_r, mask=m_e, other=0)                         # [M] (token in window * H + head) * n + slot
    t_w = pair // (H * NS)                                                 # [M] token inside the window, ascending
    t_r = T0 + t_w
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_e, i_h, H, G)
    rel_r = tl.load(pos + t_r, mask=m_e, other=-1)                         # [M] positions inside the sequences
    pr = (t_w.to(tl.int64) * (H * G) + hq_r) * NS + pair % NS
    return t_r, m_r, t_off, hq_r, rel_r, load_rows(q, t_off + hq_r, m_r, D, BD), pr


@triton.jit
def _sel_bwd_dkv_kernel(q, k, v, do, lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part, dq_part, ds, pos,
                        scale_log2, scale, NT, T0, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                        DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                        BSP: tl.constexpr, NKC: tl.constexpr, NS: tl.constexpr, WRITE_DQ: tl.constexpr,
                        WRITE_DS: tl.constexpr):
    """The dk/dv partial of one chunk x key sub-block; WRITE_DQ (key-centric path): also each (pair, sub-block)'s dq
    partial ds @ k, which _sel_key_dq_kernel sums per token; WRITE_DS (query path): also each pair row's score
    gradient ds (a row of BSP, the block's keys), from which _sel_ds_dq_kernel computes dq."""
    i_c, i_kc = tl.program_id(0), tl.program_id(1)
    e0, e1, i_h, rel_k, m_k, b_k, b_v = _key_block(k, v, pos, c_begin, c_end, c_key, i_c, i_kc, NT,
                                                   H, D, DV, BD, BDV, BS, BK)
    b_dk = tl.zeros([BK, BD], tl.float32)
    b_dv = tl.zeros([BK, BDV], tl.float32)
    for e in range(e0, e1, M // G):
        t_r, m_r, t_off, hq_r, rel_r, b_q, pr = _key_pairs(q, perm, pos, e, e1, i_h, T0, H, G, M, D, BD, NS)
        b_do = load_rows(do, t_off + hq_r, m_r, DV, BDV)                    # [M, BDV]
        b_lse = tl.load(lse + t_off + hq_r, mask=m_r, other=0.)
        b_delta = tl.load(delta + t_off + hq_r, mask=m_r, other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2                       # [M, BK]
        m_s = m_r[:, None] & m_k[None, :] & (rel_k[None, :] <= rel_r[:, None])
        b_p = tl.where(m_s, tl.exp2(b_s - b_lse[:, None]), 0.)
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)                  # [BK, BDV]
        b_dp = tl.dot(b_do, tl.trans(b_v))                                  # [M, BK]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q)                   # [BK, BD]
        if WRITE_DQ:
            store_rows(dq_part, pr * NKC + i_kc, m_r, tl.dot(b_ds.to(b_k.dtype), b_k) * scale, D, BD)  # [M, BD]
        if WRITE_DS:
            store_rows(ds + i_kc * BK, _ds_rows(t_r, i_h, pr % NS, hq_r, H, G, NS), m_r, tl.where(m_s, b_ds, 0.),
                       BSP, BK)                                             # [M, BK], 0 where p is
    part = i_c.to(tl.int64) * BSP + i_kc * BK + tl.arange(0, BK)            # [BK] rows of the partials, all stored
    store_rows(dk_part, part, tl.full([BK], 1, tl.int1), b_dk * scale, D, BD)
    store_rows(dv_part, part, tl.full([BK], 1, tl.int1), b_dv, DV, BDV)


@triton.jit
def _sel_bwd_reduce_kernel(dk_part, dv_part, dk_acc, dv_acc, dk, dv, pos, seq, seg_c0, seg_c1, NK, NB, N_ACC,
                           H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                           BS: tl.constexpr, BSP: tl.constexpr, BR: tl.constexpr, ADD: tl.constexpr):
    """dk/dv of the first NK keys = each one's block's chunk partials summed in chunk order; ADD: plus what dk_acc /
    dv_acc (fp32, the earlier token windows' sums) hold for the first N_ACC keys."""
    i_r, i_h = tl.program_id(0), tl.program_id(1)
    u = i_r * BR + tl.arange(0, BR)                       # [BR] global key tokens
    m_u = u < NK
    off = tl.load(pos + u, mask=m_u, other=0) % BS        # row inside its selection block
    blk = i_h * NB + (u - off) // BS + tl.load(seq + u, mask=m_u, other=0)  # (head, block number), as _clean_kernel
    c0 = tl.load(seg_c0 + blk, mask=m_u, other=0)         # its chunks: [c0, c1), summed in this order
    c1 = tl.load(seg_c1 + blk, mask=m_u, other=0)
    b_dk = tl.zeros([BR, BD], tl.float32)
    b_dv = tl.zeros([BR, BDV], tl.float32)
    for c in range(0, tl.max(c1 - c0)):
        m_c = m_u & (c0 + c < c1)
        part = (c0 + c).to(tl.int64) * BSP + off
        b_dk += load_rows(dk_part, part, m_c, D, BD)
        b_dv += load_rows(dv_part, part, m_c, DV, BDV)
    out = u.to(tl.int64) * H + i_h
    if ADD:
        b_dk += load_rows(dk_acc, out, m_u & (u < N_ACC), D, BD)
        b_dv += load_rows(dv_acc, out, m_u & (u < N_ACC), DV, BDV)
    store_rows(dk, out, m_u, b_dk, D, BD)
    store_rows(dv, out, m_u, b_dv, DV, BDV)


# ----------------------------------------------------------------------------------------------------------------
# dk/dv on Hopper (Gluon): nsa_kernels' warp-specialised dk/dv on the reverse index's chunks, on the query path. One
# program = two chunks (one per consumer warpgroup, each with its own block of 64 keys, loaded once); a loader warp
# per consumer streams its chunk's pairs' Q and dO as [1, G, D] TMA boxes (a pair's G query rows are contiguous),
# BT = 64 / G pairs a step, into the consumer's ring. Past a chunk's end it loads the chunk's last pair again (finite
# rows, masked out), so no stale shared memory reaches the dots. The score gradients (WRITE_DS) leave by TMA too, a
# pair's [1, G, l'] box of rows each, while the next step runs. G >= 8: a box must span the 8 rows of the shared
# memory swizzle, which also needs G * D * 2 bytes >= 1 KiB (triton 3.6 and 3.7 do not compile G = 4).


@gluon.jit
def _ws_sel_dkv_loader(q_desc, do_desc, k_desc, v_desc, perm, c_begin, c_end, c_key, k_smem, v_smem, q_bufs, do_bufs,
                       kv_ready, qd_ready, qd_free, i_p, half, NC, NT, T0, H: gl.constexpr, G: gl.constexpr,
                       D: gl.constexpr, DV: gl.constexpr, NS: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr):
    """Consumer `half`'s chunk: its block's K and V once, then each step's BT pairs' Q and dO rows."""
    i_c = gl.minimum(i_p * 2 + half, NC - 1)              # (no second chunk: its keys are loaded, it takes no step)
    e0 = gl.load(c_begin + i_c)
    e1 = gl.where(i_p * 2 + half < NC, gl.load(c_end + i_c), e0)
    key = gl.load(c_key + i_c)                            # kv head * NT + the block's first key
    i_h = (key // NT).to(gl.int32)
    mbarrier.expect(kv_ready.index(half), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [(key % NT).to(gl.int32), i_h * D], kv_ready.index(half),
                                    k_smem.index(half))
    tma.async_copy_global_to_shared(v_desc, [(key % NT).to(gl.int32), i_h * DV], kv_ready.index(half),
                                    v_smem.index(half))
    for j in range(gl.cdiv(e1 - e0, BT).to(gl.int32)):
        s, ph = j % STAGES, (j // STAGES) & 1
        b = half * STAGES + s
        mbarrier.wait(qd_free.index(b), ph ^ 1)
        mbarrier.expect(qd_ready.index(b), BT * (q_desc.block_type.nbytes + do_desc.block_type.nbytes))
        for p in gl.static_range(BT):                     # past the chunk's end its last pair again (masked)
            t = (T0 + gl.load(perm + gl.minimum(e0 + j * BT + p, e1 - 1)) // (H * NS)).to(gl.int32)
            tma.async_copy_global_to_shared(q_desc, [t, i_h * G, 0], qd_ready.index(b), q_bufs.index(b).slice(p, 1))
            tma.async_copy_global_to_shared(do_desc, [t, i_h * G, 0], qd_ready.index(b),
                                            do_bufs.index(b).slice(p, 1))


@gluon.jit
def _ws_sel_rows(perm, pos, lse, delta, e, e1, i_h, T0, H: gl.constexpr, G: gl.constexpr, NS: gl.constexpr,
                 BT: gl.constexpr, layout: gl.constexpr):
    """The 64 query rows (pair, head) of one step from entry e of a chunk ending at e1, in `layout`: their
    positions, lse and delta; and the BT pairs' boxes of score gradients ((token, kv head, slot) as _ds_rows;
    -1 past the chunk's end), all in each thread."""
    r = gl.arange(0, 64, layout=layout)
    e_r = e + r // G
    m_r = e_r < e1
    pair = gl.load(perm + e_r, mask=m_r, other=0)
    t_r = T0 + pair // (H * NS)
    rows = t_r.to(gl.int64) * (H * G) + i_h * G + r % G
    rel = gl.load(pos + t_r, mask=m_r, other=-1)
    o_p = gl.arange(0, BT, layout=gl.BlockedLayout([BT], [32], [4], [0]))
    pairs = gl.load(perm + e + o_p, mask=e + o_p < e1, other=-1 - T0 * H * NS)      # (token - T0, kv head, slot)
    ds_p = T0 * H * NS + pairs
    return rel, gl.load(lse + rows, mask=m_r, other=0.), gl.load(delta + rows, mask=m_r, other=0.), ds_p


@gluon.jit
def _ws_sel_dkv_consumer(perm, c_begin, c_end, c_key, pos, lse, delta, dk_part, dv_part, ds_desc, ds_bufs, k_smem,
                         v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free, i_p, half, scale_log2, scale, NC, NT, T0,
                         H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, NS: gl.constexpr,
                         BSP: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, WRITE_DS: gl.constexpr):
    M: gl.constexpr = BT * G                                                              # query rows a step: 64
    s_l: gl.constexpr = _ws_mma(M)
    k_l: gl.constexpr = _ws_mma(D)
    v_l: gl.constexpr = _ws_mma(DV)
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i_c = i_p * 2 + half
    valid = i_c < NC
    i_c = gl.minimum(i_c, NC - 1)
    e0 = gl.load(c_begin + i_c)
    e1 = gl.where(valid, gl.load(c_end + i_c), e0)
    key = gl.load(c_key + i_c)
    i_h = (key // NT).to(gl.int32)
    kst = key % NT
    o_k = gl.arange(0, 64, layout=gl.SliceLayout(1, s_l))                                # the block's keys
    u = kst + o_k
    rel_k = gl.load(pos + kst) + o_k
    m_k = (u < NT) & (e0 < e1)
    m_k &= gl.load(pos + u, mask=m_k, other=-1) == rel_k  # keys of the next sequence never count
    b_dk = gl.zeros([64, D], gl.float32, k_l)
    b_dv = gl.zeros([64, DV], gl.float32, v_l)
    n_rel, n_lse, n_delta, n_ds = _ws_sel_rows(perm, pos, lse, delta, e0, e1, i_h, T0, H, G, NS, BT, vec_l)
    mbarrier.wait(kv_ready.index(half), 0)
    for j in range(gl.cdiv(e1 - e0, BT).to(gl.int32)):
        s, ph = j % STAGES, (j // STAGES) & 1
        b = half * STAGES + s
        rel_r = gl.convert_layout(n_rel, gl.SliceLayout(0, s_l))                          # -1: no row
        b_lse = gl.convert_layout(n_lse, gl.SliceLayout(0, s_l))                          # base 2, gated
        b_delta = gl.convert_layout(n_delta, gl.SliceLayout(0, s_l))
        ds_p = n_ds
        n_rel, n_lse, n_delta, n_ds = _ws_sel_rows(perm, pos, lse, delta, e0 + (j + 1) * BT, e1, i_h, T0, H, G, NS,
                                                   BT, vec_l)                            # the next step's rows
        mbarrier.wait(qd_ready.index(b), ph)
        q_s = q_bufs.index(b).reshape([M, D])
        do_s = do_bufs.index(b).reshape([M, DV])
        zero = gl.zeros([64, M], gl.float32, s_l)
        b_st = warpgroup_mma(k_smem.index(half), q_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        b_dpt = warpgroup_mma(v_smem.index(half), do_s.permute((1, 0)), zero, use_acc=False, is_async=True)
        b_st = warpgroup_mma_wait(num_outstanding=1, deps=(b_st,))                        # s^T [64 keys, M]
        m_s = m_k[:, None] & (rel_k[:, None] <= rel_r[None, :])
        b_pt = gl.where(m_s, gl.exp2(b_st * scale_log2 - b_lse[None, :]), 0.)
        b_dv = warpgroup_mma(gl.convert_layout(b_pt.to(q_s.dtype), gl.DotOperandLayout(0, v_l, 2)), do_s, b_dv,
                             is_async=True)
        b_dpt = warpgroup_mma_wait(num_outstanding=1, deps=(b_dpt,))                      # dp^T [64 keys, M]
        b_dst = b_pt * (b_dpt - b_delta[None, :])
        b_dk = warpgroup_mma(gl.convert_layout(b_dst.to(q_s.dtype), gl.DotOperandLayout(0, k_l, 2)), q_s, b_dk,
                             is_async=True)
        if WRITE_DS:                                      # by TMA, one [1, G, l'] box a pair, during the next step
            ds_smem = ds_bufs.index(half)
            tma.store_wait(0)                             # (the last step's boxes have left the buffer)
            ds_smem.reshape([M, BSP]).store(gl.permute(b_dst.to(ds_desc.dtype), (1, 0)))
            fence_async_shared()
            for p in gl.static_range(BT):
                ds_row = gl.sum(gl.where(gl.arange(0, BT, layout=ds_p.type.layout) == p, ds_p, 0), axis=0)
                if ds_row >= 0:
                    tma.async_copy_shared_to_global(ds_desc, [ds_row.to(gl.int32), 0, 0], ds_smem.slice(p, 1))
        b_dv, b_dk = warpgroup_mma_wait(num_outstanding=0, deps=(b_dv, b_dk))
        mbarrier.arrive(qd_free.index(b), count=1)
    if WRITE_DS:
        tma.store_wait(0)
    part = i_c.to(gl.int64) * BSP                                                         # all 64 rows, as Triton's
    ck = part + gl.arange(0, 64, layout=gl.SliceLayout(1, k_l))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, k_l))
    gl.store(dk_part + ck[:, None] * D + o_d[None, :], b_dk * scale, mask=(ck[:, None] >= 0) & valid)
    cv = part + gl.arange(0, 64, layout=gl.SliceLayout(1, v_l))
    o_e = gl.arange(0, DV, layout=gl.SliceLayout(0, v_l))
    gl.store(dv_part + cv[:, None] * DV + o_e[None, :], b_dv, mask=(cv[:, None] >= 0) & valid)


@gluon.jit
def _ws_sel_dkv_kernel(q_desc, do_desc, k_desc, v_desc, lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part,
                       ds_desc, pos, scale_log2, scale, NC, NT, T0, H: gl.constexpr, G: gl.constexpr,
                       D: gl.constexpr, DV: gl.constexpr, NS: gl.constexpr, BSP: gl.constexpr, BT: gl.constexpr,
                       STAGES: gl.constexpr, WRITE_DS: gl.constexpr):
    i_p = gl.program_id(0)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [2 * STAGES, BT, G, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [2 * STAGES, BT, G, DV], do_desc.layout)
    if WRITE_DS:
        ds_bufs = gl.allocate_shared_memory(ds_desc.dtype, [2, BT, G, BSP], ds_desc.layout)  # one per consumer
    else:
        ds_bufs = q_bufs                                                                  # (unused)
    kv_ready = _ws_barriers(2, 1)
    qd_ready = _ws_barriers(2 * STAGES, 1)
    qd_free = _ws_barriers(2 * STAGES, 1)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_sel_dkv_consumer, (perm, c_begin, c_end, c_key, pos, lse, delta, dk_part, dv_part, ds_desc, ds_bufs,
                                k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free, i_p, 0, scale_log2,
                                scale, NC, NT, T0, H, G, D, DV, NS, BSP, BT, STAGES, WRITE_DS)),
        (_ws_sel_dkv_consumer, (perm, c_begin, c_end, c_key, pos, lse, delta, dk_part, dv_part, ds_desc, ds_bufs,
                                k_smem, v_smem, q_bufs, do_bufs, kv_ready, qd_ready, qd_free, i_p, 1, scale_log2,
                                scale, NC, NT, T0, H, G, D, DV, NS, BSP, BT, STAGES, WRITE_DS)),
        (_ws_sel_dkv_loader, (q_desc, do_desc, k_desc, v_desc, perm, c_begin, c_end, c_key, k_smem, v_smem, q_bufs,
                              do_bufs, kv_ready, qd_ready, qd_free, i_p, 0, NC, NT, T0, H, G, D, DV, NS, BT, STAGES)),
        (_ws_sel_dkv_loader, (q_desc, do_desc, k_desc, v_desc, perm, c_begin, c_end, c_key, k_smem, v_smem, q_bufs,
                              do_bufs, kv_ready, qd_ready, qd_free, i_p, 1, NC, NT, T0, H, G, D, DV, NS, BT, STAGES)),
    ], [4, 1, 1], [240, 24, 24])


def _ws_sel_dkv(qf, kf, vf, dof, lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part, ds, pos, scale_log2,
                scale, NT, t0, NS, BSP):
    """Launches _ws_sel_dkv_kernel: qf (NT, HQ, D), kf (NT, H, D), vf, dof packed; blocks of 64 keys (BSP = 64)."""
    H, G, D, DV = kf.shape[1], qf.shape[1] // kf.shape[1], qf.shape[2], vf.shape[2]
    BT = 64 // G
    NC = c_begin.numel()
    _ws_sel_dkv_kernel[(triton.cdiv(NC, 2),)](
        _ws_desc(qf, [1, G, D]), _ws_desc(dof, [1, G, DV]), _ws_desc(kf.view(-1, H * D), [64, D]),
        _ws_desc(vf.view(-1, H * DV), [64, DV]), lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part,
        None if ds is None else _ws_desc(ds.view(-1, G, BSP), [1, G, BSP]), pos, scale_log2, scale, NC, NT, t0, H=H,
        G=G, D=D, DV=DV, NS=NS, BSP=BSP, BT=BT, STAGES=2, WRITE_DS=ds is not None, num_warps=4)


# forward on union tiles on Hopper (Gluon): _sel_fwd_kernel's union tiles of 64 rows, where they run unsplit (rows
# of at most UNION_MAX_T["fwd"] tokens). One program = two union tiles of one kv head (one per consumer warpgroup); a
# loader warp per consumer streams the K and V blocks of its tile's union list by TMA; the consumer holds its Q rows
# in shared memory and runs the online softmax over the blocks, each masked to the rows whose token chose it, causally.

@gluon.jit
def _ws_tile_blocks(cnt, i_t, i_h, NTILES, H: gl.constexpr):
    """How many blocks union tile i_t of kv head i_h lists (0 past the last tile)."""
    return gl.where(i_t < NTILES, gl.load(cnt + gl.minimum(i_t, NTILES - 1) * H + i_h), 0)


@gluon.jit
def _ws_union_fwd_loader(k_desc, v_desc, lst, cnt, k_bufs, v_bufs, kv_ready, kv_free, i_p, half, i_h, NTILES,
                         H: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, LW: gl.constexpr, STAGES: gl.constexpr):
    i_t = i_p * 2 + half
    for f in range(_ws_tile_blocks(cnt, i_t, i_h, NTILES, H)):
        s, ph = f % STAGES, (f // STAGES) & 1
        b = half * STAGES + s
        u0 = gl.load(lst + (i_t * H + i_h).to(gl.int64) * LW + f)
        mbarrier.wait(kv_free.index(b), ph ^ 1)
        mbarrier.expect(kv_ready.index(b), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [u0, i_h * D], kv_ready.index(b), k_bufs.index(b))
        tma.async_copy_global_to_shared(v_desc, [u0, i_h * DV], kv_ready.index(b), v_bufs.index(b))


@gluon.jit
def _ws_union_fwd_consumer(q, o, lse, gate, idx, pos, order, lst, cnt, q_smem, k_bufs, v_bufs, kv_ready, kv_free,
                           i_p, half, i_h, scale_log2, NT, NTILES, H: gl.constexpr, G: gl.constexpr,
                           D: gl.constexpr, DV: gl.constexpr, NS: gl.constexpr, BNS: gl.constexpr, LW: gl.constexpr,
                           BS: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr):
    s_l: gl.constexpr = _ws_mma(64)
    o_l: gl.constexpr = _ws_mma(DV)
    idx_l: gl.constexpr = gl.BlockedLayout([1, BNS], [32, 1], [4, 1], [1, 0])              # a row's slots in a thread
    BT: gl.constexpr = 64 // G
    i_t = i_p * 2 + half
    n_f = _ws_tile_blocks(cnt, i_t, i_h, NTILES, H)
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, idx_l))
    p = i_t * BT + r // G                                                                 # places in order[i_h]
    t = gl.load(order + i_h.to(gl.int64) * NT + p, mask=p < NT, other=NT)
    m_t = t < NT
    rows = t.to(gl.int64) * (H * G) + i_h * G + r % G
    bos = t - gl.load(pos + t, mask=m_t, other=0)                                         # sequence starts
    o_s = gl.arange(0, BNS, layout=gl.SliceLayout(0, idx_l))
    b_idx = gl.load(idx + ((t.to(gl.int64) * H + i_h) * NS)[:, None] + o_s[None, :],
                    mask=m_t[:, None] & (o_s < NS)[None, :], other=-1)                    # [64, BNS]
    b_start = gl.where(b_idx >= 0, bos[:, None] + b_idx * BS, -1)
    q_rows = q_smem.index(half)
    q_rows.store(_ws_load_rows(q, rows, m_t, D, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])))
    fence_async_shared()
    o_k = gl.arange(0, 64, layout=gl.SliceLayout(0, s_l))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_l))
    acc = gl.zeros([64, DV], gl.float32, o_l)
    for f in range(n_f):
        s, ph = f % STAGES, (f // STAGES) & 1
        b = half * STAGES + s
        u0 = gl.load(lst + (i_t * H + i_h).to(gl.int64) * LW + f)
        m_row = m_t & (gl.max((b_start == u0).to(gl.int32), 1) > 0)                      # the rows that chose it
        rel_u = gl.convert_layout(gl.where(m_row, t - u0, -1), gl.SliceLayout(1, s_l))   # keys each reads, from u0
        mbarrier.wait(kv_ready.index(b), ph)
        b_s = warpgroup_mma(q_rows, k_bufs.index(b).permute((1, 0)), gl.zeros([64, 64], gl.float32, s_l),
                            use_acc=False, is_async=True)
        b_s = warpgroup_mma_wait(num_outstanding=0, deps=(b_s,))                          # [64, 64]
        b_s = gl.where(o_k[None, :] <= rel_u[:, None], b_s, float("-inf"))               # causal inside the block
        m_i, alpha, b_p = softmax_rescale(b_s, m_i, scale_log2)
        l_i = l_i * alpha + gl.sum(b_p, 1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        b_p = gl.convert_layout(b_p.to(q.dtype.element_ty), gl.DotOperandLayout(0, o_l, 2))
        acc = warpgroup_mma(b_p, v_bufs.index(b), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))                          # [64, DV]
        mbarrier.arrive(kv_free.index(b), count=1)
    b_o, rows, m_t = _ws_fwd_finish(lse, gate, rows, m_t, m_i, l_i, acc, 1., GATED, o_l)  # base-2 lse
    _ws_store_rows(o, rows, m_t, b_o, DV, o_l)


@gluon.jit
def _ws_union_fwd_kernel(q, k_desc, v_desc, o, lse, gate, idx, pos, order, lst, cnt, scale_log2, NT, NTILES,
                         H: gl.constexpr, G: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, NS: gl.constexpr,
                         BNS: gl.constexpr, LW: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr,
                         GATED: gl.constexpr):
    i_p, i_h = gl.program_id(0), gl.program_id(1)
    q_smem = gl.allocate_shared_memory(q.dtype.element_ty, [2, 64, D],
                                       gl.NVMMASharedLayout.get_default_for([64, D], q.dtype.element_ty))
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [2 * STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [2 * STAGES] + v_desc.block_type.shape, v_desc.layout)
    kv_ready = _ws_barriers(2 * STAGES, 1)
    kv_free = _ws_barriers(2 * STAGES, 1)
    fence_async_shared()
    gl.warp_specialize([
        (_ws_union_fwd_consumer, (q, o, lse, gate, idx, pos, order, lst, cnt, q_smem, k_bufs, v_bufs, kv_ready,
                                  kv_free, i_p, 0, i_h, scale_log2, NT, NTILES, H, G, D, DV, NS, BNS, LW, BS,
                                  STAGES, GATED)),
        (_ws_union_fwd_consumer, (q, o, lse, gate, idx, pos, order, lst, cnt, q_smem, k_bufs, v_bufs, kv_ready,
                                  kv_free, i_p, 1, i_h, scale_log2, NT, NTILES, H, G, D, DV, NS, BNS, LW, BS,
                                  STAGES, GATED)),
        (_ws_union_fwd_loader, (k_desc, v_desc, lst, cnt, k_bufs, v_bufs, kv_ready, kv_free, i_p, 0, i_h, NTILES,
                                H, D, DV, LW, STAGES)),
        (_ws_union_fwd_loader, (k_desc, v_desc, lst, cnt, k_bufs, v_bufs, kv_ready, kv_free, i_p, 1, i_h, NTILES,
                                H, D, DV, LW, STAGES)),
    ], [4, 1, 1], [240, 24, 24])


def _ws_union_fwd(qf, kf, vf, o, lse, gf, idx, pos, order, lst, cnt, scale_log2, NT, NS, sel_block, STAGES=2):
    """Launches _ws_union_fwd_kernel on union tiles of 64 // G tokens."""
    H, D, DV = kf.shape[1], kf.shape[2], vf.shape[2]
    G = qf.shape[1] // H
    NTILES = triton.cdiv(NT, 64 // G)
    _ws_union_fwd_kernel[(triton.cdiv(NTILES, 2), H)](
        qf, _ws_desc(kf.view(-1, H * D), [64, D]), _ws_desc(vf.view(-1, H * DV), [64, DV]), o, lse, gf, idx, pos,
        order, lst, cnt, scale_log2, NT, NTILES, H=H, G=G, D=D, DV=DV, NS=NS, BNS=triton.next_power_of_2(NS),
        LW=lst.shape[1], BS=sel_block, STAGES=STAGES, GATED=gf is not None, num_warps=4)


# ----------------------------------------------------------------------------------------------------------------
# key-centric forward (small G): the loop inverted. One program = (kv head, selected block, chunk of the (token, slot)
# pairs that chose it, in the reverse index) x one key sub-block of BK keys, as the dk/dv kernel above. It loads its
# K/V once and, a tile of BQ = M // G pairs at a time (an [M, D] Q tile), attends each pair's G query rows to it (causal
# inside the block): each (pair, sub-block) writes a partial o and base-2 lse, and a merge kernel combines a token's
# partials in (slot, sub-block) order into the same o and lse the query-centric forward writes. Its backward is the
# dk/dv kernel with WRITE_DQ (the dq partials ds @ k, summed per token in the same order; no query-centric dq pass).
# Deterministic, no atomics, no host sync. Each K/V block is read once per chunk instead of once per (token, kv head)
# that chose it; the price is a partial of G*max(D, Dv) per pair through memory, so it pays for small G. The o and dq
# partials are stored in the input dtype (half the bytes of fp32; each adds one rounding of a partial's size, averaged
# over the token's partials), lse and the sums in fp32.
# Masks: keys after a row inside its block get probability 0 (exact for finite values; as in any tiled causal
# kernel, a non-finite key there that a later token of the same tile also reads reaches the row as 0 * inf), keys
# of another sequence are never loaded.

@triton.jit
def _sel_key_fwd_kernel(q, k, v, o_part, lse_part, perm, c_begin, c_end, c_key, pos, scale_log2, NT, T0,
                        H: tl.constexpr, G: tl.constexpr, M: tl.constexpr,
                        D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
                        BS: tl.constexpr, BK: tl.constexpr, NKC: tl.constexpr, NS: tl.constexpr):
    """Each (pair, head) of one chunk x key sub-block: the softmax over that sub-block's keys alone, as a partial o
    and base-2 lse (-inf for a row with no key there)."""
    i_c, i_kc = tl.program_id(0), tl.program_id(1)
    e0, e1, i_h, rel_k, m_k, b_k, b_v = _key_block(k, v, pos, c_begin, c_end, c_key, i_c, i_kc, NT,
                                                   H, D, DV, BD, BDV, BS, BK)
    for e in range(e0, e1, M // G):
        t_r, m_r, t_off, hq_r, rel_r, b_q, pr = _key_pairs(q, perm, pos, e, e1, i_h, T0, H, G, M, D, BD, NS)
        b_s = tl.dot(b_q, tl.trans(b_k))                                    # [M, BK]
        m_s = m_r[:, None] & m_k[None, :] & (rel_k[None, :] <= rel_r[:, None])  # causal inside the block
        m_i, _, b_p = softmax_rescale(tl.where(m_s, b_s, float("-inf")), tl.full([M], float("-inf"), tl.float32),
                                      scale_log2)
        b_o, b_lse = softmax_finish(m_i, tl.sum(b_p, 1), tl.dot(b_p.to(b_v.dtype), b_v))   # [M, BDV], [M]
        row = pr * NKC + i_kc
        store_rows(o_part, row, m_r, b_o, DV, BDV)
        tl.store(lse_part + row, b_lse, mask=m_r)


@triton.jit
def _token_partials(idx, T0, T1, i_t, i_h, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, NS: tl.constexpr,
                    NKC: tl.constexpr, BP: tl.constexpr):
    """Tile i_t of the window's tokens [T0, T1) x the G heads of kv head i_h, as tile_rows (row mask, token offsets,
    query heads), and each row's partials: their rows [M, BP] of the (token in the window, query head, slot,
    sub-block) layout, contiguous per row, and which of them were written (the slot's id is used)."""
    p_r, g_r, m_g = group_rows(M, G)
    t_r = T0 + i_t * (M // G) + p_r                                         # [M] tokens
    m_t = m_g & (t_r < T1)
    m_r, t_off, hq_r = tile_rows(t_r, g_r, m_t, i_h, H, G)
    o_p = tl.arange(0, BP)                                                  # [BP] partial = slot * NKC + sub-block
    m_p = m_t[:, None] & (o_p < NS * NKC)[None, :]
    used = tl.load(idx + (t_r.to(tl.int64) * H + i_h)[:, None] * NS + (o_p // NKC)[None, :], mask=m_p, other=-1) >= 0
    rows = ((t_r - T0).to(tl.int64) * (H * G) + hq_r)[:, None] * (NS * NKC) + o_p[None, :]
    return m_r, t_off, hq_r, rows, m_r[:, None] & used


@triton.jit
def _load_partials(ptr, rows, m_p, D: tl.constexpr, BD: tl.constexpr):
    """[M, BP, BD] fp32: the partial rows `rows` [M, BP] of a row-major (..., D) array, 0 where m_p is false."""
    o_d = tl.arange(0, BD)
    return tl.load(ptr + rows[:, :, None] * D + o_d[None, None, :],
                   mask=m_p[:, :, None] & (o_d < D)[None, None, :], other=0.).to(tl.float32)


@triton.jit
def _sel_key_merge_kernel(o_part, lse_part, idx, o, lse, gate, T0, T1, H: tl.constexpr, G: tl.constexpr,
                          M: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, NS: tl.constexpr, NKC: tl.constexpr,
                          BP: tl.constexpr, GATED: tl.constexpr):
    """o = sum_s 2^(lse_s - lse) o_s (times the gate) and lse = log2 sum_s 2^lse_s over a token's partials: one
    softmax step with each partial as a key of score lse_s and value o_s (all of a row's partials loaded at once,
    summed in a fixed order)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    m_r, t_off, hq_r, rows, m_p = _token_partials(idx, T0, T1, i_t, i_h, H, G, M, NS, NKC, BP)
    b_lse = tl.load(lse_part + rows, mask=m_p, other=float("-inf"))         # [M, BP]
    m_i, _, b_w = softmax_rescale(b_lse, tl.full([M], float("-inf"), tl.float32), 1.)    # b_w [M, BP]: weights
    acc = tl.sum(_load_partials(o_part, rows, m_p, DV, BDV) * b_w[:, :, None], 1)   # [M, BDV]
    b_o, b_lse = softmax_finish(m_i, tl.sum(b_w, 1), acc)
    store_rows(o, t_off + hq_r, m_r, gate_out(b_o, gate_rows(gate, t_off + hq_r, m_r, GATED), GATED), DV, BDV)
    tl.store(lse + t_off + hq_r, b_lse, mask=m_r)


@triton.jit
def _sel_key_dq_kernel(dq_part, idx, dq, T0, T1, H: tl.constexpr, G: tl.constexpr, M: tl.constexpr, D: tl.constexpr,
                       BD: tl.constexpr, NS: tl.constexpr, NKC: tl.constexpr, BP: tl.constexpr):
    """dq of each token = the sum of its dq partials (all loaded at once, summed in a fixed order)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    m_r, t_off, hq_r, rows, m_p = _token_partials(idx, T0, T1, i_t, i_h, H, G, M, NS, NKC, BP)
    store_rows(dq, t_off + hq_r, m_r, tl.sum(_load_partials(dq_part, rows, m_p, D, BD), 1), D, BD)


@triton.jit
def _clean_kernel(idx, out, key, pos, seq, NR, NB, H: tl.constexpr, NS: tl.constexpr, BNS: tl.constexpr,
                  BS: tl.constexpr, BR: tl.constexpr):
    """BR rows (token, kv head) of ids: -1 where an id is outside [0, t // l'] or equals an earlier slot's; and each
    slot's reverse-index sort key: kv head * NB + the block's number (its first token // l' + the token's sequence:
    distinct and ascending over all blocks), H * NB (sorted last) for -1."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)                            # [BR] rows
    m_r = r < NR
    o_s = tl.arange(0, BNS)
    m = m_r[:, None] & (o_s < NS)[None, :]
    off = r.to(tl.int64)[:, None] * NS + o_s[None, :]
    j = tl.load(idx + off, mask=m, other=-1)                                # [BR, BNS]
    t = r // H                                                              # [BR] tokens
    rel = tl.load(pos + t, mask=m_r, other=0)
    earlier = (j[:, :, None] == j[:, None, :]) & (o_s[None, :, None] > o_s[None, None, :])   # [BR, BNS, BNS]
    ok = (j >= 0) & (j <= (rel // BS)[:, None]) & (tl.max(earlier.to(tl.int32), 2) == 0)
    tl.store(out + off, tl.where(ok, j, -1), mask=m)
    blk = ((t - rel) // BS + tl.load(seq + t, mask=m_r, other=0))[:, None] + j   # [BR, BNS] first token // l' + seq
    tl.store(key + off, tl.where(ok, (r % H)[:, None] * NB + blk, H * NB), mask=m)


@triton.jit
def _bit_count(x):
    """Set bits of each uint32 of x (the SWAR popcount: pairs, nibbles, then bytes summed by a multiply)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    return (((x + (x >> 4)) & 0x0F0F0F0F) * 0x01010101) >> 24


@triton.jit
def _group_kernel(idx, pos, order, NT, H: tl.constexpr, NS: tl.constexpr, BS: tl.constexpr, BT: tl.constexpr,
                  SPAN: tl.constexpr, BSP: tl.constexpr, NW: tl.constexpr):
    """The tokens of span i_s (SPAN tokens) for kv head i_h in tiles of BT that share blocks, into order[i_h]: each
    tile starts at the first token not yet placed and takes, BT - 1 times, the one that adds the fewest blocks to its
    list. A token's blocks are a bitmask of NW words: block b = (its packed first token - the span's earliest sequence
    start) // l' is bit b % 32 of word b // 32 % NW, so blocks 32 NW apart (or of two packed sequences less than l'
    apart) share a bit, which only makes the grouping worse, never the lists wrong. Greedy, the same every run."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    r = tl.arange(0, BSP)
    t = i_s * SPAN + r
    m = (r < SPAN) & (t < NT)
    bos = t - tl.load(pos + t, mask=m, other=0)
    base = tl.min(tl.where(m, bos, INT_MAX), 0)
    w = tl.arange(0, NW)
    blocks = tl.zeros([BSP, NW], tl.uint32)                                 # [BSP, NW] each token's blocks
    for s in range(NS):
        j = tl.load(idx + (t.to(tl.int64) * H + i_h) * NS + s, mask=m, other=-1)
        b = (bos - base + j * BS) // BS % (32 * NW)                         # [BSP] bit of block j
        bit = tl.where(j >= 0, tl.full([BSP], 1, tl.uint32) << (b % 32).to(tl.uint32), 0)
        blocks |= tl.where(w[None, :] == b[:, None] // 32, bit[:, None], 0)
    free = m
    tile = tl.zeros([NW], tl.uint32)                                        # the blocks of the tile being built
    for f in range(SPAN):                                                   # place f of the span
        first = f % BT == 0
        new = tl.sum(_bit_count(blocks ^ (blocks & tile[None, :])).to(tl.int32), 1)   # [BSP] blocks it would add
        k = tl.argmin(tl.where(free, tl.where(first, 0, new) * BSP + r, INT_MAX), 0)   # first free on ties
        tl.store(order + i_h.to(tl.int64) * NT + i_s * SPAN + f, i_s * SPAN + k, mask=i_s * SPAN + f < NT)
        free = free & (r != k)
        row = tl.max(tl.where(r[:, None] == k, blocks, 0), 0)              # [NW] blocks[k]
        tile = tl.where(first, row, tile | row)


@triton.jit
def _union_kernel(idx, pos, order, lst, cnt, NT, H: tl.constexpr, NS: tl.constexpr, BT: tl.constexpr,
                  BS: tl.constexpr, BE: tl.constexpr, LOG_BE: tl.constexpr):
    """One tile of BT tokens (those at places i_t * BT .. of order[i_h]) and kv head i_h: the first packed tokens of
    the distinct blocks its tokens selected, ascending, then -1 (its row of lst, BT * NS long), and how many (cnt).
    Entry e is the tile's token e // NS's slot e % NS; every pair of entries is compared (the tiles hold a few
    tokens), then one sort."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    e = tl.arange(0, BE)
    p = i_t * BT + e // NS                                                  # [BE] places in order
    m = (e < BT * NS) & (p < NT)
    t = tl.load(order + i_h.to(tl.int64) * NT + p, mask=m, other=0)         # [BE] tokens
    j = tl.load(idx + (t.to(tl.int64) * H + i_h) * NS + e % NS, mask=m, other=-1)
    start = tl.where(j >= 0, t - tl.load(pos + t, mask=m, other=0) + j * BS, INT_MAX)   # [BE] sequence start + j l'
    earlier = (start[:, None] == start[None, :]) & (e[:, None] > e[None, :])          # [BE, BE]
    start = tl.where(tl.max(earlier.to(tl.int32), 1) == 0, start, INT_MAX)            # a repeat counts once
    start = tl.reshape(sort_rows(tl.reshape(start.to(tl.int64), [1, BE]), 0, LOG_BE, LOG_BE), [BE])  # ascending
    row = i_t * H + i_h
    tl.store(lst + row.to(tl.int64) * (BT * NS) + e, tl.where(start == INT_MAX, -1, start).to(tl.int32),
             mask=e < BT * NS)
    tl.store(cnt + row, tl.sum((start != INT_MAX).to(tl.int32), 0))


@triton.jit
def _search(arr, n, x, steps, RIGHT: tl.constexpr):
    """For each x: the first i in [0, n) with arr[i] >= x (RIGHT: > x) in the ascending arr, n if none."""
    lo = tl.zeros(x.shape, tl.int64)
    hi = tl.full(x.shape, 0, tl.int64) + n
    for _ in range(steps):
        mid = (lo + hi) // 2
        live = lo < hi
        a = tl.load(arr + mid, mask=live, other=0)
        right = live & ((a <= x) if RIGHT else (a < x))
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(live & ~right, mid, hi)
    return lo


@triton.jit
def _lists_kernel(key, seg, n_chunks, E, HNB, chunk, steps, BL: tl.constexpr):
    """Reverse index, lists: where each (kv head, block number) b's entries start in the sorted keys (seg[b], and
    seg[HNB] = the used entries) and how many chunks its list takes."""
    b = tl.program_id(0) * BL + tl.arange(0, BL)                             # [BL] lists
    o_2 = tl.arange(0, 2)[None, :]
    s = _search(key, E, b[:, None] + o_2, steps, RIGHT=False)               # [BL, 2] starts of b and b + 1
    s0, s1 = tl.sum(tl.where(o_2 == 0, s, 0), 1), tl.sum(tl.where(o_2 == 1, s, 0), 1)
    tl.store(seg + b, s0, mask=b <= HNB)
    tl.store(n_chunks + b, (s1 - s0 + chunk - 1) // chunk, mask=b < HNB)


@triton.jit
def _chunks_kernel(seg, n_chunks, seg_c1, perm, idx, pos, c_begin, c_end, c_key, out_c0, out_c1, NC, NT, t0, chunk,
                   sel_block, steps, H: tl.constexpr, NS: tl.constexpr, HNB: tl.constexpr, BC: tl.constexpr):
    """Reverse index, chunks: each list's chunks [out_c0, out_c1) (int32), and chunk c's entries [c_begin, c_end) and
    key (kv head * NT + its block's first token); chunks after the last list's are empty."""
    c = tl.program_id(0) * BC + tl.arange(0, BC)                             # [BC] lists, then chunks
    m_l = c < HNB
    c1 = tl.load(seg_c1 + c, mask=m_l, other=0)
    tl.store(out_c0 + c, (c1 - tl.load(n_chunks + c, mask=m_l, other=0)).to(tl.int32), mask=m_l)
    tl.store(out_c1 + c, c1.to(tl.int32), mask=m_l)
    lst = _search(seg_c1, HNB, c, steps, RIGHT=True)                         # [BC] the list holding chunk c
    used = (c < NC) & (lst < HNB)
    lst = tl.minimum(lst, HNB - 1)
    first_c = tl.load(seg_c1 + lst) - tl.load(n_chunks + lst)                 # the list's first chunk
    beg = tl.load(seg + lst) + (c - first_c) * chunk
    end = tl.minimum(beg + chunk, tl.load(seg + lst + 1))
    first = tl.load(perm + beg, mask=used, other=0)                           # the chunk's first pair
    t = t0 + first // (H * NS)
    kst = t - tl.load(pos + t, mask=used, other=0) + tl.load(idx + first, mask=used, other=0) * sel_block
    m_c = c < NC
    tl.store(c_begin + c, tl.where(used, beg, 0), mask=m_c)
    tl.store(c_end + c, tl.where(used, end, 0), mask=m_c)
    tl.store(c_key + c, tl.where(used, first // NS % H * NT + kst, 0), mask=m_c)


# ----------------------------------------------------------------------------------------------------------------
# host launchers (no host syncs: every size below comes from shapes, so torch.compile and CUDA graphs can capture them)

def _num_blocks(NT, sel_block, n_seq):
    """A bound on the selection blocks of NT packed tokens in n_seq sequences (their numbers are below it)."""
    return NT // sel_block + n_seq


def _key_dtype(n):
    """The smallest signed integer dtype that holds 0..n (a radix sort takes one pass per byte)."""
    return torch.int16 if n < 2 ** 15 else torch.int32 if n < 2 ** 31 else torch.int64


def _clean_indices(idx, pos, seq, sel_block, NB):
    """(NT, H, n) ids made valid and unique in place of each slot: ids outside [0, t // l'] and repeats of an earlier
    slot's id -> -1 (the keys are a union of blocks, so a repeated id counts once). Also returns each slot's sort key
    (NT * H * n,) for the reverse index: kv head * NB + block number, H * NB for -1, in the smallest dtype."""
    NT, H, NS = idx.shape
    out = torch.empty_like(idx)
    key = torch.empty(idx.numel(), device=idx.device, dtype=_key_dtype(H * NB))
    if idx.numel():
        _clean_kernel[(triton.cdiv(NT * H, 64),)](idx, out, key, pos, seq, NT * H, NB, H=H, NS=NS,
                                                  BNS=triton.next_power_of_2(NS), BS=sel_block, BR=64)
    return out, key


def _sizes(HQ, H, D, DV, sel_block):
    return dict(head_sizes(HQ, H, D, DV), BS=sel_block, BK=min(64, triton.next_power_of_2(sel_block)))


def _key_tiles(c, sel_block, elem):
    """The key-side kernels' sizes (dk/dv, the key-centric forward) for inputs of elem bytes: BK keys per sub-block
    (fewer for wide rows, so that the K, V and fp32 dk/dv tiles stay in registers and the blocks in shared memory)
    and NKC sub-blocks per selection block."""
    BK = min(c["BK"], 32 if wide_rows(max(c["D"], c["DV"]), elem) else 64)
    return dict(c, BK=BK), triton.cdiv(sel_block, BK)


def _key_path(G):
    """Whether a call with G query heads per kv head takes the key-centric path under CONFIG["path"]."""
    path = CONFIG["path"]
    if path not in ("auto", "query", "key"):
        raise ValueError(f"sel_kernel.CONFIG['path'] must be 'auto', 'query' or 'key', got {path!r}")
    return path == "key" or (path == "auto" and G <= KEY_MAX_G)


def union_tiles(idx, pos, BT, sel_block):
    """The union tiles of BT tokens, per kv head: order (H, NT) int32, the tokens tile by tile (grouped by shared
    blocks inside spans of GROUP_TILES tiles, _group_kernel); lst (tiles * H, BT * n) int32, the first packed tokens
    (sequence start + id * l') of the distinct blocks a tile's tokens selected, ascending, then -1; cnt (tiles * H,)
    int32, how many. idx (NT, H, n) cleaned ids, pos (NT,) int32 positions. Two kernels; no host sync."""
    NT, H, NS = idx.shape
    tiles, span = triton.cdiv(NT, BT), BT * GROUP_TILES
    words = min(GROUP_WORDS, triton.next_power_of_2(triton.cdiv(triton.cdiv(NT, sel_block), 32)))  # a bit a block
    order = torch.empty(H, NT, device=idx.device, dtype=torch.int32)
    lst = torch.empty(tiles * H, BT * NS, device=idx.device, dtype=torch.int32)
    cnt = torch.empty(tiles * H, device=idx.device, dtype=torch.int32)
    if tiles:
        _group_kernel[(triton.cdiv(NT, span), H)](idx, pos, order, NT, H=H, NS=NS, BS=sel_block, BT=BT, SPAN=span,
                                                  BSP=triton.next_power_of_2(span), NW=words)
        BE = triton.next_power_of_2(BT * NS)
        _union_kernel[(tiles, H)](idx, pos, order, lst, cnt, NT, H=H, NS=NS, BT=BT, BS=sel_block, BE=BE,
                                  LOG_BE=BE.bit_length() - 1)
    return order, lst, cnt


@torch.compiler.assume_constant_result
def _l2_bytes(device):
    """L2 cache of a CUDA device, 0 for other devices (the interpreter takes the H100's rules)."""
    return torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0


def _query_launch(name, G, T, width, device):
    """(M, union, launch kwargs) of the query-centric kernel CONFIG[name] ("fwd" or "dq"), on rows of T tokens (packed
    var-length input: their total, a bound on each) and heads width = max(D, Dv) wide, on `device`; a tile holds
    M // G tokens, and union tiles need more than one. Under "auto" the forward and dq at G = 16 with heads up to 128
    wide (the measured shape) take CONFIG["fwd_union"] / ["dq_union"], where tokens share enough blocks that loading
    each once per tile pays; on rows of more than UNION_MAX_T[name] tokens they keep them only where their lists are
    short (cfg["split"] = UNION_SPLIT[name], see _query_launches), and past ONE_TOKEN_T[name] on GPUs with at least
    SPLIT_MAX_L2 of L2 cache not at all."""
    auto = CONFIG["path"] == "auto" and G == 16 and width <= 128
    one_token = T > ONE_TOKEN_T[name] and _l2_bytes(device) >= SPLIT_MAX_L2
    M, union, cfg = _launch(name + "_union" if auto and not one_token else name, G)
    if union and auto and T > UNION_MAX_T[name]:
        cfg["split"] = UNION_SPLIT[name]
    return M, union, cfg


def _query_launches(name, c, T, width, idx, pos, tiles, sel_block):
    """The launches of the query-centric kernel CONFIG[name] (_query_launch): its union index (order, lst, cnt; idx
    thrice without union tiles) and [(grid, kwargs)], two where the union tiles split (_other_launch)."""
    NT, NS, G, H = idx.shape[0], idx.shape[2], c["G"], c["H"]
    M, union, cfg = _query_launch(name, G, T, width, idx.device)
    split = cfg.pop("split", None)
    order, lst, cnt = _union_index(tiles, M // G, idx, pos, sel_block) if union else (idx, idx, idx)
    launches = [((triton.cdiv(NT, M // G), H), dict(cfg, M=M, UNION=union))]
    if split is not None:  # the tokens of union tiles listing more than split x n blocks: in CONFIG[name]'s tiles
        M1, _, cfg1 = _launch(name, G)
        M1 = min(M1, M)    # tokens a tile dividing the union tiles'
        limit = dict(LIMIT=int(split * NS), UT=M // G)
        launches = [(launches[0][0], dict(launches[0][1], SPLIT=1, **limit)),
                    ((triton.cdiv(NT, M1 // G), H), dict(cfg1, M=M1, UNION=False, SPLIT=2, **limit))]
    return order, lst, cnt, launches


def _launch(entry, G):
    """(M, union, launch kwargs) of CONFIG[entry] at G query heads per kv head."""
    cfg = dict(CONFIG[entry])
    M = tile_m(cfg.pop("rows"), G)
    return M, cfg.pop("union") and M // G > 1, cfg


def _chunk_pairs(rows, chunk_rows, G):
    """Pairs per reverse-index chunk: about chunk_rows query rows, in whole tiles of the dk/dv kernel (tile_m(rows,
    G) rows, M // G pairs)."""
    pairs = tile_m(rows, G) // G
    return max(pairs, chunk_rows // G // pairs * pairs)


def _sum_launch(G, NS, NKC):
    """Rows M of the merge and dq-sum kernels' tiles and their launch kwargs (BP: a row's partials, padded)."""
    cfg = dict(CONFIG["key_sum"])
    return tile_m(cfg.pop("rows"), G), dict(cfg, BP=triton.next_power_of_2(NS * NKC))


def _windows(NT, W):
    """Token windows [t0, t1) of W tokens covering the NT packed tokens."""
    return [(t0, min(NT, t0 + W)) for t0 in range(0, NT, W)]


def _index_sizes(W, H, NS, NB, chunk):
    """Sizes of the reverse index of a window of W tokens: its entries E, its chunks NC (a bound: E / chunk, plus
    one per (head, block) list, of which there are at most min(E, H * NB)) and perm's dtype (int32 where it fits:
    the kernels divide it by constants, which 32-bit integers do several times faster)."""
    E = W * H * NS
    return E, E // chunk + min(E, H * NB), torch.int32 if E < 2 ** 31 else torch.int64


def _reverse_index(key, idx, pos, t0, sel_block, NB, chunk):
    """For every (kv head, selected block): the (token, slot) pairs of the token window [t0, t0 + W) that selected
    it, tokens ascending, cut into chunks of `chunk`. key (W * H * n,) the window's sort keys and idx (W, H, n) its
    cleaned ids (_clean_indices), pos (NT,) int32 all tokens' positions. Returns perm (E,) (each entry's (token in
    the window, kv head, slot), flat, in list order), per chunk begin/end/key (NC,) (key = kv head * NT + the
    block's first token; chunks ordered by key, unused ones empty and last), and per (head, block number) its chunks
    [seg_c0, seg_c1) (H * NB,). One sort of E keys, then two small kernels and a cumsum over lists and chunks; no
    host sync."""
    W, H, NS = idx.shape
    NT, dev = pos.numel(), idx.device
    E, NC, perm_dtype = _index_sizes(W, H, NS, NB, chunk)
    key, perm = torch.sort(key, stable=True)                                   # stable: tokens stay ascending
    seg = torch.empty(H * NB + 1, device=dev, dtype=torch.int64)               # list starts in the sorted entries
    n_chunks = torch.empty(H * NB, device=dev, dtype=torch.int64)
    steps = (E + 1).bit_length()                                               # binary search steps over E + 1
    _lists_kernel[(triton.cdiv(H * NB + 1, 256),)](key, seg, n_chunks, E, H * NB, chunk, steps, BL=256)
    seg_c1 = torch.cumsum(n_chunks, 0)                                         # (H*NB,) each list's chunks end
    c_begin, c_end, c_key = (torch.empty(NC, device=dev, dtype=torch.int64) for _ in range(3))
    seg_c0_32, seg_c1_32 = (torch.empty(H * NB, device=dev, dtype=torch.int32) for _ in range(2))
    _chunks_kernel[(triton.cdiv(max(NC, H * NB), 256),)](
        seg, n_chunks, seg_c1, perm, idx, pos, c_begin, c_end, c_key, seg_c0_32, seg_c1_32, NC, NT, t0, chunk,
        sel_block, (H * NB).bit_length(), H=H, NS=NS, HNB=H * NB, BC=256)
    return perm.to(perm_dtype), c_begin, c_end, c_key, seg_c0_32, seg_c1_32


def _dkv_cfg(key_path, G, D, DV, elem):
    """The dk/dv pass's launch settings for inputs of elem bytes: CONFIG["dkv"] on the query path, on the key path
    "key_bwd" or the entry for its G and head width (nsa_kernels.launch_entry); fp32 heads wider than 64 in tiles of
    at most 64 rows in 4 warps (128 rows do not fit in a block's shared memory)."""
    cfg = dict(CONFIG[launch_entry("key_bwd", G, max(D, DV), CONFIG) if key_path else "dkv"])
    if elem > 2 and wide_rows(max(D, DV), elem):
        cfg.update(rows=min(cfg["rows"], 64), num_warps=min(cfg["num_warps"], 4))
    return cfg


def _plan(NT, HQ, H, NS, D, DV, sel_block, elem):
    """How a call of these sizes (inputs of elem bytes) runs: whether it takes the key path; the tokens W of each
    window of its dk/dv pass (and of the key path's forward), so that a window holds at most KEY_WINDOW_ROWS per-pair
    partial rows (one window on the query path, which has none); the partial rows of a full window; and the reverse
    index's chunk (pairs per chunk: about chunk_rows query rows of the dk/dv pass's CONFIG entry, fewer on the query
    path where pairs are few; in whole tiles)."""
    c = _sizes(HQ, H, D, DV, sel_block)
    key_path = _key_path(c["G"])
    cfg = _dkv_cfg(key_path, c["G"], D, DV, elem)
    if not key_path:  # fewer pairs: shorter chunks (down to a quarter), so that the dk/dv grid still fills the GPU
        rows = min(cfg["chunk_rows"], max(cfg["chunk_rows"] // 4, triton.next_power_of_2(NT * HQ * NS // DKV_CHUNKS)))
        return False, max(NT, 1), 0, _chunk_pairs(cfg["rows"], rows, c["G"])
    chunk = _chunk_pairs(cfg["rows"], cfg["chunk_rows"], c["G"])
    rows_per_token = HQ * NS * _key_tiles(c, sel_block, elem)[1]
    W = max(1, KEY_WINDOW_ROWS // max(1, rows_per_token))
    return True, W, min(W, NT) * rows_per_token, chunk


def _index(block_indices: torch.Tensor, sel_block: int, cu_seqlens: Optional[torch.Tensor], window: int,
           chunk: int, tile: int) -> list[torch.Tensor]:
    """What the forward and the backward both take from the ids, built once per call (the op nsa::sel_index): the
    cleaned ids (NT, H, n), pos and seq (NT,) int32 (each token's position inside its own sequence, which restarts at
    each cu_seqlens offset, and that sequence's index), the union tiles of `tile` tokens (union_tiles' three
    tensors; empty ones for tile 0), the pairs' sort keys (_clean_indices'), then for windows of `window` tokens and
    chunks of `chunk` pairs (_plan's) each window's reverse index (_reverse_indices; none for window 0, as on the
    query path, whose forward reads none: its backward builds them from the keys). A pure function of its
    arguments, as its fake must be."""
    B, T, H, NS = block_indices.shape
    cu, seq, pos = sequences(B, T, cu_seqlens, block_indices.device)
    pos, seq = pos.to(torch.int32), seq.to(torch.int32)
    NB = _num_blocks(B * T, sel_block, cu.numel() - 1)
    idx, key = _clean_indices(pack(block_indices), pos, seq, sel_block, NB)
    tiles = union_tiles(idx, pos, tile, sel_block) if tile and NS else [pos.new_empty(0) for _ in range(3)]
    return [idx, pos, seq, *tiles, key, *_reverse_indices(idx, pos, key, _windows(B * T, window) if window else [],
                                                          sel_block, NB, chunk)]


def _index_fake(block_indices, sel_block, cu_seqlens, window, chunk, tile):
    """_index's tensors, empty, with the shapes and dtypes it gives (for torch.compile)."""
    B, T, H, NS = block_indices.shape
    NT, n_seq = B * T, B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    new = block_indices.new_empty
    tiles = H * triton.cdiv(NT, tile) if tile and NS else 0
    NB = _num_blocks(NT, sel_block, n_seq)
    index = [new(NT, H, NS), new(NT), new(NT), *([new(H, NT), new(tiles, tile * NS), new(tiles)] if tiles else
                                                 [new(0) for _ in range(3)]),
             new(NT * H * NS, dtype=_key_dtype(H * NB))]
    for t0, t1 in _windows(NT, window) if NS and window else []:
        E, NC, perm_dtype = _index_sizes(t1 - t0, H, NS, NB, chunk)
        index += [new(E, dtype=perm_dtype), *[new(NC, dtype=torch.int64) for _ in range(3)], new(H * NB), new(H * NB)]
    return index


sel_index = torch.library.custom_op("nsa::sel_index", _index, mutates_args=())
sel_index.register_fake(_index_fake)


def _reverse_indices(idx, pos, key, windows, sel_block, NB, chunk):
    """_reverse_index of each token window (t0, t1) of the cleaned ids idx (NT, H, n) and their sort keys, flat."""
    H, NS = idx.shape[1], idx.shape[2]
    return [x for t0, t1 in (windows if NS else []) for x in
            _reverse_index(key[t0 * H * NS:t1 * H * NS], idx[t0:t1], pos, t0, sel_block, NB, chunk)]


def _window_index(index, windows, H, NS):
    """The reverse index of each window out of index (nsa::sel_index's), or None if index holds none or one for
    other windows."""
    if len(index) != 7 + 6 * len(windows) or any(index[7 + 6 * w].numel() != (t1 - t0) * H * NS
                                                 for w, (t0, t1) in enumerate(windows)):
        return None
    return [index[7 + 6 * w: 13 + 6 * w] for w in range(len(windows))]


def _fwd_key(qf, kf, vf, gf, idx, pos, per_window, windows, rows, c, NS, scale_log2):
    """The key-centric forward on packed inputs, window by window: partials per (token, query head, slot,
    sub-block), then the merge (which applies the gate gf, (NT, HQ) fp32 or None)."""
    NT, HQ, DV = qf.shape[0], qf.shape[1], vf.shape[2]
    cfg = dict(CONFIG[launch_entry("key_fwd", c["G"], max(kf.shape[2], DV), CONFIG)])
    c, NKC = _key_tiles(c, c["BS"], qf.element_size())
    M = tile_m(cfg.pop("rows"), c["G"])
    o_part = torch.empty(rows, DV, device=qf.device, dtype=qf.dtype)           # lse and the merge: fp32
    lse_part = torch.empty(rows, device=qf.device, dtype=torch.float32)
    o = torch.empty(NT, HQ, DV, device=qf.device, dtype=qf.dtype)
    lse = torch.empty(NT, HQ, device=qf.device, dtype=torch.float32)
    M_sum, sum_cfg = _sum_launch(c["G"], NS, NKC)
    for (t0, t1), (perm, c_begin, c_end, c_key, _, _) in zip(windows, per_window):
        _sel_key_fwd_kernel[(c_begin.numel(), NKC)](qf, kf, vf, o_part, lse_part, perm, c_begin, c_end, c_key, pos,
                                                    scale_log2, NT, t0, M=M, NKC=NKC, NS=NS, **c, **cfg)
        _sel_key_merge_kernel[(triton.cdiv(t1 - t0, M_sum // c["G"]), c["H"])](
            o_part, lse_part, idx, o, lse, gf, t0, t1, H=c["H"], G=c["G"], M=M_sum, DV=DV, BDV=c["BDV"], NS=NS,
            NKC=NKC, GATED=gf is not None, **sum_cfg)
    return o, lse


def _prepare(q, k, v, block_indices, sel_block, cu_seqlens, index, backward):
    """Sizes, the plan, the packed q, k, v, and the index: the one given (nsa::sel_index's), else built here (its
    union tiles then by _union_index); with the reverse index of the plan's windows (CONFIG may have changed since a
    compiled graph was traced) where the pass reads it: the backward, and the key path's forward."""
    B, T, HQ, D = q.shape
    H, NS, DV = k.shape[2], block_indices.shape[3], v.shape[3]
    c = _sizes(HQ, H, D, DV, sel_block)
    key_path, W, rows, chunk = _plan(B * T, HQ, H, NS, D, DV, sel_block, q.element_size())
    windows = _windows(B * T, W)
    if not index:
        index = _index(block_indices, sel_block, cu_seqlens, 0, chunk, 0)
    per_window = _window_index(index, windows, H, NS)
    if per_window is None and (backward or key_path):
        NB = _num_blocks(B * T, sel_block, B if cu_seqlens is None else cu_seqlens.numel() - 1)
        flat = _reverse_indices(index[0], index[1], index[6], windows, sel_block, NB, chunk)
        per_window = [flat[6 * w: 6 * w + 6] for w in range(len(windows))]
    return c, NS, key_path, windows, rows, per_window, pack(q), pack(k), pack(v), *index[:3], index[3:6]


def _union_index(tiles, BT, idx, pos, sel_block):
    """union_tiles of BT tokens: tiles (the index's) if they were built for BT, else built here."""
    return tiles if tiles[1].dim() == 2 and tiles[1].shape[1] == BT * idx.shape[2] else \
        union_tiles(idx, pos, BT, sel_block)


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Optional[torch.Tensor], block_indices: torch.Tensor,
         sel_block: int, scale: float, cu_seqlens: Optional[torch.Tensor],
         index: list[torch.Tensor], n_init: int, n_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, HQ, D = q.shape
    NT, DV = B * T, v.shape[3]
    if NT == 0 or block_indices.shape[3] == 0:  # nothing to attend to: o = 0, lse = -inf
        return q.new_zeros(B, T, HQ, DV), q.new_full((B, T, HQ), float("-inf"), dtype=torch.float32)
    c, NS, key_path, windows, rows, per_window, qf, kf, vf, idx, pos, _, tiles = _prepare(
        q, k, v, block_indices, sel_block, cu_seqlens, index, backward=False)
    gf = pack_gate(gate)
    scale_log2 = scale * math.log2(math.e)
    if key_path:
        o, lse = _fwd_key(qf, kf, vf, gf, idx, pos, per_window, windows, rows, c, NS, scale_log2)
        return o.view(B, T, HQ, DV), lse.view(B, T, HQ)
    order, lst, cnt, launches = _query_launches("fwd", c, T, max(D, DV), idx, pos, tiles, sel_block)
    o = torch.empty(NT, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(NT, HQ, device=q.device, dtype=torch.float32)
    kb, vb, boxes = tma_boxes(kf, vf, [c["BK"], 1, c["BD"]], [c["BK"], 1, c["BDV"]])
    grid, kw = launches[0]
    M, _, cfg = _launch("forced", c["G"])
    if (n_init or n_local) and len(launches) == 1 and not kw["UNION"] and kw["M"] // c["G"] == 1 < M // c["G"]:
        # one token a tile: first the blocks that every token of a block holds (forced), as key ranges in tiles of
        # several tokens, then the free ones, one token a tile (loading fewer bytes at no extra step)
        BK = cfg.pop("keys")
        fb, fvb, f_boxes = tma_boxes(kf, vf, [BK, 1, c["BD"]], [BK, 1, c["BDV"]])
        _sel_forced_fwd_kernel[(triton.cdiv(NT, M // c["G"]), c["H"])](
            qf, fb, fvb, o, lse, pos, scale_log2, NT, M=M, N_INIT=n_init, N_LOCAL=n_local, BOXES=f_boxes,
            **dict(c, BK=BK), **cfg)
        launches = [(grid, dict(kw, FORCED=True, N_INIT=n_init, N_LOCAL=n_local))]
    for grid, kw in launches:
        if (kw["UNION"] and kw["M"] == 64 and "SPLIT" not in kw and sel_block == 64 and c["BK"] == 64 and
                nsa_kernels._ws_applies(qf, kf, vf)):
            _ws_union_fwd(qf, kf, vf, o, lse, gf, idx, pos, order, lst, cnt, scale_log2, NT, NS, sel_block)
            continue
        _sel_fwd_kernel[grid](qf, kb, vb, o, lse, gf, idx, pos, order, lst, cnt, scale_log2, NT, NS=NS,
                              BNS=triton.next_power_of_2(NS), BOXES=boxes, GATED=gf is not None, **c, **kw)
    return o.view(B, T, HQ, DV), lse.view(B, T, HQ)


def _bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: Optional[torch.Tensor],
         o: torch.Tensor, lse: torch.Tensor, block_indices: torch.Tensor, sel_block: int, scale: float,
         cu_seqlens: Optional[torch.Tensor], index: list[torch.Tensor], n_init: int, n_local: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, HQ, D = q.shape
    NT, DV = B * T, v.shape[3]
    if NT == 0 or block_indices.shape[3] == 0:  # no key anywhere (o = 0): all gradients are zero
        return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v),
                gate_grad(q.new_zeros(B, T, HQ, dtype=torch.float32), gate))
    c, NS, key_path, windows, rows, per_window, qf, kf, vf, idx, pos, seq, tiles = _prepare(
        q, k, v, block_indices, sel_block, cu_seqlens, index, backward=True)
    of, dof = o.reshape(NT, HQ, DV).contiguous(), do.reshape(NT, HQ, DV).contiguous()
    H = c["H"]
    scale_log2 = scale * math.log2(math.e)
    gf = pack_gate(gate)
    delta = torch.empty(NT, HQ, device=q.device, dtype=torch.float32)    # dgate too, with a gate
    lse2 = torch.empty_like(delta)                                        # lse as the kernels below read it
    dq = torch.empty_like(qf)
    c_kv, NKC = _key_tiles(c, sel_block, q.element_size())
    BSP = NKC * c_kv["BK"]
    ds = None  # the query path's score gradients, a row of BSP per (token, kv head, slot, head), where they fit
    if not key_path and NT * HQ * NS * BSP * q.element_size() <= DS_MAX_BYTES:
        ds = torch.empty(NT * HQ * NS, BSP, device=q.device, dtype=q.dtype)
    if key_path or ds is not None:  # dq from the dk/dv kernel's partials or score gradients, after it
        _sel_bwd_delta_kernel[(triton.cdiv(NT * HQ, 32),)](of, dof, lse.reshape(NT, HQ), delta, lse2, gf,
                                                           NT * HQ, DV=DV, BDV=c["BDV"], BR=32, GATED=gf is not None)
    else:  # query-centric dq, which writes delta and lse2 too
        order, lst, cnt, launches = _query_launches("dq", c, T, max(D, DV), idx, pos, tiles, sel_block)
        kb, vb, boxes = tma_boxes(kf, vf, [c["BK"], 1, c["BD"]], [c["BK"], 1, c["BDV"]])
        for grid, kw in launches:
            _sel_bwd_dq_kernel[grid](qf, kb, vb, of, dof, lse.reshape(NT, HQ), lse2, delta, dq, gf, idx, pos, order,
                                     lst, cnt, scale_log2, scale, NT, NS=NS, BNS=triton.next_power_of_2(NS),
                                     BOXES=boxes, GATED=gf is not None, **c, **kw)
    lse = lse2
    cfg = _dkv_cfg(key_path, c["G"], D, DV, q.element_size())
    cfg.pop("chunk_rows")                                                      # in the index
    M = tile_m(cfg.pop("rows"), c["G"])
    dq_part = torch.empty(rows, D, device=q.device, dtype=q.dtype) if key_path else None
    M_sum, sum_cfg = _sum_launch(c["G"], NS, NKC)
    dk, dv = torch.empty_like(kf), torch.empty_like(vf)
    # the windows' sums add up in fp32 for the keys an earlier window reaches: those before the last window (a key's
    # gradients come from the tokens at or after it); the last window writes every key's dk, dv
    N_ACC = 0 if len(windows) == 1 else windows[-1][0]
    dk_acc = torch.empty(N_ACC, H, D, device=q.device, dtype=torch.float32)
    dv_acc = torch.empty(N_ACC, H, DV, device=q.device, dtype=torch.float32)
    NC_max = max(w[1].numel() for w in per_window)                            # one set of partials, reused
    dk_parts = torch.empty(NC_max, BSP, D, device=q.device, dtype=torch.float32)  # by each window in turn
    dv_parts = torch.empty(NC_max, BSP, DV, device=q.device, dtype=torch.float32)
    for (t0, t1), (perm, c_begin, c_end, c_key, seg_c0, seg_c1) in zip(windows, per_window):
        NC = c_begin.numel()
        dk_part, dv_part = dk_parts[:NC], dv_parts[:NC]
        if (not key_path and sel_block == 64 and BSP == 64 and c["G"] >= 8 and min(D, DV) >= 64 and
                nsa_kernels._ws_applies(qf, kf, vf, dof)):
            _ws_sel_dkv(qf, kf, vf, dof, lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part, ds, pos,
                        scale_log2, scale, NT, t0, NS, BSP)
        else:
            _sel_bwd_dkv_kernel[(NC, NKC)](qf, kf, vf, dof, lse, delta, perm, c_begin, c_end, c_key, dk_part, dv_part,
                                           dq_part, ds, pos, scale_log2, scale, NT, t0, M=M, BSP=BSP, NKC=NKC, NS=NS,
                                           WRITE_DQ=key_path, WRITE_DS=ds is not None, **c_kv, **cfg)
        if key_path:
            _sel_key_dq_kernel[(triton.cdiv(t1 - t0, M_sum // c["G"]), H)](dq_part, idx, dq, t0, t1, H=H, G=c["G"],
                                                                          M=M_sum, D=D, BD=c["BD"], NS=NS, NKC=NKC,
                                                                          **sum_cfg)
        NB = seg_c0.numel() // H                                               # block numbers per kv head
        last = t1 == NT
        NK = NT if last else N_ACC
        _sel_bwd_reduce_kernel[(triton.cdiv(NK, 32), H)](dk_part, dv_part, dk_acc, dv_acc, dk if last else dk_acc,
                                                         dv if last else dv_acc, pos, seq, seg_c0, seg_c1, NK, NB,
                                                         N_ACC, H=H, D=D, DV=DV, BD=c["BD"], BDV=c["BDV"],
                                                         BS=sel_block, BSP=BSP, BR=32, ADD=t0 > 0)
    if ds is not None:
        M, union, _ = _query_launch("dq", c["G"], T, max(D, DV), q.device)  # the dq's tiles, its union tiles unsplit
        order, lst, cnt = _union_index(tiles, M // c["G"], idx, pos, sel_block) if union else (idx, idx, idx)
        kb, _, boxes = tma_boxes(kf, kf, [c["BK"], 1, c["BD"]], [c["BK"], 1, c["BD"]])
        _sel_ds_dq_kernel[(triton.cdiv(NT, M // c["G"]), H)](
            kb, ds, dq, idx, pos, order, lst, cnt, scale, NT, H=H, G=c["G"], M=M, D=D, BD=c["BD"], BS=sel_block,
            BK=c["BK"], BSP=BSP, NS=NS, BNS=triton.next_power_of_2(NS), UNION=union, BOXES=boxes, **CONFIG["dq_ds"])
    return dq.view_as(q), dk.view_as(k), dv.view_as(v), gate_grad(delta, gate)


# ----------------------------------------------------------------------------------------------------------------
# torch.library ops nsa::sel_attn_fwd / nsa::sel_attn_bwd: opaque to torch.compile, autograd through the backward op

sel_attn_fwd, sel_attn_bwd = attention_op("sel_attn", _fwd, _bwd)


def selection_attention_triton(q, k, v, block_indices, sel_block, scale=None, cu_seqlens=None, gate=None,
                               forced=None):
    """Selected-block attention (the definition in nsa_attention.py, "Selected"), differentiable in q, k, v and gate;
    no host sync, deterministic backward. q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv) fp16/bf16 (fp32 works:
    tf32 dots on GPU); HQ % H == 0. block_indices int32 (B, T, H, n): for token t and kv head h the block ids j (keys
    [j*l', (j+1)*l') masked to <= t); -1 or ids outside [0, t // l'] are ignored. cu_seqlens int32 (N+1,) with
    B == 1: packed sequences, positions and block ids relative to each start. scale (> 0) defaults to D ** -0.5. gate
    (B, T, HQ) or None scales each row of o. forced (n_init, n_local) or None: every token's ids hold blocks 0 ..
    n_init - 1 and the n_local up to its own (as select_blocks' do), which the forward may then read as key ranges.
    Returns o (B, T, HQ, Dv)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, T, HQ|H, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    B, T, HQ, D = q.shape
    if k.shape[:2] != (B, T) or k.shape[3] != D or HQ % k.shape[2] or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k must be (B, T, H, D) with H dividing HQ and v (B, T, H, Dv) for q {tuple(q.shape)}, "
                         f"got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if block_indices.dtype != torch.int32 or block_indices.dim() != 4 or block_indices.shape[:3] != k.shape[:3]:
        raise ValueError(f"block_indices must be int32 (B, T, H, n) = ({B}, {T}, {k.shape[2]}, n), "
                         f"got {block_indices.dtype} {tuple(block_indices.shape)}")
    if cu_seqlens is not None and (B != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1):
        raise ValueError(f"cu_seqlens must be int32 (N + 1,) with B == 1, got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)} with B={B}")
    scale = D ** -0.5 if scale is None else float(scale)
    key_path, window, _, chunk = _plan(B * T, HQ, k.shape[2], block_indices.shape[3], D, v.shape[3],
                                       int(sel_block), q.element_size())
    G = HQ // k.shape[2]
    # the forward's union tiles are built once, for the dq too (where the forward runs one token a tile, the dq
    # builds its own); the reverse index here only for the key path's forward (the query path's backward builds it)
    M, union, _ = _query_launch("fwd", G, T, max(D, v.shape[3]), q.device)
    index = sel_index(block_indices, int(sel_block), cu_seqlens, window if key_path else 0, chunk,
                      M // G if union else 0)
    n_init, n_local = forced or (0, 0)
    return sel_attn_fwd(q, k, v, gate, block_indices, int(sel_block), scale, cu_seqlens, index, int(n_init),
                        int(n_local))[0]

