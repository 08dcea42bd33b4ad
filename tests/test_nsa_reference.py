"""The PyTorch reference of NSA (nsa_attention.py) against its definition (the module docstring): causality, Eq. 8-11
block selection checked against the per-token form, equivalences with dense attention, var-length packing, float64
gradcheck, errors."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

import nsa_attention as N
from model import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: one thread is much faster on a busy CPU (conftest.py)


def rnd(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def dense_causal(q, k, v, scale=None):
    """Plain causal GQA attention with an explicit mask: the ground truth for the equivalence tests."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True, scale=scale)
    return o.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------- selection

@pytest.mark.parametrize("l,d,lsel,expect", [(32, 16, 64, [1, 2, 2, 2, 1]), (16, 8, 32, [1, 2, 2, 2, 1]),
                                             (16, 4, 16, [1, 2, 3, 4, 3, 2, 1]), (32, 32, 64, [1, 1])],
                         ids=["default", "l16-d8-ls32", "l16-d4-ls16", "no-overlap"])
def test_eq9_weights(l, d, lsel, expect):
    W = N.cmp_to_sel_weights(64, 8, l, d, lsel, "cpu")                        # (Tc, nb)
    col = W[:, 3]                                                              # an interior selection block
    nz = col.nonzero().flatten().tolist()
    assert col[nz].tolist() == expect
    assert nz == list(range(nz[0], nz[0] + len(expect)))
    assert torch.allclose(W.sum(1)[: (8 * lsel - l) // d], torch.full(((8 * lsel - l) // d,), l / d))


@pytest.mark.parametrize("l,d,ls", [(8, 4, 16), (32, 16, 64), (16, 16, 64), (32, 8, 32)], ids=lambda v: str(v))
def test_eq9_weights_are_the_papers_double_sum(l, d, ls):
    # the paper writes Eq. 9 as a double sum over m < l'/d and n < l/d; with this repo's indexing, selection block j
    # reads compressed block j*l'/d + m - n once per (m, n): the columns of cmp_to_sel_weights, exactly
    W = N.cmp_to_sel_weights(64, 16, l, d, ls, "cpu")                         # (Tc, nb)
    L, r = l // d, ls // d
    for j in range(1, 8):
        col = torch.zeros(64)
        for m in range(r):
            for n in range(L):
                col[j * r + m - n] += 1
        assert torch.equal(W[:, j], col), j


@pytest.mark.parametrize("l,d,lsel,n,n_init,n_local,G,T", [
    (8, 4, 16, 4, 1, 2, 2, 150), (16, 8, 32, 3, 1, 2, 3, 131), (8, 8, 8, 5, 2, 1, 1, 70), (4, 2, 8, 6, 0, 2, 4, 90)],
    ids=["small", "G3-odd-T", "no-overlap", "no-init"])
def test_select_blocks_matches_per_token_form(l, d, lsel, n, n_init, n_local, G, T):
    H, D = 2, 8
    q = rnd(1, T, H * G, D, seed=1) * 2
    k_cmp = rnd(1, N.num_cmp_blocks(T, l, d), H, D, seed=2)
    got = N.select_blocks(q, k_cmp, l, d, lsel, n, n_init, n_local)
    assert got.dtype == torch.int32 and got.shape == (1, T, H, n)
    assert torch.equal(got, N.select_blocks_per_token(q, k_cmp, l, d, lsel, n, n_init, n_local))


def test_select_blocks_forced_padding_order_and_group_sum():
    l, d, lsel, n, T, H, G, D = 8, 4, 16, 5, 200, 2, 4, 8
    q, k_cmp = rnd(2, T, H * G, D, seed=3), rnd(2, N.num_cmp_blocks(T, l, d), H, D, seed=4)
    idx = N.select_blocks(q, k_cmp, l, d, lsel, n)                             # n_init=1, n_local=2
    for t in [0, 15, 16, 17, 47, 48, 100, 199]:
        tb = t // lsel
        for h in range(H):
            row = idx[0, t, h].tolist()
            valid = [j for j in row if j >= 0]
            assert row == valid + [-1] * (n - len(valid))                      # valid first, then padding
            assert valid == sorted(valid) and len(set(valid)) == len(valid)   # ascending, no duplicates
            assert len(valid) == min(n, tb + 1) and max(valid) <= tb          # all candidates when fewer than n
            assert 0 in valid and tb in valid and (tb < 1 or tb - 1 in valid)  # forced initial and 2 local
    # Eq. 10: heads of a group share one index set, so permuting heads inside a group changes nothing
    perm = torch.cat([torch.randperm(G, generator=torch.Generator().manual_seed(h)) + h * G for h in range(H)])
    assert torch.equal(N.select_blocks(q[:, :, perm], k_cmp, l, d, lsel, n), idx)


def test_select_blocks_ties_go_to_lower_block():
    l, d, lsel, n, T = 8, 4, 16, 4, 160
    q = torch.zeros(1, T, 2, 8)                                                # uniform p: interior blocks tie
    idx = N.select_blocks(q, rnd(1, N.num_cmp_blocks(T, l, d), 1, 8, seed=5), l, d, lsel, n)
    # t = 159 sits in block 9: forced {0, 8, 9}; blocks 1..7 tie (each fully covered), so block 1 wins
    assert idx[0, T - 1, 0].tolist() == [0, 1, 8, 9]


# ---------------------------------------------------------------------------------------------------- equivalences

@pytest.mark.parametrize("T,G", [(1, 1), (37, 2), (130, 4), (200, 3)], ids=["T1", "T37-G2", "T130-G4", "T200-G3"])
def test_selection_of_every_block_equals_dense(T, G):
    lsel, H, D = 16, 2, 8
    q, k, v = rnd(2, T, H * G, D, seed=6), rnd(2, T, H, D, seed=7), rnd(2, T, H, 12, seed=8)
    nb = -(-T // lsel)
    idx = torch.arange(nb, dtype=torch.int32).expand(2, T, H, nb).contiguous()  # future ids are ignored
    torch.testing.assert_close(N.selection_attention(q, k, v, idx, lsel), dense_causal(q, k, v))


@pytest.mark.parametrize("T,w", [(5, 8), (100, 100), (100, 512)], ids=["T<w", "T=w", "default-w"])
def test_window_covering_everything_equals_dense(T, w):
    q, k, v = rnd(1, T, 4, 8, seed=9), rnd(1, T, 2, 8, seed=10), rnd(1, T, 2, 8, seed=11)
    torch.testing.assert_close(N.window_attention(q, k, v, w), dense_causal(q, k, v))


def test_window_is_a_band():
    T, w = 50, 7
    q, k, v = rnd(1, T, 2, 4, seed=12), rnd(1, T, 1, 4, seed=13), rnd(1, T, 1, 4, seed=14)
    s = torch.einsum("thd,ud->thu", q[0], k[0, :, 0]) / 2.0                   # (T, HQ, T)
    t, u = torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = s.masked_fill(~((u <= t) & (u > t - w))[:, None], float("-inf"))
    expect = torch.einsum("thu,ud->thd", s.softmax(-1), v[0, :, 0])
    torch.testing.assert_close(N.window_attention(q, k, v, w)[0], expect)


def test_rope_turns_each_pair_by_its_angle_and_keeps_relative_scores():
    B, T, H, D, theta = 2, 40, 3, 8, 500.0
    x = rnd(B, T, H, D, seed=15)
    pos = torch.arange(T) * 3 + 1
    ang = pos[:, None].double() * theta ** (-torch.arange(0, D, 2).double() / D)   # (T, D/2)
    z = torch.complex(*x.double().chunk(2, dim=-1)) * torch.polar(torch.ones_like(ang), ang)[None, :, None]
    torch.testing.assert_close(N.rope(x, pos, theta), torch.cat([z.real, z.imag], -1).float())
    q, k = rnd(1, 1, 1, D, seed=16).expand(1, T, 1, D), rnd(1, 1, 1, D, seed=17).expand(1, T, 1, D)
    s = (N.rope(q[:, 5:], torch.arange(5, T), theta) * N.rope(k[:, :-5], torch.arange(T - 5), theta)).sum(-1)
    torch.testing.assert_close(s, s[:, :1].expand_as(s))                          # depends on distance alone


def test_compressed_hand_computed():
    # l = 4, d = 2, T = 7: blocks end at 3, 5 -> Tc = 2; queries 0..2 see none, 3..4 see block 0, 5..6 both.
    q = torch.ones(1, 7, 1, 2)
    k_cmp = torch.tensor([[[[0.0, 0.0]], [[math.sqrt(2) * math.log(3.0) / 2, math.sqrt(2) * math.log(3.0) / 2]]]])
    v_cmp = torch.tensor([[[[1.0, 0.0]], [[0.0, 1.0]]]])                      # (1, Tc=2, 1, 2)
    o, lse = N.compressed_attention(q, k_cmp, v_cmp, 4, 2)
    # scores with scale 1/sqrt(2): block 0 -> 0, block 1 -> log 3, so p = (1/4, 3/4) once both are visible
    expect = torch.tensor([[0, 0], [0, 0], [0, 0], [1, 0], [1, 0], [0.25, 0.75], [0.25, 0.75]])
    torch.testing.assert_close(o[0, :, 0], expect)
    torch.testing.assert_close(lse[0, :, 0], torch.tensor([float("-inf")] * 3 + [0.0, 0.0] + [math.log(4.0)] * 2))
    assert lse.dtype == torch.float32


def test_compress_blocks_and_varlen_offsets():
    x = torch.arange(20.0).view(1, 20, 1, 1)                                   # value = position
    phi = lambda blocks: blocks.sum(-1, keepdim=True)                          # (.., l*D) -> sum of the block
    out, cu = N.compress(x, torch.zeros(4, 1), phi, 4, 2)
    assert cu is None and out.shape == (1, 9, 1, 1)                            # Tc = (20 - 4) // 2 + 1
    assert out.flatten().tolist() == [sum(range(2 * i, 2 * i + 4)) for i in range(9)]
    cu_seqlens = torch.tensor([0, 3, 11, 20], dtype=torch.int32)               # lengths 3, 8, 9 -> Tc 0, 3, 3
    out, cu = N.compress(x, torch.zeros(4, 1), phi, 4, 2, cu_seqlens)
    assert cu.tolist() == [0, 0, 3, 6] and out.shape == (1, 10, 1, 1)         # static Tc = T // d, 4 padding
    assert out[:, :6].flatten().tolist() == [sum(range(s, s + 4)) for s in [3, 5, 7, 11, 13, 15]]


@pytest.mark.parametrize("l,d", [(4, 2), (8, 4), (6, 2), (6, 4)])
@pytest.mark.parametrize("T", [5, 8, 21])
def test_compress_is_eq7_block_by_block(l, d, T):
    # phi = identity shows each block as compress built it: tokens i*d .. i*d + l - 1 in order plus the position
    # embedding (l a multiple of d or not); the gradient reaches each token once per block that holds it; one packed
    # sequence gives the same blocks, also when it is shorter than a block (its padding blocks read inside x)
    x = torch.randn(2, T, 2, 3, dtype=torch.float64, requires_grad=True)
    pos_emb = torch.randn(l, 3, dtype=torch.float64, requires_grad=True)
    out, _ = N.compress(x, pos_emb, lambda blocks: blocks, l, d)               # (2, Tc, 2, l*3)
    Tc = N.num_cmp_blocks(T, l, d)
    assert out.shape == (2, Tc, 2, l * 3)
    if Tc:
        want = torch.stack([(x[:, i * d:i * d + l] + pos_emb[:, None]).transpose(1, 2).flatten(2)
                            for i in range(Tc)], 1)                            # (2, Tc, 2, l*3)
        w = torch.randn_like(out)
        assert torch.equal(out, want)
        dx, dpos = torch.autograd.grad((out * w).sum(), (x, pos_emb))
        assert torch.allclose(dx, torch.autograd.grad((want * w).sum(), x)[0])
        assert torch.allclose(dpos, w.unflatten(-1, (l, 3)).sum((0, 1, 2)))
    packed, cu = N.compress(x[:1], pos_emb, lambda blocks: blocks, l, d, torch.tensor([0, T], dtype=torch.int32))
    assert cu.tolist() == [0, Tc] and torch.equal(packed[:, :Tc], out[:1])


# ---------------------------------------------------------------------------------------------------- causality

def nsa_config(**kw):
    base = dict(n_embd=32, n_head=4, n_kv_head=2, cmp_block=8, cmp_stride=4, sel_block=16, n_select=3, window=24,
                cmp_hidden=16, backend="torch")
    base.update(kw)
    return GPTConfig(**base)


def branches(q, k, v, cu_seqlens=None):
    """Every public op on one set of inputs (compressed keys built from k by mean-pooling blocks)."""
    l, d = 8, 4
    pool = lambda blocks: blocks.unflatten(-1, (l, blocks.shape[-1] // l)).mean(-2)  # (.., l*D) -> (.., D)
    k_cmp, cu_cmp = N.compress(k, torch.zeros(l, k.shape[-1]), pool, l, d, cu_seqlens)
    v_cmp, _ = N.compress(v, torch.zeros(l, v.shape[-1]), pool, l, d, cu_seqlens)
    o_cmp, lse = N.compressed_attention(q, k_cmp, v_cmp, l, d, cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp)
    idx = N.select_blocks(q, k_cmp, l, d, 16, 3, cu_seqlens=cu_seqlens, cu_seqlens_cmp=cu_cmp)
    return {"cmp": o_cmp, "lse": lse, "idx": idx, "slc": N.selection_attention(q, k, v, idx, 16, cu_seqlens=cu_seqlens),
            "win": N.window_attention(q, k, v, 24, cu_seqlens=cu_seqlens)}


@pytest.mark.parametrize("varlen", [False, True], ids=["dense-batch", "varlen"])
def test_causality_of_every_branch_and_the_module(varlen):
    T = 90
    cu = torch.tensor([0, 37, 37, 90], dtype=torch.int32) if varlen else None
    q, k, v = rnd(1, T, 4, 8, seed=15), rnd(1, T, 2, 8, seed=16), rnd(1, T, 2, 8, seed=17)
    layer = N.NSAAttention(nsa_config())
    torch.nn.init.normal_(layer.gate[-1].weight)
    x = rnd(1, T, 32, seed=18)
    base = branches(q, k, v, cu)
    base["module"] = layer(x, cu)
    for t in [0, 7, 15, 36, 37, 50, 88]:
        bump = lambda a, s: torch.cat([a[:, : t + 1], a[:, t + 1:] + rnd(*a[:, t + 1:].shape, seed=s)], 1)
        new = branches(bump(q, 19), bump(k, 20), bump(v, 21), cu)
        new["module"] = layer(bump(x, 22), cu)
        for name in base:
            assert torch.equal(base[name][:, : t + 1], new[name][:, : t + 1]), (name, t)
        assert not torch.equal(base["module"], new["module"])                 # the bump did reach the future


# ---------------------------------------------------------------------------------------------------- var-length

def test_varlen_packed_equals_each_sequence_alone():
    lens = [5, 0, 40, 77]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    T = int(cu[-1])
    q, k, v = rnd(1, T, 4, 8, seed=23), rnd(1, T, 2, 8, seed=24), rnd(1, T, 2, 8, seed=25)
    packed = branches(q, k, v, cu)
    layer = N.NSAAttention(nsa_config())
    torch.nn.init.normal_(layer.gate[-1].weight)
    x = rnd(1, T, 32, seed=26)
    packed_module = layer(x, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = branches(q[:, a:b], k[:, a:b], v[:, a:b])
        for name in alone:
            torch.testing.assert_close(packed[name][:, a:b], alone[name], atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(packed_module[:, a:b], layer(x[:, a:b]), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- gradients

def test_gradcheck_each_branch_float64():
    T, HQ, H, D = 21, 4, 2, 4
    q, k, v = (rnd(1, T, h, D, dtype=torch.float64, seed=s).requires_grad_() for h, s in [(HQ, 27), (H, 28), (H, 29)])
    idx = N.select_blocks(q.detach(), rnd(1, N.num_cmp_blocks(T, 4, 2), H, D, dtype=torch.float64, seed=30),
                          4, 2, 8, 3)
    kc, vc = (rnd(1, N.num_cmp_blocks(T, 4, 2), H, D, dtype=torch.float64, seed=s).requires_grad_() for s in (31, 32))
    assert torch.autograd.gradcheck(lambda q, k, v: N.selection_attention(q, k, v, idx, 8), (q, k, v), fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, k, v: N.window_attention(q, k, v, 5), (q, k, v), fast_mode=True)
    assert torch.autograd.gradcheck(lambda q, k, v: N.compressed_attention(q, k, v, 4, 2)[0], (q, kc, vc), fast_mode=True)


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_gradcheck_module_and_gate_float64(gate, monkeypatch):
    # every element of the Jacobians (fast_mode's random projection misses a wrong gate gradient, measured), so the
    # layer is small: 13 tokens of width 8 still see compressed blocks, two selection blocks and a full window
    layer = N.NSAAttention(nsa_config(n_embd=8, n_head=2, n_kv_head=1, cmp_block=4, cmp_stride=2, sel_block=8,
                                      n_select=3, window=6, cmp_hidden=8, gate=gate)).double()
    torch.nn.init.normal_(layer.gate[-1].weight)
    x = rnd(1, 13, 8, dtype=torch.float64, seed=33).requires_grad_()
    assert torch.autograd.gradcheck(layer, (x,))
    gate_w = layer.gate[-1].weight.detach().clone().requires_grad_()          # the gate's own parameters too
    of_gate = lambda w: torch.func.functional_call(layer, {"gate.2.weight": w}, (x.detach(),))
    assert torch.autograd.gradcheck(of_gate, (gate_w,))
    mix = N.gated                                                              # and the check can fail: the same
    monkeypatch.setattr(N, "gated", lambda o, g, dt: mix(o, g, dt) + (g - g.detach())[..., None] * o)  # values,
    assert not torch.autograd.gradcheck(of_gate, (gate_w,), raise_exception=False)   # twice the gate's gradient


def test_gate_starts_even_and_zero_initialised():
    for gate, expect in [("softmax", 1 / 3), ("sigmoid", 0.5)]:
        layer = N.NSAAttention(nsa_config(gate=gate))
        assert torch.count_nonzero(layer.gate[-1].weight) == 0
        g = layer.gate(rnd(1, 5, 32, seed=34)).view(1, 5, 4, 3)
        act = g.softmax(-1) if gate == "softmax" else g.sigmoid()
        torch.testing.assert_close(act, torch.full_like(act, expect))


def test_record_keeps_gate_and_gated_branch_outputs_that_rebuild_the_output():
    layer = N.NSAAttention(nsa_config())
    torch.nn.init.normal_(layer.gate[-1].weight)
    x = rnd(1, 40, 32, seed=35)
    layer.record = True
    y = layer(x)
    rec = layer.recorded
    mix = rec["cmp"] + rec["slc"] + rec["win"]                                # (1, 40, 4, 8), Eq. 5
    torch.testing.assert_close(layer.wo(mix.reshape(1, 40, 32)), y)
    q = layer._project(x, torch.arange(40))[0]                                 # the window branch, ungated
    k_win, v_win = layer._project(x, torch.arange(40))[5:]
    o_win = N.window_attention(q, k_win, v_win, layer.cfg.window)
    torch.testing.assert_close(rec["win"], rec["gate"][..., 2:3] * o_win)
    torch.testing.assert_close(rec["gate"].sum(-1), torch.ones(1, 40, 4))    # softmax over the three branches


# ---------------------------------------------------------------------------------------------------- bad input

def test_errors_name_the_argument():
    q, k, v = rnd(1, 10, 4, 8), rnd(1, 10, 2, 8), rnd(1, 10, 2, 8)
    idx = torch.zeros(1, 10, 2, 3, dtype=torch.int32)
    cases = [
        (lambda: N.window_attention(q[0], k, v, 4), "q must be"),
        (lambda: N.window_attention(q, rnd(1, 10, 3, 8), rnd(1, 10, 3, 8), 4), "multiple of H"),
        (lambda: N.window_attention(q, k, v.double(), 4), "v must match"),
        (lambda: N.window_attention(q, k, rnd(1, 10, 1, 8), 4), "v must be"),
        (lambda: N.window_attention(q, rnd(1, 10, 2, 6), v, 4), "k must be"),
        (lambda: N.window_attention(q, k, v, 0), "window must be a positive int"),
        (lambda: N.window_attention(q, k, v, 4, scale=-0.5), "scale must be a positive number"),
        (lambda: N.selection_attention(q, k, v, idx, 16, scale=float("nan")), "scale must be a positive number"),
        (lambda: N.window_attention(q, k, v, 4, backend="cuda"), "backend must be"),
        (lambda: N.selection_attention(q, k, v, idx.long(), 16), "block_indices must be an int32"),
        (lambda: N.selection_attention(q, k, v, idx[:, :5], 16), "block_indices must be (B, T, H, n)"),
        (lambda: N.selection_attention(q, k, v, idx, 16, forced=1), "forced must be (n_init, n_local) or None"),
        (lambda: N.selection_attention(q, k, v, idx, 16, forced=(1, -2)), "n_init and n_local must be ints >= 0"),
        (lambda: N.window_attention(q, k, v, 4, gate=rnd(1, 10, 2)), "gate must be a floating tensor (B, T, HQ)"),
        (lambda: N.compressed_attention(q, k[:, :4], v[:, :4], 4, 2, gate=idx[..., 0]), "gate must be a floating"),
        (lambda: N.select_blocks(q, k, 32, 12, 64, 4), "cmp_stride must divide cmp_block"),
        (lambda: N.select_blocks(q, k, 32, 16, 40, 4), "cmp_stride must divide sel_block"),
        (lambda: N.select_blocks(q, k, 64, 16, 32, 4), "cmp_block must be <= sel_block"),
        (lambda: N.select_blocks(q, k, 32, 16, 64, 2), "n_select must be >= n_init + n_local"),
        (lambda: N.compressed_attention(q, k, v, 4, 2), "k_cmp has 10 blocks"),
        (lambda: N.window_attention(q, k, v, 4, cu_seqlens=torch.tensor([0, 10])), "cu_seqlens must be a 1-D int32"),
        (lambda: N.window_attention(q, k, v, 4, cu_seqlens=torch.tensor([1, 10], dtype=torch.int32)), "start at 0"),
        (lambda: N.window_attention(q, k, v, 4, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32)),
         "non-decreasing"),
        (lambda: N.window_attention(q, k, v, 4, cu_seqlens=torch.tensor([0, 9], dtype=torch.int32)), "end at T=10"),
        (lambda: N.window_attention(rnd(2, 10, 4, 8), rnd(2, 10, 2, 8), rnd(2, 10, 2, 8), 4,
                                    cu_seqlens=torch.tensor([0, 10], dtype=torch.int32)), "B == 1"),
        (lambda: N.NSAAttention(nsa_config(n_head=3)), "n_embd % n_head"),
        (lambda: N.NSAAttention(nsa_config(gate="relu")), "gate must be"),
        (lambda: N.NSAAttention(nsa_config(window=-1)), "window must be a positive int"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=re.escape(msg)):
            fn()


@pytest.mark.slow
def test_long_sequence_rows_match_direct_computation():
    """T = 8192 at the default l, d, l', n, w: spot rows of each branch against attention written out for that row."""
    T, HQ, H, D = 8192, 4, 2, 16
    q, k, v = rnd(1, T, HQ, D, seed=40), rnd(1, T, H, D, seed=41), rnd(1, T, H, D, seed=42)
    k_cmp = rnd(1, N.num_cmp_blocks(T, 32, 16), H, D, seed=43)
    idx = N.select_blocks(q, k_cmp, 32, 16, 64, 16)
    o_slc, o_win = N.selection_attention(q, k, v, idx, 64), N.window_attention(q, k, v, 512)
    o_cmp, _ = N.compressed_attention(q, k_cmp, k_cmp, 32, 16)
    for t in [5000, T - 1]:
        for hq in [0, HQ - 1]:
            h = hq // (HQ // H)
            keys = torch.cat([torch.arange(j * 64, min(j * 64 + 64, t + 1)) for j in idx[0, t, h].tolist() if j >= 0])
            row = lambda kk, vv: torch.softmax(kk @ q[0, t, hq] / 4.0, 0) @ vv
            torch.testing.assert_close(o_slc[0, t, hq], row(k[0, keys, h], v[0, keys, h]))
            torch.testing.assert_close(o_win[0, t, hq], row(k[0, t - 511: t + 1, h], v[0, t - 511: t + 1, h]))
            nc = (t + 1 - 32) // 16 + 1                                        # blocks ending at or before t
            torch.testing.assert_close(o_cmp[0, t, hq], row(k_cmp[0, :nc, h], k_cmp[0, :nc, h]))
