"""Decode tests: the cached one-token step (nsa_attention.py's decode section, model.py's GPT.prefill / decode_step)
against forward's logits, the per-branch read counters against (nsa_attention.py, "Decode reads"), the step's block
selection against select_blocks, a 64k needle built by hand in the cache, a compiled step that does not recompile, and
the Triton step against the torch one. CPU, fp32, fixed seeds."""
import pytest
import torch

import nsa_attention as nsa
from model import GPT, GPTConfig, PRESETS

TINY = dict(PRESETS["tiny"], backend="torch")  # l=8, d=4, l'=16, n=4, w=32


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def make_model(attn, seed=0, **over):
    """Tiny fp32 GPT with sharper q/k (so top-n is far from ties) and a random gate (so all three branches mix)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, "attn": attn, **over})).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(4.0)
            block.attn.wkv.weight.mul_(4.0)
            if attn == "nsa":
                torch.nn.init.normal_(block.attn.gate[-1].weight, std=0.5)
    return model


def decode_vs_forward(model, lengths, total):
    """Prefill right-padded prompts of the given lengths, then decode each row up to `total` tokens, feeding the
    same tokens that one forward pass over all `total` saw. Returns the max |logit error| of prefill and of decode."""
    torch.manual_seed(1)
    B, T = len(lengths), max(lengths)
    tokens = torch.randint(0, model.config.vocab_size, (B, total))
    lengths = torch.tensor(lengths)
    rows = torch.arange(B)
    with torch.no_grad():
        ref = model(tokens)[0]                                                 # (B, total, vocab)
        model.setup_cache(B, total)
        pre = model.prefill(tokens[:, :T], lengths)
        err_pre = max((pre[b, :n] - ref[b, :n]).abs().max().item() for b, n in enumerate(lengths.tolist()))
        err_dec, pos = 0.0, lengths
        while int(pos.max()) < total:
            p = pos.clamp_max(total - 1)                                       # rows that are done repeat their last
            logits = model.decode_step(tokens[rows, p], p)                    # (B, vocab)
            err_dec = max(err_dec, (logits - ref[rows, p]).abs().max().item())
            pos = pos + 1
    return err_pre, err_dec


@pytest.mark.parametrize("attn", ["nsa", "dense"])
def test_decode_equals_prefill_ragged(attn):
    # rows: T < l (5), a prompt ending mid-stride (13), one past an emission (21); decoding to 100 > w = 32 and
    # > n*l' = 64 crosses every compressed emission, the window ring wrap and selections with fewer blocks than
    # exist; a row prefilled past its position is rewritten when decode reaches it
    model = make_model(attn)
    err_pre, err_dec = decode_vs_forward(model, [5, 13, 21], 100)
    assert err_pre < 1e-5, err_pre
    assert err_dec < 1e-4, err_dec


def test_decode_equals_prefill_long_prompt_sigmoid_gate():
    # a prompt longer than the window and n*l' (prefill fills the rings from each row's own end), sigmoid gate,
    # n_init=0 and n_local=1
    model = make_model("nsa", seed=3, gate="sigmoid", n_init=0, n_local=1)
    err_pre, err_dec = decode_vs_forward(model, [70, 37], 90)
    assert err_pre < 1e-5 and err_dec < 1e-4, (err_pre, err_dec)


def test_decode_selection_is_sparse_in_that_test():
    # the equality above is only worth something if selection really dropped blocks at some step
    model = make_model("nsa")
    B, S = 1, 100
    with torch.no_grad():
        model.setup_cache(B, S)
        model.prefill(torch.randint(0, 257, (1, 90)), torch.tensor([90]))
        model.decode_step(torch.tensor([3]), torch.tensor([90]))
    reads = model.decode_reads()                                               # (n_layer, B, H, 3)
    assert (reads[..., 1] == 3 * 16 + 11).all()                                # n - 1 full blocks + 11 of block 5
    assert (reads[..., 1] < 91).all()


def test_select_step_equals_select_blocks():
    # decode_select (one position per row, p from the compressed branch) == select_blocks at every position
    torch.manual_seed(0)
    l, d, ls, n = 8, 4, 16, 4
    T, H, G, D = 150, 2, 2, 8
    q = torch.randn(1, T, H * G, D) * 2
    k_cmp = torch.randn(1, nsa.num_cmp_blocks(T, l, d), H, D) * 2
    for n_init, n_local in [(1, 2), (0, 1), (2, 0)]:
        ref = nsa.select_blocks(q, k_cmp, l, d, ls, n, n_init, n_local, backend="torch")[0]   # (T, H, n)
        pos = torch.arange(T)
        kc = k_cmp.transpose(1, 2).expand(T, -1, -1, -1)                       # (T, H, Tc, D): row = position
        _, p, _ = nsa.decode_compressed(q[0], kc, kc, pos, l, d, D ** -0.5)
        got, _ = nsa.decode_select(p, pos, l, d, ls, n, n_init, n_local, -(-T // ls))
        assert torch.equal(got, ref), (n_init, n_local)


def test_counters_equal_decode_reads_over_S_sweep():
    # one NSA layer, the step at every S = 1 .. 140: crosses T < l, every compressed emission, the window (32),
    # n*l' (64) and selection-block edges; reads per KV group = (Tc(S), selected, min(w, S)) exactly
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    attn = nsa.NSAAttention(cfg).eval()
    S_max, B = 140, 2
    x = torch.randn(B, S_max, cfg.n_embd)
    with torch.no_grad():
        attn.setup_cache(B, S_max)
        attn.prefill(x[:, :1], torch.tensor([1, 1]))
        for S in range(1, S_max + 1):
            pos = torch.full((B,), S - 1)
            if S > 1:
                attn.decode(x[:, S - 1:S], pos)
            else:
                attn.decode(x[:, :1], pos)                                     # position 0 again: same token
            want = nsa.decode_reads(S, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.n_select, cfg.window)
            got = attn.kv_cache.reads                                          # (B, H, 3)
            assert (got == torch.tensor(want)).all(), (S, got[0, 0].tolist(), want)
            assert got[0, 0, 1] <= cfg.n_select * cfg.sel_block


def test_counters_table4_at_64k():
    # "Decode reads": Tc + n*l' + w = 4095 + 1024 + 512 at S = 65536 with the paper's defaults (11.6x fewer than dense)
    c, s, w = nsa.decode_reads(65536, 32, 16, 64, 16, 512)
    assert (c, s, w) == (4095, 1024, 512)
    assert 65536 / (c + s + w) > 11.6


def needle_cache(S=65536, H=2, G=2, D=16, needle=3000, seed=0):
    """Hand-built 64k cache: noise everywhere, and one selection block (the one holding `needle`) whose compressed
    keys and the needle's raw key point along q, with a distinctive value."""
    l, d, ls = 32, 16, 64
    torch.manual_seed(seed)
    Tc = nsa.num_cmp_blocks(S, l, d)
    q = torch.zeros(1, H * G, D)
    q[..., 0] = 4.0                                                            # every head looks along e_0
    k_cmp = torch.randn(1, H, Tc, D) * 0.3
    v_cmp = torch.randn(1, H, Tc, D)
    j = needle // ls
    inside = [i for i in range(Tc) if i * d >= j * ls and i * d + l <= (j + 1) * ls]
    k_cmp[:, :, inside, 0] = 6.0                                               # high compressed score for block j
    k = torch.randn(1, H, S, D) * 0.3
    v = torch.randn(1, H, S, D)
    k[:, :, needle, 0] = 12.0
    v[:, :, needle] = 5.0                                                      # the needle's value: all 5
    return q, k_cmp, v_cmp, k, v, j


def test_needle_64k_selected_at_every_later_position():
    S, needle, l, d, ls, n = 65536, 3000, 32, 16, 64, 16
    q, k_cmp, v_cmp, k, v, j = needle_cache(S, needle=needle)
    D = q.shape[-1]
    first = (j + 1) * ls + 2 * ls                                              # past the needle's own forced window
    # positions after it: the first 256, every 37th, the last 256 (every one would copy k_cmp per row: too slow)
    later = torch.cat([torch.arange(first, first + 256), torch.arange(first, S, 37), torch.arange(S - 256, S)])
    for chunk in later.unique().split(128):
        P = chunk.numel()
        qe = q.expand(P, -1, -1)
        _, p, _ = nsa.decode_compressed(qe, k_cmp.expand(P, -1, -1, -1), v_cmp.expand(P, -1, -1, -1), chunk, l, d,
                                        D ** -0.5)
        idx, score = nsa.decode_select(p, chunk, l, d, ls, n, 1, 2, -(-S // ls))
        assert (idx == j).any(-1).all(), "needle block not selected"
        top2 = score[..., :j + 1].topk(2, dim=-1).indices
        assert (top2 == j).any(-1).all()                                       # its score is among the top two
    # and the selected branch attends to it: o ~ the needle's value at a few far positions
    pos = torch.tensor([first, 20000, 40000, S - 1])
    P = pos.numel()
    _, p, _ = nsa.decode_compressed(q.expand(P, -1, -1), k_cmp.expand(P, -1, -1, -1), v_cmp.expand(P, -1, -1, -1),
                                    pos, l, d, D ** -0.5)
    idx, _ = nsa.decode_select(p, pos, l, d, ls, n, 1, 2, -(-S // ls))
    o, reads = nsa.decode_selection(q.expand(P, -1, -1), k.expand(P, -1, -1, -1), v.expand(P, -1, -1, -1), idx, pos,
                                    ls, D ** -0.5)
    assert (o - 5.0).abs().max() < 0.25, o[..., :4]
    want = torch.tensor([nsa.decode_reads(t + 1, l, d, ls, n, 512)[1] for t in pos.tolist()])
    assert (reads == want[:, None]).all() and (reads <= n * ls).all()


def test_needle_step_is_strictly_causal():
    # poisoning every cache slot after the query's position (huge raw K/V, a compressed block that would win the
    # selection) changes nothing: the compressed, selected and window branches only read the past
    S, l, d, ls, n, w = 65536, 32, 16, 64, 16, 512
    q, k_cmp, v_cmp, k, v, j = needle_cache(S, needle=50)
    D = q.shape[-1]
    t = 40000 + 37                                                             # mid-block, mid-stride position

    def step(k_cmp, v_cmp, k, v):
        pos = torch.tensor([t])
        o_c, p, _ = nsa.decode_compressed(q, k_cmp, v_cmp, pos, l, d, D ** -0.5)
        idx, _ = nsa.decode_select(p, pos, l, d, ls, n, 1, 2, -(-S // ls))
        o_s, _ = nsa.decode_selection(q, k, v, idx, pos, ls, D ** -0.5)
        ring = nsa.ring_positions(pos + 1, w)[0]                               # positions in the window ring
        o_w, _ = nsa.decode_window(q, k[:, :, ring], v[:, :, ring], pos, D ** -0.5)
        return torch.cat([o_c, o_s, o_w], dim=-1), idx

    clean, idx = step(k_cmp, v_cmp, k, v)
    k2, v2, kc2, vc2 = k.clone(), v.clone(), k_cmp.clone(), v_cmp.clone()
    k2[:, :, t + 1:, 0], v2[:, :, t + 1:] = 1e4, 1e6
    first_future = (t - l + 1) // d + 1                                        # first block with an end after t
    kc2[:, :, first_future:, 0], vc2[:, :, first_future:] = 1e3, 1e6
    poisoned, idx2 = step(kc2, vc2, k2, v2)
    assert torch.equal(idx, idx2) and (idx == j).any()
    assert torch.equal(clean, poisoned)


def test_prefill_errors():
    model = make_model("nsa")
    with pytest.raises(ValueError, match="setup_cache"):
        model.prefill(torch.zeros(1, 4, dtype=torch.long), torch.tensor([4]))
    model.setup_cache(2, 16)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, T=4\]"):
        model.prefill(torch.zeros(2, 4, dtype=torch.long), torch.tensor([4, 0]))
    with pytest.raises(ValueError, match="max_len=16"):
        model.prefill(torch.zeros(2, 20, dtype=torch.long), torch.tensor([4, 20]))
    with pytest.raises(ValueError, match="batch_size and max_len"):
        model.setup_cache(0, 16)


@pytest.mark.parametrize("attn", ["nsa", "dense"])
def test_compiled_step_does_not_recompile(attn):
    # position is a tensor and every cache shape is static: one trace serves every step (here across a compressed
    # emission, the window wrap and a new selection block); the eager backend keeps the check fast on CPU
    import torch._dynamo
    model = make_model(attn, window=8)
    torch._dynamo.reset()
    step = torch.compile(model.decode_step, backend="eager", fullgraph=True)
    B, T, N = 2, 12, 10
    tokens = torch.randint(0, 257, (B, T + N))
    lengths = torch.tensor([T, 7])
    rows = torch.arange(B)
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        model.setup_cache(B, T + N)
        model.prefill(tokens[:, :T], lengths)
        ref = model(tokens)[0]
        pos = lengths
        for _ in range(N):
            logits = step(tokens[rows, pos], pos)
            assert (logits - ref[rows, pos]).abs().max() < 1e-4
            pos = pos + 1


@pytest.mark.gpu
def test_gpu_compiled_decode_matches_forward():
    # CUDA: prefill through the Triton kernels, then the step compiled with mode="reduce-overhead" (CUDA graphs),
    # against forward over the whole sequence: the fp32 reference (tight) and the Triton kernels, whose fp32 dots
    # run in TF32 (~1e-3 per score; with these sharp scores a few 1e-2 of the output, hence the looser bound)
    from nsa_attention import NSAAttention
    cfg = GPTConfig(**{**TINY, "backend": "auto", "n_embd": 256, "n_head": 8, "n_kv_head": 2, "cmp_block": 32,
                       "cmp_stride": 16, "sel_block": 64, "n_select": 8, "window": 128, "cmp_hidden": 64})
    torch.manual_seed(0)
    attn = NSAAttention(cfg).cuda().eval()
    with torch.no_grad():
        attn.wq.weight.mul_(4.0)                                               # decisive selection: no TF32 ties
        attn.wkv.weight.mul_(4.0)
    B, T0, N = 2, 700, 80
    x = torch.randn(B, T0 + N, cfg.n_embd, device="cuda")
    with torch.no_grad():
        ref = attn(x)
        attn.cfg = GPTConfig(**{**vars(cfg), "backend": "torch"})
        ref32 = attn(x)                                                        # the reference, plain fp32 on GPU
        attn.cfg = cfg
        attn.setup_cache(B, T0 + N)
        attn.prefill(x[:, :T0], torch.tensor([T0, T0 - 333], device="cuda"))
        step = torch.compile(attn.decode, fullgraph=True, mode="reduce-overhead")
        pos = torch.tensor([T0, T0 - 333], device="cuda")
        for _ in range(N):
            torch.compiler.cudagraph_mark_step_begin()
            o = step(x[torch.arange(B), pos][:, None], pos)[:, 0]              # (B, C)
            rows = torch.arange(B, device="cuda"), pos
            err32 = ((o - ref32[rows]).norm() / ref32[rows].norm()).item()
            err = ((o - ref[rows]).norm() / ref[rows].norm()).item()
            print(f"pos {pos.tolist()}: rel err vs reference {err32:.2e}, vs Triton forward {err:.2e}")
            assert err32 < 1e-4 and err < 5e-2
            pos = pos + 1


def test_select_step_ties_go_to_lower_block():
    # exact ties in Eq. 10 scores (p exactly representable): the free slot goes to the lowest tied block j
    l, d, ls, n, S = 8, 4, 16, 4, 200
    Tc, nb = nsa.num_cmp_blocks(S, l, d), -(-S // ls)
    p = torch.zeros(1, 1, 2, Tc)
    for j in (9, 3, 7, 5):
        p[0, 0, :, 4 * j + 1] = 0.125                                          # inside block j: weight 2
    idx, score = nsa.decode_select(p, torch.tensor([S - 1]), l, d, ls, n, 1, 2, nb)
    assert score[0, 0, 3] == score[0, 0, 9] == 0.5
    assert idx[0, 0].tolist() == [0, 3, nb - 2, nb - 1]                       # init, lowest tie, two local


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests: CUDA, else the Triton interpreter


def random_cache(B, S, H, G, D, cfg, seed):
    """A filled fp32 nsa_cache with sharp random keys (top-n far from ties), queries q (B, HQ, D) and a gate."""
    torch.manual_seed(seed)
    c = nsa.nsa_cache(B, S, H * G, H, D, cfg, DEV, torch.float32)
    for name in ("k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp"):
        getattr(c, name).normal_()
    q = torch.randn(B, H * G, D, device=DEV) * 2
    return c, q, torch.softmax(torch.randn(B, H * G, 3, device=DEV), -1)


@pytest.mark.parametrize("G", range(1, 17), ids=lambda g: f"G{g}")
def test_decode_kernel_matches_reference(G, monkeypatch):
    # nsa_kernels.decode_attention_triton (TRITON_INTERPRET on CPU) == the torch step: output, blocks, scores, reads;
    # rows at positions before the first compressed block, on emission boundaries, inside and past the window.
    # Every buffer the kernel allocates is NaN-poisoned, so an unwritten element fails.
    pytest.importorskip("triton")
    D = 24 if G == 3 else 16
    S = 150
    ref_cfg = GPTConfig(**{**TINY, "n_select": 5 if G % 2 else 4})          # l=8 d=4 l'=16 w=32
    tri_cfg = GPTConfig(**{**vars(ref_cfg), "backend": "triton"})
    pos = torch.tensor([0, 6, 7, 11, 31, 33, 100, 149], device=DEV)
    c, q, g = random_cache(len(pos), S, 2, G, D, ref_cfg, seed=G)
    o_ref = nsa.decode_attention(q, c, pos, g, ref_cfg)
    ref = {n: getattr(c, n).clone() for n in ("reads", "sel_idx", "sel_score", "gate")}
    c.reads.fill_(-1), c.sel_idx.fill_(-7), c.sel_score.fill_(float("nan")), c.gate.fill_(float("nan"))
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan") if kw.get(
        "dtype", torch.float32).is_floating_point else -(1 << 30)))
    o = nsa.decode_attention(q, c, pos, g, tri_cfg)
    monkeypatch.setattr(torch, "empty", empty)
    assert torch.equal(c.sel_idx, ref["sel_idx"])
    assert torch.equal(c.reads, ref["reads"])
    assert torch.equal(c.gate, ref["gate"])
    torch.testing.assert_close(c.sel_score, ref["sel_score"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)


def test_decode_kernel_paper_defaults_long():
    # the paper's l=32 d=16 l'=64 n=16 w=512 at S=3000 (several split-K chunks, partly filled window ring)
    pytest.importorskip("triton")
    ref_cfg = GPTConfig(**{**TINY, "cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "n_select": 16,
                           "window": 512})
    pos = torch.tensor([300, 1055, 2999], device=DEV)
    c, q, g = random_cache(len(pos), 3000, 2, 4, 32, ref_cfg, seed=1)
    o_ref = nsa.decode_attention(q, c, pos, g, ref_cfg)
    idx_ref, reads_ref = c.sel_idx.clone(), c.reads.clone()
    o = nsa.decode_attention(q, c, pos, g, GPTConfig(**{**vars(ref_cfg), "backend": "triton"}))
    assert torch.equal(c.sel_idx, idx_ref) and torch.equal(c.reads, reads_ref)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_decode_kernel_bf16_cache():
    # a bf16 cache (the kernel keeps raw scores in fp16 and rounds P to bf16 for P.V) against the fp32 torch step on
    # the same bf16 values: block scores within 2%; each chosen block among the reference's top-n up to that error
    # (near-ties may swap); the output == the fp32 branches over the kernel's own blocks within bf16 rounding
    B, S, H, G, D, n = 4, 8192, 4, 16, 128, 16
    cfg = GPTConfig(**{**TINY, "cmp_block": 32, "cmp_stride": 16, "sel_block": 64, "n_select": n, "window": 512})
    pos = torch.tensor([300, 1055, 2999, 8191], device=DEV)
    c, q, g = random_cache(B, S, H, G, D, cfg, seed=2)
    names = ("k_slc", "v_slc", "k_win", "v_win", "k_cmp", "v_cmp")
    for name in names:
        getattr(c, name).copy_(getattr(c, name).bfloat16())
    q = q.bfloat16().float()
    nsa.decode_attention(q, c, pos, g, cfg)
    idx_ref, score_ref, reads_ref = c.sel_idx.clone(), c.sel_score.clone(), c.reads.clone()
    c16 = nsa.nsa_cache(B, S, H * G, H, D, cfg, DEV, torch.bfloat16)
    for name in names:
        getattr(c16, name).copy_(getattr(c, name))
    o = nsa.decode_attention(q.bfloat16(), c16, pos, g, GPTConfig(**{**vars(cfg), "backend": "triton"}))
    torch.testing.assert_close(c16.sel_score, score_ref, rtol=2e-2, atol=1e-5)
    assert torch.equal(c16.reads, reads_ref)
    for b, t in enumerate(pos.tolist()):
        forced = {0} | {t // 64 - 1, t // 64}                                  # n_init = 1, n_local = 2
        for h in range(H):
            ref, got = set(idx_ref[b, h].tolist()) - {-1}, set(c16.sel_idx[b, h].tolist()) - {-1}
            floor = score_ref[b, h, sorted(ref - forced)].min() * 0.98         # the reference's n-th best, -2%
            assert len(got) == len(ref) and forced <= got and all(score_ref[b, h, j] >= floor for j in got - forced), \
                (b, h, sorted(ref ^ got))
    scale = D ** -0.5
    o_cmp = nsa.decode_compressed(q, c.k_cmp, c.v_cmp, pos, 32, 16, scale)[0]
    o_slc = nsa.decode_selection(q, c.k_slc, c.v_slc, c16.sel_idx, pos, 64, scale)[0]
    o_win = nsa.decode_window(q, c.k_win, c.v_win, pos, scale)[0]
    o_ref = g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win   # (B, HQ, Dv)
    torch.testing.assert_close(o, o_ref, rtol=2e-2, atol=2e-2)


def test_decode_kernel_needle_64k():
    # the needle cache through the Triton step (CUDA, or the interpreter): the needle's block is selected at far
    # positions and the selected branch returns its value; poisoning every slot after pos changes nothing (causal)
    pytest.importorskip("triton")
    S, l, d, ls, n, w = 65536, 32, 16, 64, 16, 512
    cfg = GPTConfig(**{**TINY, "cmp_block": l, "cmp_stride": d, "sel_block": ls, "n_select": n, "window": w,
                       "backend": "triton"})
    q, k_cmp, v_cmp, k, v, j = needle_cache(S, needle=3000)
    pos = torch.tensor([(j + 3) * ls, 20000, 40037, S - 1])
    B, HQ, D = len(pos), q.shape[1], q.shape[2]
    c = nsa.nsa_cache(B, S, HQ, k.shape[1], D, cfg, DEV, torch.float32)
    c.k_slc.copy_(k.expand(B, -1, -1, -1)), c.v_slc.copy_(v.expand(B, -1, -1, -1))
    c.k_cmp.copy_(k_cmp.expand(B, -1, -1, -1)), c.v_cmp.copy_(v_cmp.expand(B, -1, -1, -1))
    ring = nsa.ring_positions(pos + 1, w)                                      # (B, w) position in each window slot
    c.k_win.copy_(k[0][:, ring].transpose(0, 1)), c.v_win.copy_(v[0][:, ring].transpose(0, 1))
    qb, pos = q.expand(B, -1, -1).to(DEV), pos.to(DEV)
    only_selected = torch.tensor([0.0, 1.0, 0.0], device=DEV).expand(B, HQ, 3)
    o = nsa.decode_attention(qb, c, pos, only_selected, cfg)
    assert (c.sel_idx == j).any(-1).all(), "needle block not selected"
    assert (o - 5.0).abs().max() < 0.25, o[..., :4]
    mix = torch.full((B, HQ, 3), 1 / 3, device=DEV)
    clean, idx = nsa.decode_attention(qb, c, pos, mix, cfg), c.sel_idx.clone()
    for b, t in enumerate(pos.tolist()):                                       # poison the future of each row
        c.k_slc[b, :, t + 1:, 0], c.v_slc[b, :, t + 1:] = 1e4, 1e6
        future = (t - l + 1) // d + 1                                          # first compressed block ending after t
        c.k_cmp[b, :, future:, 0], c.v_cmp[b, :, future:] = 1e3, 1e6
    assert torch.equal(nsa.decode_attention(qb, c, pos, mix, cfg), clean) and torch.equal(c.sel_idx, idx)
