"""bench.py on CPU (tiny shapes, kernels in the interpreter): each mode passes its own correctness check against the
fp32 reference and writes the table it prints to --csv; indices taken from a tiny checkpoint on real text run end to
end; the locality numbers and the kernels' CONFIG after a sweep are checked in this process."""
import csv
import gc
import importlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, *args, ok=True):
    """bench.py ARGS in a subprocess: (stdout, rows of its --csv) or, with ok=False, the finished process."""
    out = tmp_path / "table.csv"
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "bench.py", f"--csv={out}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if not ok:
        return res
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout, list(csv.DictReader(open(out)))


@pytest.fixture(scope="module")
def bench():
    """bench.py imported (its config at the defaults, main() not run)."""
    argv, sys.argv = sys.argv, ["bench.py"]
    try:
        return importlib.import_module("bench")
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(out_dir with a ckpt.pt of a tiny NSA model, a prepared byte-level data dir): the model's l' and n are the
    CPU bench's (l, d, l', n, w, D), it has one KV head (so the bench's two KV heads both map to it), and its
    block_size is below the bench's T."""
    from model import GPT, GPTConfig, PRESETS
    from prepare_data import prepare
    d = tmp_path_factory.mktemp("trained")
    args = dict(PRESETS["tiny"], n_embd=128, n_head=4, n_kv_head=1, block_size=32, cmp_block=16, cmp_stride=8,
                window=512)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**args))
    torch.save(dict(model=model.state_dict(), model_args=args, config={}), d / "ckpt.pt")
    for i in range(6):
        (d / f"doc{i}.txt").write_text(f"Document {i}: to be, or not to be, that is the question.")
    meta = prepare(dataset="text", input=str(d / "doc*.txt"), out_dir=str(d / "data"), num_proc=1, val_frac=0.5)
    assert 40 <= meta["splits"]["val"]["tokens"] < 256  # enough for T = 40, too few for T = 256
    return str(d), str(d / "data")


def test_selection_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--seqlens=(40,)")
    assert "check T=40 query:" in text and "check T=40 query union:" in text
    assert "FAIL" not in text and text.count("(ok)") >= 2
    assert "locality T=40 HQ=4: token t+1 selects" in text
    timed = {(r["impl"], r["pass_"]) for r in rows}
    assert timed >= {(f"nsa selection ({p})", s) for p in ("query", "query union") for s in ("fwd", "fwd+bwd")}
    assert all(float(r["ms"]) > 0 and r["indices"] == "select" for r in rows)


def test_trained_indices(tmp_path, trained):
    ckpt, data = trained
    # the kernels' check is test_selection_mode's: here the model, the mapping and the locality end to end
    text, rows = run_bench(tmp_path, "--seqlens=(40,)", "--indices=trained", f"--ckpt={ckpt}", f"--text={data}",
                           "--layer=1", "--check=False", "--reference=0")
    assert "trained inputs: layer 1 of 2" in text and "q, k, v from the model" in text
    assert "T > block_size" in text and "locality T=40 HQ=4" in text
    assert rows and all(r["indices"].startswith("trained (layer 1") for r in rows)
    assert 0 <= float(rows[0]["next_overlap"]) <= 1 and 0 < float(rows[0]["tile_blocks"]) <= 8


def test_trained_inputs_map_the_model_heads(bench, trained):
    # T = 96 > n*l' = 64: a real top-n. Bench KV heads 0 and 1 both take the model's only KV head (same indices, k,
    # v); bench query heads (h, g) take the model's query head g. The layer mode's inputs are the same tensors, and
    # its core's select_blocks on them picks (up to fp16 rounding of the model's fp32 q, k_cmp) the model's blocks.
    ckpt, data = trained
    with bench.overridden(vars(bench), dict(ckpt=ckpt, text=data, layer=1, seqlens=(96,), layer_seqlens=(96,))):
        model_val = bench.load_trained()
        q, k, v, idx = bench.selection_inputs(96, model_val)
        xs = bench.layer_inputs(96, 4, model_val)
    assert q.shape == (1, 96, 4, 32) and k.shape == v.shape == (1, 96, 2, 32) and idx.shape == (1, 96, 2, 4)
    assert torch.equal(idx[:, :, 0], idx[:, :, 1]) and torch.equal(k[:, :, 0], k[:, :, 1])
    assert torch.equal(q[:, :, :2], q[:, :, 2:]) and not torch.equal(q[:, :, 0], q[:, :, 1])
    assert (idx[:, :, :, 0] == 0).all() and (idx[:, 64:] >= 0).all()  # block 0 forced; n blocks once there are n
    assert torch.equal(xs[0], q) and torch.equal(xs[3], k) and torch.equal(xs[4], v)
    assert xs[1].shape == xs[2].shape == (1, 11, 2, 32) and xs[7].shape == (1, 96, 4, 3)
    from nsa_attention import select_blocks
    again = select_blocks(xs[0].float(), xs[1].float(), 16, 8, 16, 4, backend="torch")
    assert (again == idx).float().mean() > 0.9
    overlap, tile = bench.locality(idx, 8)
    assert 0 < overlap < 1 and 0 < tile < 8  # early tiles see fewer than n blocks


def test_trained_user_errors(tmp_path, bench, trained):
    res = run_bench(tmp_path, "--indices=trained", ok=False)  # the command line: one line on stderr, exit 1
    assert res.returncode == 1 and res.stderr.startswith("error: ") and "needs --ckpt" in res.stderr
    assert "Traceback" not in res.stderr
    ckpt, data = trained
    for changes, says in ((dict(ckpt=str(tmp_path)), f"--ckpt={tmp_path}: no checkpoint"),
                          (dict(text=str(tmp_path)), f"--text={tmp_path}: "), (dict(layer=5), "--layer must be"),
                          (dict(seqlens=(256,)), "no shard of its val split"),
                          (dict(mode="layer", layer_seqlens=(96,), window=64), "window=512"),
                          (dict(indices="random", mode="layer"), "is not for --mode=layer")):
        with bench.overridden(vars(bench), {**dict(indices="trained", ckpt=ckpt, text=data), **changes}):
            with pytest.raises(ValueError) as e:  # the command line prints it as one line "error: ..." (above)
                bench.main()
        assert says in str(e.value), e.value


def test_choices_checked_before_the_cpu_smoke_shapes(tmp_path):
    res = run_bench(tmp_path, "--dtype=fp8", ok=False)  # on CPU the smoke test runs float16 whatever --dtype says
    assert res.returncode == 1 and res.stderr == "error: dtype must be 'float16' or 'bfloat16', got 'fp8'\n"
    for args, want in ((["--seqlens=()"], "seqlens must be a non-empty tuple of positive ints"),
                       (["--layer_seqlens=(64.5,)"], "layer_seqlens must be a non-empty tuple of positive ints"),
                       (["--batch_size=0"], "need batch_size, n_kv_head >= 1"),
                       (["--rounds=0"], "rounds >= 1"),
                       (["--n_head=6", "--n_kv_head=4"], "n_head a multiple of n_kv_head"),
                       (["--layer_hq=(6,)"], "every layer_hq must be a multiple of n_kv_head=4"),
                       ([f"--csv={tmp_path}/no/such.csv"], "is a directory or in none")):
        res = run_bench(tmp_path, *args, ok=False)
        assert res.returncode == 1 and res.stderr.startswith("error: ") and want in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1, res.stderr                        # one line


def test_locality(bench):
    constant = torch.tensor([0, 2, 5, -1], dtype=torch.int32).expand(2, 50, 3, 4)  # (B, T, H, n)
    assert bench.locality(constant, 8) == (1.0, 0.75)                             # 3 of n = 4 ids, all shared
    # 5 tokens selecting one new block each: nothing shared; tiles of 2 tokens hold 2, 2, 1 blocks of n = 3
    walk = torch.full((1, 5, 1, 3), -1, dtype=torch.int32)
    walk[0, :, 0, 0] = torch.arange(5)
    overlap, tile = bench.locality(walk, 2)
    assert overlap == 0.0 and tile == pytest.approx(5 / 3 / 3)
    torch.manual_seed(0)
    ids = torch.randint(-1, 40, (1, 300, 2, 4), dtype=torch.int32)
    overlap, tile = bench.locality(ids, 8)
    assert 0 < overlap < 1 and 1 < tile <= 8


def test_sweep_restores_config(bench, capsys):
    import sel_kernel
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in sel_kernel.CONFIG.items()}
    seen = []

    def op():  # what the kernels would read, then a failure for the second config
        seen.append(dict(sel_kernel.CONFIG["fwd"]))
        if sel_kernel.CONFIG["fwd"]["num_warps"] == 1:
            raise RuntimeError("out of resources")

    grid = {"fwd": [dict(union=True), dict(num_warps=1)], "dq": [dict(rows=32, num_warps=8)]}
    bench.sweep_configs("sweep", sel_kernel.CONFIG, grid, {"fwd": [("fwd", op)], "dq": [("fwd+bwd", op)]})
    assert seen[0] == {**before["fwd"], "union": True} and seen[1]["num_warps"] == 1 and seen[2] == before["fwd"]
    assert "failed (out of resources)" in capsys.readouterr().out
    assert sel_kernel.CONFIG == before
    with pytest.raises(KeyError):  # a typo is an error, not a new setting
        with bench.overridden(sel_kernel.CONFIG, {"fwd_typo": {}}):
            pass
    assert sel_kernel.CONFIG == before


def test_selection_sweep_times_each_kernel_on_its_path(bench, monkeypatch, capsys):
    """The key path's kernels are swept on the key path and the query path's on the query path, whichever path
    "auto" would take at the bench's shape; CONFIG is as before afterwards."""
    import nsa_kernels
    import sel_kernel
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in sel_kernel.CONFIG.items()}
    seen = []

    def record():  # what the kernels would read
        seen.append((sel_kernel.CONFIG["path"], {k: dict(v) for k, v in sel_kernel.CONFIG.items() if k != "path"}))

    monkeypatch.setattr(bench, "selection_inputs", lambda T, trained=None: ())
    monkeypatch.setattr(bench, "fwd_bwd", lambda f, *inputs: (record, record))
    bench.selection_sweep(None, "select")
    lines = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    key_fwd, key_bwd = (nsa_kernels.launch_entry(n, bench.HQ // bench.H, max(bench.D, bench.Dv), sel_kernel.CONFIG)
                        for n in ("key_fwd", "key_bwd"))  # at this shape
    assert len(lines) == len(seen) and {"fwd", "dq", "dkv", "dq_ds", key_fwd, key_bwd, "key_sum"} == set(lines)
    for kname, (path, cfg) in zip(lines, seen):
        assert path == ("key" if kname.startswith("key") else "query")
        changed = {k for k in cfg if cfg[k] != before[k]}
        assert changed <= {kname}  # one kernel's settings at a time
    assert sel_kernel.CONFIG == before


def test_decode_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--mode=decode")
    assert "decode check" in text and "(ok)" in text
    impls = {r["impl"] for r in rows}
    assert {"nsa decode (triton)", "nsa decode (torch ref)", "nsa layer decode", "dense layer decode"} <= impls
    # reads: the "Decode reads" count of nsa_attention.py at S = 256, CPU shapes (l=16, d=8, l'=16, n=4, w=512)
    assert next(r for r in rows if r["impl"] == "nsa decode (triton)")["reads"] == str(31 + 64 + 256)


@pytest.mark.slow
def test_layer_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--mode=layer", "--rounds=2")
    assert "layer check" in text and "(ok)" in text and "the median of 2 round(s)" in text
    assert {"NSA layer core", "compressed", "select_blocks", "selection", "window", "mix"} <= {r["impl"] for r in rows}
    floor = {(r["impl"], r["pass"]): float(r["floor_ms"]) for r in rows}
    for p in ("fwd", "fwd+bwd"):  # the parts' floors add up to the layer core's (select_blocks has no backward)
        parts = [floor[name, p] for name in ("compressed", "selection", "window", "mix")]
        parts.append(floor["select_blocks", "fwd"])
        assert all(f > 0 for f in parts) and sum(parts) == pytest.approx(floor["NSA layer core", p])
    shares = [float(r["floor_share"]) for r in rows if r["pass"] == "fwd"]  # each part's share of the layer's floor
    assert sum(shares) == pytest.approx(2.0) and max(shares) == 1.0  # the parts' and the layer core's own
    assert all(float(r["x_floor"]) > 0 for r in rows)


@pytest.mark.gpu
def test_captured_replay_matches_eager(bench):
    """--graphs=True times captured(fn): a replay recomputes the layer core's forward and backward (into the buffers
    of the capture) and gives what the eager call gives."""
    fb = bench.fwd_bwd(bench.layer_parts("triton")[-1], *bench.layer_inputs(1024, 8))[1]
    got = {}
    replay = bench.captured(lambda: got.update(grads=fb()))
    for g in got["grads"]:
        g.fill_(float("nan"))
    replay()
    want = fb()
    assert len(want) == 8 and all(torch.equal(a, b) for a, b in zip(got["grads"], want))


@pytest.mark.gpu
def test_captured_replay_outlives_its_function(bench):
    """A replay holds fn, so the tensors its capture reads stay allocated after the caller drops fn: a later capture
    (which collects garbage and empties the allocator's cache) or a new tensor cannot take their memory."""
    x = torch.randn(1 << 20, device="cuda")
    out = {}

    def make():
        y = x.clone()                                  # read by the capture, held only by the lambda
        return bench.captured(lambda: out.update(s=(y * 2).sum()))

    replay = make()
    gc.collect()
    z = torch.zeros_like(x)                            # would take y's memory, were it freed
    replay()
    assert torch.equal(out["s"], (x * 2).sum()) and not z.any()


@pytest.mark.parametrize("hq", (4, 16, 64))
def test_layer_sweep_varies_the_entries_its_g_takes(bench, monkeypatch, capsys, hq):
    """The layer sweep varies the entries that the kernels then read: *_small_d ones for narrow heads, else at
    G < nsa_kernels.SMALL_G the *_small_g ones, where CONFIG has them; the branches are timed with their gate; CONFIG
    is as before afterwards."""
    import nsa_kernels
    before = {k: dict(v) for k, v in nsa_kernels.CONFIG.items()}
    changed, n_inputs = set(), []

    def part(*args):  # what a kernel would read
        changed.update(k for k, v in nsa_kernels.CONFIG.items() if v != before[k])
        return None, None

    def fwd_bwd(f, *inputs):
        n_inputs.append(len(inputs))
        return part, part

    monkeypatch.setattr(bench, "layer_inputs",
                        lambda T, hq, trained=None: [torch.zeros(3)] * 7 + [torch.zeros(1, 2, hq, 3)])  # gate logits
    monkeypatch.setattr(bench, "layer_parts", lambda be: (part,) * 6)
    monkeypatch.setattr(bench, "fwd_bwd", fwd_bwd)
    monkeypatch.setattr(bench, "layer_hq", (hq,))
    bench.layer_sweep(None)
    small = hq // bench.H < nsa_kernels.SMALL_G
    narrow = max(bench.D, bench.Dv) <= nsa_kernels.SMALL_D
    ranges = ({"fwd_small_d", "dq_small_d", "dkv_small_d"} if narrow else {"fwd_small_g", "dq", "dkv"} if small
              else {"fwd", "dq", "dkv"})
    assert changed == ranges | {"select_small_g" if small else "select"}
    assert n_inputs == [4, 4]                                                 # q, k, v and the gate
    assert nsa_kernels.CONFIG == before and "failed" not in capsys.readouterr().out
