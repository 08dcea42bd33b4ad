"""Tests of sel_kernel.py (Triton selection attention, forward + backward) against the PyTorch reference in
nsa_attention.py, on each of its two paths (the `path` fixture: query-centric, key-centric), and of what only the
key-centric path has (the same o and lse as the query path, its launch sizes, the rule that picks a path). On CPU the
kernels run in the Triton interpreter (fp32 / fp16 dots; bf16 dots are wrong there); tests marked gpu run the same
checks in fp16 / bf16 on CUDA, plus long sequences, 64-bit offsets, determinism, torch.compile and CUDA graphs."""
import pytest
import torch

import nsa_attention
import nsa_kernels
import sel_kernel
from test_nsa_kernels import gate_grads, poison_allocations, spy_launches, with_gate

CUDA = torch.cuda.is_available()


def random_indices(B, T, H, n, sel_block, seed=0, device="cpu", cu_seqlens=None):
    """Valid-first ascending, duplicate-free block ids in [0, t // l'] padded with -1: int32 (B, T, H, n)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = nsa_attention.positions(cu_seqlens.cpu() if cu_seqlens is not None else None, T, "cpu")
    t = t.expand(B, T) if cu_seqlens is None else t[None]
    nb = (t // sel_block + 1)[..., None, None]                                 # (B, T, 1, 1) reachable blocks
    j = (torch.rand(B, T, H, n, generator=g) * nb).long()                      # (B, T, H, n)
    j = torch.where(torch.arange(n) == 0, 0, j)                                # block 0 always (like n_init)
    j = j.sort(-1).values
    dup = torch.zeros_like(j, dtype=torch.bool)
    dup[..., 1:] = j[..., 1:] == j[..., :-1]
    j = torch.where(dup, 1 << 40, j).sort(-1).values
    return torch.where(j == 1 << 40, -1, j).to(torch.int32).to(device)


def rel_rmse(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def forced_indices(B, T, H, n, sel_block, n_init, n_local, seed=0, cu_seqlens=None, device="cpu"):
    """Ids as select_blocks makes them (top_n of random block scores, 8192 tokens at a time): the forced blocks
    always among them."""
    g = torch.Generator(device=device).manual_seed(seed)
    t = nsa_attention.positions(cu_seqlens, T, device)
    t = t.expand(B, T) if cu_seqlens is None else t[None]
    parts = []
    for ts in t.split(8192, 1):                                                # (B, <= 8192) positions
        score = torch.rand(B, ts.shape[1], H, T // sel_block + 1, generator=g, device=device)
        parts.append(nsa_attention.top_n(score, ts[..., None], sel_block, n, n_init, n_local))
    return torch.cat(parts, 1)


def run_both(B, T, HQ, H, D, DV, n, sel_block, dtype, device="cpu", seed=0, cu_seqlens=None, idx=None, gated=False,
             forced=None):
    """Kernel output and grads (dq, dk, dv[, dgate]) in `dtype`, reference in fp64 (CPU) / fp32 (GPU) on the same
    rounded inputs; gated: with a random gate (test_nsa_kernels.random_gate); forced: the kernel's argument."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, h, d, generator=g).to(device=device, dtype=dtype)
                   for h, d in ((HQ, D), (H, D), (H, DV), (HQ, DV)))
    idx = random_indices(B, T, H, n, sel_block, seed, device, cu_seqlens) if idx is None else idx
    qk = [x.clone().requires_grad_() for x in with_gate(g, [q, k, v], HQ, gated)]
    o = sel_kernel.selection_attention_triton(*qk[:3], idx, sel_block, None, cu_seqlens, *qk[3:], forced=forced)
    grads = torch.autograd.grad(o, qk, do)
    ref_dt = torch.float64 if device == "cpu" else torch.float32
    qr = [x.detach().to(ref_dt).requires_grad_() for x in qk]
    o_ref = nsa_attention.selection_attention(*qr[:3], idx, sel_block, cu_seqlens=cu_seqlens, backend="torch",
                                              gate=qr[3] if gated else None)
    grads, grads_ref = gate_grads(grads, torch.autograd.grad(o_ref, qr, do.to(ref_dt)), qk)
    return (o, *grads), (o_ref, *grads_ref)


@pytest.fixture(params=["query", "key"])
def path(request, monkeypatch):
    """The selection path under test (sel_kernel.CONFIG["path"]); on CPU the key-centric one with 16-row tiles and
    32-row chunks, so a block's list of pairs spans several chunks and tiles. "recompute" (asked for by name): the
    query path whose dq kernel recomputes the score gradients (DS_MAX_BYTES = 0) instead of reading those that the
    dk/dv kernel wrote, which "query" does at these sizes."""
    if request.param == "recompute":
        monkeypatch.setattr(sel_kernel, "DS_MAX_BYTES", 0)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "query" if request.param == "recompute" else request.param)
    if request.param == "key" and not CUDA:
        for name in ("key_fwd", "key_fwd_small_d"):
            monkeypatch.setitem(sel_kernel.CONFIG, name, dict(sel_kernel.CONFIG[name], rows=16))
        for name in ("key_bwd", "key_bwd_small_d"):
            monkeypatch.setitem(sel_kernel.CONFIG, name, dict(sel_kernel.CONFIG[name], rows=16, chunk_rows=32))
    return request.param


def fwd_lse(q, k, v, idx, l, cu_seqlens=None):
    """o and the saved base-2 lse (what the backward reads) of the forward op."""
    return sel_kernel.sel_attn_fwd(q, k, v, None, idx, l, q.shape[3] ** -0.5, cu_seqlens, [], 0, 0)


def randn(*shapes, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in shapes]


# (B, T, HQ, H, D, DV, n, sel_block, dtype): G = 1, 2, 3, 4, 8, 16; T < l', T not a multiple of l'; D != Dv; l' = 48
# (one 64-key tile, partly masked); D = 160 (two 32-key sub-blocks per block on the key side); rows of 40 bytes (the
# query path's K/V by pointers: no TMA boxes)
CPU_CASES = {
    "G1-D32-T40-B2-fp32": (2, 40, 2, 2, 32, 32, 3, 16, torch.float32),
    "G2-D32-T33-fp16": (1, 33, 4, 2, 32, 32, 2, 16, torch.float16),
    "G3-D48-Dv32-T37-fp32": (1, 37, 3, 1, 48, 32, 3, 16, torch.float32),
    "G4-D64-T20<l'-fp16": (1, 20, 4, 1, 64, 64, 2, 32, torch.float16),
    "G8-D32-Dv48-T50-n4-fp32": (1, 50, 8, 1, 32, 48, 4, 16, torch.float32),
    "G16-D32-Dv64-T30-fp16": (1, 30, 16, 1, 32, 64, 2, 16, torch.float16),
    "G2-lsel48-T100-fp32": (1, 100, 2, 1, 32, 32, 2, 48, torch.float32),
    "G1-D160-2subblocks-T70-fp32": (1, 70, 2, 2, 160, 32, 3, 64, torch.float32),
    "G2-D20-unaligned-rows-fp16": (1, 33, 4, 2, 20, 20, 2, 16, torch.float16),  # 40-byte rows: pointer loads
}
# G = 16 on the query paths only (the key path is for small G); the recomputing dq never meets sub-blocks (the
# dk/dv's score gradients do)
NOT_ON = {"key": {"G16-D32-Dv64-T30-fp16"}, "query": set(), "recompute": {"G1-D160-2subblocks-T70-fp32"}}
CPU_RUNS = [(path, name) for name in CPU_CASES for path in ("query", "recompute", "key") if name not in NOT_ON[path]]


@pytest.mark.parametrize("path,case", [(path, CPU_CASES[name]) for path, name in CPU_RUNS], indirect=["path"],
                         ids=[f"{path}-{name}" for path, name in CPU_RUNS])
def test_matches_reference_cpu(path, case):
    *shape, dtype = case
    out, ref = run_both(*shape, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel_rmse(a, b) <= tol, f"{name}: rel RMSE {rel_rmse(a, b):.2e} > {tol}"


@pytest.mark.parametrize("path", ["query", "key"], indirect=True)
@pytest.mark.parametrize("G", [1, 3])
def test_gated_matches_reference(path, G):
    """gate=: o times the gate per row, forward and every gradient, dgate included (var-length, rows of gate 0)."""
    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    out, ref = run_both(1, 57, 2 * G, 2, 32, 32, 3, 16, torch.float32, seed=30 + G, cu_seqlens=cu, gated=True)
    assert out[-1].shape == (1, 57, 2 * G) and (out[-1] != 0).any()
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_key_path_token_windows_match_reference(path, monkeypatch):
    """More partial rows than KEY_WINDOW_ROWS: the key path runs window by window (7 tokens here, so windows cut the
    sequences; then two sub-blocks per block), and o, every gradient and dgate still match the reference."""
    monkeypatch.setattr(sel_kernel, "KEY_WINDOW_ROWS", 7 * 4 * 3)             # HQ * n = 12 rows per token
    assert sel_kernel._plan(57, 4, 2, 3, 32, 32, 16, 2)[1:3] == (7, 7 * 4 * 3)
    assert sel_kernel._windows(57, 7) == [(t, t + 7) for t in range(0, 56, 7)] + [(56, 57)]
    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    out, ref = run_both(1, 57, 4, 2, 32, 32, 3, 16, torch.float32, seed=40, cu_seqlens=cu, gated=True)
    out2, ref2 = run_both(2, 30, 2, 1, 160, 32, 3, 64, torch.float32, seed=41)   # 7 tokens a window again
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate", "o", "dq", "dk", "dv"), out + out2, ref + ref2):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_key_path_window_sums_nan_poison(path, monkeypatch):
    """Token windows: the keys of the last window get their dk/dv from it alone (a key's gradients come from the
    tokens at or after it), the earlier keys sum the windows in fp32. Every buffer starts as NaN, and o and every
    gradient still match the reference, var-length, with blocks that straddle the windows' border."""
    HQ, n = 4, 3
    monkeypatch.setattr(sel_kernel, "KEY_WINDOW_ROWS", 60 * HQ * n)            # windows [0, 60) and [60, 100)
    cu = torch.tensor([0, 45, 100], dtype=torch.int32)
    poison_allocations(monkeypatch)
    out, ref = run_both(1, 100, HQ, 2, 32, 32, n, 16, torch.float32, seed=6, cu_seqlens=cu)
    monkeypatch.undo()
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("path", ["query"], indirect=True)
@pytest.mark.parametrize("rows", [16, 64])
def test_union_tiles_match_reference(path, rows, monkeypatch):
    """union=True: a tile of several tokens walks the union of their blocks, each loaded once for all the rows that
    chose it (the other launch choice); tiles of 8 and 32 tokens (G = 2), across two var-length sequences, gated."""
    for kname in ("fwd", "dq"):
        monkeypatch.setitem(sel_kernel.CONFIG, kname, dict(sel_kernel.CONFIG[kname], union=True, rows=rows))
    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    out, ref = run_both(1, 45, 4, 2, 32, 32, 3, 16, torch.float32, seed=14)
    out2, ref2 = run_both(1, 57, 4, 2, 32, 32, 3, 16, torch.float32, seed=15, cu_seqlens=cu, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "o", "dq", "dk", "dv", "dgate"), out + out2, ref + ref2):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("split", [0.0, 0.5])
@pytest.mark.parametrize("ds", [False, True])
def test_union_split_matches_reference(split, ds, monkeypatch):
    """Past UNION_MAX_T the forward and dq split the union tiles by list length: those listing more than
    UNION_SPLIT x n blocks (all at 0; at 0.5 those of 2 or more here) run their tokens one to a tile, in a second
    launch over the tiles' order. Every row is written once, by one of the two (the dq's also its delta and lse for
    dk/dv): o and every gradient match the reference, var-length and gated. With ds, the dq reads the dk/dv's score
    gradients in whole union tiles instead (no split)."""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")
    if not ds:
        monkeypatch.setattr(sel_kernel, "DS_MAX_BYTES", 0)
    monkeypatch.setattr(sel_kernel, "UNION_MAX_T", dict(fwd=16, dq=16))
    monkeypatch.setattr(sel_kernel, "UNION_SPLIT", dict(fwd=split, dq=split))
    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    out, ref = run_both(1, 57, 32, 2, 16, 16, 3, 16, torch.float32, seed=16, cu_seqlens=cu, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("auto", [False, True])
def test_dq_from_score_gradients_equals_recomputed(auto, monkeypatch):
    """The query path's dq from the score gradients that the dk/dv kernel wrote is the recomputing dq kernel's, bit
    for bit (the same ds, summed over the same blocks in the same order), slot by slot and (auto at G = 16) in union
    tiles; var-length and gated. And the rule: score gradients while they take at most DS_MAX_BYTES."""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto" if auto else "query")
    launches = spy_launches(monkeypatch, sel_kernel, "_sel_ds_dq_kernel")
    cu = torch.tensor([0, 20, 57], dtype=torch.int32)
    HQ, n, l, D = 32, 3, 16, 16
    need = 57 * HQ * n * l * 4                       # bytes of the score gradients: fp32, one row of l' a pair row
    runs = {}
    for budget in (need, need - 1):
        monkeypatch.setattr(sel_kernel, "DS_MAX_BYTES", budget)
        runs[budget], _ = run_both(1, 57, HQ, 2, D, D, n, l, torch.float32, seed=17, cu_seqlens=cu, gated=True)
    assert len(launches) == 1                          # only the run whose score gradients fit the budget
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), runs[need], runs[need - 1]):
        assert torch.equal(a, b), name


def test_union_tiles():
    """union_tiles: order[h] places every token once, inside its span of BT * GROUP_TILES tokens; a tile's list is
    the distinct blocks (by packed first token, so equal ids of two sequences differ) the tokens at its places
    selected, ascending, then -1, and their count (against sets); tokens that selected the same blocks share a
    tile, though they are not neighbours; and a tile grows by the token that adds the fewest blocks."""
    g = torch.Generator().manual_seed(3)
    NT, H, NS, BT, BS = 23, 2, 4, 8, 4
    pos = torch.cat([torch.arange(10), torch.arange(13)]).to(torch.int32)       # two sequences: 10 and 13 tokens
    idx = torch.randint(-1, 4, (NT, H, NS), generator=g, dtype=torch.int32)
    idx = torch.where(idx <= (pos // BS)[:, None, None], idx, -1)
    order, lst, cnt = sel_kernel.union_tiles(idx, pos, BT, BS)
    bos = torch.arange(NT) - pos
    span = BT * sel_kernel.GROUP_TILES
    for h in range(H):
        places = order[h].tolist()
        assert sorted(places) == list(range(NT)) and all(t // span == p // span for p, t in enumerate(places))
        for tile in range(3):
            want = sorted({int(bos[t] + j * BS) for t in places[tile * BT:tile * BT + BT]
                           for j in idx[t, h].tolist() if j >= 0})
            row = lst[tile * H + h].tolist()
            assert cnt[tile * H + h] == len(want) and row == want + [-1] * (BT * NS - len(want))
    # even tokens select block 0, odd ones block 1: four tiles of one block each, not eight blocks in neighbours
    idx = torch.full((16, 1, 2), -1, dtype=torch.int32)
    idx[:, 0, 0] = torch.arange(16) % 2
    order, lst, cnt = sel_kernel.union_tiles(idx, torch.arange(16, dtype=torch.int32), 4, 1)
    assert order[0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15] and cnt.tolist() == [1] * 4
    # a tile takes the token that adds the fewest blocks to its list (3: none), not the one sharing the most (2)
    idx = torch.full((12, 1, 3), -1, dtype=torch.int32)                          # tokens 0-7 select nothing
    idx[8:, 0] = torch.tensor([[0, 1, -1], [2, 3, -1], [0, 1, 2], [0, -1, -1]], dtype=torch.int32)
    order, lst, cnt = sel_kernel.union_tiles(idx, torch.arange(12, dtype=torch.int32), 2, 1)
    assert order[0].tolist()[8:] == [8, 11, 9, 10] and cnt.tolist()[4:] == [2, 4]


def test_key_path_default_launch_config_matches_reference(monkeypatch):
    """The key-centric path at the GPU's tile and chunk sizes (one chunk per block here) gives the same answer."""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "key")
    out, ref = run_both(1, 45, 4, 2, 32, 32, 3, 16, torch.float32, seed=3)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("path", ["key"], indirect=True)
@pytest.mark.parametrize("G", [1, 3])
def test_key_path_same_o_and_lse_as_query_path(G, path, monkeypatch):
    """o and the saved lse equal the query-centric forward's (fp32 rounding apart), and each backward run after
    the other path's forward gives the reference gradients: the two paths share their conventions."""
    B, T, H, D, n, l = 1, 37, 2, 32, 3, 16
    q, k, v, do = randn((B, T, H * G, D), (B, T, H, D), (B, T, H, D), (B, T, H * G, D), seed=20 + G)
    idx = random_indices(B, T, H, n, l, seed=20 + G)
    o_key, lse_key = fwd_lse(q, k, v, idx, l)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "query")
    o_q, lse_q = fwd_lse(q, k, v, idx, l)
    assert rel_rmse(o_key, o_q) <= 1e-6
    assert torch.allclose(lse_key, lse_q, rtol=0, atol=1e-5)
    qr = [x.double().requires_grad_() for x in (q, k, v)]
    ref = torch.autograd.grad(nsa_attention.selection_attention(*qr, idx, l, backend="torch"), qr, do.double())
    for fwd_path, bwd_path in (("key", "query"), ("query", "key")):
        qk = [x.clone().requires_grad_() for x in (q, k, v)]
        monkeypatch.setitem(sel_kernel.CONFIG, "path", fwd_path)
        o = sel_kernel.selection_attention_triton(*qk, idx, l)
        monkeypatch.setitem(sel_kernel.CONFIG, "path", bwd_path)
        for name, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(o, qk, do), ref):
            assert rel_rmse(a, b) <= 1e-5, f"{fwd_path} fwd, {bwd_path} bwd, {name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_key_path_fp16_partials_near_query_path_error(path, monkeypatch):
    """The key path stores its o and dq partials in the input dtype: in fp16 its errors against the fp64 reference
    stay near the query path's, also with keys that share a large component (the blocks' dq partials cancel)."""
    B, T, HQ, H, D, n, l = 1, 34, 2, 1, 32, 3, 16
    q, k, v, do = randn((B, T, HQ, D), (B, T, H, D), (B, T, H, D), (B, T, HQ, D), seed=17)
    k = k + 3 * randn((D,), seed=18)[0]
    q, k, v, do = (x.half() for x in (q, k, v, do))
    idx = random_indices(B, T, H, n, l, seed=17)
    qr = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = nsa_attention.selection_attention(*qr, idx, l, backend="torch")
    ref = (o_ref, *torch.autograd.grad(o_ref, qr, do.double()))
    err = {}
    for p in ("key", "query"):
        monkeypatch.setitem(sel_kernel.CONFIG, "path", p)
        qk = [x.clone().requires_grad_() for x in (q, k, v)]
        o = sel_kernel.selection_attention_triton(*qk, idx, l)
        err[p] = [rel_rmse(a, b) for a, b in zip((o, *torch.autograd.grad(o, qk, do)), ref)]
    for name, e_key, e_query in zip(("o", "dq", "dk", "dv"), err["key"], err["query"]):
        assert e_key <= 1.5 * e_query, f"{name}: key path rel RMSE {e_key:.2e}, query path {e_query:.2e}"


def test_varlen_matches_reference_and_separate_runs(path):
    cu = torch.tensor([0, 13, 13, 50, 77], dtype=torch.int32)  # an empty sequence, lengths not multiples of l'
    out, ref = run_both(1, 77, 4, 2, 32, 32, 3, 16, torch.float32, cu_seqlens=cu, seed=1)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    q, k, v = randn((1, 77, 4, 32), (1, 77, 2, 32), (1, 77, 2, 32), seed=2)
    idx = random_indices(1, 77, 2, 3, 16, seed=3, cu_seqlens=cu)
    o, lse = fwd_lse(q, k, v, idx, 16, cu)
    for a, b in ((0, 13), (13, 50), (50, 77)):  # each sequence alone gives the same rows: no read crosses a start
        o_alone, lse_alone = fwd_lse(q[:, a:b], k[:, a:b], v[:, a:b], idx[:, a:b], 16)
        # up to rounding: the interpreter's dots go through numpy, whose BLAS may round a row differently when the
        # tile's other rows differ (a read across a start would be off by O(1))
        torch.testing.assert_close(o[:, a:b], o_alone, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, a:b], lse_alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_varlen_never_reads_the_next_sequence(path):
    """A sequence ending inside a block (40 = 2.5 blocks): NaN keys of the next sequence reach none of its outputs
    or gradients, though the key path loads whole blocks."""
    cu = torch.tensor([0, 40, 77], dtype=torch.int32)
    q, k, v, do = randn((1, 77, 4, 32), (1, 77, 2, 32), (1, 77, 2, 32), (1, 77, 4, 32), seed=16)
    k[:, 40:], v[:, 40:] = float("nan"), float("nan")
    idx = random_indices(1, 77, 2, 3, 16, seed=16, cu_seqlens=cu)
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    o = sel_kernel.selection_attention_triton(*qk, idx, 16, None, cu)
    do[:, 40:] = 0
    grads = torch.autograd.grad(o, qk, do)
    qr = [x[:, :40].double().requires_grad_() for x in (q, k, v)]
    o_ref = nsa_attention.selection_attention(*qr, idx[:, :40], 16, backend="torch")
    grads_ref = torch.autograd.grad(o_ref, qr, do[:, :40].double())
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        assert torch.isfinite(a[:, :40]).all(), f"{name} of the first sequence is not finite"
        assert rel_rmse(a[:, :40], b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a[:, :40], b):.2e}"


@pytest.mark.parametrize("path", ["query", "recompute", "key"], indirect=True)
def test_no_unwritten_outputs_nan_poison(path, monkeypatch):
    """Every buffer the op allocates (partials included) starts as NaN (ints as their most negative value): the
    outputs, the saved lse and the grads must still be finite and right, so no unwritten element is ever read."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(torch.iinfo(x.dtype).min)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    q, k, v, do = randn((1, 33, 6, 32), (1, 33, 2, 32), (1, 33, 2, 32), (1, 33, 6, 32), seed=4)  # G = 3: rows
    idx = random_indices(1, 33, 2, 4, 16, seed=4)                                                # g >= G masked
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = fwd_lse(*qk, idx, 16)
    out = (o, *torch.autograd.grad(o, qk, do))
    monkeypatch.undo()
    qr = [x.double().requires_grad_() for x in (q, k, v)]
    o_ref = nsa_attention.selection_attention(*qr, idx, 16, backend="torch")
    ref = (o_ref, *torch.autograd.grad(o_ref, qr, do.double()))
    assert torch.isfinite(lse).all()
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert torch.isfinite(a).all(), f"{name} has unwritten (NaN) elements"
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


def test_deterministic_two_runs_bit_identical(path):
    a, _ = run_both(1, 40, 4, 1, 32, 32, 4, 16, torch.float32, seed=5)
    b, _ = run_both(1, 40, 4, 1, 32, 32, 4, 16, torch.float32, seed=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("path,loads", [("query", "boxes"), ("query", "pointers"), ("recompute", "pointers"),
                                        ("key", "boxes")],
                         indirect=["path"])
def test_out_of_range_and_repeated_ids_ignored_no_future_reads(path, loads, monkeypatch):
    """Ids past t // l', below -1, far outside the tensor, or repeated change nothing; NaN keys after the first half
    never reach the first half's outputs or dq, which match the reference and equal a run on the first half alone.
    The query path by pointer loads reads no key past its tile's last token, so its half ends inside a block; by
    boxes (tma_boxes) it reads whole blocks, as the key path does (sel_kernel.py, "Masks"): their half ends at a
    block."""
    if loads == "pointers":
        monkeypatch.setattr(sel_kernel, "tma_boxes", lambda k, v, *boxes: (k, v, False))
    B, T, HQ, H, D, n, l = 1, 48, 2, 1, 32, 5, 16
    idx = random_indices(B, T, H, n, l, seed=6)
    bad = idx.clone()
    t = torch.arange(T)[None, :, None]
    bad[..., -1] = torch.where(bad[..., -1] == -1, t // l + 1, bad[..., -1])  # future block
    bad[..., -2] = torch.where(bad[..., -2] == -1, -7, bad[..., -2])          # below -1
    bad[..., -3] = torch.where(bad[..., -3] == -1, bad[..., 0], bad[..., -3])  # a repeat of slot 0
    bad[0, 5, 0, 4], bad[0, 40, 0, 4] = 1 << 30, (1 << 31) - 1                  # far outside the tensor
    assert (bad != idx).any()
    q, k, v = randn((B, T, HQ, D), (B, T, H, D), (B, T, H, D), seed=7)
    half = T // 2 if loads == "pointers" else 2 * l
    k[:, half:], v[:, half:] = float("nan"), float("nan")                      # the future of the first half
    qg = q.clone().requires_grad_()
    o = sel_kernel.selection_attention_triton(qg, k, v, bad, l)
    (dq,) = torch.autograd.grad(o[:, :half].sum(), qg)
    qr = q[:, :half].double().requires_grad_()
    o_ref = nsa_attention.selection_attention(qr, k[:, :half].double(), v[:, :half].double(), idx[:, :half], l,
                                              backend="torch")
    (dq_ref,) = torch.autograd.grad(o_ref.sum(), qr)
    assert torch.isfinite(o[:, :half]).all() and torch.isfinite(dq[:, :half]).all()
    assert rel_rmse(o[:, :half], o_ref) <= 1e-5 and rel_rmse(dq[:, :half], dq_ref) <= 1e-5
    q2 = q[:, :half].clone().requires_grad_()
    (dq_alone,) = torch.autograd.grad(sel_kernel.selection_attention_triton(q2, k[:, :half], v[:, :half],
                                                                            idx[:, :half], l).sum(), q2)
    assert torch.equal(dq[:, :half], dq_alone)


@pytest.mark.parametrize("path", ["query"], indirect=True)
@pytest.mark.parametrize("HQ,n_init,n_local,n,T,cu,dtype", [
    (16, 1, 2, 5, 100, None, torch.float16),          # G = 16: one token a tile on the query path
    (32, 0, 1, 3, 90, [0, 37, 90], torch.float32),    # no initial block; var-length
    (24, 2, 1, 4, 12, None, torch.float32),           # G = 24 (not a power of 2); T < l'
    (16, 3, 3, 7, 100, [0, 61, 100], torch.float32)])
def test_forced_blocks_as_key_ranges(path, HQ, n_init, n_local, n, T, cu, dtype, monkeypatch):
    """forced=(n_init, n_local) on select_blocks-like ids, tiles of one token: the forced blocks as key ranges in
    tiles of several tokens, then the free ids. o and every gradient as the reference's, from NaN-poisoned buffers;
    and the ranges are what the forward read: with block 0 taken out of the ids (the promise broken) o is the same."""
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    idx = forced_indices(1, T, 1, n, 16, n_init, n_local, seed=HQ + T, cu_seqlens=cu)
    poison_allocations(monkeypatch)
    out, ref = run_both(1, T, HQ, 1, 32, 32, n, 16, dtype, seed=T, cu_seqlens=cu, idx=idx, gated=True,
                        forced=(n_init, n_local))
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= tol, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    if n_init:
        q, k, v, g = randn((1, T, HQ, 32), (1, T, 1, 32), (1, T, 1, 32), (1, T, HQ), seed=T, dtype=dtype)
        o = sel_kernel.selection_attention_triton(q, k, v, idx, 16, None, cu, g, forced=(n_init, n_local))
        broken = torch.where(idx == 0, -1, idx)
        assert torch.equal(sel_kernel.selection_attention_triton(q, k, v, broken, 16, None, cu, g,
                                                                 forced=(n_init, n_local)), o)
        assert not torch.equal(sel_kernel.selection_attention_triton(q, k, v, broken, 16, None, cu, g), o)


@pytest.mark.parametrize("path", ["query"], indirect=True)
def test_forced_blocks_only_where_a_range_tile_holds_several_tokens(path):
    """At G = 64 a tile of CONFIG["forced"]'s rows holds one token, as the slot loop's does: the ids run as given
    (with block 0 taken out of them o changes), still as the reference's."""
    T, HQ = 40, 64
    idx = forced_indices(1, T, 1, 3, 16, 1, 2, seed=5)
    out, ref = run_both(1, T, HQ, 1, 32, 32, 3, 16, torch.float32, seed=5, idx=idx, forced=(1, 2))
    for a, b in zip(out, ref):
        assert rel_rmse(a, b) <= 1e-5
    q, k, v = randn((1, T, HQ, 32), (1, T, 1, 32), (1, T, 1, 32), seed=5)
    broken = torch.where(idx == 0, -1, idx)
    assert not torch.equal(sel_kernel.selection_attention_triton(q, k, v, broken, 16, forced=(1, 2)),
                           sel_kernel.selection_attention_triton(q, k, v, idx, 16, forced=(1, 2)))


def test_query_with_no_key_gives_zero_and_minus_inf_lse(path):
    B, T, H, n, l = 1, 20, 1, 2, 16
    idx = random_indices(B, T, H, n, l, seed=8)
    idx[0, 3:9] = -1
    out, ref = run_both(B, T, 2, H, 32, 32, n, l, torch.float32, idx=idx)
    assert (out[0][0, 3:9] == 0).all() and (out[1][0, 3:9] == 0).all()
    for a, b in zip(out, ref):
        assert rel_rmse(a, b) <= 1e-5
    q, k, v = randn((B, T, 2, 32), (B, T, H, 32), (B, T, H, 32), seed=8)
    _, lse = fwd_lse(q, k, v, idx, l)
    assert (lse[0, 3:9] == float("-inf")).all() and torch.isfinite(lse[0, 9:]).all()


@pytest.mark.parametrize("path", ["query"], indirect=True)
def test_duplicate_ids_count_once(path):
    """The keys are a union of blocks: an id listed twice by a token (select_blocks never does) counts once."""
    B, T, H, n, l = 1, 34, 1, 3, 16
    idx = random_indices(B, T, H, n, l, seed=10)
    dup = idx.clone()
    dup[..., -1] = torch.where(dup[..., -1] == -1, dup[..., 0], dup[..., -1])
    assert (dup != idx).any()
    a, _ = run_both(B, T, 2, H, 32, 32, n, l, torch.float32, idx=idx, seed=10)
    b, _ = run_both(B, T, 2, H, 32, 32, n, l, torch.float32, idx=dup, seed=10)
    for x, y in zip(a, b):
        assert rel_rmse(x, y) <= 1e-6


def test_clean_indices_keeps_each_valid_id_once_in_its_slot():
    """_clean_indices against a loop: ids outside [0, t // l'] and repeats of an earlier slot's id -> -1, the rest in
    place, whatever order the slots come in; each slot's sort key kv head * NB + block number (the block's first
    token // l' + its sequence), H * NB for -1."""
    NT, H, n, l, NB = 37, 3, 16, 4, 99
    g = torch.Generator().manual_seed(11)
    idx = torch.randint(-3, 12, (NT, H, n), generator=g, dtype=torch.int32)
    seq = (torch.arange(NT) >= 21).int()                                       # two sequences: [0, 21), [21, 37)
    pos = (torch.arange(NT) - 21 * seq).int()
    out, key = sel_kernel._clean_indices(idx, pos, seq, l, NB)
    want, want_key = torch.full_like(idx, -1), torch.full((NT, H, n), H * NB)
    for t in range(NT):
        for h in range(H):
            seen = set()
            for s, j in enumerate(idx[t, h].tolist()):
                if 0 <= j <= pos[t] // l and j not in seen:
                    want[t, h, s] = j
                    want_key[t, h, s] = h * NB + (t - pos[t] + j * l) // l + seq[t]
                seen.add(j)
    assert (want == -1).any() and (want >= 0).any() and torch.equal(out, want)
    assert key.dtype == torch.int16 and torch.equal(key.long(), want_key.flatten())


def test_reverse_index_lists_each_blocks_pairs_in_token_order(monkeypatch):
    """Against a loop, var-length, windows that start mid-sequence: each used chunk holds at most `chunk` (token,
    slot) pairs of one (kv head, block), its c_key; a block's chunks are consecutive, hold every pair that chose it,
    tokens ascending, and are its [seg_c0, seg_c1) (empty for a block nobody chose); unused chunks are empty and
    last. The int16 sort keys of every CPU size and the int32 / int64 ones of large inputs give the same index."""
    cu = torch.tensor([0, 70, 75, 200], dtype=torch.int32)
    T, H, n, l, chunk, W = 200, 3, 4, 16, 7, 90
    idx = random_indices(1, T, H, n, l, seed=12, cu_seqlens=cu)
    index = sel_kernel._index(idx, l, cu, W, chunk, 0)
    cleaned, pos, seq = index[:3]
    NB = index[11].numel() // H
    for w, t0 in enumerate(range(0, T, W)):
        perm, c_begin, c_end, c_key, seg_c0, seg_c1 = index[7 + 6 * w:13 + 6 * w]
        want = {}                                                               # c_key -> its pairs, loop order
        for t in range(t0, min(T, t0 + W)):
            for h in range(H):
                for s in range(n):
                    if (j := int(cleaned[t, h, s])) >= 0:
                        want.setdefault(h * T + t - int(pos[t]) + j * l, []).append(((t - t0) * H + h) * n + s)
        used = c_begin < c_end
        assert used.sum() > len(want) > H * 3 and not used[int(used.sum()):].any()   # some blocks cut in chunks
        assert ((c_end - c_begin) <= chunk).all() and c_key[used].diff().ge(0).all()
        got = {}
        for c in range(int(used.sum())):
            got.setdefault(int(c_key[c]), []).append(c)
        assert sorted(got) == sorted(want)
        listed = torch.zeros(H * NB, dtype=torch.bool)
        for key, chunks in got.items():
            assert sum((perm[c_begin[c]:c_end[c]].tolist() for c in chunks), []) == want[key]
            h, kst = divmod(key, T)
            blk = h * NB + kst // l + int(seq[kst])
            assert chunks == list(range(int(seg_c0[blk]), int(seg_c1[blk])))
            listed[blk] = True
        assert (seg_c0[~listed] == seg_c1[~listed]).all()
    for dtype in (torch.int32, torch.int64):
        monkeypatch.setattr(sel_kernel, "_key_dtype", lambda n: dtype)
        assert all(torch.equal(a, b) for a, b in zip(sel_kernel._index(idx, l, cu, W, chunk, 0), index))


@pytest.mark.parametrize("windows", [1, 3])
def test_index_built_once_and_its_fake_matches(path, windows, monkeypatch):
    """nsa::sel_index builds the ids' index once per call: forward and backward take it and build none of their own;
    on the query path it holds no reverse index, which only the backward builds (once per window, from the index's
    sort keys); its fake (for torch.compile) gives every tensor's shape and dtype, union tiles' too; an index built
    for another plan (here other token windows) gets the plan's reverse index, and the result stays right."""
    B, T, HQ, H, n, l = 1, 40, 4, 2, 3, 16
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    monkeypatch.setattr(sel_kernel, "KEY_WINDOW_ROWS", HQ * n * -(-T // windows))  # the key path: that many windows
    idx = random_indices(B, T, H, n, l, seed=13, cu_seqlens=cu)
    plan = sel_kernel._plan(T, HQ, H, n, 32, 32, l, 2)
    for window in (plan[1], 0):
        for tile in (4, 0):
            index = sel_kernel._index(idx, l, cu, window, plan[3], tile)
            fake = sel_kernel._index_fake(idx, l, cu, window, plan[3], tile)
            assert len(index) == 7 + 6 * (window > 0) * (windows if path == "key" else 1)
            assert index[4].numel() == (tile > 0) * T * n * H
            assert [(x.shape, x.dtype) for x in index] == [(x.shape, x.dtype) for x in fake]
            torch.library.opcheck(sel_kernel.sel_index, (idx, l, cu, window, plan[3], tile))
    stale = sel_kernel._index(idx, l, cu, plan[1], plan[3], 0)                 # reverse index of the plan's windows
    built, index_fn, reverse, reverse_fn = [], sel_kernel._index, [], sel_kernel._reverse_index
    monkeypatch.setattr(sel_kernel, "_index", lambda *a: built.append(a) or index_fn(*a))
    monkeypatch.setattr(sel_kernel, "_reverse_index", lambda *a: reverse.append(a) or reverse_fn(*a))
    q, k, v = randn((B, T, HQ, 32), (B, T, H, 32), (B, T, H, 32), seed=13)
    sel_kernel.selection_attention_triton(q, k, v, idx, l, None, cu)
    assert not built and len(reverse) == (windows if path == "key" else 0)   # the query path's forward: none
    reverse.clear()
    out, ref = run_both(B, T, HQ, H, 32, 32, n, l, torch.float32, idx=idx, cu_seqlens=cu, seed=13)
    assert not built and len(reverse) == (windows if path == "key" else 1)   # sel_index's; the backward's
    for a, b in zip(out, ref):
        assert rel_rmse(a, b) <= 1e-5
    reverse.clear()
    monkeypatch.setattr(sel_kernel, "KEY_WINDOW_ROWS", HQ * n * -(-T // (windows + 1)))
    o_stale = sel_kernel.sel_attn_fwd(q, k, v, None, idx, l, 32 ** -0.5, cu, stale, 0, 0)[0]
    assert not built and len(reverse) == (windows + 1 if path == "key" else 0)  # the key path's windows differ
    assert torch.equal(o_stale, sel_kernel.sel_attn_fwd(q, k, v, None, idx, l, 32 ** -0.5, cu, [], 0, 0)[0])


def test_empty_inputs(path):
    """T = 0, B = 0 and n = 0, with and without cu_seqlens: no launch, o = 0 and zero gradients of the right shapes."""
    for B, T, n, cu in ((1, 0, 3, None), (0, 20, 3, None), (1, 0, 3, [0, 0]), (1, 20, 0, None), (1, 20, 0, [0, 20])):
        cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        qk = [torch.randn(B, T, h, 32, requires_grad=True) for h in (4, 2, 2)]
        o = sel_kernel.selection_attention_triton(*qk, torch.zeros(B, T, 2, n, dtype=torch.int32), 16, None, cu)
        grads = torch.autograd.grad(o.sum(), qk, allow_unused=True)
        assert o.shape == (B, T, 4, 32) and (o == 0).all()
        assert all(g.shape == x.shape and (g == 0).all() for g, x in zip(grads, qk))


def test_auto_rule_and_bad_path(monkeypatch):
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")
    G = sel_kernel.KEY_MAX_G
    assert sel_kernel._key_path(G) and sel_kernel._key_path(1) and not sel_kernel._key_path(G + 1)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "query")
    assert not sel_kernel._key_path(1)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "keys")
    with pytest.raises(ValueError, match="'auto', 'query' or 'key'"):
        sel_kernel._key_path(1)


def test_auto_union_rule(monkeypatch):
    """Under "auto" the forward and dq at G = 16 run union tiles (CONFIG["fwd_union"], ["dq_union"], several tokens a
    tile) with heads up to 128 wide, on rows of more than UNION_MAX_T[kernel] tokens split by list length
    (UNION_SPLIT[kernel]), and with at least SPLIT_MAX_L2 of L2 cache one token a tile past ONE_TOKEN_T[kernel];
    other G, wider heads and the "query" path keep one token a tile. And the selection under "auto" at G = 16
    matches the reference."""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")
    cpu = torch.device("cpu")
    for name in ("fwd", "dq"):
        T = sel_kernel.UNION_MAX_T[name]
        M, union, cfg = sel_kernel._query_launch(name, 16, T, 128, cpu)
        assert union and M // 16 > 1 and "split" not in cfg, name
        for G, t, width in ((16, T + 1, 128), (12, T, 128), (32, T, 128), (16, T, 192)):
            M, union, cfg = sel_kernel._query_launch(name, G, t, width, cpu)
            if G == 16 and width == 128:                                     # longer rows: split by list length
                assert union and cfg["split"] == sel_kernel.UNION_SPLIT[name]
            else:
                assert not union and M // G == 1, (name, G, t, width)
    # with an L2 cache of SPLIT_MAX_L2 or more, rows longer than ONE_TOKEN_T run one token a tile; up to it they keep
    # union tiles (split past UNION_MAX_T); with less they split at every length past UNION_MAX_T
    l2 = sel_kernel._l2_bytes
    for name in ("fwd", "dq"):
        T = sel_kernel.ONE_TOKEN_T[name]
        monkeypatch.setattr(sel_kernel, "_l2_bytes", lambda device: sel_kernel.SPLIT_MAX_L2)
        M, union, cfg = sel_kernel._query_launch(name, 16, T, 128, cpu)
        assert union and ("split" in cfg) == (T > sel_kernel.UNION_MAX_T[name]), name
        M, union, cfg = sel_kernel._query_launch(name, 16, T + 1, 128, cpu)
        assert not union and M == 16 and "split" not in cfg, name
        monkeypatch.setattr(sel_kernel, "_l2_bytes", lambda device: sel_kernel.SPLIT_MAX_L2 - 1)
        assert sel_kernel._query_launch(name, 16, T + 1, 128, cpu)[2]["split"] == sel_kernel.UNION_SPLIT[name], name
    monkeypatch.setattr(sel_kernel, "_l2_bytes", l2)
    out, ref = run_both(1, 70, 32, 2, 16, 16, 3, 16, torch.float32, seed=21, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "query")
    assert not sel_kernel._query_launch("fwd", 16, 16, 128, cpu)[1]
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")                       # forward and dq: one grouping,
    monkeypatch.setattr(sel_kernel, "UNION_MAX_T", dict(fwd=64, dq=64))        # rows of T (not B * T) tokens
    built, tiles_fn = [], sel_kernel.union_tiles
    monkeypatch.setattr(sel_kernel, "union_tiles", lambda *a: built.append(a) or tiles_fn(*a))
    run_both(2, 40, 32, 2, 16, 16, 3, 16, torch.float32, seed=21)
    assert len(built) == 1
    # longer rows with a large L2: the forward runs one token a tile (one launch), the dq builds its own union tiles
    # (it goes one token a tile from longer rows), and then neither builds any
    monkeypatch.setattr(sel_kernel, "_l2_bytes", lambda device: sel_kernel.SPLIT_MAX_L2)
    monkeypatch.setattr(sel_kernel, "ONE_TOKEN_T", dict(fwd=64, dq=128))
    fwd_launches = spy_launches(monkeypatch, sel_kernel, "_sel_fwd_kernel")
    built.clear()
    out, ref = run_both(1, 70, 32, 2, 16, 16, 3, 16, torch.float32, seed=22, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    assert [kw["UNION"] for _, kw in fwd_launches] == [False] and len(built) == 1
    monkeypatch.setattr(sel_kernel, "ONE_TOKEN_T", dict(fwd=64, dq=64))
    built.clear()
    out, ref = run_both(1, 70, 32, 2, 16, 16, 3, 16, torch.float32, seed=23, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert torch.isfinite(a).all() and rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    assert not built


def test_dkv_cfg_by_path_head_width_and_dtype(monkeypatch):
    """The dk/dv pass's CONFIG entry, which also sets the index's chunks: "dkv" on the query path, on the key path
    "key_bwd_small_d" for heads up to SMALL_D wide (Dv counts too), else "key_bwd" (fp32: in 64-row tiles); the key
    path's forward likewise."""
    d, entry, table, cfg = nsa_kernels.SMALL_D, nsa_kernels.launch_entry, sel_kernel.CONFIG, sel_kernel._dkv_cfg
    assert entry("key_fwd", 1, d, table) == "key_fwd_small_d" in table
    assert entry("key_fwd", 1, d + 1, table) == "key_fwd"
    assert cfg(False, 1, d, d, 2) == table["dkv"]
    assert cfg(True, 1, d, d, 2) == cfg(True, 1, d, d, 4) == table["key_bwd_small_d"]
    assert cfg(True, 1, d, 2 * d, 2) == cfg(True, 1, 2 * d, d, 2) == table["key_bwd"]
    assert cfg(True, 1, 2 * d, d, 4) == dict(table["key_bwd"], rows=64, num_warps=4) != table["key_bwd"]
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "key")
    monkeypatch.setitem(sel_kernel.CONFIG, "key_bwd", dict(sel_kernel.CONFIG["key_bwd"], rows=16, chunk_rows=64))
    monkeypatch.setitem(sel_kernel.CONFIG, "key_bwd_small_d", dict(sel_kernel.CONFIG["key_bwd"], chunk_rows=128))
    assert sel_kernel._plan(100, 4, 2, 3, d, d, 16, 2)[3] == 64
    assert sel_kernel._plan(100, 4, 2, 3, 2 * d, d, 16, 2)[3] == 32


def test_query_path_chunks_shrink_for_few_pairs():
    """The query path cuts its reverse index into chunks of "dkv"'s chunk_rows query rows on long inputs; on shorter
    ones into shorter chunks, down to a quarter, so that the dk/dv grid keeps about DKV_CHUNKS programs."""
    rows = sel_kernel.CONFIG["dkv"]["chunk_rows"]
    chunk_rows = lambda T: sel_kernel._plan(T, 64, 4, 16, 128, 128, 64, 2)[3] * 16   # G = 16: pairs -> query rows
    full = rows * sel_kernel.DKV_CHUNKS // (64 * 16)                                # tokens that fill the grid
    assert chunk_rows(4 * full) == chunk_rows(full) == rows
    assert chunk_rows(full // 2) == rows // 2
    assert chunk_rows(full // 4) == chunk_rows(full // 64) == rows // 4


def _compiled_loss(q, k, v, idx, l, backend):
    f = torch.compile(lambda q, k, v: (sel_kernel.selection_attention_triton(q, k, v, idx, l).float() ** 2).sum(),
                      fullgraph=True, backend=backend)
    return f(q, k, v)


def test_compile_fullgraph_cpu(path):
    torch._dynamo.reset()
    q, k, v = randn((1, 24, 4, 32), (1, 24, 2, 32), (1, 24, 2, 32), seed=9)
    idx = random_indices(1, 24, 2, 2, 16, seed=9)
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(_compiled_loss(*qk, idx, 16, "inductor"), qk)  # fullgraph: no graph break
    qe = [x.clone().requires_grad_() for x in (q, k, v)]
    for a, b in zip(grads, torch.autograd.grad((sel_kernel.selection_attention_triton(*qe, idx, 16) ** 2).sum(), qe)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_input_errors():
    q, k, v = torch.randn(1, 8, 4, 32), torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32)
    idx = torch.zeros(1, 8, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_indices must be int32"):
        sel_kernel.selection_attention_triton(q, k, v, idx.long(), 16)
    with pytest.raises(ValueError, match="block_indices must be int32"):
        sel_kernel.selection_attention_triton(q, k, v, idx[:, :4], 16)
    with pytest.raises(ValueError, match="k must be"):
        sel_kernel.selection_attention_triton(q, torch.randn(1, 8, 3, 32), v, idx, 16)
    with pytest.raises(ValueError, match="q, k, v must be 4-D"):
        sel_kernel.selection_attention_triton(q[0], k, v, idx, 16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sel_kernel.selection_attention_triton(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                              idx.expand(2, -1, -1, -1), 16, None, torch.tensor([0, 8], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------------------------
# GPU (run on the device; skipped without CUDA)

QUERY_GPU = [(G, D, DV, torch.bfloat16) for G, D, DV in ((1, 64, 64), (2, 32, 32), (3, 64, 64), (4, 128, 128),
                                                          (8, 192, 192), (16, 128, 128), (32, 64, 64), (4, 256, 256),
                                                          (16, 192, 128))] + [(4, 128, 128, torch.float16),
                                                                               (16, 64, 32, torch.float16)]
KEY_GPU = [(G, D, DV, torch.bfloat16) for G, D, DV in ((1, 128, 128), (2, 64, 64), (3, 64, 32), (4, 128, 128),
                                                        (8, 64, 64), (4, 256, 192), (1, 16, 16))] + \
          [(4, 128, 128, torch.float16)]
GPU_CASES = [("query", *c) for c in QUERY_GPU] + [("key", *c) for c in KEY_GPU] + \
            [("auto", 16, 128, 128, torch.bfloat16)] + \
            [(p, G, 128, 128, torch.float32) for p, G in (("query", 4), ("key", 4), ("auto", 16))]  # tf32 dots


@pytest.mark.gpu
@pytest.mark.parametrize("path,G,D,DV,dtype", GPU_CASES, indirect=["path"],
                         ids=[f"{p}-G{G}-D{D}-Dv{DV}-{str(dt)[6:]}" for p, G, D, DV, dt in GPU_CASES])
def test_matches_reference_gpu(path, G, D, DV, dtype):
    H = 2
    out, ref = run_both(1, 1000, H * G, H, D, DV, 16, 64, dtype, device="cuda", seed=G + D)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("path,HQ", [("query", 16), ("key", 8)], indirect=["path"])
def test_varlen_gpu(path, HQ):
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_both(1, 2000, HQ, 4, 128, 128, 16, 64, torch.bfloat16, device="cuda", cu_seqlens=cu)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["query"], indirect=True)
@pytest.mark.parametrize("HQ,D,dtype", [(32, 128, torch.bfloat16), (64, 64, torch.float16), (40, 128, torch.float32)])
def test_forced_blocks_as_key_ranges_gpu(path, HQ, D, dtype):
    """forced=(1, 2) on select_blocks-like ids, one token a tile (G = 16, 32, 20): var-length and gated, as the
    fp32 reference, dgate included (the forced blocks' K/V by TMA boxes where they apply)."""
    cu = torch.tensor([0, 1000, 1000, 3001], dtype=torch.int32)
    idx = forced_indices(1, 3001, 2, 16, 64, 1, 2, seed=HQ, cu_seqlens=cu).cuda()
    out, ref = run_both(1, 3001, HQ, 2, D, D, 16, 64, dtype, device="cuda", seed=HQ, cu_seqlens=cu.cuda(), idx=idx,
                        gated=True, forced=(1, 2))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["query"], indirect=True)
def test_union_tiles_gated_gpu(path, monkeypatch):
    """bf16: union tiles of 4 tokens at G = 16 (the kernels' compiled union loops), var-length and gated, match the
    fp32 reference, dgate included."""
    for kname in ("fwd", "dq"):
        monkeypatch.setitem(sel_kernel.CONFIG, kname, dict(sel_kernel.CONFIG[kname], union=True, rows=64))
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_both(1, 2000, 32, 2, 128, 128, 16, 64, torch.bfloat16, device="cuda", cu_seqlens=cu, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("split", [0.0, 0.5])
def test_union_split_gated_gpu(split, monkeypatch):
    """bf16: the forward's and dq's union tiles split by list length (all tiles at 0; at 0.5 n those listing more
    than 8 blocks, whose tokens sit past about position 512, while earlier ones stay union tiles), var-length and
    gated, match the fp32 reference. (The dq recomputes its score gradients here: it splits only then.)"""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")
    monkeypatch.setattr(sel_kernel, "DS_MAX_BYTES", 0)
    monkeypatch.setattr(sel_kernel, "UNION_MAX_T", dict(fwd=16, dq=16))
    monkeypatch.setattr(sel_kernel, "UNION_SPLIT", dict(fwd=split, dq=split))
    monkeypatch.setattr(sel_kernel, "SPLIT_MAX_L2", float("inf"))              # both split on any GPU
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_both(1, 2000, 64, 4, 128, 128, 16, 64, torch.bfloat16, device="cuda", cu_seqlens=cu, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_key_path_windows_gated_gpu(path, monkeypatch):
    """bf16: the key path over several token windows (300 tokens each, cutting the sequences) with a gate matches the
    fp32 reference, dgate included."""
    monkeypatch.setattr(sel_kernel, "KEY_WINDOW_ROWS", 300 * 8 * 16)
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_both(1, 2000, 8, 4, 128, 128, 16, 64, torch.bfloat16, device="cuda", cu_seqlens=cu, gated=True)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("path,HQ", [("query", 16), ("key", 4)], indirect=["path"])
def test_deterministic_gpu(path, HQ):
    a, _ = run_both(1, 8192, HQ, 1, 128, 128, 16, 64, torch.bfloat16, device="cuda", seed=11)
    b, _ = run_both(1, 8192, HQ, 1, 128, 128, 16, 64, torch.bfloat16, device="cuda", seed=11)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16384, 65536])
def test_long_sequence_gpu(T):
    """HQ=64, H=4, D=128: finite outputs and grads; rows near the end equal a direct fp32 computation. At 16k the dq
    reads the dk/dv's score gradients (2 GiB, all of DS_MAX_BYTES), at 64k it recomputes them."""
    check_long(1, T, 64, 4, 128, 128)


@pytest.mark.gpu
def test_64bit_offsets_gpu():
    """B*T*HQ*D = 2^32 elements (B=2, T=131072, HQ=64, D=256): offsets past 2^31 must not wrap."""
    check_long(2, 131072, 64, 4, 256, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["key"], indirect=True)
def test_64bit_partial_offsets_gpu(path):
    """Key path, T = 131072, G = 1, H = 4, n = 16, D = 128: the (token, head, slot) partials hold 2^32 elements, so
    rows near the end sit past 2^31; they must equal a direct fp32 computation (and every gradient stays finite)."""
    check_long(1, 131072, 4, 4, 128, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["query"], indirect=True)
def test_64bit_offsets_forced_gpu(path, monkeypatch):
    """The forced blocks' key ranges (one token a tile at G = 16 past 32k) at 2^32-element offsets, on ids that
    hold them as select_blocks' do."""
    launches = spy_launches(monkeypatch, sel_kernel, "_sel_forced_fwd_kernel")
    check_long(2, 131072, 64, 4, 256, 64, forced=(1, 2))
    assert len(launches) == 1


def check_long(B, T, HQ, H, D, DV, n=16, l=64, forced=None):
    g = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(B, T, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for h, d in ((HQ, D), (H, D), (H, DV)))
    idx = random_indices(B, T, H, n, l, seed=12, device="cuda") if forced is None else \
        forced_indices(B, T, H, n, l, *forced, seed=12, device="cuda")
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    o = sel_kernel.selection_attention_triton(*qk, idx, l, forced=forced)
    grads = torch.autograd.grad(o, qk, torch.randn_like(o))
    assert all(torch.isfinite(x).all() for x in (o, *grads))
    b, G = B - 1, HQ // H
    for t in (T - 1, T - 1000, T // 2 + 7):
        for h in range(H):
            js = idx[b, t, h][idx[b, t, h] >= 0].long()
            u = (js[:, None] * l + torch.arange(l, device="cuda")).flatten()
            u = u[u <= t]
            s = q[b, t, h * G:(h + 1) * G].float() @ k[b, u, h].float().T * D ** -0.5
            ref = torch.softmax(s, -1) @ v[b, u, h].float()
            assert rel_rmse(o[b, t, h * G:(h + 1) * G], ref) <= 1e-2


@pytest.mark.gpu
def test_compile_fullgraph_gpu(path):
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 512, h, 64, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2))
    idx = random_indices(1, 512, 2, 4, 64, seed=13, device="cuda")
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(_compiled_loss(*qk, idx, 64, "inductor"), qk)
    qe = [x.clone().requires_grad_() for x in (q, k, v)]
    grads_e = torch.autograd.grad((sel_kernel.selection_attention_triton(*qe, idx, 64).float() ** 2).sum(), qe)
    for a, b in zip(grads, grads_e):
        assert rel_rmse(a, b) <= 1e-2


@pytest.mark.gpu
def test_cuda_graph_capture_gpu(path):
    """No host sync in forward or backward: the whole step captures into a CUDA graph and replays to the same bits."""
    q, k, v = (torch.randn(1, 1024, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    idx = random_indices(1, 1024, 2, 8, 64, seed=15, device="cuda")
    do = torch.randn(1, 1024, 8, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        o = sel_kernel.selection_attention_triton(q, k, v, idx, 64)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        eager = step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = step()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)


HOPPER_CASES = [("query", 4, 128, True), ("query", 8, 128, True), ("query", 8, 64, False), ("auto", 16, 128, True),
                ("query", 16, 128, False), ("query", 32, 64, True), ("auto-split", 16, 64, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("path,G,D,ds", HOPPER_CASES, ids=[f"{p}-G{G}-D{D}-{'ds' if ds else 'recompute'}"
                                                           for p, G, D, ds in HOPPER_CASES])
def test_hopper_gpu(path, G, D, ds, monkeypatch):
    """The warp-specialised kernels: the dk/dv on the query path (G >= 8; G = 4 keeps Triton's) and, under "auto" at
    G = 16, the forward on union tiles (not where they split: "auto-split", which mixes the two) against the
    reference, one row and var-length, gated, with the score gradients written for the dq or not; and against the
    Triton kernels' outputs on the same input."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the warp-specialised kernels are Hopper's")
    if path == "auto-split":
        monkeypatch.setattr(sel_kernel, "UNION_MAX_T", dict(fwd=16, dq=16))
        monkeypatch.setattr(sel_kernel, "UNION_SPLIT", dict(fwd=0.5, dq=0.5))
        monkeypatch.setattr(sel_kernel, "SPLIT_MAX_L2", float("inf"))
    monkeypatch.setitem(sel_kernel.CONFIG, "path", path.split("-")[0])
    if not ds:
        monkeypatch.setattr(sel_kernel, "DS_MAX_BYTES", 0)
    ran = []  # the launchers of the Gluon kernels that ran
    for launcher in ("_ws_sel_dkv", "_ws_union_fwd"):
        monkeypatch.setattr(sel_kernel, launcher, lambda *a, f=getattr(sel_kernel, launcher), name=launcher:
                            ran.append(name) or f(*a))
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    for c in (None, cu):
        monkeypatch.setattr(nsa_kernels, "HOPPER_WS", True)
        ran.clear()
        out, ref = run_both(1, 2000, 2 * G, 2, D, D, 16, 64, torch.bfloat16, device="cuda", seed=G, cu_seqlens=c,
                            gated=True)
        assert ("_ws_sel_dkv" in ran, "_ws_union_fwd" in ran) == (G >= 8, path == "auto"), ran
        for name, a, b in zip(("o", "dq", "dk", "dv", "dgate"), out, ref):
            assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
        monkeypatch.setattr(nsa_kernels, "HOPPER_WS", False)
        ran.clear()
        triton_out, _ = run_both(1, 2000, 2 * G, 2, D, D, 16, 64, torch.bfloat16, device="cuda", seed=G,
                                 cu_seqlens=c, gated=True)
        assert not ran
        for name, a, b in zip(("o", "dq", "dk", "dv"), out[:4], triton_out[:4]):
            assert rel_rmse(a, b) <= 2e-3, f"{name} against Triton's: rel RMSE {rel_rmse(a, b):.2e}"
