"""Tests of nsa_kernels.py (compressed attention, block selection, sliding window) against the PyTorch reference in
nsa_attention.py (backend="torch"). On CPU the kernels run in the Triton interpreter (fp32 / fp16: bf16 dots are wrong
there); tests marked gpu run bf16 on CUDA against an fp32 reference, plus the module under torch.compile. Every kernel
of both kernel files is also compiled for a Hopper GPU on the CPU (tests/compile_hopper.py)."""
import os
import subprocess
import sys

import pytest
import torch

import nsa_attention as na
import nsa_kernels as nk


def rel_rmse(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def randn(g, *shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def random_gate(g, B, T, HQ, device="cpu"):
    """A branch's gate weights (B, T, HQ) fp32 in [0, 1), every 5th row exactly 0."""
    gate = torch.rand(B, T, HQ, generator=g)
    gate.view(-1)[::5] = 0
    return gate.to(device)


def with_gate(g, xs, HQ, gated):
    """xs plus a gate when gated (B, T from xs[0]); the last output of run_* is then dgate."""
    return xs + [random_gate(g, *xs[0].shape[:2], HQ, xs[0].device)] if gated else xs


def gate_grads(grads, grads_r, xs):
    """The reference's dgate where the gate is 0 set to the kernels' 0 (the backward folds the gate into the lse, so
    a row of gate 0 has p = 0; a softmax or sigmoid gate's logits get no gradient from it anyway)."""
    if len(xs) == 4:
        grads_r = (*grads_r[:3], torch.where(xs[3] > 0, grads_r[3], 0))
    return grads, grads_r


def run_cmp(B, T, HQ, H, D, DV, l, d, dtype, device="cpu", seed=0, cu=None, gated=False):
    """Kernel (o, lse, dq, dk, dv[, dgate]) in `dtype` and the reference on the same rounded inputs in fp64 (CPU) /
    fp32; gated: with a random gate (random_gate)."""
    g = torch.Generator().manual_seed(seed)
    cu_c = None if cu is None else na.cmp_cu_seqlens(cu, l, d)
    Tc = na.num_cmp_blocks(T, l, d) if cu is None else int(cu_c[-1])
    q, k, v, do = (randn(g, *s, dtype=dtype, device=device) for s in ((B, T, HQ, D), (B, Tc, H, D), (B, Tc, H, DV),
                                                                         (B, T, HQ, DV)))
    xs = [x.clone().requires_grad_() for x in with_gate(g, [q, k, v], HQ, gated)]
    o, lse = nk.compressed_attention_triton(*xs[:3], l, d, D ** -0.5, cu, cu_c, *xs[3:])
    grads = torch.autograd.grad(o, xs, do, allow_unused=True)
    ref_dt = torch.float64 if device == "cpu" else torch.float32
    xr = [x.detach().to(ref_dt).requires_grad_() for x in xs]
    o_r, lse_r = na.compressed_attention(*xr[:3], l, d, cu_seqlens=cu, cu_seqlens_cmp=cu_c, backend="torch",
                                         gate=xr[3] if gated else None)
    grads, grads_r = gate_grads(grads, torch.autograd.grad(o_r, xr, do.to(ref_dt), allow_unused=True), xs)
    return (o, lse, *grads), (o_r, lse_r, *grads_r)


def run_win(B, T, HQ, H, D, DV, w, dtype, device="cpu", seed=0, cu=None, gated=False):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (randn(g, B, T, h, dd, dtype=dtype, device=device) for h, dd in ((HQ, D), (H, D), (H, DV), (HQ, DV)))
    xs = [x.clone().requires_grad_() for x in with_gate(g, [q, k, v], HQ, gated)]
    o = nk.window_attention_triton(*xs[:3], w, D ** -0.5, cu, *xs[3:])
    grads = torch.autograd.grad(o, xs, do)
    ref_dt = torch.float64 if device == "cpu" else torch.float32
    xr = [x.detach().to(ref_dt).requires_grad_() for x in xs]
    o_r = na.window_attention(*xr[:3], w, cu_seqlens=cu, backend="torch", gate=xr[3] if gated else None)
    grads, grads_r = gate_grads(grads, torch.autograd.grad(o_r, xr, do.to(ref_dt)), xs)
    return (o, *grads), (o_r, *grads_r)


def check(out, ref, tol, names):
    for name, a, b in zip(names, out, ref):
        if a is None and b is None:
            continue
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(b)), "lse: -inf rows differ"
            a, b = a[torch.isfinite(b)], b[torch.isfinite(b)]
        assert torch.isfinite(a).all(), f"{name}: non-finite values"
        assert rel_rmse(a, b) <= tol, f"{name}: rel RMSE {rel_rmse(a, b):.2e} > {tol}"


CMP_NAMES, WIN_NAMES = ("o", "lse", "dq", "dk", "dv"), ("o", "dq", "dk", "dv")

# (B, T, HQ, H, D, DV, l, d, dtype): G = 1, 2, 3, 4, 16; T < l; D not a power of 2; Dv != D
CMP_CASES = {
    "G1-B2-T70-fp32": (2, 70, 2, 2, 32, 32, 8, 4, torch.float32),
    "G2-T100-Dv16-fp16": (1, 100, 4, 2, 32, 16, 16, 8, torch.float16),
    "G3-D48-T90-fp32": (1, 90, 3, 1, 48, 32, 8, 8, torch.float32),
    "G4-T7<l-fp32": (1, 7, 4, 1, 32, 32, 8, 4, torch.float32),
    "G16-T60-fp16": (1, 60, 16, 1, 32, 32, 8, 4, torch.float16),
}


@pytest.mark.parametrize("case", CMP_CASES.values(), ids=CMP_CASES.keys())
def test_compressed_matches_reference(case):
    *shape, dtype = case
    out, ref = run_cmp(*shape, dtype)
    assert out[0].dtype == dtype and out[1].dtype == torch.float32
    check(out, ref, 1e-5 if dtype == torch.float32 else 2e-3, CMP_NAMES)


def test_compressed_varlen_matches_reference_and_separate_runs(monkeypatch):
    cu = torch.tensor([0, 5, 5, 40, 97], dtype=torch.int32)   # a sequence shorter than l, an empty one
    out, ref = run_cmp(1, 97, 4, 2, 32, 32, 8, 4, torch.float32, seed=1, cu=cu)
    check(out, ref, 1e-5, CMP_NAMES)
    monkeypatch.setattr(nk, "DKV_CHUNK", 16)                   # dk/dv from 7 query chunks, summed
    out2, _ = run_cmp(1, 97, 4, 2, 32, 32, 8, 4, torch.float32, seed=1, cu=cu)
    check(out2, ref, 1e-5, CMP_NAMES)
    g = torch.Generator().manual_seed(2)
    cu_c = na.cmp_cu_seqlens(cu, 8, 4)
    q, k, v = randn(g, 1, 97, 4, 32), randn(g, 1, int(cu_c[-1]), 2, 32), randn(g, 1, int(cu_c[-1]), 2, 32)
    o, lse = nk.compressed_attention_triton(q, k, v, 8, 4, 32 ** -0.5, cu, cu_c)
    c = cu_c.tolist()
    for a, b, ca, cb in ((0, 5, c[0], c[1]), (5, 40, c[2], c[3]), (40, 97, c[3], c[4])):
        o1, lse1 = nk.compressed_attention_triton(q[:, a:b], k[:, ca:cb], v[:, ca:cb], 8, 4, 32 ** -0.5)
        assert torch.allclose(o[:, a:b], o1, atol=1e-6) and torch.allclose(lse[:, a:b], lse1, atol=1e-6)


def test_compressed_padded_keys_ignored():
    """k_cmp may hold more blocks than cu_seqlens_cmp[-1] (a static upper bound such as T // d, for compile): the
    extra blocks are never read (NaN there changes nothing) and get zero gradient."""
    cu = torch.tensor([0, 37, 90], dtype=torch.int32)
    cu_c = na.cmp_cu_seqlens(cu, 8, 4)
    n = int(cu_c[-1])
    g = torch.Generator().manual_seed(14)
    q, k, v = randn(g, 1, 90, 4, 32), randn(g, 1, 90 // 4, 2, 32), randn(g, 1, 90 // 4, 2, 32)
    k[:, n:], v[:, n:] = float("nan"), float("nan")
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = nk.compressed_attention_triton(*xs, 8, 4, 0.2, cu, cu_c)
    dq, dk, dv = torch.autograd.grad(o.sum(), xs)
    o1, lse1 = nk.compressed_attention_triton(q, k[:, :n], v[:, :n], 8, 4, 0.2, cu, cu_c)
    assert torch.equal(o, o1) and torch.equal(lse, lse1) and torch.isfinite(dq).all()
    assert (dk[:, n:] == 0).all() and (dv[:, n:] == 0).all() and torch.isfinite(dk).all()
    idx = nk.select_blocks_triton(q, k, 8, 4, 16, 3, 1, 1, 0.2, cu, cu_c, lse)
    assert torch.equal(idx, nk.select_blocks_triton(q, k[:, :n], 8, 4, 16, 3, 1, 1, 0.2, cu, cu_c, lse))


# (B, T, HQ, H, D, DV, w, dtype): window 2, window > T, G = 1, 3, 8
WIN_CASES = {
    "G1-B2-w16-fp32": (2, 70, 2, 2, 32, 32, 16, torch.float32),
    "G2-w2-fp16": (1, 40, 4, 2, 32, 16, 2, torch.float16),
    "G3-D48-w>T-fp32": (1, 50, 3, 1, 48, 32, 64, torch.float32),
    "G8-w33-fp16": (1, 90, 8, 1, 32, 32, 33, torch.float16),
}


@pytest.mark.parametrize("case", WIN_CASES.values(), ids=WIN_CASES.keys())
def test_window_matches_reference(case):
    *shape, dtype = case
    out, ref = run_win(*shape, dtype)
    assert out[0].dtype == dtype
    check(out, ref, 1e-5 if dtype == torch.float32 else 2e-3, WIN_NAMES)


def test_window_varlen_matches_reference_and_separate_runs():
    cu = torch.tensor([0, 3, 3, 41, 80], dtype=torch.int32)
    out, ref = run_win(1, 80, 4, 2, 32, 32, 10, torch.float32, seed=3, cu=cu)
    check(out, ref, 1e-5, WIN_NAMES)
    g = torch.Generator().manual_seed(4)
    q, k, v = randn(g, 1, 80, 4, 32), randn(g, 1, 80, 2, 32), randn(g, 1, 80, 2, 32)
    o = nk.window_attention_triton(q, k, v, 10, 0.2, cu)
    for a, b in ((0, 3), (3, 41), (41, 80)):
        assert torch.allclose(o[:, a:b], nk.window_attention_triton(q[:, a:b], k[:, a:b], v[:, a:b], 10, 0.2),
                              atol=1e-6)


@pytest.mark.parametrize("branch", ["compressed", "window"])
def test_gated_matches_reference(branch):
    """gate=: o times the gate per row, forward and every gradient, dgate included (G = 3, var-length with a
    sequence shorter than l, rows of gate 0)."""
    cu = torch.tensor([0, 6, 60, 97], dtype=torch.int32)
    if branch == "compressed":
        out, ref = run_cmp(1, 97, 6, 2, 32, 32, 8, 4, torch.float32, seed=5, cu=cu, gated=True)
    else:
        out, ref = run_win(1, 97, 6, 2, 32, 32, 10, torch.float32, seed=5, cu=cu, gated=True)
    assert out[-1].shape == (1, 97, 6) and (out[-1] != 0).any()
    check(out, ref, 1e-5, (CMP_NAMES if branch == "compressed" else WIN_NAMES) + ("dgate",))


@pytest.mark.parametrize("loads", ["boxes", "pointers"])
def test_small_tiles_masked_and_unmasked_steps(monkeypatch, loads):
    """16-row / 16-key tiles, so every kernel has key (or query) steps that all its rows read in full, which skip
    the mask, between masked first and last steps; and dk/dv split into query chunks. Key tiles as TMA boxes (the
    interpreter reads them as Hopper does) and by pointers (GPUs before Hopper, rows not 16-byte aligned)."""
    if loads == "pointers":
        monkeypatch.setattr(nk, "tma_boxes", lambda x, y, *boxes: (x, y, False))
    for name in [n for n in nk.CONFIG if not n.startswith("select")]:     # every entry any G or width takes
        monkeypatch.setitem(nk.CONFIG, name, dict(M=16, BN=16, num_warps=4, num_stages=1))
    monkeypatch.setattr(nk, "DKV_CHUNK", 40)
    out, ref = run_cmp(1, 150, 4, 2, 32, 32, 8, 4, torch.float32, seed=12)
    check(out, ref, 1e-5, CMP_NAMES)
    out, ref = run_cmp(3, 150, 4, 2, 32, 32, 8, 4, torch.float32, seed=14)   # rows of 36 keys: tiles end inside one
    check(out, ref, 1e-5, CMP_NAMES)
    out, ref = run_win(1, 150, 4, 2, 32, 32, 48, torch.float32, seed=12)
    check(out, ref, 1e-5, WIN_NAMES)
    cu = torch.tensor([0, 70, 150], dtype=torch.int32)
    out, ref = run_win(1, 150, 6, 2, 32, 32, 40, torch.float32, seed=13, cu=cu)
    check(out, ref, 1e-5, WIN_NAMES)


@pytest.mark.parametrize("few", [0, 10 ** 9], ids=["dkv", "dkv_few"])
def test_dkv_entry_by_grid_size(monkeypatch, few):
    """Heads wider than SMALL_D: the range dk/dv launches with "dkv" on grids of at least DKV_FEW_PROGRAMS programs
    and with "dkv_few" (other tile rows and warps) below; both match the reference."""
    monkeypatch.setattr(nk, "DKV_FEW_PROGRAMS", few)
    names, launch_cfg = [], nk._launch_cfg
    monkeypatch.setattr(nk, "_launch_cfg", lambda name, *a: names.append(name) or launch_cfg(name, *a))
    D = nk.SMALL_D + 16
    out, ref = run_cmp(1, 150, 4, 2, D, D, 8, 4, torch.float32, seed=15)
    check(out, ref, 1e-5, CMP_NAMES)
    out, ref = run_win(1, 150, 4, 2, D, D, 48, torch.float32, seed=15)
    check(out, ref, 1e-5, WIN_NAMES)
    assert names.count("dkv") == 2 and names.count("dkv_few") == (2 if few else 0)


def test_launch_entry_by_width_then_group():
    """Heads up to SMALL_D wide take a kernel's *_small_d entry where CONFIG has one, else groups below SMALL_G its
    *_small_g entry where it has one, else the kernel's own entry; and the range kernels launch with it."""
    d, g = nk.SMALL_D, nk.SMALL_G
    assert nk.launch_entry("select", g, d) == "select"                                # no select_small_d to take
    assert nk.launch_entry("fwd", 4 * g, d + 1) == "fwd"
    assert nk.launch_entry("dkv", g, d) == "dkv_small_d" and nk.launch_entry("dkv", 1, d + 1) == "dkv"
    assert nk.launch_entry("fwd", 1, d) == "fwd_small_d" and nk.launch_entry("fwd", g, d + 1) == "fwd"
    assert nk.launch_entry("fwd", 1, d + 1) == "fwd_small_g" and nk.launch_entry("select", 1, d) == "select_small_g"
    q, k = torch.zeros(1, 1, 2 * g, d), torch.zeros(1, 1, 2, d)
    assert nk._launch_cfg("dkv", q, k, k)[0] == nk.CONFIG["dkv_small_d"]["M"]


def test_tma_boxes_only_for_aligned_rows():
    """tma_boxes: descriptors of [rows, 1, BD] boxes over (N, H, D) arrays whose rows are 16-byte aligned (the
    interpreter takes them as Hopper does), else the arrays themselves (pointer loads)."""
    x = torch.zeros(10, 2, 32, dtype=torch.float16)
    kb, vb, boxes = nk.tma_boxes(x, x, [8, 1, 32], [8, 1, 32])
    assert boxes and list(kb.block_shape) == [8, 1, 32] and list(kb.strides) == [64, 32, 1]
    narrow = torch.zeros(10, 2, 20, dtype=torch.float16)                                             # 40-byte rows
    assert nk.tma_boxes(x, narrow, [8, 1, 32], [8, 1, 32]) == (x, narrow, False)
    shifted = torch.zeros(10 * 2 * 32 + 1, dtype=torch.float16)[1:].view(10, 2, 32)                # 2-byte offset
    assert nk.tma_boxes(shifted, x, [8, 1, 32], [8, 1, 32]) == (shifted, x, False)


# (B, T, HQ, H, D, l, d, l', n, n_init, n_local): forced blocks on/off, fewer candidates than n (-1 padding),
# T < l (no compressed block: every score 0, ties to the lower j), l'/d = 3 and 5 (not powers of 2), l = l' (a
# compressed block's 1 to 3 last strides spill into the next selection block), l = d = l' (one column a selection
# block, no spill), G = 1, 2, 3, 4
SEL_CASES = {
    "G2-n3-init1-local1": (1, 150, 4, 2, 32, 8, 4, 16, 3, 1, 1),
    "G1-B2-n4-noforced": (2, 120, 2, 2, 32, 8, 4, 16, 4, 0, 0),
    "G4-n5-init2-local2": (1, 200, 4, 1, 32, 16, 8, 16, 5, 2, 2),
    "G3-lsel24-d8-n4": (1, 160, 3, 1, 32, 8, 8, 24, 4, 1, 1),
    "G2-T5<l-n3": (1, 5, 4, 2, 32, 8, 4, 8, 3, 1, 1),
    "G2-n20>blocks": (1, 90, 4, 2, 32, 8, 4, 16, 20, 1, 2),
    "G2-l=lsel-n4": (1, 180, 4, 2, 32, 16, 4, 16, 4, 1, 1),
    "G4-lsel20-d4-n3": (1, 170, 8, 2, 32, 8, 4, 20, 3, 1, 1),
    "G2-l=d=lsel-n4": (1, 150, 4, 2, 32, 8, 8, 8, 4, 1, 1),
}


def run_sel(B, T, HQ, H, D, l, d, lsel, n, n_init, n_local, seed=0, cu=None, pass_lse=True, device="cpu",
            dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    cu_c = None if cu is None else na.cmp_cu_seqlens(cu, l, d)
    Tc = na.num_cmp_blocks(T, l, d) if cu is None else int(cu_c[-1])
    q, k = randn(g, B, T, HQ, D, dtype=dtype, device=device), randn(g, B, Tc, H, D, dtype=dtype, device=device)
    lse = nk.compressed_attention_triton(q, k, k, l, d, D ** -0.5, cu, cu_c)[1] if pass_lse else None
    idx = nk.select_blocks_triton(q, k, l, d, lsel, n, n_init, n_local, D ** -0.5, cu, cu_c, lse)
    ref = na.select_blocks(q.float(), k.float(), l, d, lsel, n, n_init, n_local, cu_seqlens=cu, cu_seqlens_cmp=cu_c,
                           backend="torch")
    return idx, ref


@pytest.mark.parametrize("case", SEL_CASES.values(), ids=SEL_CASES.keys())
def test_select_blocks_equal_reference(case):
    idx, ref = run_sel(*case)
    assert idx.dtype == torch.int32 and idx.shape == ref.shape
    assert torch.equal(idx, ref), f"{(idx != ref).any(-1).sum().item()} of {idx[..., 0].numel()} rows differ"
    assert (idx == -1).any() and (idx >= 0).any()                             # the -1 padding is exercised


def test_select_blocks_forced_padding_and_own_lse():
    B, T, HQ, H, D, l, d, lsel, n = 1, 130, 4, 2, 32, 8, 4, 16, 4
    idx, ref = run_sel(B, T, HQ, H, D, l, d, lsel, n, 1, 2, seed=5, pass_lse=False)
    assert torch.equal(idx, ref)
    t = torch.arange(T)[:, None]
    tb = t // lsel
    assert ((idx[0] == 0).any(-1)).all()                                       # block 0 forced everywhere
    assert ((idx[0] == tb[..., None]).any(-1)).all()                           # the query's own block
    assert ((idx[0] == (tb - 1)[..., None]).any(-1) | (tb == 0)).all()         # and the one before
    assert (idx[0, :lsel, :, 1:] == -1).all()                                  # one candidate: -1 padded


def select_launch(monkeypatch, G, D, l, d, lsel, n, dtype):
    """The keyword arguments select_op launches _select_kernel with at G query heads per kv head (2 kv heads, 64
    tokens), recorded instead of run."""
    launches = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    with monkeypatch.context() as m:
        m.setattr(nk, "_select_kernel", Spy())
        q, k = torch.zeros(1, 64, 2 * G, D, dtype=dtype), torch.zeros(1, 3, 2, D, dtype=dtype)
        nk.select_op(q, k, torch.zeros(1, 64, 2 * G), l, d, lsel, n, 1, 2, 1.0, None, None)
    kw, = launches
    return kw


@pytest.mark.parametrize("G,M", [(1, 256), (1, 64), (3, 256), (3, 128), (8, 256), (8, 128), (16, 256), (16, 128),
                                 (20, 512)])
def test_select_blocks_tile_rows(monkeypatch, G, M):
    """Tiles of M query rows at small and large G against the reference. Rows token major at G = 1 and at G = 3 in
    256 rows, in _head_rows' order elsewhere: QB = 1, 2 and 4 in 128-row tiles, 1 at G = 8 in 256, 2 at G = 16 (256)
    and 20 (512). Var-length and rows of 250 tokens (tiles across two rows), with 30-50 blocks: chunks of 16 that a
    tile sees whole (no mask); no local blocks forced, so the scores next to a query decide too."""
    monkeypatch.setattr(nk, "SMALL_G", 0)                                    # every G takes CONFIG["select"]
    monkeypatch.setitem(nk.CONFIG, "select", dict(nk.CONFIG["select"], M=M))
    kw = select_launch(monkeypatch, G, 32, 8, 4, 8, 4, torch.float32)
    assert kw["BT"] * kw["BG"] == M
    assert kw["QB"] == {(1, 256): 0, (1, 64): 0, (3, 256): 0, (3, 128): 1, (8, 256): 1, (8, 128): 2, (16, 256): 2,
                        (16, 128): 4, (20, 512): 2}[G, M]
    for B, T, cu in ((1, 400, torch.tensor([0, 70, 400], dtype=torch.int32)), (2, 250, None)):
        idx, ref = run_sel(B, T, 2 * G, 2, 32, 8, 4, 8, 4, 1, 0, seed=G, cu=cu)
        assert torch.equal(idx, ref), f"{(idx != ref).any(-1).sum().item()} of {idx[..., 0].numel()} rows differ"


def test_select_small_g_tiles_by_tokens(monkeypatch):
    """Below SMALL_G a tile holds CONFIG's tokens (32), at least 64 rows: 64 tokens at G = 1, 32 from G = 2."""
    assert [select_launch(monkeypatch, G, 32, 8, 4, 8, 4, torch.float32)["BT"] for G in (1, 2, 3, 4)] == \
        [64, 32, 32, 32]


@pytest.mark.parametrize("G,D,lsel,n,dtype,tokens,stages", [(16, 128, 64, 16, torch.bfloat16, 16, 3),
                                                              (32, 128, 64, 16, torch.bfloat16, 8, 3),
                                                              (8, 128, 64, 16, torch.bfloat16, 32, 2),
                                                              (1, 256, 64, 16, torch.bfloat16, 64, 2),
                                                              (32, 128, 128, 16, torch.bfloat16, 8, 3),
                                                              (32, 128, 64, 32, torch.bfloat16, 8, 3),
                                                              (4, 128, 128, 32, torch.float16, 32, 2),
                                                              (16, 128, 64, 16, torch.float32, 8, 2)])
def test_select_launch_fits_shared_memory(monkeypatch, G, D, lsel, n, dtype, tokens, stages):
    """The select launch's tiles stay within SELECT_SMEM (GPU tests run these shapes), and take a third stage only
    where two programs still share a multiprocessor with it or one program held it alone anyway: the paper's shape
    at G = 16 and 32 (3 stages), at G = 8 and at G = 1 with heads of 256 (2); wider chunks (l' / d = 8, n = 32,
    both) and fp32 take fewer stages, then fewer tokens."""
    kw = select_launch(monkeypatch, G, D, 32, 16, lsel, n, dtype)
    assert (kw["BT"], kw["num_stages"]) == (tokens, stages)
    size = lambda stages: nk._select_smem(kw["BT"], kw["BG"], kw["BKC"], kw["BD"], kw["NP"], stages, dtype.itemsize)
    assert size(stages) <= nk.SELECT_SMEM
    assert stages < 3 or size(3) <= nk.SELECT_SMEM_PAIR or size(2) > nk.SELECT_SMEM_PAIR


@pytest.mark.gpu
@pytest.mark.parametrize("n,n_init,n_local", [(16, 1, 2), (5, 0, 0), (3, 2, 1), (32, 1, 2), (17, 3, 0)])
def test_select_top_equal_reference_gpu(n, n_init, n_local):
    """_ws_top_kernel (block selection's top n on Hopper) on Eq. 9's own and spill parts of two rows, in windows that
    split a row and a 32-token program: the reference's top_n of own[j] + spill[j - 1]. Scores from few values tie
    often (the lower block wins); n = 16 exceeds the early tokens' blocks (-1 padding); rows of 40 blocks take three
    chunks of 16 or two of 32."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("a Hopper kernel")
    B, T, H, ls = 2, 640, 3, 16
    NB = -(-T // ls)
    g = torch.Generator().manual_seed(n)
    parts = torch.randint(0, 4, (B * T, H, 2, NB), generator=g).float()
    score = parts[:, :, 0].clone()
    score[..., 1:] += parts[:, :, 1, :-1]
    ref = na.top_n(score, (torch.arange(B * T) % T)[:, None], ls, n, n_init, n_local)
    idx = torch.full((B * T, H, n), -7, dtype=torch.int32, device="cuda")
    for t0, t1 in ((0, 136), (136, 1280)):                     # windows of an op's scores buffer
        nk._select_top(parts[t0:t1].cuda(), idx, t0, t1 - t0, T, ls, n, n_init, n_local)
    idx = idx.cpu()
    assert torch.equal(idx, ref), f"{(idx != ref).any(-1).sum().item()} of {B * T * H} rows differ"
    assert (idx == -1).any() or n <= 3


def test_ws_select_rule(monkeypatch):
    """Which inputs take the Hopper block selection (_ws_select_applies), its GPU checks (_ws_applies) aside: G from
    SELECT_WS_MIN_G (8) to 32, rows of whole tiles of 256 / G tokens, l' / d = 2, 4 or 8, n <= 32, no var-length
    input."""
    monkeypatch.setattr(nk, "_ws_applies", lambda *a: True)

    def applies(G, T, ls=64, d=16, cu=None, n=16):
        return nk._ws_select_applies(torch.zeros(T, 2 * G, 8), torch.zeros(3, 2, 8), T, d, ls, n, cu)
    assert [applies(G, 256) for G in (4, 8, 16, 32, 64)] == [False, True, True, True, False]
    assert [applies(16, T) for T in (16, 4096, 4104)] == [True, True, False]
    assert applies(32, 4104)                                                    # tiles of 8 tokens
    assert [applies(16, 256, ls) for ls in (16, 32, 64, 128, 256)] == [False, True, True, True, False]
    assert not applies(16, 256, cu=torch.tensor([0, 256], dtype=torch.int32))
    assert [applies(16, 256, n=n) for n in (1, 32, 33)] == [True, True, False]


def test_select_blocks_varlen():
    cu = torch.tensor([0, 6, 6, 70, 150], dtype=torch.int32)
    idx, ref = run_sel(1, 150, 4, 2, 32, 8, 4, 16, 3, 1, 1, seed=6, cu=cu)
    assert torch.equal(idx, ref)


def spy_launches(monkeypatch, module, name):
    """The (grid, keyword arguments) of each launch of `module`'s kernel `name` from now on, in a list that fills as
    they run."""
    launches, kernel = [], getattr(module, name)
    monkeypatch.setattr(module, name, type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *args, **kw: launches.append((grid, kw)) or kernel[grid](*args, **kw))})())
    return launches


def poison_allocations(monkeypatch):
    """From here on every buffer torch.empty / empty_like allocates starts as NaN (ints as -2^30, or their most
    negative value where narrower)."""
    empty, empty_like = torch.empty, torch.empty_like

    @torch.no_grad()                                      # (a leaf that requires grad may be filled so too)
    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(max(-(1 << 30), torch.iinfo(x.dtype).min))

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


def test_no_unwritten_outputs_nan_poison(monkeypatch):
    """Every buffer the ops allocate starts as NaN (ints as -2^30); outputs and grads must still be right."""
    monkeypatch.setattr(nk, "DKV_CHUNK", 16)                   # the fp32 dk/dv partials are poisoned too
    poison_allocations(monkeypatch)
    out_c, ref_c = run_cmp(1, 45, 4, 2, 32, 32, 8, 4, torch.float32, seed=7)
    out_w, ref_w = run_win(1, 45, 4, 2, 32, 32, 9, torch.float32, seed=7)
    idx, ref_i = run_sel(1, 45, 4, 2, 32, 8, 4, 8, 3, 1, 1, seed=7)
    monkeypatch.undo()
    check(out_c, ref_c, 1e-5, CMP_NAMES)
    check(out_w, ref_w, 1e-5, WIN_NAMES)
    assert torch.equal(idx, ref_i)


def test_deterministic_two_runs_bit_identical():
    a, _ = run_cmp(1, 64, 4, 1, 32, 32, 8, 4, torch.float32, seed=8)
    b, _ = run_cmp(1, 64, 4, 1, 32, 32, 8, 4, torch.float32, seed=8)
    c, _ = run_win(1, 64, 4, 1, 32, 32, 9, torch.float32, seed=8)
    e, _ = run_win(1, 64, 4, 1, 32, 32, 9, torch.float32, seed=8)
    for x, y in zip(a + c, b + e):
        assert torch.equal(x, y)


def test_cu_seqlens_cmp_required():
    q, k = torch.randn(1, 20, 2, 32), torch.randn(1, 4, 1, 32)
    cu = torch.tensor([0, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_cmp"):
        nk.compressed_attention_triton(q, k, k, 8, 4, 0.1, cu, None)
    with pytest.raises(ValueError, match="cu_seqlens_cmp"):
        nk.select_blocks_triton(q, k, 8, 4, 16, 2, 1, 1, 0.1, cu, None)


# (B, T, cu_seqlens): no token at all, no row, a batch of empty sequences; with cu_seqlens a single empty sequence
EMPTY_CASES = {"B1-T0": (1, 0, None), "B0-T20": (0, 20, None), "B0-T0": (0, 0, None),
               "B1-T0-varlen": (1, 0, [0, 0]), "B1-T0-two-empty-seqs": (1, 0, [0, 0, 0])}


@pytest.mark.parametrize("B,T,cu", EMPTY_CASES.values(), ids=EMPTY_CASES.keys())
def test_empty_inputs_match_reference(B, T, cu):
    """No query: every op returns empty outputs of the reference's shapes and dtypes, gradients included; keys
    nobody reads (k_cmp may hold padding blocks past cu_seqlens_cmp[-1]) get zero gradient."""
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    cu_c = None if cu is None else na.cmp_cu_seqlens(cu, 8, 4)
    g = torch.Generator().manual_seed(15)
    q, k, v = randn(g, B, T, 4, 32), randn(g, B, T, 2, 32), randn(g, B, T, 2, 16)
    Tc = na.num_cmp_blocks(T, 8, 4) if cu is None else 2                       # with cu_seqlens: padding blocks
    k_c, v_c = randn(g, B, Tc, 2, 32), randn(g, B, Tc, 2, 16)
    for triton_fn, ref_fn, xs, args, kw in (
            (nk.compressed_attention_triton, na.compressed_attention, (q, k_c, v_c), (8, 4), dict(cu_seqlens_cmp=cu_c)),
            (nk.window_attention_triton, na.window_attention, (q, k, v), (8,), {})):
        xs = [x.clone().requires_grad_() for x in xs]
        out = triton_fn(*xs, *args, 0.2, cu_seqlens=cu, **kw)
        ref = ref_fn(*xs, *args, scale=0.2, cu_seqlens=cu, backend="torch", **kw)
        out, ref = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        assert [(a.shape, a.dtype) for a in out] == [(b.shape, b.dtype) for b in ref]
        grads = torch.autograd.grad(out[0].sum(), xs)
        assert all(d.shape == x.shape and (d == 0).all() for d, x in zip(grads, xs))
    idx = nk.select_blocks_triton(q, k_c, 8, 4, 16, 3, 1, 1, 0.2, cu, cu_c)
    ref = na.select_blocks(q, k_c, 8, 4, 16, 3, 1, 1, cu_seqlens=cu, cu_seqlens_cmp=cu_c, backend="torch")
    assert idx.shape == ref.shape and idx.dtype == ref.dtype


def test_decode_empty_batch():
    from model import GPTConfig, PRESETS
    cfg = GPTConfig(**dict(PRESETS["tiny"], backend="torch"))
    c = na.nsa_cache(0, 50, 4, 2, 16, cfg, "cpu", torch.float32)
    q, pos, gate = torch.randn(0, 4, 16), torch.zeros(0, dtype=torch.int64), torch.rand(0, 4, 3)
    o = nk.decode_attention_triton(q, c, pos, gate, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_select,
                                   cfg.n_init, cfg.n_local, 0.25)
    assert o.shape == na.decode_attention(q, c, pos, gate, cfg).shape == (0, 4, 16)


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper():
    """Every kernel of nsa_kernels.py and sel_kernel.py compiles for sm_90, as the layer (forward, backward, decode)
    launches them at G = 1, 3, 16, 32, heads of 64..256, fp16 / bf16 / fp32 and var-length, within a Hopper block's
    shared memory. In its own process (tests/compile_hopper.py), where Triton compiles instead of interpreting: the
    interpreter skips code that only a compile reads (after a `return` inside a constexpr `if`, say)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "compile_hopper.py")
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "_select_kernel" in run.stdout and "_ws_range_kernel" in run.stdout
    assert all(f" QB={qb} " in run.stdout for qb in (0, 1, 2, 8))             # _head_rows' orders of the select tile


# ----------------------------------------------------------------------------------------------------------------
# the module: the Triton path (both kernel files) against backend="torch", and torch.compile(fullgraph=True)

def tiny_config(backend, **kw):
    from model import GPTConfig
    cfg = dict(n_embd=64, n_head=4, n_kv_head=2, cmp_block=8, cmp_stride=4, sel_block=16, n_select=3, n_init=1,
               n_local=1, window=12, cmp_hidden=16, backend=backend)
    cfg.update(kw)
    return GPTConfig(**{k: v for k, v in cfg.items() if k in GPTConfig.__dataclass_fields__})


def module_pair(seed=9, **kw):
    torch.manual_seed(seed)
    m_ref = na.NSAAttention(tiny_config("torch", **kw))
    for p in m_ref.gate[-1].parameters():                                     # a gate that is not an even mix
        torch.nn.init.normal_(p, std=0.5)
    m_tri = na.NSAAttention(tiny_config("triton", **kw))
    m_tri.load_state_dict(m_ref.state_dict())
    return m_ref, m_tri


def test_module_triton_matches_torch():
    m_ref, m_tri = module_pair()
    x = torch.randn(1, 70, 64, generator=torch.Generator().manual_seed(10))
    y_ref, y = m_ref(x), m_tri(x)
    assert rel_rmse(y, y_ref) <= 1e-5
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(m_ref.parameters()))
    g = torch.autograd.grad(y.square().sum(), list(m_tri.parameters()))
    for (name, _), a, b in zip(m_ref.named_parameters(), g, g_ref):
        assert rel_rmse(a, b) <= 1e-4, f"grad {name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("varlen", [False, True], ids=["dense-batch", "varlen"])
def test_module_compile_fullgraph(varlen):
    torch._dynamo.reset()
    _, m = module_pair()
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(11))
    cu = torch.tensor([0, 5, 29, 40], dtype=torch.int32) if varlen else None  # no host sync on cu_seqlens either
    f = torch.compile(m, fullgraph=True, backend="aot_eager")                 # raises on any graph break
    y = f(x, cu)
    (gw,) = torch.autograd.grad(y.square().sum(), [m.wq.weight])
    y_e = m(x, cu)
    (gw_e,) = torch.autograd.grad(y_e.square().sum(), [m.wq.weight])
    assert rel_rmse(y, y_e) <= 1e-6 and rel_rmse(gw, gw_e) <= 1e-5


# ----------------------------------------------------------------------------------------------------------------
# GPU (run on the device; skipped without CUDA): bf16 against an fp32 reference, relative RMSE <= 1e-2

GPU_SHAPES = [(G, D) for G in (1, 4, 16) for D in (64, 128)] + [(3, 128), (8, 192), (16, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("few", [10 ** 9, 0], ids=["dkv_few", "dkv"])   # these grids are small: both dk/dv entries
@pytest.mark.parametrize("G,D", GPU_SHAPES, ids=[f"G{G}-D{D}" for G, D in GPU_SHAPES])
def test_compressed_and_window_gpu(G, D, few, monkeypatch):
    monkeypatch.setattr(nk, "DKV_FEW_PROGRAMS", few)
    out, ref = run_cmp(1, 3000, 2 * G, 2, D, D, 32, 16, torch.bfloat16, device="cuda", seed=G + D)
    check(out, ref, 1e-2, CMP_NAMES)
    out, ref = run_win(1, 3000, 2 * G, 2, D, D, 512, torch.bfloat16, device="cuda", seed=G + D)
    check(out, ref, 1e-2, WIN_NAMES)


@pytest.mark.gpu
@pytest.mark.parametrize("few", [10 ** 9, 0], ids=["dkv_few", "dkv"])
@pytest.mark.parametrize("G", [4, 16])
def test_fp32_gpu(G, few, monkeypatch):
    """fp32 heads 128 wide (rows of 512 bytes take the halved tiles of 256-wide 16-bit heads, which fit in shared
    memory) against the reference; wider fp32 heads are a user error."""
    monkeypatch.setattr(nk, "DKV_FEW_PROGRAMS", few)
    out, ref = run_cmp(1, 1000, 2 * G, 2, 128, 128, 32, 16, torch.float32, device="cuda", seed=G)
    check(out, ref, 1e-2, CMP_NAMES)
    out, ref = run_win(1, 1000, 2 * G, 2, 128, 128, 512, torch.float32, device="cuda", seed=G)
    check(out, ref, 1e-2, WIN_NAMES)
    q, k = (torch.randn(1, 64, n, 256, device="cuda") for n in (2 * G, 2))
    with pytest.raises(ValueError, match="fp32 heads up to 128 wide, got 256"):
        na.window_attention(q, k, k, 16)
    with pytest.raises(ValueError, match="fp32 heads up to 128 wide, got 256"):       # values count too
        na.window_attention(q[..., :128], k[..., :128], k, 16)


@pytest.mark.gpu
def test_varlen_gpu():
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_cmp(1, 2000, 16, 4, 128, 128, 32, 16, torch.bfloat16, device="cuda", cu=cu)
    check(out, ref, 1e-2, CMP_NAMES)
    out, ref = run_win(1, 2000, 16, 4, 128, 128, 512, torch.bfloat16, device="cuda", cu=cu)
    check(out, ref, 1e-2, WIN_NAMES)


# (G, D, l', n, dtype): the paper's l' and n at G = 1..32 (G = 8, 16, 32: each thread sums one token's heads,
# _head_rows); chunks of 128 compressed keys (l' / d = 8, or n = 32) and of 256 (both), and at D = 256: some fit in
# shared memory only with fewer stages or tokens a tile
SEL_GPU = [(1, 128, 64, 16, torch.bfloat16), (4, 128, 64, 16, torch.bfloat16), (8, 128, 64, 16, torch.bfloat16),
           (16, 128, 64, 16, torch.bfloat16),
           (16, 256, 64, 16, torch.bfloat16), (32, 64, 64, 16, torch.bfloat16), (16, 128, 128, 16, torch.bfloat16),
           (16, 128, 64, 32, torch.bfloat16), (4, 128, 128, 32, torch.float16), (16, 256, 128, 16, torch.bfloat16)]


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,lsel,n,dtype", SEL_GPU,
                         ids=[f"G{g}-D{d}-l{ls}-n{n}-{str(t)[6:]}" for g, d, ls, n, t in SEL_GPU])
def test_select_blocks_gpu(G, D, lsel, n, dtype):
    """16-bit inputs, reference on the same values in fp32 (bf16 products are exact in both): the index sets differ
    only where two scores tie to rounding, on <= 0.1% of rows; with and without var-length. D = 256 halves the
    tiles (shared memory), G = 32 is the widest head group a tile sums."""
    cu = torch.tensor([0, 1000, 1000, 5000], dtype=torch.int32, device="cuda")
    for c in (None, cu):
        idx, ref = run_sel(1, 5000, 2 * G, 2, D, 32, 16, lsel, n, 1, 2, seed=G, cu=c, device="cuda", dtype=dtype)
        assert (idx != ref).any(-1).float().mean().item() <= 1e-3


# (B, T, G, D, l', n, dtype): block selection by _ws_score_kernel and _ws_top_kernel (whole tiles of 256 / G tokens a
# row; l' / d = 4, 8 and 2)
SEL_WS_GPU = [(1, 5120, 16, 128, 64, 16, torch.bfloat16), (2, 2048, 8, 128, 64, 16, torch.bfloat16),
              (1, 4096, 32, 64, 64, 16, torch.bfloat16), (1, 4096, 16, 128, 128, 32, torch.bfloat16),
              (1, 512, 16, 64, 32, 8, torch.bfloat16), (3, 96, 8, 128, 64, 16, torch.bfloat16),
              (1, 2048, 16, 128, 64, 16, torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("B,T,G,D,lsel,n,dtype", SEL_WS_GPU, ids=[f"B{b}-T{t}-G{g}-D{d}-l{ls}-n{n}-{str(x)[6:]}"
                                                                for b, t, g, d, ls, n, x in SEL_WS_GPU])
def test_select_blocks_ws_gpu(monkeypatch, B, T, G, D, lsel, n, dtype):
    """The Hopper block selection against the fp32 reference as test_select_blocks_gpu; scores held for windows of
    about a fifth of the tokens (SELECT_SCORE_BYTES), so tiles of every window run; rows as short as 96 tokens (5
    compressed keys, 2 selection blocks) and as long as 5120."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("Hopper kernels")
    ws_select, calls = nk._ws_select, []
    monkeypatch.setattr(nk, "_ws_select", lambda *a: calls.append(1) or ws_select(*a))
    monkeypatch.setattr(nk, "SELECT_SCORE_BYTES", B * T * 2 * 2 * -(-T // lsel) * 4 // 5)
    idx, ref = run_sel(B, T, 2 * G, 2, D, 32, 16, lsel, n, 1, 2, seed=G, device="cuda", dtype=dtype)
    assert calls == [1]
    assert (idx != ref).any(-1).float().mean().item() <= 1e-3


HOPPER_SHAPES = [(1, 128, False, torch.bfloat16), (2, 64, True, torch.float16), (4, 128, True, torch.bfloat16),
                 (16, 128, False, torch.bfloat16), (16, 64, True, torch.bfloat16), (32, 128, True, torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,gated,dtype", HOPPER_SHAPES, ids=[f"G{G}-D{D}-{'gated' if g else 'plain'}-{str(t)[6:]}"
                                                                 for G, D, g, t in HOPPER_SHAPES])
def test_range_hopper_gpu(G, D, gated, dtype, monkeypatch):
    """The warp-specialised kernels against the reference, every buffer they allocate NaN-poisoned: both branches'
    forward, dq and dk/dv, on two rows of 2100 tokens (130 compressed keys: a 128-key tile and 2 keys; at G = 1 a
    128-row tile straddles the rows; the window's dk/dv consumers skip steps), queries split into token chunks, and more
    tiles than multiprocessors at G >= 4 (each persistent program walks several), twice (bit-equal); and var-length
    input (where the forward and dq stay Triton's) with NaN padding keys."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernels are Hopper's")
    q = torch.empty(1, 8, 2 * G, D, device="cuda", dtype=dtype)
    assert nk._ws_applies(nk.pack(q), q[0, :, :2], q[0, :, :2])
    ranges = spy_launches(monkeypatch, nk, "_ws_range_kernel")       # the persistent forward / dq launches
    dkv = spy_launches(monkeypatch, nk, "_ws_dkv_kernel")
    poison_allocations(monkeypatch)
    out, ref = run_cmp(2, 2100, 2 * G, 2, D, D, 32, 16, dtype, device="cuda", seed=G + D, gated=gated)
    out_w, ref_w = run_win(2, 2100, 2 * G, 2, D, D, 512, dtype, device="cuda", seed=G + D, gated=gated)
    # a second run bit-equal: a shared buffer that a TMA load refills before the consumers have read it shows here
    again, _ = run_cmp(2, 2100, 2 * G, 2, D, D, 32, 16, dtype, device="cuda", seed=G + D, gated=gated)
    again_w, _ = run_win(2, 2100, 2 * G, 2, D, D, 512, dtype, device="cuda", seed=G + D, gated=gated)
    monkeypatch.undo()
    tiles = 2 * -(-4200 // (128 // G))                    # 2 kv heads x tiles of 128 // G tokens
    grids = [grid for grid, _ in ranges]
    assert grids == [(min(tiles, nk._sm_count(q.device)),)] * 8, grids   # forward and dq of each branch, twice
    kinds = [kw["KIND"] for _, kw in dkv]
    assert kinds == ([0, 1] if G > 1 else [0]) * 2, kinds                # the window's at G = 1 is Triton's
    assert all(torch.equal(a, b) for a, b in zip(out + out_w, again + again_w))
    check(out, ref, 1e-2, CMP_NAMES + (("dgate",) if gated else ()))
    check(out_w, ref_w, 1e-2, WIN_NAMES + (("dgate",) if gated else ()))
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_cmp(1, 2000, 2 * G, 2, D, D, 32, 16, dtype, device="cuda", seed=G, cu=cu, gated=gated)
    check(out, ref, 1e-2, CMP_NAMES + (("dgate",) if gated else ()))
    out, ref = run_win(1, 2000, 2 * G, 2, D, D, 512, dtype, device="cuda", seed=G, cu=cu, gated=gated)
    check(out, ref, 1e-2, WIN_NAMES + (("dgate",) if gated else ()))
    # padding keys past cu_seqlens_cmp[-1] hold NaN, every buffer the ops allocate starts as NaN: the same o, lse and
    # dq as without the padding, dk / dv within rounding (a key tile with padding starts its token steps elsewhere, so
    # it sums them in another grouping), zero gradient at the padding, and two runs bit-identical
    cu_c = na.cmp_cu_seqlens(cu, 32, 16)
    n = int(cu_c[-1])
    g = torch.Generator().manual_seed(G)
    q, k, v = (randn(g, 1, t, h, D, dtype=dtype, device="cuda") for t, h in ((2000, 2 * G), (n + 100, 2), (n + 100, 2)))
    k[:, n:], v[:, n:] = float("nan"), float("nan")

    def run(k, v):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = nk.compressed_attention_triton(*xs, 32, 16, D ** -0.5, cu, cu_c)
        return [o, lse, *torch.autograd.grad(o.float().square().sum(), xs)]

    poison_allocations(monkeypatch)
    first, second, unpadded = run(k, v), run(k, v), run(k[:, :n], v[:, :n])
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b) for a, b in zip(first[:3], unpadded[:3]))
    assert rel_rmse(first[3][:, :n], unpadded[3]) <= 1e-2 and rel_rmse(first[4][:, :n], unpadded[4]) <= 1e-2
    assert (first[3][:, n:] == 0).all() and (first[4][:, n:] == 0).all()


@pytest.mark.gpu
def test_module_compile_gpu():
    torch._dynamo.reset()
    m_ref, m = module_pair(n_embd=256, n_head=8, n_kv_head=2, cmp_block=32, cmp_stride=16, sel_block=64, n_select=4,
                           window=128, cmp_hidden=64)
    m_ref, m = m_ref.cuda(), m.cuda()
    x = torch.randn(1, 1024, 256, device="cuda")
    f = torch.compile(m, fullgraph=True)
    y, y_ref = f(x), m_ref(x)
    assert rel_rmse(y, y_ref) <= 1e-2
    g = torch.autograd.grad(y.square().sum(), list(m.parameters()))
    g_ref = torch.autograd.grad(y_ref.square().sum(), list(m_ref.parameters()))
    for a, b in zip(g, g_ref):
        assert rel_rmse(a, b) <= 2e-2
