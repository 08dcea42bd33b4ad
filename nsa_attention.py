"""Native Sparse Attention (Yuan et al., arXiv 2502.11089) in plain PyTorch: each branch as the paper writes it, the
four public ops (backend="auto" runs the Triton kernels of sel_kernel.py / nsa_kernels.py on CUDA, this code elsewhere),
the NSAAttention layer that model.py stacks, and its decode step. The paper leaves some indexing implicit; this
docstring is the definition the code, the kernels and the tests follow, cited as (nsa_attention.py, "<section>").

Notation
    B batch, T tokens, HQ query heads, H key/value heads, G = HQ / H query heads per KV group (any G >= 1), D the
    query/key head dim, Dv the value head dim; t is a query's position inside its own sequence, from 0. The queries
    are shared; each branch has its own key and value projections. Hyperparameters, with the paper's values:
    l = cmp_block (32), d = cmp_stride (16), l' = sel_block (64), n = n_select (16), n_init (1), n_local (2),
    w = window (512); softmax scale 1 / sqrt(D) unless given. Valid: l, d, l', n, w and the scale positive, n_init
    and n_local >= 0, d divides l and l', l <= l', n >= n_init + n_local; anything else is a ValueError naming the
    value.

Compressed
    Compressed block i covers positions [i*d, i*d + l), so T tokens give Tc = 0 if T < l else (T - l) // d + 1.
    phi (Eq. 7) maps a block's l keys (or values), each plus a learned intra-block position embedding (l, D), through
    an MLP l*D -> hidden -> D to one token. Query t sees block i iff i*d + l - 1 <= t (the whole block is in its
    past); a query that sees none gets o = 0 and lse = -inf. phi reads keys without RoPE; the compressed key is then
    rotated at i*d + l - 1, its block's last position.

Selected
    Selection block j covers positions [j*l', (j+1)*l'). With p the softmax of query t's compressed scores (Eq. 8),
    block j scores, for KV group h,
        s[t, h, j] = sum over the G heads of group h and the blocks i that t sees of  w(i, j) * p[t, head, i],
        w(i, j) = |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / d,
    which is Eq. 9 with its indexing made explicit (by default block j reads compressed blocks 4j-1 .. 4j+3 with
    weights 1, 2, 2, 2, 1) and Eq. 10 (the group sum: a group's heads share one set of blocks). The candidates are
    blocks 0 .. t // l'. Blocks 0 .. n_init - 1 and the n_local newest, t // l' - n_local + 1 .. t // l', are forced
    in where they exist; the other places go to the highest scores, ties to the lower j (Eq. 11); with fewer
    candidates than n, all are taken. Layout: int32 (B, T, H, n), the chosen ids ascending, then -1. The branch
    attends to the keys of the chosen blocks that are not after t (Eq. 12); a repeated id counts once and ids
    outside 0 .. t // l' are ignored like -1.

Window
    Query t reads the keys u with max(0, t - w + 1) <= u <= t.

Gate
    g = act(MLP(x_t)) of shape (B, T, HQ, 3), act = softmax over the three branches (the default) or sigmoid (the
    paper's); the MLP's last layer starts at zero, so training starts from an even mix.
    o_t = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win (Eq. 5), then the output projection. The branch ops take
    their gate weight (gate=, (B, T, HQ)) and return g_c * o_c, so the layer sums them; a kernel's backward then
    reads the incoming gradient as it is (no per-branch g_c * do).

Var-length
    B = 1 and cu_seqlens (int32 (N + 1,), from 0, non-decreasing, ending at T) pack N sequences. Positions and block
    ids restart at every sequence start and no branch reads across a boundary: the output equals running each
    sequence alone. Each sequence is compressed on its own (no block spans a boundary) and cu_seqlens_cmp
    (cmp_cu_seqlens) marks its compressed blocks. The compressed keys have the static length T // d, a bound on the
    sum of the sequences' Tc that needs nothing from the host: cu_seqlens_cmp[-1] may be below it, and the blocks
    after it are padding that no op reads.

Decode reads
    A decode step at context length S (the query at position S - 1) reads, per KV group, Tc(S) compressed tokens,
    the selected blocks' tokens (all S while S fits in n blocks, else n - 1 full blocks and the S - l' * ((S - 1)
    // l') tokens of the newest, which n_local >= 1 forces in) and min(w, S) window tokens (paper Table 4): with the
    defaults 4095 + 1024 + 512 = 5631 at S = 65536 against 65536 for dense attention (the paper's Table 4 lists
    5632 = S / d + n*l' + w).
"""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

BACKENDS = ("auto", "torch", "triton")
QUERY_CHUNK = 128  # queries per step of the reference: every score tensor is (chunk x keys), never T x T


# ----------------------------------------------------------------------------------------------------------------
# sizes, positions, RoPE

def num_cmp_blocks(T, cmp_block, cmp_stride):
    """Tc: compressed blocks of a length-T sequence; block i covers positions [i*d, i*d + l)."""
    return 0 if T < cmp_block else (T - cmp_block) // cmp_stride + 1


def cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride):
    """cu_seqlens of the compressed sequences: each packed sequence is compressed on its own."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()                           # (N,)
    tc = torch.where(lens < cmp_block, 0, torch.div(lens - cmp_block, cmp_stride, rounding_mode="floor") + 1)
    return F.pad(tc.cumsum(0), (1, 0)).to(torch.int32)                          # (N + 1,)


def positions(cu_seqlens, T, device):
    """Position of each packed token inside its own sequence: (T,) int64 (plain arange without cu_seqlens)."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    seq = torch.searchsorted(cu_seqlens[1:].long(), t, right=True)             # (T,) sequence id of each token
    return t - cu_seqlens.long()[seq]


@torch.library.custom_op("nsa::rope_table", mutates_args=())
def rope_table(pos: torch.Tensor, D: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, D/2) of RoPE's angles pos * theta^(-2i/D), pos (T,) int. An op, opaque to torch.compile,
    so the table is computed once per call: fused into rope's kernels, cos and sin ran for every element of x."""
    inv_freq = theta ** (-torch.arange(0, D, 2, device=pos.device, dtype=dtype) / D)   # (D/2,)
    ang = pos.to(dtype)[:, None] * inv_freq[None, :]                               # (T, D/2)
    return ang.cos(), ang.sin()


@rope_table.register_fake
def _(pos, D, theta, dtype):
    return pos.new_empty(pos.shape[0], D // 2, dtype=dtype), pos.new_empty(pos.shape[0], D // 2, dtype=dtype)


def rope(x, pos, theta):
    """Rotary embedding (rotate-half form). x (B, T, H, D) with D even, pos (T,) int positions."""
    dt = torch.promote_types(x.dtype, torch.float32)                           # fp32, or fp64 for gradcheck
    cos, sin = rope_table(pos, x.shape[-1], float(theta), dt)                  # (T, D/2) each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]                    # (1, T, 1, D/2)
    x1, x2 = x.to(dt).chunk(2, dim=-1)                                         # (B, T, H, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# softmax attention (paper Eq. 2), which each branch applies to its own keys. A branch function below computes the
# queries t0 .. t0 + C - 1 of one sequence; the public ops further down run it per sequence and per query chunk.

def attention_scores(q, k, allowed, scale):
    """scale * q.k of each query head with its KV group's keys (GQA). q (B, C, HQ, D), k (B, S, H, D), allowed bool
    broadcastable to (B, C, H, S). Returns s (B, H, C, G, S), fp32 (fp64 for fp64 q), set to the dtype's minimum
    where not allowed (finite, not -inf, so a query with no allowed key stays NaN-free, its gradients too), and the
    mask (B|1, H|1, C, 1, S)."""
    B, C, HQ, D = q.shape
    S, H = k.shape[1], k.shape[2]
    G = HQ // H
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(dt).view(B, C, H, G, D).permute(0, 2, 1, 3, 4).reshape(B, H, C * G, D)   # (B, H, C*G, D)
    with torch.autocast(q.device.type, enabled=False):                         # fp32 scores under autocast too
        s = (qh @ k.to(dt).permute(0, 2, 3, 1)).view(B, H, C, G, S) * scale   # (B, H, C, G, S)
    mask = allowed.permute(0, 2, 1, 3)[:, :, :, None, :]                       # (B|1, H|1, C, 1, S)
    return s.masked_fill(~mask, torch.finfo(dt).min), mask


def softmax_weights(s, mask):
    """p = softmax(s) over the allowed keys, all 0 for a query with none: (B, H, C, G, S). Over the compressed keys
    this is Eq. 8, the input of the block scores."""
    return torch.softmax(s, dim=-1).masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)


def attend(q, k, v, allowed, scale):
    """Eq. 2: o = softmax(scale * q k^T) v over the allowed keys. q (B, C, HQ, D), k (B, S, H, D), v (B, S, H, Dv),
    allowed as in attention_scores. Returns o (B, C, HQ, Dv) and lse (B, C, HQ), fp32 (fp64 for fp64 inputs); a query
    with no allowed key gets o = 0 and lse = -inf."""
    s, mask = attention_scores(q, k, allowed, scale)                           # (B, H, C, G, S)
    B, H, C, G, S = s.shape
    Dv = v.shape[-1]
    seen = mask.any(dim=-1)                                                    # (B|1, H|1, C, 1): the query has a key
    p = torch.softmax(s, dim=-1)                                               # uniform where no key: o zeroed below
    with torch.autocast(q.device.type, enabled=False):
        o = (p.view(B, H, C * G, S) @ v.to(p.dtype).transpose(1, 2)).view(B, H, C, G, Dv) * seen[..., None]
    with torch.no_grad():  # lse = logsumexp(s) from the softmax at hand, max s - log max p: cheaper than recomputing
        lse = s.amax(dim=-1) - p.amax(dim=-1).log() if S else s.new_zeros(B, H, C, G)   # (B, H, C, G)
        lse = lse.masked_fill(~seen, float("-inf"))
    return o.permute(0, 2, 1, 3, 4).reshape(B, C, H * G, Dv), lse.permute(0, 2, 1, 3).reshape(B, C, H * G)


# ----------------------------------------------------------------------------------------------------------------
# compressed branch: phi (Eq. 7), then attention over the compressed tokens

def compress(x, pos_emb, phi, cmp_block, cmp_stride, cu_seqlens=None):
    """Eq. 7: block i = x[i*d : i*d + l] plus the intra-block position embedding -> phi -> one token.
    x (B, T, H, D), pos_emb (l, D), phi: module mapping (..., l*D) -> (..., Dout).
    Returns x_cmp (B, Tc, H, Dout) and cu_seqlens_cmp (None without cu_seqlens); sequences compress alone.
    With cu_seqlens, Tc is the static bound T // d: blocks past cu_seqlens_cmp[-1] are padding that no op reads."""
    B, T, H, D = x.shape
    if cu_seqlens is None:
        starts = torch.arange(num_cmp_blocks(T, cmp_block, cmp_stride), device=x.device) * cmp_stride   # (Tc,)
        cu_cmp = None
    else:
        cu_cmp = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)                # (N + 1,)
        c = torch.arange(T // cmp_stride, device=x.device)                     # (Tc,) packed compressed index
        seq = torch.searchsorted(cu_cmp[1:].long(), c, right=True).clamp_max(cu_cmp.numel() - 2)  # its sequence
        starts = cu_seqlens.long()[seq] + (c - cu_cmp.long()[seq]) * cmp_stride   # (Tc,) first position
        starts = torch.where(c < cu_cmp[-1], starts, 0)                        # padding blocks start at 0
    idx = (starts[:, None] + torch.arange(cmp_block, device=x.device)).clamp_max(T - 1)  # (Tc, l), inside x if T < l
    blocks = x[:, idx] + pos_emb[:, None, :].to(x.dtype)                       # (B, Tc, l, H, D)
    blocks = blocks.permute(0, 1, 3, 2, 4).flatten(3)                          # (B, Tc, H, l*D)
    return phi(blocks), cu_cmp                                                 # (B, Tc, H, Dout)


def cmp_visible(t, Tc, cmp_block, cmp_stride):
    """Which compressed blocks queries at positions t (...) see: i*d + l - 1 <= t. Returns bool (..., Tc)."""
    return torch.arange(Tc, device=t.device) * cmp_stride + cmp_block - 1 <= t[..., None]


def compressed_branch(t0, q, k_cmp, v_cmp, cmp_block, cmp_stride, scale):
    """Attention over the compressed tokens that each query sees. q (B, C, HQ, D), k_cmp (B, Tc, H, D),
    v_cmp (B, Tc, H, Dv). Returns o (B, C, HQ, Dv) and lse (B, C, HQ)."""
    t = torch.arange(t0, t0 + q.shape[1], device=q.device)                    # (C,)
    seen = cmp_visible(t, k_cmp.shape[1], cmp_block, cmp_stride)               # (C, Tc)
    return attend(q, k_cmp, v_cmp, seen[None, :, None], scale)


# ----------------------------------------------------------------------------------------------------------------
# selected branch: block scores (Eq. 8-10), top-n (Eq. 11), attention over the chosen blocks (Eq. 12)

def cmp_to_sel_weights(Tc, nb, cmp_block, cmp_stride, sel_block, device):
    """Eq. 9: w(i, j) = |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / d, shape (Tc, nb) fp32 (1, 2, 2, 2, 1 by default)."""
    i32 = dict(device=device, dtype=torch.int32)                              # exact, and half int64's work
    s = torch.arange(Tc, **i32)[:, None] * cmp_stride                         # (Tc, 1) start of compressed block i
    j = torch.arange(nb, **i32)[None, :] * sel_block                          # (1, nb) start of selection block j
    overlap = torch.minimum(s + cmp_block, j + sel_block) - torch.maximum(s, j)
    return overlap.clamp_min(0).float() / cmp_stride


def block_scores(p, weights):
    """Eq. 9-10: p (..., G, Tc), the compressed softmax of a KV group's heads (Eq. 8), and weights (Tc, nb) from
    cmp_to_sel_weights -> selection block scores (..., nb), summed over the group's heads."""
    return p.sum(dim=-2) @ weights.to(p.dtype)


def top_n(score, t, sel_block, n_select, n_init, n_local):
    """Eq. 11 with the forced blocks: the n_select blocks a query at position t reads. score (..., nb) from
    block_scores, t broadcastable to its (...). Returns int32 (..., n_select): the ids ascending, then -1."""
    nbp = max(score.shape[-1], n_select)
    j = torch.arange(nbp, device=score.device)                                 # (nbp,) blocks, padded to >= n
    tb = torch.div(t, sel_block, rounding_mode="floor")[..., None]             # (..., 1) the query's own block
    forced = (j < n_init) | ((j > tb - n_local) & (j <= tb))
    s = torch.where(forced, float("inf"), F.pad(score, (0, nbp - score.shape[-1])))
    s = torch.where(j <= tb, s, float("-inf"))                                 # later blocks are no candidates
    top_s, top = torch.sort(s, dim=-1, descending=True, stable=True)          # ties: the lower j first
    top = torch.where(top_s[..., :n_select] > float("-inf"), top[..., :n_select], nbp)   # nbp: no block
    top = torch.sort(top, dim=-1).values                                       # ascending, the empty places last
    return torch.where(top == nbp, -1, top).to(torch.int32)


def select_blocks_per_token(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init=1, n_local=2, scale=None):
    """select_blocks for one sequence, one query and one KV group at a time, in plain Python from the definition
    ("Selected"): the readable Eq. 8-11, which the tests hold select_branch (all queries at once) to. Slow.
    q (B, T, HQ, D), k_cmp (B, Tc, H, D). Returns int32 (B, T, H, n_select)."""
    l, d, ls, n = cmp_block, cmp_stride, sel_block, n_select
    B, T, HQ, D = q.shape
    Tc, H = k_cmp.shape[1], k_cmp.shape[2]
    G, scale = HQ // H, D ** -0.5 if scale is None else scale
    out = torch.full((B, T, H, n), -1, dtype=torch.int32)
    for b in range(B):
        for t in range(T):
            seen = [i for i in range(Tc) if i * d + l - 1 <= t]               # compressed blocks t sees
            last = t // ls                                                     # candidates: blocks 0 .. last
            for h in range(H):
                score = [0.0] * (last + 1)
                for head in range(h * G, (h + 1) * G):                         # Eq. 10: sum over the group
                    s = torch.tensor([float(q[b, t, head].double() @ k_cmp[b, i, h].double()) * scale for i in seen],
                                     dtype=torch.float64)
                    for p, i in zip(torch.softmax(s, 0).tolist(), seen):      # Eq. 8
                        for j in range(last + 1):                              # Eq. 9
                            score[j] += max(0, min(i * d + l, (j + 1) * ls) - max(i * d, j * ls)) / d * p
                forced = {j for j in range(last + 1) if j < n_init or j > last - n_local}
                rest = sorted(set(range(last + 1)) - forced, key=lambda j: (-score[j], j))   # Eq. 11, ties: lower j
                chosen = sorted(forced | set(rest[:n - len(forced)]))
                out[b, t, h, :len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    return out


def select_branch(t0, q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale):
    """select_blocks for queries t0 .. t0 + C - 1: Eq. 8 -> Eq. 9-10 -> Eq. 11. Returns int32 (B, C, H, n)."""
    C, Tc = q.shape[1], k_cmp.shape[1]
    t = torch.arange(t0, t0 + C, device=q.device)                              # (C,)
    seen = cmp_visible(t, Tc, cmp_block, cmp_stride)                           # (C, Tc)
    p = softmax_weights(*attention_scores(q, k_cmp, seen[None, :, None], scale))   # (B, H, C, G, Tc)  Eq. 8
    nb = max(1, -(-(t0 + C) // sel_block))                                     # blocks the chunk's queries reach
    score = block_scores(p, cmp_to_sel_weights(Tc, nb, cmp_block, cmp_stride, sel_block, q.device))  # (B, H, C, nb)
    return top_n(score, t, sel_block, n_select, n_init, n_local).transpose(1, 2)   # (B, C, H, n)


def selected_branch(t0, q, block_ids, k, v, sel_block, scale):
    """Eq. 12: attention over the tokens of each query's chosen blocks that are not after it. q (B, C, HQ, D),
    block_ids (B, C, H, n), k (B, T, H, D), v (B, T, H, Dv). Returns o (B, C, HQ, Dv)."""
    t1 = t0 + q.shape[1]
    t = torch.arange(t0, t1, device=q.device)                                  # (C,)
    nb = -(-t1 // sel_block)                                                   # blocks the chunk's queries reach
    ids = block_ids.long()                                                     # (B, C, H, n)
    ok = (ids >= 0) & (ids <= (t // sel_block)[None, :, None, None])           # -1 and later blocks: ignored
    chosen = torch.zeros(*ids.shape[:3], nb + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where(ok, ids, nb), True)                        # (B, C, H, nb + 1): the set of blocks
    read = chosen[..., :nb].repeat_interleave(sel_block, dim=-1)[..., :t1]     # (B, C, H, t1): their tokens
    read = read & (torch.arange(t1, device=q.device) <= t[:, None])[None, :, None]   # not after t
    return attend(q, k[:, :t1], v[:, :t1], read, scale)[0]


# ----------------------------------------------------------------------------------------------------------------
# sliding-window branch

def window_visible(u, t, window):
    """Which keys at positions u a query at position t reads: max(0, t - w + 1) <= u <= t."""
    return (u >= 0) & (u > t - window) & (u <= t)


def window_branch(t0, q, k, v, window, scale):
    """Attention over the last `window` keys of each query. q (B, C, HQ, D), k (B, T, H, D), v (B, T, H, Dv).
    Returns o (B, C, HQ, Dv)."""
    t1 = t0 + q.shape[1]
    k0 = max(0, t0 - window + 1)                                               # first key any query of the chunk reads
    t, u = torch.arange(t0, t1, device=q.device), torch.arange(k0, t1, device=q.device)
    read = window_visible(u[None, :], t[:, None], window)                      # (C, S)
    return attend(q, k[:, k0:t1], v[:, k0:t1], read[None, :, None], scale)[0]


# ----------------------------------------------------------------------------------------------------------------
# the public ops: argument checks, backend dispatch, and the reference run per sequence and per chunk of queries

def _check_hparams(n_init=None, n_local=None, **positive):
    for name, value in positive.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if n_init is not None and not (isinstance(n_init, int) and isinstance(n_local, int) and n_init >= 0
                                   and n_local >= 0):
        raise ValueError(f"n_init and n_local must be ints >= 0, got n_init={n_init!r}, n_local={n_local!r}")
    l, d, ls, n = (positive.get(k) for k in ("cmp_block", "cmp_stride", "sel_block", "n_select"))
    if l is not None and d is not None and l % d:
        raise ValueError(f"cmp_stride must divide cmp_block, got cmp_block={l}, cmp_stride={d}")
    if ls is not None and d is not None and ls % d:
        raise ValueError(f"cmp_stride must divide sel_block, got sel_block={ls}, cmp_stride={d}")
    if l is not None and ls is not None and l > ls:
        raise ValueError(f"cmp_block must be <= sel_block, got cmp_block={l}, sel_block={ls}")
    if n is not None and n_init is not None and n < n_init + n_local:
        raise ValueError(f"n_select must be >= n_init + n_local = {n_init + n_local}, got {n}")


def _check_qkv(q, k, v, names):
    """q (B, T, HQ, D), k (B, Tk, H, D), v (B, Tk, H, Dv) or None: ranks, matching dims, dtype, device, HQ % H."""
    if q.dim() != 4:
        raise ValueError(f"{names[0]} must be (B, T, HQ, D), got {tuple(q.shape)}")
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{names[1]} must be (B, Tk, H, D) with B={q.shape[0]}, D={q.shape[3]} from {names[0]}, "
                         f"got {tuple(k.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"HQ={q.shape[2]} ({names[0]}) must be a multiple of H={k.shape[2]} ({names[1]})")
    if v is not None and (v.dim() != 4 or v.shape[:3] != k.shape[:3]):
        raise ValueError(f"{names[2]} must be (B, Tk, H, Dv) with (B, Tk, H)={tuple(k.shape[:3])}, "
                         f"got {tuple(v.shape)}")
    for name, x in zip(names, (q, k, v)):
        if x is not None and not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
        if x is not None and (x.dtype != q.dtype or x.device != q.device):
            raise ValueError(f"{name} must match {names[0]}'s dtype and device ({q.dtype}, {q.device}), "
                             f"got ({x.dtype}, {x.device})")


def check_cu_seqlens(cu_seqlens, B, T, device, name="cu_seqlens", exact_end=True):
    """cu_seqlens (None, or int32 (N + 1,) offsets from 0, non-decreasing, ending at T; at most T where exact_end is
    False: compressed keys may carry padding after the last sequence). The value checks are skipped under compile."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int32 tensor, got "
                         f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))} {tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on {device}, got {cu_seqlens.device}")
    if B != 1:
        raise ValueError(f"{name} needs packed input with B == 1, got B={B}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must hold at least 2 offsets (N + 1 for N sequences), got {cu_seqlens.numel()}")
    if torch.compiler.is_compiling():
        return
    c = cu_seqlens.tolist()
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}")
    if any(b < a for a, b in zip(c, c[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {c}")
    if (c[-1] != T) if exact_end else (c[-1] > T):
        raise ValueError(f"{name} must end at {'' if exact_end else 'most at '}T={T}, got {c[-1]}")


def _checked(q, k, v, names, scale, cu_seqlens, cu_seqlens_cmp=None, block_indices=None, gate=None, **hparams):
    """Every check of a public op's arguments (eager). Returns the scale (1 / sqrt(D) by default) and, for the ops
    over compressed keys (those given cmp_stride), cu_seqlens_cmp, built from cu_seqlens when not given."""
    _check_qkv(q, k, v, names)
    if gate is not None and (not isinstance(gate, torch.Tensor) or gate.shape != q.shape[:3]
                             or not gate.is_floating_point() or gate.device != q.device):
        raise ValueError(f"gate must be a floating tensor (B, T, HQ) = {tuple(q.shape[:3])} on {q.device}, got "
                         f"{getattr(gate, 'dtype', type(gate))} {tuple(getattr(gate, 'shape', ()))}")
    _check_hparams(**hparams)
    if scale is not None and not (isinstance(scale, (int, float)) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive number, got {scale!r}")
    B, T, Tk = q.shape[0], q.shape[1], k.shape[1]
    check_cu_seqlens(cu_seqlens, B, T, q.device)
    if "cmp_stride" not in hparams:                                            # raw keys: one per query
        if Tk != T:
            raise ValueError(f"{names[1]} must have T={T} tokens like {names[0]}, got {Tk}")
    elif cu_seqlens is None:
        Tc = num_cmp_blocks(T, hparams["cmp_block"], hparams["cmp_stride"])
        if Tk > Tc:
            raise ValueError(f"{names[1]} has {Tk} blocks but T={T} gives at most Tc={Tc}")
    else:
        if cu_seqlens_cmp is None:
            cu_seqlens_cmp = cmp_cu_seqlens(cu_seqlens, hparams["cmp_block"], hparams["cmp_stride"])
        check_cu_seqlens(cu_seqlens_cmp, B, Tk, q.device, "cu_seqlens_cmp", exact_end=False)
        if cu_seqlens_cmp.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cmp must have the shape of cu_seqlens {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_cmp.shape)}")
    if block_indices is not None:
        if not isinstance(block_indices, torch.Tensor) or block_indices.dtype != torch.int32:
            raise ValueError(f"block_indices must be an int32 tensor, got "
                             f"{getattr(block_indices, 'dtype', block_indices)}")
        if block_indices.dim() != 4 or block_indices.shape[:3] != (B, T, k.shape[2]):
            raise ValueError(f"block_indices must be (B, T, H, n) = ({B}, {T}, {k.shape[2]}, n), "
                             f"got {tuple(block_indices.shape)}")
        if block_indices.device != q.device:
            raise ValueError(f"block_indices must be on {q.device}, got {block_indices.device}")
    return (q.shape[-1] ** -0.5 if scale is None else scale), cu_seqlens_cmp


def _kernel(backend, x, name, v=None):
    """The Triton function `name` if this call should use it on queries x (and values v), else None (run the
    reference). auto: the kernel on CUDA; triton: the kernel or an error; torch: the reference."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return None
    fn = KERNELS.get(name)
    if fn is None and backend == "triton":
        raise ValueError(f"backend='triton' needs {name} from sel_kernel.py / nsa_kernels.py "
                         f"({KERNEL_IMPORT_ERROR or 'not defined'}); use backend='torch'")
    width = max(x.shape[-1], 0 if v is None else v.shape[-1])  # the kernels size their tiles by max(D, Dv)
    if x.is_cuda and x.dtype == torch.float32 and width > 128:  # their tiles outgrow a block's shared memory
        raise ValueError(f"the Triton kernels take fp32 heads up to 128 wide, got {width}: use bfloat16 or "
                         f"float16, or backend='torch'")
    return fn


def _load_kernels():
    """Every *_triton function of sel_kernel.py and nsa_kernels.py, looked up once at import (dynamo cannot trace an
    import inside forward). Returns ({name: fn}, the ImportError if triton or a kernel file is missing)."""
    try:
        import nsa_kernels
        import sel_kernel
    except ImportError as e:
        return {}, e
    return {n: f for m in (sel_kernel, nsa_kernels) for n, f in vars(m).items() if n.endswith("_triton")}, None


def _segments(cu_seqlens, T):
    """[(start, end)] of each packed sequence (one segment without cu_seqlens); a host sync, reference only."""
    if cu_seqlens is None:
        return [(0, T)]
    c = cu_seqlens.tolist()
    return list(zip(c[:-1], c[1:]))


def _reference(branch, queries, keys, cu_seqlens, cu_keys, *args):
    """Run a branch function the memory-saving way: each packed sequence alone ("Var-length"), its queries in
    chunks of QUERY_CHUNK; with autograd on, a chunk's forward is recomputed in the backward (activation
    checkpointing), so memory holds one chunk's scores. queries: tensors (B, T, ...) cut per query; keys: tensors
    (B, Tk, ...) cut per sequence by cu_keys. branch(t0, *query chunks, *sequence keys, *args) returns a tensor or a
    tuple; the chunks' results are concatenated along T."""
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in queries + keys)
    outs = []
    for (a, b), (ka, kb) in zip(_segments(cu_seqlens, queries[0].shape[1]), _segments(cu_keys, keys[0].shape[1])):
        seq_keys = [x[:, ka:kb] for x in keys]
        for t0 in range(0, max(b - a, 1), QUERY_CHUNK):                        # one empty chunk for an empty sequence
            chunk = [x[:, a + t0:min(b, a + t0 + QUERY_CHUNK)] for x in queries]
            if grad:
                out = checkpoint(branch, t0, *chunk, *seq_keys, *args, use_reentrant=False)
            else:
                out = branch(t0, *chunk, *seq_keys, *args)
            outs.append(out if isinstance(out, tuple) else (out,))
    cat = [torch.cat(parts, dim=1) for parts in zip(*outs)]
    return cat if len(cat) > 1 else cat[0]


def gated(o, gate, dtype):
    """o (B, T, HQ, Dv) times gate (B, T, HQ) per row (Eq. 5's g_c * o_c; no gate: o), in dtype."""
    return (o if gate is None else o * gate[..., None]).to(dtype)


def compressed_attention(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale=None, cu_seqlens=None, cu_seqlens_cmp=None,
                         backend="auto", gate=None):
    """Attention over compressed tokens ("Compressed"). q (B, T, HQ, D), k_cmp (B, Tc, H, D), v_cmp (B, Tc, H, Dv);
    gate (B, T, HQ) or None: this branch's gate weight, which scales o per row (see "Gate"). Returns o
    (B, T, HQ, Dv) in q's dtype and lse (B, T, HQ) fp32 of the branch's own softmax (-inf, with o = 0, for a query
    that sees no block). lse carries no gradient."""
    scale, cu_seqlens_cmp = _checked(q, k_cmp, v_cmp, ("q", "k_cmp", "v_cmp"), scale, cu_seqlens, cu_seqlens_cmp,
                                     gate=gate, cmp_block=cmp_block, cmp_stride=cmp_stride)
    if kernel := _kernel(backend, q, "compressed_attention_triton", v_cmp):
        return kernel(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, cu_seqlens, cu_seqlens_cmp, gate)
    o, lse = _reference(compressed_branch, (q,), (k_cmp, v_cmp), cu_seqlens, cu_seqlens_cmp, cmp_block, cmp_stride,
                        scale)
    return gated(o, gate, q.dtype), lse.float()


def select_blocks(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init=1, n_local=2, scale=None,
                  cu_seqlens=None, cu_seqlens_cmp=None, backend="auto", lse=None):
    """Top-n selection blocks per query and KV group ("Selected"). q (B, T, HQ, D), k_cmp (B, Tc, H, D); lse
    (B, T, HQ) fp32 from compressed_attention may be passed so a kernel need not recompute it (the reference ignores
    it). Returns int32 (B, T, H, n_select): valid block ids ascending, then -1. No gradient."""
    scale, cu_seqlens_cmp = _checked(q, k_cmp, None, ("q", "k_cmp"), scale, cu_seqlens, cu_seqlens_cmp,
                                     cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block,
                                     n_select=n_select, n_init=n_init, n_local=n_local)
    if kernel := _kernel(backend, q, "select_blocks_triton"):
        return kernel(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale,
                      cu_seqlens, cu_seqlens_cmp, lse)
    with torch.no_grad():
        return _reference(select_branch, (q,), (k_cmp,), cu_seqlens, cu_seqlens_cmp, cmp_block, cmp_stride,
                          sel_block, n_select, n_init, n_local, scale)


def selection_attention(q, k, v, block_indices, sel_block, scale=None, cu_seqlens=None, backend="auto", gate=None,
                        forced=None):
    """Attention over the selected blocks ("Selected"). q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv),
    block_indices int32 (B, T, H, n) (-1 = padding; ids outside [0, t // sel_block] are ignored like padding).
    Keys after t inside a selected block are masked. gate (B, T, HQ) or None scales o per row. forced (n_init,
    n_local) or None: a promise that the ids hold the forced blocks (as select_blocks' do with these), which lets
    the kernels read those as key ranges; the result is the same. Returns o (B, T, HQ, Dv) in q's dtype."""
    if forced is not None and not (isinstance(forced, (tuple, list)) and len(forced) == 2):
        raise ValueError(f"forced must be (n_init, n_local) or None, got {forced!r}")
    scale, _ = _checked(q, k, v, ("q", "k", "v"), scale, cu_seqlens, block_indices=block_indices, gate=gate,
                        sel_block=sel_block, **dict(zip(("n_init", "n_local"), forced or ())))
    if kernel := _kernel(backend, q, "selection_attention_triton", v):
        return kernel(q, k, v, block_indices, sel_block, scale, cu_seqlens, gate, forced)
    return gated(_reference(selected_branch, (q, block_indices), (k, v), cu_seqlens, cu_seqlens, sel_block, scale),
                 gate, q.dtype)


def window_attention(q, k, v, window, scale=None, cu_seqlens=None, backend="auto", gate=None):
    """Sliding-window causal attention ("Window"): query t sees keys max(0, t - window + 1) .. t.
    q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv); gate (B, T, HQ) or None scales o per row. Returns o
    (B, T, HQ, Dv) in q's dtype."""
    scale, _ = _checked(q, k, v, ("q", "k", "v"), scale, cu_seqlens, gate=gate, window=window)
    if kernel := _kernel(backend, q, "window_attention_triton", v):
        return kernel(q, k, v, window, scale, cu_seqlens, gate)
    return gated(_reference(window_branch, (q,), (k, v), cu_seqlens, cu_seqlens, window, scale), gate, q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# the layer: projections, phi, the three branches and the gate (Eq. 5)

def check_heads(config):
    """(n_embd, HQ, H) of a config, checked: heads split the width and KV heads divide the query heads."""
    C, HQ, H = config.n_embd, config.n_head, config.n_kv_head
    if HQ <= 0 or H <= 0 or C % HQ or HQ % H:
        raise ValueError(f"need n_embd % n_head == 0 and n_head % n_kv_head == 0, got n_embd={C}, "
                         f"n_head={HQ}, n_kv_head={H}")
    return C, HQ, H


def gate_mix(g, o_cmp, o_slc, o_win):
    """Eq. 5: o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win. g (..., HQ, 3), each o (..., HQ, Dv)."""
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


class NSAAttention(nn.Module):
    """NSA layer: shared queries, separate K/V per branch, compression MLP phi, gate MLP, three branches.
    Reads from config: n_embd, n_head (HQ), n_kv_head (H), cmp_block, cmp_stride, sel_block, n_select, n_init,
    n_local, window, gate ('softmax' | 'sigmoid'), rope_theta, cmp_hidden, backend."""

    def __init__(self, config):
        super().__init__()
        C, HQ, H = check_heads(config)
        _check_hparams(cmp_block=config.cmp_block, cmp_stride=config.cmp_stride, sel_block=config.sel_block,
                       n_select=config.n_select, window=config.window, cmp_hidden=config.cmp_hidden,
                       n_init=config.n_init, n_local=config.n_local)
        if config.gate not in ("softmax", "sigmoid"):
            raise ValueError(f"gate must be 'softmax' or 'sigmoid', got {config.gate!r}")
        if config.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
        self.cfg = config
        self.HQ, self.H, self.D = HQ, H, C // HQ
        if self.D % 2:
            raise ValueError(f"head dim n_embd // n_head must be even for RoPE, got {self.D}")
        l, D = config.cmp_block, self.D
        self.wq = nn.Linear(C, HQ * D, bias=False)
        self.wkv = nn.Linear(C, 6 * H * D, bias=False)  # k, v for each branch: cmp, slc, win (paper section 3.3.3)
        self.k_pos = nn.Parameter(torch.zeros(l, D))    # intra-block position embedding of phi, keys
        self.v_pos = nn.Parameter(torch.zeros(l, D))    # ... and values
        self.k_phi = nn.Sequential(nn.Linear(l * D, config.cmp_hidden), nn.GELU(), nn.Linear(config.cmp_hidden, D))
        self.v_phi = nn.Sequential(nn.Linear(l * D, config.cmp_hidden), nn.GELU(), nn.Linear(config.cmp_hidden, D))
        self.gate = nn.Sequential(nn.Linear(C, C // 4 or 1), nn.SiLU(), nn.Linear(C // 4 or 1, HQ * 3))
        nn.init.zeros_(self.gate[-1].weight)            # the gate starts as an even mix ("Gate")
        nn.init.zeros_(self.gate[-1].bias)
        self.wo = nn.Linear(HQ * D, C, bias=False)
        self.record = False  # when True, forward keeps its gate weights and branch outputs in self.recorded

    def forward(self, x, cu_seqlens=None):
        """x (B, T, C) -> (B, T, C). With cu_seqlens (B == 1), sequences are independent."""
        return self._forward(x, cu_seqlens)[0]

    def _project(self, x, pos):
        """The shared queries and each branch's keys and values of x (B, T, C) at positions pos (T,): q (B, T, HQ, D)
        and k_raw, v_raw (phi's input), k_slc, v_slc, k_win, v_win (B, T, H, D); RoPE on q, k_slc and k_win."""
        B, T, _ = x.shape
        th = self.cfg.rope_theta
        q = rope(self.wq(x).view(B, T, self.HQ, self.D), pos, th)             # (B, T, HQ, D)
        k_raw, v_raw, k_slc, v_slc, k_win, v_win = self.wkv(x).view(B, T, 6, self.H, self.D).unbind(2)
        # the kernels read contiguous (B, T, H, D) tensors: copied here (once, fused by torch.compile), the ops do not
        # each copy these strided views of the projection in their forward and again in their backward
        return q, k_raw, v_raw, rope(k_slc, pos, th), v_slc.contiguous(), rope(k_win, pos, th), v_win.contiguous()

    def _forward(self, x, cu_seqlens):
        """forward's output and the keys/values it made: {name: (B, T or Tc, H, D)}, which prefill caches."""
        cfg, be, l, d = self.cfg, self.cfg.backend, self.cfg.cmp_block, self.cfg.cmp_stride
        B, T, _ = x.shape
        pos = positions(cu_seqlens, T, x.device)                               # (T,)
        q, k_raw, v_raw, k_slc, v_slc, k_win, v_win = self._project(x, pos)
        # phi reads keys without RoPE; the compressed key then gets RoPE at its block's last position i*d + l - 1,
        # the first query allowed to see it, so q . k_cmp depends on distance like the raw branches
        k_cmp, cu_cmp = compress(k_raw, self.k_pos, self.k_phi, l, d, cu_seqlens)   # (B, Tc, H, D)  Eq. 7
        v_cmp, _ = compress(v_raw, self.v_pos, self.v_phi, l, d, cu_seqlens)
        k_cmp = rope(k_cmp, positions(cu_cmp, k_cmp.shape[1], x.device) * d + l - 1, cfg.rope_theta)
        g = self._gate(x)                                                      # (B, T, HQ, 3)
        g_cmp, g_slc, g_win = g.permute(3, 0, 1, 2).contiguous()               # (B, T, HQ) each, contiguous
        # each branch returns its output times its gate weight, so Eq. 5 is their sum (on the kernels, the backward
        # then needs no (B, T, HQ, D) gradient per branch: see nsa_kernels.gate_lse)
        o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, l, d, cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp,
                                          backend=be, gate=g_cmp)             # (B, T, HQ, D)
        idx = select_blocks(q.detach(), k_cmp.detach(), l, d, cfg.sel_block, cfg.n_select, cfg.n_init, cfg.n_local,
                            cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp, backend=be, lse=lse)   # (B, T, H, n)
        o_slc = selection_attention(q, k_slc, v_slc, idx, cfg.sel_block, cu_seqlens=cu_seqlens, backend=be,
                                    gate=g_slc, forced=(cfg.n_init, cfg.n_local))
        o_win = window_attention(q, k_win, v_win, cfg.window, cu_seqlens=cu_seqlens, backend=be, gate=g_win)
        o = o_cmp + o_slc + o_win                                              # (B, T, HQ, D)  Eq. 5
        if self.record:  # train.py's statistics: how the gate mixes the branches (gated outputs)
            self.recorded = dict(gate=g.detach(), cmp=o_cmp.detach(), slc=o_slc.detach(), win=o_win.detach())
        kv = dict(k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win, k_raw=k_raw, v_raw=v_raw, k_cmp=k_cmp,
                  v_cmp=v_cmp)
        return self.wo(o.reshape(B, T, self.HQ * self.D)), kv

    def _gate(self, x):
        """Gate weights (..., HQ, 3) for x (..., C): softmax or sigmoid of the gate MLP, in fp32 (fp64 in gradcheck)."""
        g = self.gate(x).unflatten(-1, (self.HQ, 3))                           # (..., HQ, 3) gate logits
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        return torch.softmax(g, dim=-1) if self.cfg.gate == "softmax" else torch.sigmoid(g)

    # -- decode: the layer's part (projections, cache writes, phi, gate); the cache and the step's attention follow

    def setup_cache(self, batch_size, max_len, device=None, dtype=None):
        """Allocate this layer's static decode cache (nsa_cache) for batch_size rows of up to max_len tokens."""
        w = self.wq.weight
        self.kv_cache = nsa_cache(batch_size, max_len, self.HQ, self.H, self.D, self.cfg, device or w.device,
                                  dtype or w.dtype)

    def prefill(self, x, lengths):
        """forward(x) for right-padded rows, filling the cache: x (B, T, C), row b holds tokens 0..lengths[b]-1.
        The selection and compressed caches take positions 0..T-1 (slots past a row's length are rewritten by
        decode before any query can see them); the rings take each row's own last positions. Returns (B, T, C)."""
        c = getattr(self, "kv_cache", None)
        check_prefill(c, x.shape[0], x.shape[1], lengths)
        out, kv = self._forward(x, None)
        for name in ("k_slc", "v_slc", "k_cmp", "v_cmp"):
            getattr(c, name)[:, :, :kv[name].shape[1]] = kv[name].transpose(1, 2)
        for name in ("k_win", "v_win", "k_raw", "v_raw"):
            ring = getattr(c, name)                                            # (B, H, W, D)
            held = ring_positions(lengths, ring.shape[2]).clamp_min(0)         # (B, W) position of each slot
            held = held[:, :, None, None].expand(-1, -1, self.H, self.D)      # (B, W, H, D)
            ring.copy_(torch.gather(kv[name], 1, held).transpose(1, 2))
        return out

    def decode(self, x, pos):
        """One token per row: x (B, 1, C) at positions pos (B,) int64 (row b has pos[b] tokens cached). Writes the
        token's K/V, and a compressed token when pos closes a block, then runs decode_attention. Returns forward()'s
        output at pos (B, 1, C); the cache keeps the step's reads, blocks, block scores and gate."""
        c, cfg, B = self.kv_cache, self.cfg, x.shape[0]
        l, d = cfg.cmp_block, cfg.cmp_stride
        rows = torch.arange(B, device=x.device)                                # (B,)
        # the rows act as _project's T axis, so each gets RoPE at its own pos: q (B, HQ, D), the rest (B, H, D)
        q, k_raw, v_raw, k_slc, v_slc, k_win, v_win = (t[0] for t in self._project(x.transpose(0, 1), pos))
        W = c.k_win.shape[2]
        for buf, slot, new in ((c.k_slc, pos, k_slc), (c.v_slc, pos, v_slc), (c.k_win, pos % W, k_win),
                               (c.v_win, pos % W, v_win), (c.k_raw, pos % l, k_raw), (c.v_raw, pos % l, v_raw)):
            buf[rows, :, slot] = new
        # pos closes compressed block i = (pos + 1 - l) / d when that is a whole number >= 0 ("Compressed")
        emit = (pos + 1 >= l) & ((pos + 1 - l) % d == 0)                       # (B,)
        i = torch.div((pos + 1 - l).clamp_min(0), d, rounding_mode="floor")    # (B,)
        ring = (pos[:, None] - l + 1 + torch.arange(l, device=x.device)) % l   # (B, l) slots of pos - l + 1 .. pos
        for raw, pos_emb, phi, cmp, is_key in ((c.k_raw, self.k_pos, self.k_phi, c.k_cmp, True),
                                               (c.v_raw, self.v_pos, self.v_phi, c.v_cmp, False)):
            new = compress(raw[rows[:, None], :, ring], pos_emb, phi, l, d)[0][:, 0]   # (B, H, D)  Eq. 7, one block
            new = rope(new[None], pos, cfg.rope_theta)[0] if is_key else new   # keys: RoPE at pos = i*d + l - 1
            cmp[rows, :, i] = torch.where(emit[:, None, None], new, cmp[rows, :, i])
        o = decode_attention(q, c, pos, self._gate(x[:, 0]), cfg)             # (B, HQ, D)
        return self.wo(o.to(x.dtype).reshape(B, 1, self.HQ * self.D))


# ----------------------------------------------------------------------------------------------------------------
# decode: the static cache of one layer and the attention of a one-token step, gpt-fast style: every shape is fixed
# by (batch, max_len) and the positions pos (B,) are a tensor, so the step compiles once and replays as a CUDA
# graph. Rows have their own lengths: prefill takes right-padded rows plus lengths (B,), a step takes pos (B,).
# model.py's GPT.setup_cache / prefill / decode_step run it layer by layer; sample.py drives them.

class DecodeCache(nn.Module):
    """Named zero buffers of shape (batch_size, H, slots, D) and the like, left out of state_dict: one layer's
    static decode cache, for batch_size rows of up to max_len tokens."""

    def __init__(self, batch_size, max_len, device, **buffers):
        super().__init__()
        self.batch_size, self.max_len = batch_size, max_len
        for name, (shape, dtype) in buffers.items():
            self.register_buffer(name, torch.zeros(shape, device=device, dtype=dtype), persistent=False)


def nsa_cache(B, max_len, HQ, H, D, cfg, device, dtype):
    """Decode cache of one NSA layer, all (B, H, slots, D) so a KV group's keys are contiguous:
    k_slc/v_slc raw K/V of the selection branch (max_len slots); k_win/v_win the window branch's last W = min(w,
    max_len) K/V in a ring (slot = position % W); k_raw/v_raw the last l inputs of phi (ring, slot = position % l);
    k_cmp/v_cmp the compressed K/V (Tc(max_len) slots). What the last step did: reads (B, H, 3) tokens read per
    KV group (compressed, selected, window), sel_idx (B, H, n), sel_score (B, H, nb) (Eq. 10), gate (B, HQ, 3)."""
    f, i64 = dtype, torch.int64
    tc = max(1, num_cmp_blocks(max_len, cfg.cmp_block, cfg.cmp_stride))
    nb, W, l = -(-max_len // cfg.sel_block), min(cfg.window, max_len), cfg.cmp_block
    return DecodeCache(B, max_len, device, k_slc=((B, H, max_len, D), f), v_slc=((B, H, max_len, D), f),
                       k_win=((B, H, W, D), f), v_win=((B, H, W, D), f), k_raw=((B, H, l, D), f),
                       v_raw=((B, H, l, D), f), k_cmp=((B, H, tc, D), f), v_cmp=((B, H, tc, D), f),
                       reads=((B, H, 3), i64), sel_idx=((B, H, cfg.n_select), torch.int32),
                       sel_score=((B, H, nb), torch.float32), gate=((B, HQ, 3), torch.float32))


def check_prefill(cache, B, T, lengths):
    """prefill's checks (eager): a cache exists for this batch and T, lengths (B,) int64 in [1, T]."""
    if cache is None:
        raise ValueError("no decode cache: call setup_cache(batch_size, max_len) first")
    if B != cache.batch_size or T > cache.max_len:
        raise ValueError(f"x must be (B, T, C) with B={cache.batch_size} and T <= max_len={cache.max_len} of the "
                         f"cache, got B={B}, T={T}")
    if not isinstance(lengths, torch.Tensor) or lengths.shape != (B,) or lengths.dtype != torch.int64:
        raise ValueError(f"lengths must be an int64 tensor of shape ({B},), got "
                         f"{getattr(lengths, 'dtype', type(lengths))} {tuple(getattr(lengths, 'shape', ()))}")
    if not torch.compiler.is_compiling() and (int(lengths.min()) < 1 or int(lengths.max()) > T):
        raise ValueError(f"lengths must be in [1, T={T}], got {lengths.tolist()}")


def ring_positions(length, size):
    """Position held by each slot of a ring buffer (slot = position % size) once positions 0..length-1 were
    written: length (B,) int64 -> (B, size) int64, negative for a slot never written."""
    last = length[:, None] - 1                                                 # (B, 1)
    return last - (last - torch.arange(size, device=length.device)) % size     # (B, size)


def decode_compressed(q, k_cmp, v_cmp, pos, cmp_block, cmp_stride, scale):
    """The compressed branch at one position per row. q (B, HQ, D), k_cmp (B, H, Tc, D), v_cmp (B, H, Tc, Dv),
    pos (B,) int64. Returns o (B, HQ, Dv), p (B, H, G, Tc) (Eq. 8) and reads (B,): compressed tokens read."""
    seen = cmp_visible(pos, k_cmp.shape[2], cmp_block, cmp_stride)            # (B, Tc)
    p = softmax_weights(*attention_scores(q[:, None], k_cmp.transpose(1, 2), seen[:, None, None], scale))[:, :, 0]
    o = p @ v_cmp.to(p.dtype)                                                  # (B, H, G, Dv); p: (B, H, G, Tc) Eq. 8
    return o.flatten(1, 2), p, seen.sum(-1)


def decode_select(p, pos, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, num_blocks):
    """select_blocks at one position per row, from the compressed branch's softmax p (B, H, G, Tc): the same
    Eq. 9-10 and top-n as training. Returns block ids int32 (B, H, n) and the scores (B, H, num_blocks) fp32."""
    weights = cmp_to_sel_weights(p.shape[-1], num_blocks, cmp_block, cmp_stride, sel_block, p.device)
    score = block_scores(p, weights)                                           # (B, H, nb)
    return top_n(score, pos[:, None], sel_block, n_select, n_init, n_local), score


def decode_selection(q, k, v, block_ids, pos, sel_block, scale):
    """The selected branch at one position per row: the keys selected_branch reads, gathered from the raw cache so
    the step reads n*l' tokens, not all S. q (B, HQ, D), k (B, H, S, D), v (B, H, S, Dv), block_ids int32 (B, H, n)
    (-1 = none). Returns o (B, HQ, Dv) and reads (B, H): tokens each KV group read."""
    ids, t = block_ids.long(), pos[:, None, None]                               # (B, H, n), (B, 1, 1)
    ok = (ids >= 0) & (ids <= torch.div(t, sel_block, rounding_mode="floor"))
    ok = ok & ~(ids[..., :, None] == ids[..., None, :]).tril(-1).any(-1)      # a repeated id reads its block once
    tok = ids.clamp_min(0)[..., None] * sel_block + torch.arange(sel_block, device=k.device)   # (B, H, n, l')
    read = (ok[..., None] & (tok <= t[..., None])).flatten(2)                 # (B, H, n*l')
    tok = tok.flatten(2).clamp_max(k.shape[2] - 1)[..., None]                  # (B, H, n*l', 1)
    ks, vs = (x.gather(2, tok.expand(-1, -1, -1, x.shape[-1])).transpose(1, 2) for x in (k, v))   # (B, n*l', H, .)
    return attend(q[:, None], ks, vs, read[:, None], scale)[0][:, 0], read.sum(-1)


def decode_window(q, k, v, pos, scale):
    """The window branch at one position per row over the ring k (B, H, W, D), v (B, H, W, Dv) that already
    holds position pos (slot = position % W, W = min(w, max_len)). Returns o (B, HQ, Dv) and reads (B,)."""
    read = window_visible(ring_positions(pos + 1, k.shape[2]), pos[:, None], k.shape[2])   # (B, W)
    return attend(q[:, None], k.transpose(1, 2), v.transpose(1, 2), read[:, None, None], scale)[0][:, 0], read.sum(-1)


def decode_attention(q, cache, pos, g, cfg):
    """The attention of one decode step over a filled nsa_cache: compressed -> select -> selected -> window -> gate
    (g (B, HQ, 3) fp32). q (B, HQ, D) with RoPE at pos (B,). Returns o (B, HQ, Dv) fp32 and stores the step's reads,
    chosen blocks, block scores and gate in the cache. backend "auto" runs nsa_kernels' step on CUDA."""
    c, scale, l, d, ls = cache, q.shape[-1] ** -0.5, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    B, H = c.reads.shape[:2]
    if kernel := _kernel(cfg.backend, q, "decode_attention_triton"):  # also fills reads, sel_idx, sel_score, gate
        return kernel(q, c, pos, g, l, d, ls, cfg.n_select, cfg.n_init, cfg.n_local, scale)
    o_cmp, p, n_cmp = decode_compressed(q, c.k_cmp, c.v_cmp, pos, l, d, scale)   # (B, HQ, Dv), (B, H, G, Tc)
    idx, score = decode_select(p, pos, l, d, ls, cfg.n_select, cfg.n_init, cfg.n_local,
                               c.sel_score.shape[-1])                          # (B, H, n), (B, H, nb)
    o_slc, n_slc = decode_selection(q, c.k_slc, c.v_slc, idx, pos, ls, scale)
    o_win, n_win = decode_window(q, c.k_win, c.v_win, pos, scale)
    c.reads.copy_(torch.stack([n_cmp[:, None].expand(B, H), n_slc, n_win[:, None].expand(B, H)], dim=-1))
    c.sel_idx.copy_(idx)
    c.sel_score.copy_(score)
    c.gate.copy_(g)
    return gate_mix(g, o_cmp, o_slc, o_win)                                    # (B, HQ, Dv)  Eq. 5


def decode_reads(S, cmp_block, cmp_stride, sel_block, n_select, window):
    """Tokens a decode step at context length S (the query at S - 1) reads per KV group ("Decode reads"), with the
    newest block forced (n_local >= 1): (compressed, selected, window) = (Tc(S), all S while S fits in n blocks
    else n - 1 full blocks plus the newest one's tokens (<= n*l'), min(w, S))."""
    nb = -(-S // sel_block)
    slc = S if nb <= n_select else (n_select - 1) * sel_block + (S - 1) % sel_block + 1
    return num_cmp_blocks(S, cmp_block, cmp_stride), slc, min(window, S)


@functools.cache  # train.py's log asks at every line
def tokens_read_per_query(T, cmp_block, cmp_stride, sel_block, n_select, window):
    """Mean keys a query reads over positions 0..T-1 per KV group, (compressed, selected, window): the query at t
    reads what a decode step at S = t + 1 reads (decode_reads)."""
    totals = [sum(branch) for branch in zip(*(decode_reads(S, cmp_block, cmp_stride, sel_block, n_select, window)
                                              for S in range(1, T + 1)))]
    return tuple(total / T for total in totals) if T > 0 else (0.0, 0.0, 0.0)


KERNELS, KERNEL_IMPORT_ERROR = _load_kernels()  # at the end: the kernel files may import from this one
