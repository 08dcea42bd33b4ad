"""Tests of the key-centric selection path of sel_kernel.py (CONFIG["path"] = "key"): forward and every gradient
against the PyTorch reference in nsa_attention.py, and against the query-centric path (same o, same base-2 lse, so
either backward can follow either forward). On CPU the kernels run in the Triton interpreter with small tiles and
chunks, so a block's list of pairs spans several chunks and tiles; tests marked gpu run bf16 on CUDA."""
import pytest
import torch

import nsa_attention
import sel_kernel
from test_sel_kernel import _compiled_loss, random_indices, rel_rmse, run_both

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def key_path(monkeypatch):
    """Every test runs the key-centric path; on CPU with 16-row tiles and 32-row chunks (several per block)."""
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "key")
    if not CUDA:
        monkeypatch.setitem(sel_kernel.CONFIG, "key_fwd", dict(sel_kernel.CONFIG["key_fwd"], rows=16, chunk_rows=32))
        monkeypatch.setitem(sel_kernel.CONFIG, "key_bwd", dict(sel_kernel.CONFIG["key_bwd"], rows=16))
        monkeypatch.setattr(sel_kernel, "CHUNK_ROWS", 32)


def fwd_lse(q, k, v, idx, l, cu_seqlens=None):
    """o and the saved base-2 lse (what the backward reads) of the forward op."""
    return sel_kernel.sel_attn_fwd(q, k, v, idx, l, q.shape[3] ** -0.5, cu_seqlens)


def randn(*shapes, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).to(device=device, dtype=dtype) for s in shapes]


# (B, T, HQ, H, D, DV, n, sel_block, dtype): G = 1, 2, 3, 4, 8; T < l', T not a multiple of l'; D != Dv; l' = 48
# (one 64-key tile, partly masked); D = 160 (two 32-key sub-blocks per block, merged as separate partials)
CPU_CASES = {
    "G1-D32-T40-B2-fp32": (2, 40, 2, 2, 32, 32, 3, 16, torch.float32),
    "G2-D32-T33-fp16": (1, 33, 4, 2, 32, 32, 2, 16, torch.float16),
    "G3-D48-Dv32-T37-fp32": (1, 37, 3, 1, 48, 32, 3, 16, torch.float32),
    "G4-D64-T20<l'-fp16": (1, 20, 4, 1, 64, 64, 2, 32, torch.float16),
    "G8-D32-Dv48-T50-n4-fp32": (1, 50, 8, 1, 32, 48, 4, 16, torch.float32),
    "G2-lsel48-T100-fp32": (1, 100, 2, 1, 32, 32, 2, 48, torch.float32),
    "G1-D160-2subblocks-T70-fp32": (1, 70, 2, 2, 160, 32, 3, 64, torch.float32),
}


@pytest.mark.parametrize("case", CPU_CASES.values(), ids=CPU_CASES.keys())
def test_matches_reference_cpu(case):
    *shape, dtype = case
    out, ref = run_both(*shape, dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert a.dtype == dtype and a.shape == b.shape
        assert rel_rmse(a, b) <= tol, f"{name}: rel RMSE {rel_rmse(a, b):.2e} > {tol}"


def test_default_launch_config_matches_reference(monkeypatch):
    """The GPU's tile and chunk sizes (one chunk per block here) give the same answer."""
    monkeypatch.undo()
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "key")
    out, ref = run_both(1, 45, 4, 2, 32, 32, 3, 16, torch.float32, seed=3)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.parametrize("G", [1, 3])
def test_same_o_and_lse_as_query_path(G, monkeypatch):
    """o and the saved lse equal the query-centric forward's (fp32 rounding apart), and each backward run after
    the other path's forward gives the reference gradients: the two paths share their conventions."""
    B, T, H, D, n, l = 1, 53, 2, 32, 3, 16
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


def test_varlen_matches_reference_and_separate_runs():
    cu = torch.tensor([0, 13, 13, 50, 77], dtype=torch.int32)  # an empty sequence, lengths not multiples of l'
    out, ref = run_both(1, 77, 4, 2, 32, 32, 3, 16, torch.float32, cu_seqlens=cu, seed=1)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"
    q, k, v = randn((1, 77, 4, 32), (1, 77, 2, 32), (1, 77, 2, 32), seed=2)
    idx = random_indices(1, 77, 2, 3, 16, seed=3, cu_seqlens=cu)
    o, lse = fwd_lse(q, k, v, idx, 16, cu)
    for a, b in ((0, 13), (13, 50), (50, 77)):  # each sequence alone gives the same rows: no read crosses a start
        o_alone, lse_alone = fwd_lse(q[:, a:b], k[:, a:b], v[:, a:b], idx[:, a:b], 16)
        assert torch.equal(o[:, a:b], o_alone) and torch.equal(lse[:, a:b], lse_alone)


def test_no_unwritten_outputs_nan_poison(monkeypatch):
    """Every buffer the op allocates (partials included) starts as NaN (ints as a huge negative): the outputs, the
    saved lse and the grads must still be finite and right, so no unwritten partial is ever read."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(x):
        return x.fill_(float("nan")) if x.is_floating_point() else x.fill_(-(1 << 30))

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
    out, ref = run_both(1, 45, 6, 2, 32, 32, 4, 16, torch.float32, seed=4)  # G = 3: rows g >= G masked
    q, k, v = randn((1, 45, 6, 32), (1, 45, 2, 32), (1, 45, 2, 32), seed=4)
    _, lse = fwd_lse(q, k, v, random_indices(1, 45, 2, 4, 16, seed=4), 16)
    monkeypatch.undo()
    assert torch.isfinite(lse).all()
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert torch.isfinite(a).all(), f"{name} has unwritten (NaN) elements"
        assert rel_rmse(a, b) <= 1e-5, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


def test_deterministic_two_runs_bit_identical():
    a, _ = run_both(1, 40, 4, 1, 32, 32, 4, 16, torch.float32, seed=5)
    b, _ = run_both(1, 40, 4, 1, 32, 32, 4, 16, torch.float32, seed=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_out_of_range_and_repeated_ids_ignored_no_future_reads():
    """Ids past t // l', below -1, far outside the tensor, or repeated change nothing; NaN keys from the first
    block after the first half never reach the first half's outputs or dq."""
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
    half = 2 * l
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


def test_varlen_never_reads_the_next_sequence():
    """A sequence ending inside a block (40 = 2.5 blocks): NaN keys of the next sequence reach none of its outputs
    or gradients."""
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


def test_query_with_no_key_gives_zero_and_minus_inf_lse():
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


def test_empty_inputs():
    """T = 0 and n = 0: no launch, o = 0 and zero gradients of the right shapes."""
    for T, n in ((0, 3), (20, 0)):
        qk = [torch.randn(1, T, h, 32, requires_grad=True) for h in (4, 2, 2)]
        o = sel_kernel.selection_attention_triton(*qk, torch.zeros(1, T, 2, n, dtype=torch.int32), 16)
        grads = torch.autograd.grad(o.sum(), qk, allow_unused=True)
        assert o.shape == (1, T, 4, 32) and (o == 0).all()
        assert all(g.shape == x.shape and (g == 0).all() for g, x in zip(grads, qk))


def test_auto_rule_and_bad_path(monkeypatch):
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "auto")
    G, NT = sel_kernel.KEY_MAX_G, sel_kernel.KEY_MIN_TOKENS
    assert sel_kernel._key_path(G, NT) and sel_kernel._key_path(1, NT)
    assert not sel_kernel._key_path(G + 1, NT) and not sel_kernel._key_path(1, NT - 1)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "query")
    assert not sel_kernel._key_path(1, NT)
    monkeypatch.setitem(sel_kernel.CONFIG, "path", "keys")
    with pytest.raises(ValueError, match="'auto', 'query' or 'key'"):
        sel_kernel._key_path(1, NT)


def test_compile_fullgraph_cpu():
    torch._dynamo.reset()
    q, k, v = randn((1, 24, 4, 32), (1, 24, 2, 32), (1, 24, 2, 32), seed=9)
    idx = random_indices(1, 24, 2, 2, 16, seed=9)
    qk = [x.clone().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad(_compiled_loss(*qk, idx, 16, "aot_eager"), qk)  # fullgraph: no graph break
    qe = [x.clone().requires_grad_() for x in (q, k, v)]
    for a, b in zip(grads, torch.autograd.grad((sel_kernel.selection_attention_triton(*qe, idx, 16) ** 2).sum(), qe)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# GPU (run on the device; skipped without CUDA)

GPU_CASES = [(G, D, DV, torch.bfloat16) for G, D, DV in ((1, 128, 128), (2, 64, 64), (3, 64, 32), (4, 128, 128),
                                                          (8, 64, 64), (4, 256, 192), (1, 16, 16))] + \
            [(4, 128, 128, torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("G,D,DV,dtype", GPU_CASES, ids=[f"G{G}-D{D}-Dv{DV}-{str(dt)[6:]}" for G, D, DV, dt in GPU_CASES])
def test_matches_reference_gpu(G, D, DV, dtype):
    H = 2
    out, ref = run_both(1, 1000, H * G, H, D, DV, 16, 64, dtype, device="cuda", seed=G + D)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
def test_varlen_gpu():
    cu = torch.tensor([0, 300, 300, 1111, 2000], dtype=torch.int32, device="cuda")
    out, ref = run_both(1, 2000, 8, 4, 128, 128, 16, 64, torch.bfloat16, device="cuda", cu_seqlens=cu)
    for name, a, b in zip(("o", "dq", "dk", "dv"), out, ref):
        assert rel_rmse(a, b) <= 1e-2, f"{name}: rel RMSE {rel_rmse(a, b):.2e}"


@pytest.mark.gpu
def test_deterministic_gpu():
    a, _ = run_both(1, 8192, 4, 1, 128, 128, 16, 64, torch.bfloat16, device="cuda", seed=11)
    b, _ = run_both(1, 8192, 4, 1, 128, 128, 16, 64, torch.bfloat16, device="cuda", seed=11)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.gpu
def test_64bit_partial_offsets_gpu():
    """T = 131072, G = 1, H = 4, n = 16, D = 128: the (token, head, slot) partials hold 2^32 elements, so rows near
    the end sit past 2^31; they must equal a direct fp32 computation (and every gradient stays finite)."""
    from test_sel_kernel import check_long
    check_long(1, 131072, 4, 4, 128, 128)


@pytest.mark.gpu
def test_compile_and_cuda_graph_gpu():
    """torch.compile(fullgraph=True) and CUDA-graph capture of forward + backward: same as eager, replay bit-equal."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 1024, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2))
    idx = random_indices(1, 1024, 2, 8, 64, seed=15, device="cuda")
    grads = torch.autograd.grad(_compiled_loss(q, k, v, idx, 64, "inductor"), (q, k, v))
    grads_e = torch.autograd.grad((sel_kernel.selection_attention_triton(q, k, v, idx, 64).float() ** 2).sum(), (q, k, v))
    for a, b in zip(grads, grads_e):
        assert rel_rmse(a, b) <= 1e-2
    do = torch.randn(1, 1024, 4, 64, device="cuda", dtype=torch.bfloat16)

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
