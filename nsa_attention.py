"""Native Sparse Attention (Yuan et al., arXiv 2502.11089): the pure-PyTorch reference of every op and the module.
The four public ops (compressed_attention, select_blocks, selection_attention, window_attention) follow SPEC.md;
backend="auto" runs the Triton kernels of sel_kernel.py on CUDA and this reference elsewhere. model.py uses NSAAttention.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

BACKENDS = ("auto", "torch", "triton")
QUERY_CHUNK = 128  # queries per step in the reference: keeps every score tensor at (chunk x keys), never T x T


# ----------------------------------------------------------------------------------------------------------------
# input checks (eager only: under torch.compile the value checks that need the host are skipped)

def _check_hparams(**values):
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    l, d, lsel = values.get("cmp_block"), values.get("cmp_stride"), values.get("sel_block")
    if l is not None and d is not None and l % d:
        raise ValueError(f"cmp_stride must divide cmp_block, got cmp_block={l}, cmp_stride={d}")
    if lsel is not None and d is not None and lsel % d:
        raise ValueError(f"cmp_stride must divide sel_block, got sel_block={lsel}, cmp_stride={d}")
    if l is not None and lsel is not None and l > lsel:
        raise ValueError(f"cmp_block must be <= sel_block, got cmp_block={l}, sel_block={lsel}")


def _check_qkv(q, k, v=None, names=("q", "k", "v")):
    """q (B, T, HQ, D), k (B, Tk, H, D), v (B, Tk, H, Dv): ranks, matching dims, dtype, device, HQ % H == 0."""
    if q.dim() != 4:
        raise ValueError(f"{names[0]} must be (B, T, HQ, D), got {tuple(q.shape)}")
    if k.dim() != 4 or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{names[1]} must be (B, Tk, H, D) with B={q.shape[0]}, D={q.shape[3]} from {names[0]}, "
                         f"got {tuple(k.shape)}")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"HQ={q.shape[2]} ({names[0]}) must be a multiple of H={k.shape[2]} ({names[1]})")
    tensors = [(names[0], q), (names[1], k)]
    if v is not None:
        if v.dim() != 4 or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"{names[2]} must be (B, Tk, H, Dv) with (B, Tk, H)={tuple(k.shape[:3])}, "
                             f"got {tuple(v.shape)}")
        tensors.append((names[2], v))
    for name, t in tensors:
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match {names[0]}'s dtype and device ({q.dtype}, {q.device}), "
                             f"got ({t.dtype}, {t.device})")


def _check_cu_seqlens(cu_seqlens, B, T, device, name="cu_seqlens", exact_end=True):
    """int32 (N + 1,) offsets from 0, non-decreasing, ending at T (at most T where exact_end=False: compressed keys
    may carry padding blocks after the last sequence)."""
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


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _load_kernels():
    """Every *_triton function of sel_kernel.py and nsa_kernels.py, looked up once at import (dynamo cannot trace an
    import inside forward). Returns ({name: fn}, the ImportError if triton or a kernel file is missing)."""
    try:
        import nsa_kernels
        import sel_kernel
    except ImportError as e:
        return {}, e
    return {n: f for m in (sel_kernel, nsa_kernels) for n, f in vars(m).items() if n.endswith("_triton")}, None


def _kernel(backend, x, name):
    """The Triton function `name` if this call should use it, else None (use the reference).
    auto: the kernel on CUDA; triton: the kernel or an error; torch: the reference."""
    _check_backend(backend)
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return None
    fn = KERNELS.get(name)
    if fn is None and backend == "triton":
        raise ValueError(f"backend='triton' needs {name} from sel_kernel.py / nsa_kernels.py "
                         f"({KERNEL_IMPORT_ERROR or 'not defined'}); use backend='torch'")
    return fn


def num_cmp_blocks(T, cmp_block, cmp_stride):
    """Tc: compressed blocks of a length-T sequence; block i covers raw positions [i*d, i*d + l)."""
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


def _segments(cu_seqlens, T):
    """[(start, end)] of each packed sequence (one segment without cu_seqlens); host sync, reference only."""
    if cu_seqlens is None:
        return [(0, T)]
    c = cu_seqlens.tolist()
    return list(zip(c[:-1], c[1:]))


# ----------------------------------------------------------------------------------------------------------------
# the attention core shared by all three reference branches

def _masked_attention(q, k, v, allowed, scale):
    """Softmax attention of a chunk of queries over a slab of keys, GQA by head groups.
    q (B, C, HQ, D), k (B, S, H, D), v (B, S, H, Dv), allowed bool (B or 1, C, H or 1, S).
    Returns o (B, C, HQ, Dv) fp32+ and lse (B, C, HQ); a row with no allowed key gives o = 0, lse = -inf."""
    B, C, HQ, D = q.shape
    S, H, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = HQ // H
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qh = q.to(dt).view(B, C, H, G, D).permute(0, 2, 1, 3, 4).reshape(B, H, C * G, D)   # (B, H, C*G, D)
    kh, vh = k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2)              # (B, H, S, D), (B, H, S, Dv)
    s = (qh @ kh.transpose(-1, -2)).to(dt).view(B, H, C, G, S) * scale              # (B, H, C, G, S)
    mask = allowed.permute(0, 2, 1, 3)[:, :, :, None, :]                       # (B|1, H|1, C, 1, S)
    # a finite fill (not -inf) keeps empty rows NaN-free in forward and backward; they are zeroed below
    s = s.masked_fill(~mask, torch.finfo(dt).min)
    lse = torch.logsumexp(s.detach(), dim=-1)                                  # (B, H, C, G)
    p = torch.softmax(s, dim=-1)                                               # (B, H, C, G, S)
    seen = mask.any(dim=-1)                                                    # (B|1, H|1, C, 1): row has a key
    o = (p.view(B, H, C * G, S) @ vh).view(B, H, C, G, Dv) * seen[..., None]  # (B, H, C, G, Dv)
    lse = torch.where(seen, lse, float("-inf"))
    o = o.permute(0, 2, 1, 3, 4).reshape(B, C, HQ, Dv)                        # (B, C, HQ, Dv)
    return o, lse.permute(0, 2, 1, 3).reshape(B, C, HQ)


def _chunked(T, step, *tensors):
    """Run step(c0, c1, *tensors) -> (o, lse) over query chunks; with autograd on, each chunk is recomputed in the
    backward (activation checkpointing), so memory stays at one chunk's scores."""
    outs, lses = [], []
    for c0 in range(0, max(T, 1), QUERY_CHUNK):  # one empty chunk when T == 0
        c1 = min(T, c0 + QUERY_CHUNK)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            o, lse = checkpoint(step, c0, c1, *tensors, use_reentrant=False)
        else:
            o, lse = step(c0, c1, *tensors)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# ----------------------------------------------------------------------------------------------------------------
# compressed branch (paper Eq. 7 for phi, Eq. 5 for attention over compressed keys)

def compress(x, pos_emb, phi, cmp_block, cmp_stride, cu_seqlens=None):
    """Learnable compression: block i = x[i*d : i*d + l] (+ intra-block position embedding) -> phi -> one token.
    x (B, T, H, D), pos_emb (l, D), phi: module mapping (..., l*D) -> (..., Dout).
    Returns x_cmp (B, Tc, H, Dout) and cu_seqlens_cmp (None without cu_seqlens); sequences compress alone.
    With cu_seqlens the count of blocks depends on the lengths, so Tc is the static bound T // d (no host sync,
    compile-friendly): blocks past cu_seqlens_cmp[-1] are padding that no op reads."""
    B, T, H, D = x.shape
    if cu_seqlens is None:
        starts = torch.arange(num_cmp_blocks(T, cmp_block, cmp_stride), device=x.device) * cmp_stride   # (Tc,)
        cu_cmp = None
    else:
        cu_cmp = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)                # (N + 1,)
        c = torch.arange(T // cmp_stride, device=x.device)                     # (Tc,) packed compressed index
        seq = torch.searchsorted(cu_cmp[1:].long(), c, right=True).clamp_max(cu_cmp.numel() - 2)  # its sequence
        starts = cu_seqlens.long()[seq] + (c - cu_cmp.long()[seq]) * cmp_stride   # (Tc,) first raw position
        starts = torch.where(c < cu_cmp[-1], starts, 0)                        # padding blocks read position 0
    idx = starts[:, None] + torch.arange(cmp_block, device=x.device)           # (Tc, l) raw positions of each block
    blocks = x[:, idx] + pos_emb[:, None, :].to(x.dtype)                       # (B, Tc, l, H, D)
    blocks = blocks.permute(0, 1, 3, 2, 4).flatten(3)                          # (B, Tc, H, l*D)
    return phi(blocks), cu_cmp                                                 # (B, Tc, H, Dout)


def _compressed_ref(q, k_cmp, v_cmp, l, d, scale):
    T, Tc = q.shape[1], k_cmp.shape[1]
    last = torch.arange(Tc, device=q.device) * d + l - 1                       # (Tc,) last raw position of block i

    def step(c0, c1, q, k_cmp, v_cmp):
        t = torch.arange(c0, c1, device=q.device)                              # (C,)
        allowed = (last[None, :] <= t[:, None])[None, :, None, :]              # (1, C, 1, Tc)
        return _masked_attention(q[:, c0:c1], k_cmp, v_cmp, allowed, scale)

    return _chunked(T, step, q, k_cmp, v_cmp)


def compressed_attention(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale=None, cu_seqlens=None, cu_seqlens_cmp=None,
                         backend="auto"):
    """Attention over compressed tokens. q (B, T, HQ, D), k_cmp (B, Tc, H, D), v_cmp (B, Tc, H, Dv).
    Query t sees block i iff i*d + l - 1 <= t. Returns o (B, T, HQ, Dv) in q's dtype and lse (B, T, HQ) fp32
    (-inf, with o = 0, for a query that sees no block). lse carries no gradient."""
    _check_qkv(q, k_cmp, v_cmp, ("q", "k_cmp", "v_cmp"))
    _check_hparams(cmp_block=cmp_block, cmp_stride=cmp_stride)
    B, T, HQ, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    _check_cu_seqlens(cu_seqlens, B, T, q.device)
    if cu_seqlens is not None and cu_seqlens_cmp is None:
        cu_seqlens_cmp = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
    if cu_seqlens is None:
        expect = num_cmp_blocks(T, cmp_block, cmp_stride)
        if k_cmp.shape[1] > expect:
            raise ValueError(f"k_cmp has {k_cmp.shape[1]} blocks but T={T} gives at most Tc={expect}")
    else:
        _check_cu_seqlens(cu_seqlens_cmp, B, k_cmp.shape[1], q.device, "cu_seqlens_cmp", exact_end=False)
        if cu_seqlens_cmp.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cmp must have the shape of cu_seqlens {tuple(cu_seqlens.shape)}, "
                             f"got {tuple(cu_seqlens_cmp.shape)}")
    kernel = _kernel(backend, q, "compressed_attention_triton")
    if kernel is not None:
        return kernel(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, cu_seqlens, cu_seqlens_cmp)
    outs = [_compressed_ref(q[:, a:b], k_cmp[:, ca:cb], v_cmp[:, ca:cb], cmp_block, cmp_stride, scale)
            for (a, b), (ca, cb) in zip(_segments(cu_seqlens, T), _segments(cu_seqlens_cmp, k_cmp.shape[1]))]
    o = torch.cat([o for o, _ in outs], dim=1).to(q.dtype)
    lse = torch.cat([lse for _, lse in outs], dim=1).float()
    return o, lse


# ----------------------------------------------------------------------------------------------------------------
# block selection (Eq. 8-10 with SPEC.md's explicit indexing)

def cmp_to_sel_weights(Tc, nb, cmp_block, cmp_stride, sel_block, device):
    """Eq. 9: w(i, j) = |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / d, shape (Tc, nb) fp32 (1, 2, 2, 2, 1 by default)."""
    s = torch.arange(Tc, device=device)[:, None] * cmp_stride                 # (Tc, 1) start of compressed block i
    j = torch.arange(nb, device=device)[None, :] * sel_block                  # (1, nb) start of selection block j
    overlap = torch.minimum(s + cmp_block, j + sel_block) - torch.maximum(s, j)
    return overlap.clamp_min(0).float() / cmp_stride


def _select_ref(q, k_cmp, l, d, lsel, n, n_init, n_local, scale):
    B, T, HQ, D = q.shape
    H, Tc = k_cmp.shape[2], k_cmp.shape[1]
    nb = max(1, -(-T // lsel))                                                 # selection blocks in the sequence
    W = cmp_to_sel_weights(Tc, nb, l, d, lsel, q.device)                      # (Tc, nb)
    last = torch.arange(Tc, device=q.device) * d + l - 1                       # (Tc,)
    j = torch.arange(max(nb, n), device=q.device)                              # (nbp,) candidates, padded to >= n
    out = []
    for c0 in range(0, max(T, 1), QUERY_CHUNK):  # one empty chunk when T == 0
        c1 = min(T, c0 + QUERY_CHUNK)
        t = torch.arange(c0, c1, device=q.device)                              # (C,)
        allowed = (last[None, :] <= t[:, None])[None, :, None, :]              # (1, C, 1, Tc)
        qg = q[:, c0:c1].float().view(B, c1 - c0, H, HQ // H, D)               # (B, C, H, G, D)
        s = torch.einsum("bchgd,bshd->bchgs", qg, k_cmp.float()) * scale       # (B, C, H, G, Tc)
        p = torch.softmax(s.masked_fill(~allowed[:, :, :, None], float("-inf")), dim=-1).nan_to_num(0.0)  # Eq. 8
        score = p.sum(dim=3) @ W                                               # (B, C, H, nb)  Eq. 9 + Eq. 10
        score = F.pad(score, (0, j.numel() - nb))                              # (B, C, H, nbp)
        tb = (t // lsel)[:, None]                                              # (C, 1) block of the query itself
        forced = (j < n_init) | ((j > tb - n_local) & (j <= tb))               # (C, nbp)
        score = torch.where(forced[None, :, None], float("inf"), score)
        score = torch.where((j <= tb)[None, :, None], score, float("-inf"))
        top_score, top = torch.sort(score, dim=-1, descending=True, stable=True)  # ties -> lower j first
        top = torch.where(top_score[..., :n] > float("-inf"), top[..., :n], -1)   # (B, C, H, n)
        top = torch.sort(torch.where(top < 0, j.numel(), top), dim=-1).values  # ascending, padding last
        out.append(torch.where(top == j.numel(), -1, top))
    return torch.cat(out, dim=1).to(torch.int32)


def select_blocks(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init=1, n_local=2, scale=None,
                  cu_seqlens=None, cu_seqlens_cmp=None, backend="auto", lse=None):
    """Top-n selection blocks per query and KV group. q (B, T, HQ, D), k_cmp (B, Tc, H, D); lse (B, T, HQ) fp32
    from compressed_attention may be passed so a kernel need not recompute it (the reference ignores it).
    Returns int32 (B, T, H, n_select): valid block ids ascending, then -1. No gradient."""
    _check_qkv(q, k_cmp, None, ("q", "k_cmp"))
    _check_hparams(cmp_block=cmp_block, cmp_stride=cmp_stride, sel_block=sel_block, n_select=n_select)
    if not (isinstance(n_init, int) and isinstance(n_local, int) and n_init >= 0 and n_local >= 0):
        raise ValueError(f"n_init and n_local must be ints >= 0, got n_init={n_init!r}, n_local={n_local!r}")
    if n_select < n_init + n_local:
        raise ValueError(f"n_select must be >= n_init + n_local = {n_init + n_local}, got {n_select}")
    B, T, HQ, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    _check_cu_seqlens(cu_seqlens, B, T, q.device)
    if cu_seqlens is not None and cu_seqlens_cmp is None:
        cu_seqlens_cmp = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
    kernel = _kernel(backend, q, "select_blocks_triton")
    if kernel is not None:
        return kernel(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, scale,
                      cu_seqlens, cu_seqlens_cmp, lse)
    with torch.no_grad():
        return torch.cat([_select_ref(q[:, a:b], k_cmp[:, ca:cb], cmp_block, cmp_stride, sel_block, n_select,
                                      n_init, n_local, scale)
                          for (a, b), (ca, cb) in zip(_segments(cu_seqlens, T),
                                                      _segments(cu_seqlens_cmp, k_cmp.shape[1]))], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# selected and sliding-window branches

def _selection_ref(q, k, v, block_indices, lsel, scale):
    T = q.shape[1]

    def step(c0, c1, q, k, v):
        t = torch.arange(c0, c1, device=q.device)                              # (C,)
        nb = -(-c1 // lsel)                                                    # blocks that chunk can reach
        idx = block_indices[:, c0:c1].long()                                   # (B, C, H, n)
        ok = (idx >= 0) & (idx <= (t // lsel)[None, :, None, None])            # padding and future blocks ignored
        chosen = torch.zeros(*idx.shape[:3], nb + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, torch.where(ok, idx, nb), True)                    # (B, C, H, nb + 1)
        allowed = chosen[..., :nb].repeat_interleave(lsel, dim=-1)[..., :c1]   # (B, C, H, c1)
        allowed = allowed & (torch.arange(c1, device=q.device)[None, :] <= t[:, None])[None, :, None]
        return _masked_attention(q[:, c0:c1], k[:, :c1], v[:, :c1], allowed, scale)

    return _chunked(T, step, q, k, v)[0]


def selection_attention(q, k, v, block_indices, sel_block, scale=None, cu_seqlens=None, backend="auto"):
    """Attention over the selected blocks. q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv),
    block_indices int32 (B, T, H, n) (-1 = padding; ids outside [0, t // sel_block] are ignored like padding).
    Keys after t inside a selected block are masked. Returns o (B, T, HQ, Dv) in q's dtype."""
    _check_qkv(q, k, v)
    _check_hparams(sel_block=sel_block)
    B, T, HQ, D = q.shape
    if k.shape[1] != T:
        raise ValueError(f"k must have T={T} tokens like q, got {k.shape[1]}")
    if not isinstance(block_indices, torch.Tensor) or block_indices.dtype != torch.int32:
        raise ValueError(f"block_indices must be an int32 tensor, got {getattr(block_indices, 'dtype', block_indices)}")
    if block_indices.dim() != 4 or block_indices.shape[:3] != (B, T, k.shape[2]):
        raise ValueError(f"block_indices must be (B, T, H, n) = ({B}, {T}, {k.shape[2]}, n), "
                         f"got {tuple(block_indices.shape)}")
    if block_indices.device != q.device:
        raise ValueError(f"block_indices must be on {q.device}, got {block_indices.device}")
    scale = D ** -0.5 if scale is None else scale
    _check_cu_seqlens(cu_seqlens, B, T, q.device)
    kernel = _kernel(backend, q, "selection_attention_triton")
    if kernel is not None:
        return kernel(q, k, v, block_indices, sel_block, scale, cu_seqlens)
    return torch.cat([_selection_ref(q[:, a:b], k[:, a:b], v[:, a:b], block_indices[:, a:b], sel_block, scale)
                      for a, b in _segments(cu_seqlens, T)], dim=1).to(q.dtype)


def _window_ref(q, k, v, w, scale):
    T = q.shape[1]

    def step(c0, c1, q, k, v):
        k0 = max(0, c0 - w + 1)                                                # first key any query of the chunk sees
        t = torch.arange(c0, c1, device=q.device)[:, None]                     # (C, 1)
        u = torch.arange(k0, c1, device=q.device)[None, :]                     # (1, S)
        allowed = ((u <= t) & (u > t - w))[None, :, None]                      # (1, C, 1, S)
        return _masked_attention(q[:, c0:c1], k[:, k0:c1], v[:, k0:c1], allowed, scale)

    return _chunked(T, step, q, k, v)[0]


def window_attention(q, k, v, window, scale=None, cu_seqlens=None, backend="auto"):
    """Sliding-window causal attention: query t sees keys max(0, t - window + 1) .. t.
    q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv). Returns o (B, T, HQ, Dv) in q's dtype."""
    _check_qkv(q, k, v)
    _check_hparams(window=window)
    B, T, HQ, D = q.shape
    if k.shape[1] != T:
        raise ValueError(f"k must have T={T} tokens like q, got {k.shape[1]}")
    scale = D ** -0.5 if scale is None else scale
    _check_cu_seqlens(cu_seqlens, B, T, q.device)
    kernel = _kernel(backend, q, "window_attention_triton")
    if kernel is not None:
        return kernel(q, k, v, window, scale, cu_seqlens)
    return torch.cat([_window_ref(q[:, a:b], k[:, a:b], v[:, a:b], window, scale)
                      for a, b in _segments(cu_seqlens, T)], dim=1).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------------
# the module

def check_heads(config):
    """(n_embd, HQ, H) of a config, checked: heads split the width and KV heads divide the query heads."""
    C, HQ, H = config.n_embd, config.n_head, config.n_kv_head
    if HQ <= 0 or H <= 0 or C % HQ or HQ % H:
        raise ValueError(f"need n_embd % n_head == 0 and n_head % n_kv_head == 0, got n_embd={C}, "
                         f"n_head={HQ}, n_kv_head={H}")
    return C, HQ, H


def rope(x, pos, theta):
    """Rotary embedding (rotate-half form). x (B, T, H, D) with D even, pos (T,) int positions."""
    D = x.shape[-1]
    dt = torch.promote_types(x.dtype, torch.float32)                           # fp32, or fp64 for gradcheck
    inv_freq = theta ** (-torch.arange(0, D, 2, device=x.device, dtype=dt) / D)   # (D/2,)
    ang = pos.to(dt)[:, None] * inv_freq[None, :]                              # (T, D/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]        # (1, T, 1, D/2)
    x1, x2 = x.to(dt).chunk(2, dim=-1)                                         # (B, T, H, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class NSAAttention(nn.Module):
    """NSA layer: shared queries, separate K/V per branch, compression MLP phi, gate MLP, three branches.
    Reads from config: n_embd, n_head (HQ), n_kv_head (H), cmp_block, cmp_stride, sel_block, n_select, n_init,
    n_local, window, gate ('softmax' | 'sigmoid'), rope_theta, cmp_hidden, backend."""

    def __init__(self, config):
        super().__init__()
        C, HQ, H = check_heads(config)
        _check_hparams(cmp_block=config.cmp_block, cmp_stride=config.cmp_stride, sel_block=config.sel_block,
                       n_select=config.n_select, window=config.window, cmp_hidden=config.cmp_hidden)
        if config.n_select < config.n_init + config.n_local:
            raise ValueError(f"n_select must be >= n_init + n_local, got {config.n_select}")
        if config.gate not in ("softmax", "sigmoid"):
            raise ValueError(f"gate must be 'softmax' or 'sigmoid', got {config.gate!r}")
        _check_backend(config.backend)
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
        nn.init.zeros_(self.gate[-1].weight)            # the gate starts as an even mix (SPEC.md)
        nn.init.zeros_(self.gate[-1].bias)
        self.wo = nn.Linear(HQ * D, C, bias=False)
        self.record = False  # when True, forward keeps its gate weights and branch outputs in self.recorded

    def forward(self, x, cu_seqlens=None):
        """x (B, T, C) -> (B, T, C). With cu_seqlens (B == 1), sequences are independent."""
        return self._forward(x, cu_seqlens)[0]

    def _forward(self, x, cu_seqlens):
        """forward's output and the keys/values it made: {name: (B, T or Tc, H, D)}, which prefill caches."""
        cfg, HQ, H, D = self.cfg, self.HQ, self.H, self.D
        B, T, C = x.shape
        pos = positions(cu_seqlens, T, x.device)                               # (T,)
        q = rope(self.wq(x).view(B, T, HQ, D), pos, cfg.rope_theta)            # (B, T, HQ, D)
        k_raw, v_raw, k_slc, v_slc, k_win, v_win = self.wkv(x).view(B, T, 6, H, D).unbind(2)  # each (B, T, H, D)
        k_slc, k_win = rope(k_slc, pos, cfg.rope_theta), rope(k_win, pos, cfg.rope_theta)
        # phi sees raw keys without RoPE; the compressed key then gets RoPE at its block's last position
        # i*d + l - 1, the first query allowed to see it, so q . k_cmp depends on distance like the raw branches.
        k_cmp, cu_cmp = compress(k_raw, self.k_pos, self.k_phi, cfg.cmp_block, cfg.cmp_stride, cu_seqlens)
        v_cmp, _ = compress(v_raw, self.v_pos, self.v_phi, cfg.cmp_block, cfg.cmp_stride, cu_seqlens)
        pos_cmp = positions(cu_cmp, k_cmp.shape[1], x.device) * cfg.cmp_stride + cfg.cmp_block - 1   # (Tc,)
        k_cmp = rope(k_cmp, pos_cmp, cfg.rope_theta)                           # (B, Tc, H, D)
        be = cfg.backend
        o_cmp, lse = compressed_attention(q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, cu_seqlens=cu_seqlens,
                                          cu_seqlens_cmp=cu_cmp, backend=be)   # (B, T, HQ, D)
        idx = select_blocks(q.detach(), k_cmp.detach(), cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_select,
                            cfg.n_init, cfg.n_local, cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp, backend=be, lse=lse)
        o_slc = selection_attention(q, k_slc, v_slc, idx, cfg.sel_block, cu_seqlens=cu_seqlens, backend=be)
        o_win = window_attention(q, k_win, v_win, cfg.window, cu_seqlens=cu_seqlens, backend=be)
        g = self._gate(x)                                                      # (B, T, HQ, 3)
        o = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win   # (B, T, HQ, D)
        if self.record:  # train.py's statistics: how the gate mixes the branches
            self.recorded = dict(gate=g.detach(), cmp=o_cmp.detach(), slc=o_slc.detach(), win=o_win.detach())
        kv = dict(k_slc=k_slc, v_slc=v_slc, k_win=k_win, v_win=v_win, k_raw=k_raw, v_raw=v_raw, k_cmp=k_cmp,
                  v_cmp=v_cmp)
        return self.wo(o.to(x.dtype).reshape(B, T, HQ * D)), kv

    def _gate(self, x):
        """Gate weights (..., HQ, 3) for x (..., C): softmax or sigmoid of the gate MLP, computed in fp32 (fp64 in
        gradcheck)."""
        g = self.gate(x).unflatten(-1, (self.HQ, 3))                           # (..., HQ, 3) gate logits
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        return torch.softmax(g, dim=-1) if self.cfg.gate == "softmax" else torch.sigmoid(g)

    # ---- decode (issue 7): cache, batched prefill, one-token step (decode section at the bottom) ----

    def setup_cache(self, batch_size, max_len, device=None, dtype=None):
        """Allocate this layer's static decode cache (nsa_cache) for batch_size rows of up to max_len tokens."""
        w = self.wq.weight
        self.kv_cache = nsa_cache(batch_size, max_len, self.HQ, self.H, self.D, self.cfg,
                                  device or w.device, dtype or w.dtype)

    def prefill(self, x, lengths):
        """forward(x) for right-padded rows, filling the cache: x (B, T, C), row b holds tokens 0..lengths[b]-1.
        The selection and compressed caches take positions 0..T-1 (slots past a row's length are rewritten by
        decode before any query can see them); the rings take each row's own last positions. Returns (B, T, C)."""
        c, H, D = getattr(self, "kv_cache", None), self.H, self.D
        B, T, _ = x.shape
        _check_cache_input(c, B, T, lengths)
        out, kv = self._forward(x, None)
        c.k_slc[:, :, :T], c.v_slc[:, :, :T] = kv["k_slc"].transpose(1, 2), kv["v_slc"].transpose(1, 2)
        for name in ("k_win", "v_win", "k_raw", "v_raw"):
            ring = getattr(c, name)                                            # (B, H, W, D)
            held = ring_positions(lengths, ring.shape[2]).clamp_min(0)         # (B, W) position of each slot
            ring.copy_(torch.gather(kv[name], 1, held[:, :, None, None].expand(-1, -1, H, D)).transpose(1, 2))
        Tc = kv["k_cmp"].shape[1]
        c.k_cmp[:, :, :Tc], c.v_cmp[:, :, :Tc] = kv["k_cmp"].transpose(1, 2), kv["v_cmp"].transpose(1, 2)
        return out

    def decode(self, x, pos):
        """One token per row: x (B, 1, C) at positions pos (B,) int64 (row b has pos[b] tokens cached). Writes the
        token's K/V (and a compressed token when a block of l ends at pos), then select_blocks -> selection ->
        window -> compressed -> gate. Returns (B, 1, C), forward()'s output at pos; kv_cache.reads (B, H, 3) counts
        the tokens each KV group read per branch (compressed, selected, window)."""
        c, cfg, HQ, H, D = self.kv_cache, self.cfg, self.HQ, self.H, self.D
        l, d, th = cfg.cmp_block, cfg.cmp_stride, cfg.rope_theta
        B = x.shape[0]
        rows = torch.arange(B, device=x.device)                                # (B,)
        q = rope(self.wq(x).view(1, B, HQ, D), pos, th)[0]                     # (B, HQ, D): rows act as T for rope
        k_cmp, v_cmp, k_slc, v_slc, k_win, v_win = self.wkv(x[:, 0]).view(B, 6, H, D).unbind(1)  # each (B, H, D)
        c.k_slc[rows, :, pos] = rope(k_slc[None], pos, th)[0]
        c.v_slc[rows, :, pos] = v_slc
        W = c.k_win.shape[2]
        c.k_win[rows, :, pos % W] = rope(k_win[None], pos, th)[0]
        c.v_win[rows, :, pos % W] = v_win
        c.k_raw[rows, :, pos % l] = k_cmp
        c.v_raw[rows, :, pos % l] = v_cmp
        # a compressed token is emitted when pos closes block i = (pos + 1 - l) / d (SPEC.md "Compressed")
        emit = (pos + 1 >= l) & ((pos + 1 - l) % d == 0)                       # (B,)
        i = torch.div((pos + 1 - l).clamp_min(0), d, rounding_mode="floor")    # (B,)
        ring = ((pos[:, None] - l + 1 + torch.arange(l, device=x.device)) % l)[:, None, :, None]   # (B, 1, l, 1)
        for raw, pos_emb, phi, cache, use_rope in ((c.k_raw, self.k_pos, self.k_phi, c.k_cmp, True),
                                                   (c.v_raw, self.v_pos, self.v_phi, c.v_cmp, False)):
            block = torch.gather(raw, 2, ring.expand(B, H, l, D)) + pos_emb.to(raw.dtype)   # (B, H, l, D)
            new = phi(block.flatten(2))                                        # (B, H, D)
            new = rope(new[None], pos, th)[0] if use_rope else new             # RoPE at i*d + l - 1 = pos
            cache[rows, :, i] = torch.where(emit[:, None, None], new, cache[rows, :, i])
        o = decode_attention(q, c, pos, self._gate(x[:, 0]), cfg)             # (B, HQ, D)
        return self.wo(o.to(x.dtype).reshape(B, 1, HQ * D))


def tokens_read_per_query(T, cmp_block, cmp_stride, sel_block, n_select, window):
    """Mean keys a query reads over positions 0..T-1 (compressed + selected + window), per KV group (Table 4)."""
    t = torch.arange(T, dtype=torch.float64)
    cmp = torch.where(t + 1 < cmp_block, 0.0, torch.floor((t + 1 - cmp_block) / cmp_stride) + 1)
    slc = torch.minimum(t + 1, torch.full_like(t, float(n_select * sel_block)))
    win = torch.minimum(t + 1, torch.full_like(t, float(window)))
    return float((cmp + slc + win).mean()) if T > 0 else 0.0


# ----------------------------------------------------------------------------------------------------------------
# decode (issue 7): the static cache and the branches of a one-token step (NSAAttention.prefill / .decode above).
# Rows of a batch have their own lengths: prefill takes right-padded rows plus lengths (B,), a step takes pos (B,).
# Every shape is fixed by (batch, max_len), and pos is a tensor, so the step compiles once and replays as a graph.

class DecodeCache(nn.Module):
    """Named zero buffers, left out of state_dict: the static decode cache of one attention layer."""

    def __init__(self, device, **buffers):
        super().__init__()
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
    return DecodeCache(device, k_slc=((B, H, max_len, D), f), v_slc=((B, H, max_len, D), f),
                       k_win=((B, H, W, D), f), v_win=((B, H, W, D), f), k_raw=((B, H, l, D), f),
                       v_raw=((B, H, l, D), f), k_cmp=((B, H, tc, D), f), v_cmp=((B, H, tc, D), f),
                       reads=((B, H, 3), i64), sel_idx=((B, H, cfg.n_select), torch.int32),
                       sel_score=((B, H, nb), torch.float32), gate=((B, HQ, 3), torch.float32))


def _check_cache_input(cache, B, T, lengths):
    """prefill's checks (eager): a cache exists for this batch and T, lengths (B,) int64 in [1, T]."""
    if cache is None:
        raise ValueError("no decode cache: call setup_cache(batch_size, max_len) first")
    slots = cache.k_slc.shape[2] if hasattr(cache, "k_slc") else cache.k.shape[2]
    if B != cache.reads.shape[0] or T > slots:
        raise ValueError(f"x must be (B, T, C) with B={cache.reads.shape[0]} and T <= max_len={slots} of the cache, "
                         f"got B={B}, T={T}")
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


def decode_attend(q, k, v, allowed, scale):
    """One query per row and head against cached keys, GQA by groups. q (B, HQ, D), k (B, H, S, D), v (B, H, S, Dv),
    allowed bool (B, H or 1, S). Returns o (B, HQ, Dv) in q's dtype and p (B, H, G, S) fp32, the softmax (0 where
    not allowed); a row with no allowed key gets o = 0."""
    B, HQ, D = q.shape
    H, S = k.shape[1], k.shape[2]
    s = (q.view(B, H, HQ // H, D) @ k.transpose(-1, -2)).float() * scale      # (B, H, G, S)
    s = s.masked_fill(~allowed[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)                               # (B, H, G, S)
    o = p.to(v.dtype) @ v                                                      # (B, H, G, Dv)
    return o.reshape(B, HQ, v.shape[-1]).to(q.dtype), p


def decode_compressed(q, k_cmp, v_cmp, pos, cmp_block, cmp_stride, scale):
    """Compressed branch at one position per row (Eq. 5): block i is read iff i*d + l - 1 <= pos.
    q (B, HQ, D), k_cmp (B, H, Tc, D), v_cmp (B, H, Tc, Dv), pos (B,) int64. Returns o (B, HQ, Dv),
    p (B, H, G, Tc) fp32 (Eq. 8) and reads (B,): compressed tokens each KV group read."""
    last = torch.arange(k_cmp.shape[2], device=q.device) * cmp_stride + cmp_block - 1   # (Tc,)
    seen = last[None, :] <= pos[:, None]                                       # (B, Tc)
    o, p = decode_attend(q, k_cmp, v_cmp, seen[:, None], scale)
    return o, p, seen.sum(-1)


def sel_block_weights(cmp_block, cmp_stride, sel_block):
    """Eq. 9 as a strided filter: selection block j reads compressed blocks j*r - L + 1 + k (r = l'/d, L = l/d,
    k = 0 .. r + L - 2) with weight w[k] = overlap / d; the columns of cmp_to_sel_weights. (r + L - 1,) fp32."""
    L, r = cmp_block // cmp_stride, sel_block // cmp_stride
    start = (torch.arange(r + L - 1) - (L - 1)) * cmp_stride                  # (K,) start of each compressed block
    overlap = torch.clamp(start + cmp_block, max=sel_block) - start.clamp_min(0)
    return overlap.clamp_min(0).float() / cmp_stride                           # (K,): 1, 2, 2, 2, 1 by default


def decode_select(p, pos, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local, num_blocks):
    """select_blocks at one position per row, from the compressed branch's softmax p (B, H, G, Tc) fp32.
    Returns block ids int32 (B, H, n) (valid ascending, then -1; SPEC.md "Selected") and the scores s (B, H,
    num_blocks) fp32 of Eq. 10 before forcing."""
    B, H, G, Tc = p.shape
    L, r = cmp_block // cmp_stride, sel_block // cmp_stride
    wt = sel_block_weights(cmp_block, cmp_stride, sel_block).to(p.device)     # (K,)
    ps = p.sum(dim=2).reshape(B * H, Tc)                                       # (B*H, Tc) Eq. 10: group sum
    ps = F.pad(ps, (L - 1, max(0, (num_blocks - 1) * r + wt.numel() - Tc - (L - 1))))
    score = (ps.unfold(-1, wt.numel(), r)[:, :num_blocks] @ wt).reshape(B, H, num_blocks)   # Eq. 9
    nbp = max(num_blocks, n_select)
    j = torch.arange(nbp, device=p.device)                                     # (nbp,) candidates, padded to >= n
    tb = torch.div(pos, sel_block, rounding_mode="floor")[:, None]             # (B, 1) block of the query itself
    forced = (j < n_init) | ((j > tb - n_local) & (j <= tb))                   # (B, nbp)
    s = torch.where(forced[:, None], float("inf"), F.pad(score, (0, nbp - num_blocks)))   # (B, H, nbp)
    # top-n with ties to the lower j, as one int64 key: the bits of a float >= 0 (or +inf) order like the float,
    # the low 20 bits rank lower j higher; a block that is not a candidate (-inf) gets key -1
    key = s.abs().view(torch.int32).long() * (1 << 20) + ((1 << 20) - 1 - j)  # (B, H, nbp); abs: -0.0 -> 0.0
    key = torch.where((j <= tb)[:, None], key, -1)
    top_key, top = torch.topk(key, n_select, dim=-1)                           # (B, H, n)
    top = torch.where(top_key >= 0, top, -1)
    top = torch.sort(torch.where(top < 0, nbp, top), dim=-1).values            # ascending, padding last
    return torch.where(top == nbp, -1, top).to(torch.int32), score


def decode_selection(q, k, v, block_ids, pos, sel_block, scale):
    """Selected branch at one position per row: gathers the n blocks of each KV group from the raw cache.
    k (B, H, S, D), v (B, H, S, Dv), block_ids int32 (B, H, n) (-1 = none); keys after pos are masked.
    Returns o (B, HQ, Dv) and reads (B, H): tokens each KV group read."""
    B, H, S, D = k.shape
    ids = block_ids.long()
    tok = ids.clamp_min(0)[..., None] * sel_block + torch.arange(sel_block, device=k.device)   # (B, H, n, l')
    tok = tok.flatten(2)                                                       # (B, H, n*l')
    allowed = (ids >= 0).repeat_interleave(sel_block, dim=-1) & (tok <= pos[:, None, None])   # (B, H, n*l')
    tok = tok.clamp_max(S - 1)[..., None]                                      # (B, H, n*l', 1)
    ks = torch.gather(k, 2, tok.expand(-1, -1, -1, D))                         # (B, H, n*l', D)
    vs = torch.gather(v, 2, tok.expand(-1, -1, -1, v.shape[-1]))               # (B, H, n*l', Dv)
    return decode_attend(q, ks, vs, allowed, scale)[0], allowed.sum(-1)


def decode_window(q, k, v, pos, scale):
    """Sliding-window branch at one position per row over the ring k (B, H, W, D), v (B, H, W, Dv) that already
    holds position pos (slot = position % W, W = min(w, max_len)). Returns o (B, HQ, Dv) and reads (B,)."""
    allowed = ring_positions(pos + 1, k.shape[2]) >= 0                         # (B, W)
    return decode_attend(q, k, v, allowed[:, None], scale)[0], allowed.sum(-1)


def decode_attention(q, cache, pos, g, cfg):
    """The attention of one decode step over a filled nsa_cache: compressed -> select_blocks -> selection -> window,
    mixed by the gate g (B, HQ, 3) fp32. q (B, HQ, D) with RoPE at pos (B,). Returns o (B, HQ, Dv) fp32 and stores
    the step's reads, selected blocks, block scores and gate in the cache (counters, --plot_selection)."""
    c, scale, l, d, ls = cache, q.shape[-1] ** -0.5, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    B, H = c.reads.shape[:2]
    fast = _kernel(cfg.backend, q, "decode_attention_triton")
    if fast is not None:  # nsa_kernels: the same step in four launches, which also fill reads, sel_idx, sel_score, gate
        return fast(q, c, pos, g, l, d, ls, cfg.n_select, cfg.n_init, cfg.n_local, scale)
    c.gate.copy_(g)
    o_cmp, p, n_cmp = decode_compressed(q, c.k_cmp, c.v_cmp, pos, l, d, scale)   # (B, HQ, Dv), (B, H, G, Tc)
    idx, score = decode_select(p, pos, l, d, ls, cfg.n_select, cfg.n_init, cfg.n_local,
                               c.sel_score.shape[-1])                          # (B, H, n), (B, H, nb)
    o_slc, n_slc = decode_selection(q, c.k_slc, c.v_slc, idx, pos, ls, scale)
    o_win, n_win = decode_window(q, c.k_win, c.v_win, pos, scale)
    c.reads.copy_(torch.stack([n_cmp[:, None].expand(B, H), n_slc, n_win[:, None].expand(B, H)], dim=-1))
    c.sel_idx.copy_(idx)
    c.sel_score.copy_(score)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win    # (B, HQ, Dv)


def decode_reads(S, cmp_block, cmp_stride, sel_block, n_select, window):
    """SPEC.md "Decode reads" at context length S (positions 0..S-1, the step at S - 1) per KV group, assuming the
    newest block is forced (n_local >= 1): (compressed, selected, window) = (Tc(S), all of S while it fits in n
    blocks else n - 1 full blocks plus the partial newest one (<= n*l'), min(w, S))."""
    nb = -(-S // sel_block)
    slc = S if nb <= n_select else (n_select - 1) * sel_block + (S - 1) % sel_block + 1
    return num_cmp_blocks(S, cmp_block, cmp_stride), slc, min(window, S)


KERNELS, KERNEL_IMPORT_ERROR = _load_kernels()  # at the end: the kernel files may import from this one
