"""model.py: shapes, untrained loss ~ ln(vocab), a few AdamW steps learn a fixed batch, optimizer groups, MFU
accounting, var-length packing at model level, and errors."""
import math

import pytest
import torch

from model import GPT, GPTConfig, PRESETS, peak_flops_of


def tiny(attn, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(attn=attn, backend="torch", **{**PRESETS["tiny"], **kw}))


@pytest.mark.parametrize("attn", ["nsa", "dense"])
def test_shapes_untrained_loss_and_learning(attn):
    model = tiny(attn)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 257, (2, 70), generator=g)
    targets = torch.randint(0, 257, (2, 70), generator=g)
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 70, 257)
    assert abs(loss.item() - math.log(257)) < 0.1                             # untrained: near uniform
    # the gradient flows through the loss only (a compiled backward would else take a zero (B, T, vocab) gradient)
    assert loss.requires_grad and not logits.requires_grad
    assert model(idx)[1] is None and model(idx)[0].requires_grad              # inference logits keep their graph
    opt = model.configure_optimizers(0.1, 3e-3, (0.9, 0.95), "cpu")
    for _ in range(8):
        opt.zero_grad()
        loss = model(idx, targets)[1]
        loss.backward()
        opt.step()
    assert model(idx, targets)[1].item() < math.log(257) - 1.0                # it memorises the fixed batch


def test_nsa_kernel_inputs_are_contiguous():
    """The layer hands the branch ops contiguous q and K/V (else each op copies the strided views of the projection,
    in its forward and again in its backward), with the values of those views; phi's inputs may stay views."""
    layer = tiny("nsa").blocks[0].attn
    x = torch.randn(2, 40, layer.cfg.n_embd)
    pos = torch.arange(40)
    outs = layer._project(x, pos)
    assert all(outs[i].is_contiguous() for i in (0, 3, 4, 5, 6))              # q, k_slc, v_slc, k_win, v_win
    v_slc, v_win = layer.wkv(x).view(2, 40, 6, layer.H, layer.D)[:, :, [3, 5]].unbind(2)
    assert torch.equal(outs[4], v_slc) and torch.equal(outs[6], v_win)


def test_reference_nsa_under_autocast():
    """The PyTorch reference under bf16 autocast (backend='torch' on CPU, or on a GPU without the kernels): scores in
    fp32, masked with fp32's minimum, finite output and gradients close to the fp32 run."""
    model = tiny("nsa")
    idx = torch.randint(0, 257, (2, 70), generator=torch.Generator().manual_seed(1))
    ref = model(idx, idx)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(idx, idx)[1]
    loss.backward()
    assert abs(loss.item() - ref.item()) < 0.05
    assert all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)


def test_ignore_index_drops_targets():
    model = tiny("dense")
    idx = torch.randint(0, 257, (1, 20))
    targets = torch.randint(0, 257, (1, 20))
    masked = targets.clone()
    masked[:, 10:] = -1
    logits, loss = model(idx, masked)
    expect = torch.nn.functional.cross_entropy(logits[0, :10], targets[0, :10])
    torch.testing.assert_close(loss, expect)


def test_tied_head_and_optimizer_groups():
    model = tiny("nsa")
    assert model.lm_head.weight is model.wte.weight
    untied = tiny("nsa", tie_embeddings=False)
    assert untied.num_params() == model.num_params() + 257 * 64
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} >= {"wte.weight", "norm.weight", "blocks.0.attn.k_pos"}
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert not any(names[id(p)].endswith(("bias", "_pos", "wte.weight")) for p in decay["params"])
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params()


def test_mfu_counts_the_keys_nsa_reads():
    nsa, dense = tiny("nsa"), tiny("dense")
    c = nsa.config                                                             # l=8, d=4, l'=16, n=4, w=32
    T = 1000
    S = torch.arange(1, T + 1, dtype=torch.float64)                            # the query at t reads S = t + 1 keys
    cmp = torch.where(S < 8, 0.0, torch.floor((S - 8) / 4) + 1)
    slc = torch.where(S <= 64, S, 48 + (S - 1) % 16 + 1)                       # 3 full blocks + the newest's tokens
    expect = float((cmp + slc + torch.clamp(S, max=32)).mean())
    assert nsa.keys_per_query(T) == pytest.approx(expect)
    assert dense.keys_per_query(T) == pytest.approx((T + 1) / 2)
    extra = 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head)
    assert nsa.flops_per_token(T) == pytest.approx(6 * nsa.num_params() + extra * expect)
    assert nsa.estimate_mfu(1000, T, 1.0, peak_flops=1e12) == pytest.approx(nsa.flops_per_token(T) * 1000 / 1e12)
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops_of("cpu") == 0.0


@pytest.mark.parametrize("attn", ["nsa", "dense"])
def test_varlen_model_equals_sequences_alone(attn):
    model = tiny(attn)
    idx = torch.randint(0, 257, (1, 90))
    cu = torch.tensor([0, 33, 90], dtype=torch.int32)
    packed = model(idx, cu_seqlens=cu)[0]
    for a, b in [(0, 33), (33, 90)]:
        torch.testing.assert_close(packed[:, a:b], model(idx[:, a:b])[0], atol=2e-5, rtol=1e-4)


def test_model_errors():
    with pytest.raises(ValueError, match="attn must be"):
        tiny("linear")
    with pytest.raises(ValueError, match="vocab_size must be"):
        tiny("dense", vocab_size=70000)
    with pytest.raises(ValueError, match="dropout must be in"):
        tiny("nsa", dropout=1.0)
    model = tiny("dense")
    with pytest.raises(ValueError, match="idx must be"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be"):
        model(torch.zeros(1, 5, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="cu_seqlens must end at T=5"):
        model(torch.zeros(1, 5, dtype=torch.long), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


@pytest.mark.parametrize("attn", ["nsa", "dense"])
def test_dropout_only_while_training(attn):
    # dropout on the embedding and the residual branches: random in train mode, off in eval mode (evaluation, decode)
    model, plain = tiny(attn, dropout=0.3), tiny(attn)                        # same seed: same weights
    idx = torch.randint(0, 257, (2, 40), generator=torch.Generator().manual_seed(2))
    model.eval(), plain.eval()
    assert torch.equal(model(idx)[0], plain(idx)[0])
    model.train()
    a, b = model(idx)[0], model(idx)[0]
    assert not torch.allclose(a, b) and not torch.allclose(a, plain(idx)[0])


def test_safetensors_round_trip(tmp_path):
    """write_safetensors / read_safetensors keep every dtype, shape and value, empty tensors too; a file that is not
    safetensors is a one-line ValueError naming it."""
    from model import read_safetensors, write_safetensors
    state = {"w": torch.randn(3, 5), "b": torch.randn(4).bfloat16(), "h": torch.randn(2, 2).half(),
             "i": torch.arange(6).view(2, 3), "empty": torch.zeros(0, 7)}
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as f:
        write_safetensors(f, state, {"step": "1"})
    back = read_safetensors(str(path))
    assert set(back) == set(state)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t), name
    path.write_bytes(b"\x10" + b"\x00" * 7 + b"not json")
    with pytest.raises(ValueError, match=f"^{path} is not a readable safetensors file"):
        read_safetensors(str(path))
