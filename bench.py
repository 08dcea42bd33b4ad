"""Benchmarks of nanoNSA's kernels on one GPU, in three modes; each first checks its kernels against the fp32 reference.
  selection: the selected-block attention of sel_kernel.py alone, each of its paths, against dense causal attention
             (every SDPA backend, flash-attn if importable) and the PyTorch reference of nsa_attention.py;
  layer:     the whole NSA layer core (the gate's softmax, compressed, select_blocks, selection, window, mix) and each
             part but the softmax, against dense causal cuDNN attention and against each part's floor (its FLOPs or
             bytes at rates measured in the run);
  decode:    one decode step over a filled cache, the attention alone and the whole layer, against dense SDPA.
Selections come from random inputs or (--indices=trained) from a trained model run on real text; the selection and
layer modes print how local they are. `python bench.py --mode=layer --csv=out.csv`; without CUDA each mode runs a
tiny smoke test in the Triton interpreter.
"""
import contextlib
import csv as csv_lib
import io
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

# -----------------------------------------------------------------------------
# config (override with config/*.py or --key=value)
mode = "selection"  # selection | layer | decode
batch_size = 1  # B
n_head = 64  # HQ: query heads (layer mode: layer_hq)
n_kv_head = 4  # H: key/value heads (G = HQ / H)
head_dim = 128  # D: q/k head dim
v_head_dim = 128  # Dv: v head dim
cmp_block = 32  # compressed block (l)
cmp_stride = 16  # compressed stride (d)
sel_block = 64  # selection block size (l')
n_select = 16  # selected blocks per query (n)
n_init = 1  # forced initial blocks
n_local = 2  # forced local blocks
window = 512  # sliding window (w)
dtype = "bfloat16"  # float16 | bfloat16
seqlens = (8192, 16384, 32768, 65536)  # selection mode: T values
indices = "select"  # select: select_blocks on random q, k_cmp | random: uniform ids (selection mode) | trained
ckpt = ""  # indices=trained (selection, layer modes): out_dir of an NSA model (ckpt.pt, or safetensors + config.json)
text = ""  # indices=trained: a prepared data dir (prepare_data.py) whose val split the model reads
layer = 0  # indices=trained: the model layer whose q, k, v and selections the bench takes
reference = 8192  # selection mode: also time the PyTorch reference at T up to this (0 = never)
layer_seqlens = (4096, 8192, 16384, 32768, 65536, 131072)  # layer mode: T values
layer_hq = (64, 16)  # layer mode: query heads to run with H kv heads (16 -> G = 4)
decode_seqlens = (8192, 32768, 65536, 131072)  # decode mode: cache lengths S
decode_batches = (1, 8)  # decode mode: batch sizes
dense = True  # dense causal attention baselines
check = True  # compare our output and grads with an fp32 reference at a small T first
sweep = False  # instead of the table, time launch configs of the mode's kernels at the largest T (selection, layer)
graphs = False  # layer mode and sweeps: time each part (each config) replayed from a CUDA graph (as train.py's default
#                 on one GPU runs NSA), so launch overhead is out of the numbers
profile = False  # per-kernel CUDA time at the largest T: one forward+backward (selection; layer: the core at the last
#                  HQ of layer_hq), one decode step
rounds = 1  # layer mode: time dense cuDNN and the NSA layer core alternately this many times, each row the median
#            (their speed drifts by several % between calls, and a speedup compares the two)
warmup_ms = 25  # triton.testing.do_bench warmup (ms)
rep_ms = 100  # triton.testing.do_bench repetitions (ms)
csv = ""  # write the table here too
seed = 1337
hopper_ws = True  # the warp-specialised kernels on Hopper where the kernel files take them (False: Triton's only)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())  # overrides
check_choice(mode=("selection", "layer", "decode"), dtype=("float16", "bfloat16"),
             indices=("select", "random", "trained"))
for _name in ("seqlens", "layer_seqlens", "layer_hq", "decode_seqlens", "decode_batches"):
    _v = globals()[_name]
    if not (_v and all(isinstance(x, int) and x > 0 for x in _v)):
        raise ValueError(f"{_name} must be a non-empty tuple of positive ints, e.g. --{_name}=\"(8192,)\", got {_v!r}")
if min(batch_size, n_head, n_kv_head, head_dim, v_head_dim, rounds) < 1 or n_head % n_kv_head or head_dim % 2 or \
        min(rep_ms, warmup_ms) <= 0:
    raise ValueError(f"need batch_size, n_kv_head >= 1, n_head a multiple of n_kv_head, an "
                     f"even head_dim, v_head_dim, rounds >= 1, rep_ms and warmup_ms > 0; got {batch_size}, {n_head}, "
                     f"{n_kv_head}, {head_dim}, {v_head_dim}, {rounds}, {rep_ms}, {warmup_ms}")
if any(hq % n_kv_head for hq in layer_hq):
    raise ValueError(f"every layer_hq must be a multiple of n_kv_head={n_kv_head}, got {layer_hq}")
if csv and (os.path.isdir(csv) or not os.path.isdir(os.path.dirname(os.path.abspath(csv)))):
    raise ValueError(f"csv={csv!r} is a directory or in none: name a file in an existing directory")  # before the run
# -----------------------------------------------------------------------------

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import nsa_attention  # noqa: E402
import nsa_kernels  # noqa: E402
import sel_kernel  # noqa: E402

B, HQ, H, D, Dv = batch_size, n_head, n_kv_head, head_dim, v_head_dim
nsa_kernels.HOPPER_WS = hopper_ws
cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
if not cuda:  # CPU smoke test: tiny shapes for the slow interpreter, fp16 as bf16 dots are wrong there
    print("no CUDA: a smoke test at tiny fixed shapes in the Triton interpreter (the shape, sweep and profile "
          "settings apply on a GPU)")
    dtype, seqlens = "float16", tuple(t for t in seqlens if t <= 256) or (64,)
    layer_seqlens, layer_hq, decode_seqlens, decode_batches = (128,), (4,), (256,), (2,)
    HQ, H, D, Dv, n_select, sel_block, cmp_block, cmp_stride = 4, 2, 32, 32, 4, 16, 16, 8
    dense, sweep, profile = False, False, False
dt = getattr(torch, dtype)


def bench(fn):
    """Median ms of fn(): CUDA events through triton's do_bench on GPU, one wall-clock run on CPU."""
    if cuda:
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def write_csv(header, rows):
    """The printed table to --csv= (nothing when csv is ""), atomically (prepare_data.atomic_write)."""
    if csv:
        from prepare_data import atomic_write
        table = io.StringIO()
        w = csv_lib.writer(table)
        w.writerow(header)
        w.writerows(rows)
        atomic_write(csv, lambda f: f.write(table.getvalue().encode()))


def rel_rmse(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_once(f, inputs):
    """f on copies of inputs whose floating ones require grad: (args, those, the output, a fixed random do for it)."""
    args = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
    o = f(*args)
    do = torch.randn(o.shape, device=o.device, generator=torch.Generator(o.device).manual_seed(seed)).to(o.dtype)
    return args, [x for x in args if x.requires_grad], o, do


def fwd_bwd(f, *inputs):
    """(forward, forward+backward) closures for f(*inputs); gradients wrt the inputs that require them."""
    args, diff, _, do = run_once(f, inputs)
    return (lambda: f(*args)), (lambda: torch.autograd.grad(f(*args), diff, do))


def out_and_grads(f, *inputs):
    """f(*inputs) and the gradients fwd_bwd's forward+backward returns, from a single forward (for the checks)."""
    _, diff, o, do = run_once(f, inputs)
    return (o, *torch.autograd.grad(o, diff, do))


def free_memory():
    if cuda:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def overridden(table, changes):
    """table (a dict: a kernel file's CONFIG, a module's vars()) with changes inside the block, restored afterwards,
    also on error. A dict value is merged into the entry it replaces: {"fwd": {"union": True}} keeps fwd's other
    settings. Only existing keys can be changed (a typo is a KeyError)."""
    saved = {key: table[key] for key in changes}
    table.update({key: {**saved[key], **val} if isinstance(val, dict) else val for key, val in changes.items()})
    try:
        yield
    finally:
        table.update(saved)


def sweep_configs(title, table, grid, ops):
    """Time ops[kernel] under each launch config of grid[kernel] merged into table[kernel] (a kernel file's CONFIG),
    one kernel at a time with the others at their defaults; table is as before afterwards."""
    print(title)
    for kname, configs in grid.items():
        for cfg in configs:
            with overridden(table, {kname: cfg}):
                try:
                    timed = [(name, bench(captured(fn) if graphs else fn)) for name, fn in ops[kname]]
                    res = "  ".join(f"{name} {ms:.3f} ms" for name, ms in timed)
                except Exception as e:  # out of resources for this config
                    res = f"failed ({str(e).splitlines()[0][:60]})"
            print(f"  {kname:<6} {' '.join(f'{k}={v}' for k, v in cfg.items()):<44} {res}")


def print_kernel_times(title, fn, reps, top=12):
    """Where fn()'s GPU time goes: its `top` kernels by CUDA time (us per run of fn, `reps` runs under torch.profiler
    after one outside it) and the sum over all of them."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    print(f"\n{title}, CUDA us per run by kernel (all kernels: {sum(e.device_time_total for e in events) / reps:.1f}):")
    for e in events[:top]:
        print(f"  {e.device_time_total / reps:9.1f}  {e.key[:90]}")


def matmul_tflops():
    """This device's matmul rate in dt (TFLOP/s), measured on one large torch.matmul in this run."""
    n = 8192 if cuda else 256
    a, b = (torch.randn(n, n, device=device, dtype=dt) for _ in range(2))
    tflops = 2 * n ** 3 / bench(lambda: a @ b) / 1e9
    print(f"matmul {n}^3 {dtype}: {tflops:.3g} TFLOP/s")
    return tflops


def copy_gbps():
    """This device's copy bandwidth (GB/s, bytes read + written), measured on one large tensor copy in this run."""
    x = torch.empty(2 ** 30 if cuda else 2 ** 22, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    gbps = 2 * x.numel() / bench(lambda: y.copy_(x)) / 1e6
    print(f"copy {x.numel() >> 20} MiB: {gbps:.3g} GB/s")
    return gbps


# -----------------------------------------------------------------------------
# dense attention baselines (causal: k, v expanded to HQ heads outside the timed region; decode: GQA inside SDPA)

def sdpa_backends(**kw):
    """{name: f(q, k, v)}: F.scaled_dot_product_attention(q, k, v, **kw) on one SDPA backend alone, for each backend
    this torch has; q, k, v (B, heads, T, .)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def on(backend):
        def sdpa(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        return sdpa

    return {name.split("_")[0].lower(): on(getattr(SDPBackend, name))
            for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION") if hasattr(SDPBackend, name)}


def dense_baselines():
    """Dense causal attention f(q, k, v) of dense_inputs: each SDPA backend, and flash-attn's when importable."""
    out = sdpa_backends(is_causal=True)
    try:
        from flash_attn import flash_attn_func
        out["flash-attn"] = lambda q, k, v: flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            causal=True)
    except ImportError:
        pass
    return out


def dense_inputs(q, k, v):
    """q (B, T, HQ, D), k, v (B, T, H, .) as (B, HQ, T, .) for SDPA, k and v repeated for each query head."""
    G = q.shape[2] // k.shape[2]
    return q.transpose(1, 2), k.repeat_interleave(G, 2).transpose(1, 2), v.repeat_interleave(G, 2).transpose(1, 2)


# -----------------------------------------------------------------------------
# a trained model's inputs (selection and layer modes, --indices=trained): the model runs on the first B*T tokens of
# the val split of --text as B rows of T (T may exceed its block_size: RoPE has no length limit, but the model never
# trained there), and its layer --layer's branch inputs are kept. Heads map onto the bench's: bench KV head h takes
# the model's KV head h mod H_m, and query head g of bench KV head h the model's query head g mod G_m of that KV head.

def load_trained():
    """The GPT of --ckpt (eval, on the device) and the val split of --text, checked against the bench's shape."""
    from model import load_model
    from prepare_data import TokenShards
    try:
        model, _ = load_model(ckpt, backend="auto")
    except ValueError as e:
        raise ValueError(f"--ckpt={ckpt}: {e}") from e
    try:
        val = TokenShards(text, "val")
    except ValueError as e:
        raise ValueError(f"--text={text}: {e}") from e
    c = model.config
    Dm, T_max = c.n_embd // c.n_head, max(seqlens if mode == "selection" else layer_seqlens)
    need = dict(sel_block=sel_block, n_select=n_select)  # what the selections depend on, and in layer mode (the
    if mode == "layer":                                   # core selects from the model's q, k_cmp) what it computes
        need.update(cmp_block=cmp_block, cmp_stride=cmp_stride, n_init=n_init, n_local=n_local, window=window,
                    head_dim=D, v_head_dim=Dv)
    has = {**vars(c), "head_dim": Dm, "v_head_dim": Dm}
    if c.attn != "nsa" or any(has[k] != v for k, v in need.items()):
        raise ValueError(f"--ckpt={ckpt} holds a {c.attn} model with " + " ".join(f"{k}={has[k]}" for k in need)
                         + "; the bench needs an NSA model with its own "
                         + " ".join(f"{k}={v}" for k, v in need.items()) + " (set the bench's with --key=value)")
    if not 0 <= layer < c.n_layer:
        raise ValueError(f"--layer must be in [0, {c.n_layer}) for --ckpt={ckpt}, got {layer}")
    if val.vocab_size > c.vocab_size:
        raise ValueError(f"--text={text} has {val.vocab_size} token ids, the model of --ckpt={ckpt} {c.vocab_size}")
    if max(len(shard) for shard in val.shards) < B * T_max:
        raise ValueError(f"--text={text}: no shard of its val split holds B*T = {B * T_max} tokens; use a smaller T "
                         f"or a larger data set")
    print(f"trained inputs: layer {layer} of {c.n_layer} of {ckpt} (HQ={c.n_head} H={c.n_kv_head} D={Dm} "
          f"block_size={c.block_size}) on the first B*T tokens of {text}'s val split; bench KV head h = the model's "
          f"KV head h mod {c.n_kv_head}; q, k, v {'from the model' if Dm == D == Dv else 'random (head dims differ)'}"
          + ("; T > block_size runs the model past its training length" if T_max > c.block_size else ""))
    return model.to(device=device, dtype=dt if cuda else torch.float32), val


def model_branch_inputs(T, model, val):
    """{op: its tensor arguments} for the branch ops (compressed_attention, selection_attention, window_attention)
    as layer --layer of the model calls them on the first B*T tokens of the val split."""
    tokens = next(shard[:B * T] for shard in val.shards if len(shard) >= B * T)  # load_trained checked there is one
    x = torch.from_numpy(tokens.astype("int64")).view(B, T).to(device)        # (B, T)
    seen = {}

    def recording(name):
        op = getattr(nsa_attention, name)

        def record(*args, **kwargs):
            seen[name] = [a for a in args if torch.is_tensor(a)]
            return op(*args, **kwargs)
        return record

    ops = ("compressed_attention", "selection_attention", "window_attention")
    with torch.no_grad(), overridden(vars(nsa_attention), {name: recording(name) for name in ops}):
        h = model.wte(x)                                                       # (B, T, C): GPT.forward up to --layer
        for block in model.blocks[:layer + 1]:
            h = block(h)
    if len(seen) < len(ops):  # a bug: NSAAttention calls its branch ops some other way now
        raise RuntimeError(f"NSAAttention did not call nsa_attention.{set(ops) - set(seen)}: update this capture")
    return seen


def bench_heads(x, Hm, hq=0):
    """x (B, T, heads, .) of the model, with H_m KV heads: its KV heads as the bench's H, or (hq > 0) its query heads
    as the bench's hq."""
    heads = torch.arange(H, device=x.device) % Hm                              # (H,) model KV head of each bench one
    if hq:
        Gm = x.shape[2] // Hm
        heads = (heads[:, None] * Gm + torch.arange(hq // H, device=x.device) % Gm).flatten()  # (hq,) query heads
    return x[:, :, heads].contiguous()


def trained_selection_inputs(T, model, val):
    """selection_inputs from the model: its indices, and its q, k, v where its head dim is D = Dv (else random)."""
    q, k, v, idx = model_branch_inputs(T, model, val)["selection_attention"]
    Hm = k.shape[2]
    q, k, v = (bench_heads(q, Hm, HQ).to(dt), bench_heads(k, Hm).to(dt), bench_heads(v, Hm).to(dt)) \
        if q.shape[-1] == D == Dv else random_qkv(T)
    return q, k, v, bench_heads(idx, Hm)


def trained_layer_inputs(T, hq, model, val):
    """layer_inputs from the model: q and the K/V of its three branches (load_trained checked their shapes); the gate
    logits stay random (they change no time)."""
    seen = model_branch_inputs(T, model, val)
    (q, kc, vc), (_, ks, vs, _), (_, kw, vw) = (seen[op] for op in ("compressed_attention", "selection_attention",
                                                                     "window_attention"))
    Hm = kc.shape[2]
    return [bench_heads(q, Hm, hq).to(dt)] + [bench_heads(x, Hm).to(dt) for x in (kc, vc, ks, vs, kw, vw)] + \
        [torch.randn(B, T, hq, 3, device=device, dtype=dt)]


# -----------------------------------------------------------------------------
# mode = "selection": sel_kernel.py's selected-block attention alone, correctness at the smallest T, then the table
# (or the launch-config sweep) and an optional per-kernel profile at the largest T

def make_indices(T, q):
    """int32 (B, T, H, n): select_blocks on random compressed keys (the real top-k) or uniform random ids."""
    if indices == "select":
        Tc = nsa_attention.num_cmp_blocks(T, cmp_block, cmp_stride)
        k_cmp = torch.randn(B, Tc, H, D, device=device, dtype=q.dtype)
        with torch.no_grad():
            return nsa_attention.select_blocks(q, k_cmp, cmp_block, cmp_stride, sel_block, n_select)
    t = torch.arange(T, device=device)
    j = torch.rand(B, T, H, n_select, device=device) * (t // sel_block + 1)[None, :, None, None]
    j = j.long().sort(-1).values                                               # (B, T, H, n) visible ids, ascending
    dup = torch.zeros_like(j, dtype=torch.bool)
    dup[..., 1:] = j[..., 1:] == j[..., :-1]
    j = torch.where(dup, 1 << 40, j).sort(-1).values
    return torch.where(j == 1 << 40, -1, j).to(torch.int32)


def selection_inputs(T, trained=None):
    """q (B, T, HQ, D), k (B, T, H, D), v (B, T, H, Dv) and block indices (B, T, H, n): random inputs with
    make_indices, or a trained model's (trained = load_trained())."""
    if trained:
        return trained_selection_inputs(T, *trained)
    q, k, v = random_qkv(T)
    return q, k, v, make_indices(T, q)


def random_qkv(T):
    return (torch.randn(B, T, HQ, D, device=device, dtype=dt), torch.randn(B, T, H, D, device=device, dtype=dt),
            torch.randn(B, T, H, Dv, device=device, dtype=dt))


def ours(q, k, v, idx):
    return sel_kernel.selection_attention_triton(q, k, v, idx, sel_block)


def ref(q, k, v, idx):
    return nsa_attention.selection_attention(q, k, v, idx, sel_block, backend="torch")


def selection_paths():
    """The selection kernel's paths as overrides of sel_kernel.CONFIG: what "auto" picks at each shape, query-centric
    tiles (each token loads its own blocks), union tiles of the rows of CONFIG["fwd_union"] in the forward and the dq
    (a block several tokens of a tile chose is loaded once for them; 4 tokens at G = 16, where the default tile holds
    one), and the key-centric forward."""
    union = sel_kernel.CONFIG["fwd_union"]
    return {"auto": {"path": "auto"},
            "query": {"path": "query", "fwd": {"union": False}, "dq": {"union": False}},
            "query union": {"path": "query", "fwd": union, "dq": {"union": True, "rows": union["rows"]}},
            "key": {"path": "key"}}


def tile_tokens(T, hq):
    """BT: the tokens one program of the query-centric selection forward holds at T tokens and hq query heads, as
    sel_kernel.py picks its tile under the current CONFIG (union tiles included)."""
    M, _, _ = sel_kernel._query_launch("fwd", hq // H, T, max(D, Dv), torch.device(device))
    return M // (hq // H)


def locality(idx, tile):
    """How much neighbouring tokens share their selected blocks, idx (B, T, H, n) int32 (-1 = none): the mean over
    (token t, KV head) of the fraction of t's blocks that t + 1 also selects, and the mean number of distinct blocks
    the tokens of a tile of `tile` consecutive ones select, over n (1 when they all select the same n, tile at most)."""
    B, T, H, n = idx.shape
    valid = idx >= 0                                                           # (B, T, H, n)
    shared = ((idx[:, :-1, :, :, None] == idx[:, 1:, :, None, :]).any(-1) & valid[:, :-1]).sum(-1)  # (B, T-1, H)
    count = valid[:, :-1].sum(-1)                                              # (B, T-1, H)
    overlap = (shared / count.clamp_min(1))[count > 0].mean()
    tiles = F.pad(idx, (0, 0, 0, 0, 0, -T % tile), value=-1).view(B, -1, tile, H, n)
    ids = tiles.transpose(2, 3).flatten(3).sort(-1).values                     # (B, T / tile, H, tile * n)
    distinct = (ids[..., :1] >= 0).sum(-1) + ((ids[..., 1:] != ids[..., :-1]) & (ids[..., 1:] >= 0)).sum(-1)
    return overlap.item(), distinct.float().mean().item() / n


def print_locality(T, hq, idx):
    """locality(idx) for the tiles of the selection kernel at hq query heads, printed and returned."""
    BT = tile_tokens(T, hq)
    overlap, tile_blocks = locality(idx, BT)
    print(f"locality T={T} HQ={hq}: token t+1 selects {overlap:.3f} of token t's blocks; BT={BT} consecutive tokens "
          f"(the query-centric selection's tile size; its union tiles group tokens by shared blocks instead) select "
          f"{tile_blocks:.2f} n distinct blocks (at most {BT} n)")
    return overlap, tile_blocks


def selection_check(T, paths, trained):
    """Output and grads of each path vs the PyTorch reference in fp32 on the same rounded inputs."""
    q, k, v, idx = selection_inputs(T, trained)
    expect = out_and_grads(ref, q.float(), k.float(), v.float(), idx)
    for path, changes in paths.items():
        with overridden(sel_kernel.CONFIG, changes):
            errs = [rel_rmse(a, b) for a, b in zip(out_and_grads(ours, q, k, v, idx), expect)]
        print(f"check T={T} {path}: rel RMSE vs fp32 reference  o {errs[0]:.2e}  dq {errs[1]:.2e}  dk {errs[2]:.2e}  "
              f"dv {errs[3]:.2e}  ({'ok' if max(errs) <= 1e-2 else 'FAIL'})")


def run_selection():
    paths, trained = selection_paths(), load_trained() if indices == "trained" else None
    source = f"trained (layer {layer} of {ckpt} on {text})" if trained else indices
    if check:
        selection_check(seqlens[0], paths, trained)
    if sweep:
        return selection_sweep(trained, source)
    if cuda:
        matmul_tflops()
    rows = []

    def add(T, loc, impl, pass_, ms, flops, base=None):  # loc: print_locality of the indices at T
        rows.append(dict(T=T, impl=impl, pass_=pass_, ms=ms, tflops=flops / ms / 1e9 if ms else float("nan"),
                         speedup=(base / ms) if base else float("nan"), indices=source, next_overlap=loc[0],
                         tile_blocks=loc[1]))

    for T in seqlens:
        q, k, v, idx = selection_inputs(T, trained)
        loc = print_locality(T, HQ, idx)
        sel_flops = 4 * B * T * HQ * (n_select * sel_block) * D  # every selected key counted
        dense_flops = 4 * B * T * T * HQ * D / 2  # causal
        base = {}
        if dense:
            for name, fn in dense_baselines().items():
                try:
                    df, dfb = fwd_bwd(fn, *dense_inputs(q, k, v))
                    add(T, loc, f"dense {name}", "fwd", bench(df), dense_flops)
                    add(T, loc, f"dense {name}", "fwd+bwd", bench(dfb), 3.5 * dense_flops)
                except RuntimeError as e:  # backend not available for this shape / GPU
                    print(f"T={T} dense {name}: skipped ({str(e).splitlines()[0][:80]})")
                free_memory()
            base = {r["pass_"]: r["ms"] for r in rows if r["T"] == T and r["impl"] == "dense cudnn"}
        impls = {f"nsa selection ({path})": (ours, changes) for path, changes in paths.items()}
        if T <= reference:
            impls["nsa selection (torch ref)"] = (ref, {})
        for impl, (fn, changes) in impls.items():
            with overridden(sel_kernel.CONFIG, changes):
                f, fb = fwd_bwd(fn, q, k, v, idx)
                add(T, loc, impl, "fwd", bench(f), sel_flops, base.get("fwd"))
                add(T, loc, impl, "fwd+bwd", bench(fb), 3.5 * sel_flops, base.get("fwd+bwd"))
        del q, k, v, idx, f, fb
        free_memory()

    print(f"\nB={B} HQ={HQ} H={H} D={D} Dv={Dv} n={n_select} l'={sel_block} {dtype} indices={source}; "
          f"speedup = dense cuDNN ms / ms; selection TFLOP/s count 4*T*HQ*n*l'*D (x3.5 fwd+bwd)")
    print(f"{'T':>7} {'impl':<32} {'pass':<8} {'ms':>10} {'TFLOP/s':>8} {'speedup':>8}")
    for r in rows:
        print(f"{r['T']:>7} {r['impl']:<32} {r['pass_']:<8} {r['ms']:>10.3f} {r['tflops']:>8.1f} {r['speedup']:>8.2f}")
    write_csv(list(rows[0]), [list(r.values()) for r in rows])
    if profile:
        T = max(seqlens)
        print_kernel_times(f"T={T} nsa selection fwd+bwd", fwd_bwd(ours, *selection_inputs(T, trained))[1], reps=5)


def selection_sweep(trained, source):
    """Launch configs of sel_kernel.py's kernels at the largest T: each variant of one kernel, others at default."""
    T = max(seqlens)
    f, fb = fwd_bwd(ours, *selection_inputs(T, trained))

    def on(path, fn):  # fn on one path of the selection kernel, whatever "auto" would pick at this shape
        def run():
            with overridden(sel_kernel.CONFIG, {"path": path}):
                return fn()
        return run

    def ds(fn):  # fn with the dq from the dk/dv's score gradients, whatever they take at this T
        def run():
            limit, sel_kernel.DS_MAX_BYTES = sel_kernel.DS_MAX_BYTES, float("inf")
            try:
                return fn()
            finally:
                sel_kernel.DS_MAX_BYTES = limit
        return run

    key_fwd, key_bwd = (nsa_kernels.launch_entry(n, HQ // H, max(D, Dv), sel_kernel.CONFIG)  # this shape's
                        for n in ("key_fwd", "key_bwd"))
    grid = {"fwd": [dict(rows=16, union=u, num_warps=w, num_stages=2) for u in (True, False) for w in (1, 2, 4)],
            "dq": [dict(rows=16, union=u, num_warps=w, num_stages=s) for u in (True, False)
                   for w, s in ((2, 2), (2, 3), (4, 2))],
            "dkv": [dict(rows=r, chunk_rows=16384, num_warps=w, num_stages=s)
                    for r, w, s in ((64, 4, 2), (64, 4, 3), (128, 8, 2))],
            "dq_ds": [dict(num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (8, 2))],
            key_fwd: [dict(rows=r, num_warps=w, num_stages=s)
                      for r, w, s in ((64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (256, 8, 2))]
            + [dict(rows=64, num_warps=4, num_stages=3, maxnreg=128)],
            key_bwd: [dict(rows=r, chunk_rows=c, num_warps=w, num_stages=s)
                      for r, c, w, s in ((64, 8192, 4, 3), (64, 2048, 4, 3), (128, 16384, 8, 3), (128, 8192, 8, 2),
                                         (128, 8192, 8, 3), (128, 4096, 8, 3), (128, 2048, 8, 3))],
            "key_sum": [dict(rows=r, num_warps=w) for r, w in ((4, 4), (8, 2), (8, 4), (16, 4), (16, 8), (32, 8))]}
    ops = {"fwd": [("fwd", on("query", f))], "dq": [("fwd+bwd", on("query", fb))],
           "dkv": [("fwd+bwd", on("query", fb))], "dq_ds": [("fwd+bwd", on("query", ds(fb)))],
           key_fwd: [("fwd", on("key", f))], key_bwd: [("fwd+bwd", on("key", fb))],
           "key_sum": [("fwd+bwd", on("key", fb))]}
    sweep_configs(f"selection sweep T={T} HQ={HQ} H={H} indices={source}: ms under each config of one kernel",
                  sel_kernel.CONFIG, grid, ops)


# -----------------------------------------------------------------------------
# mode = "layer": the whole NSA layer core, q, k, v of the three branches and gate logits in, o out (softmax gate,
# compressed attention, select_blocks on its lse, selection, window, each branch scaled by its gate weight inside its
# kernels, and the mix: their sum, Eq. 5), forward and forward+backward, per-part times
# and peak extra memory, against dense causal cuDNN SDPA at each T of layer_seqlens, for each HQ of layer_hq

def layer_parts(be):
    """The layer core and its parts as functions of tensors, on the Triton kernels (be="triton") or the reference."""

    def cmp(q, kc, vc, g=None):
        return nsa_attention.compressed_attention(q, kc, vc, cmp_block, cmp_stride, backend=be, gate=g)

    def select(q, kc, lse):
        return nsa_attention.select_blocks(q, kc, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local,
                                           backend=be, lse=lse)

    def slc(q, ks, vs, idx, g=None):
        return nsa_attention.selection_attention(q, ks, vs, idx, sel_block, backend=be, gate=g,
                                                 forced=(n_init, n_local))

    def win(q, kw, vw, g=None):
        return nsa_attention.window_attention(q, kw, vw, window, backend=be, gate=g)

    def mix(o_cmp, o_slc, o_win):  # Eq. 5 of the gated outputs
        return o_cmp + o_slc + o_win

    def core(q, kc, vc, ks, vs, kw, vw, gl):
        g_cmp, g_slc, g_win = gate_weights(gl)
        o_cmp, lse = cmp(q, kc, vc, g_cmp)
        idx = select(q.detach(), kc.detach(), lse)
        return mix(o_cmp, slc(q, ks, vs, idx, g_slc), win(q, kw, vw, g_win))   # (B, T, HQ, Dv)

    if cuda and be == "triton":  # compiled, as train.py runs the layer: the mix is one fused kernel, and so is the
        # sum of q's three gradients in the backward; the core is compiled for each shape
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return cmp, select, slc, win, torch.compile(mix, dynamic=True), torch.compile(core, fullgraph=True)
    return cmp, select, slc, win, mix, core


def gate_weights(gl):
    """The softmax gate's weights of each branch, (B, T, HQ) contiguous, of logits gl (B, T, HQ, 3): as NSAAttention
    hands them to the kernels (strided ones would each be copied by the op)."""
    return torch.softmax(gl.float(), dim=-1).permute(3, 0, 1, 2).contiguous()      # (3, B, T, HQ)


def layer_inputs(T, hq, trained=None):
    """q, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gate logits of the layer core: random, or a trained model's
    (trained = load_trained())."""
    if trained:
        return trained_layer_inputs(T, hq, *trained)
    Tc = nsa_attention.num_cmp_blocks(T, cmp_block, cmp_stride)
    shapes = ((B, T, hq, D), (B, Tc, H, D), (B, Tc, H, Dv), (B, T, H, D), (B, T, H, Dv), (B, T, H, D), (B, T, H, Dv),
              (B, T, hq, 3))
    return [torch.randn(*s, device=device, dtype=dt) for s in shapes]


def peak_extra_gib(fn):
    """Peak memory allocated while fn() runs, above what was allocated before (GiB); CUDA only."""
    if not cuda:
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def layer_check(hq):
    """Layer output and grads vs the PyTorch reference (fp32, same rounded inputs) at a small T."""
    T = 2048 if cuda else 96
    xs = layer_inputs(T, hq)
    out = out_and_grads(layer_parts("triton")[-1], *xs)
    ref = out_and_grads(layer_parts("torch")[-1], *[x.float() for x in xs])
    errs = [rel_rmse(a, b) for a, b in zip(out, ref)]
    print(f"layer check HQ={hq} T={T}: rel RMSE vs fp32 reference: o {errs[0]:.2e}, grads max "
          f"{max(errs[1:]):.2e} ({'ok' if max(errs) <= 2e-2 else 'FAIL'})")


def layer_floors(T, hq, tflops, gbps):
    """Floor ms of each part of the layer core, {part: {pass: ms}}. Attention: its FLOPs (QK and PV, 2 per
    multiply-add, over the keys each query reads as nsa_attention.tokens_read_per_query counts them; the backward
    2.5x the forward) at the measured matmul rate; block scores: QK alone (select_blocks has no backward); mix: its
    bytes (3 gated branch outputs in, o out; its backward hands do to each branch as it is) at the measured copy
    bandwidth."""
    def attention(nk):
        fwd = 2 * B * T * hq * nk * (D + Dv) / tflops / 1e9
        return {"fwd": fwd, "fwd+bwd": 3.5 * fwd}

    per_value = B * T * hq * dt.itemsize / gbps / 1e6                          # ms to move one value per (t, head)
    cmp, slc, win = nsa_attention.tokens_read_per_query(T, cmp_block, cmp_stride, sel_block, n_select, window)
    floors = {"dense cudnn": attention((T + 1) / 2),
              "compressed": attention(cmp),
              "select_blocks": {"fwd": 2 * B * T * hq * cmp * D / tflops / 1e9},
              "selection": attention(slc),
              "window": attention(win),
              "mix": {"fwd": 4 * Dv * per_value, "fwd+bwd": 4 * Dv * per_value}}
    parts = [floors[name] for name in ("compressed", "select_blocks", "selection", "window", "mix")]
    floors["NSA layer core"] = {p: sum(f.get(p, f["fwd"]) for f in parts) for p in ("fwd", "fwd+bwd")}
    return floors


def run_layer():
    trained = load_trained() if indices == "trained" else None
    source = f"select_blocks on the q, k_cmp of layer {layer} of {ckpt} on {text}" if trained else \
        "select_blocks on random q, k_cmp"
    if check:
        for hq in layer_hq:
            layer_check(hq)
    if sweep:
        return layer_sweep(trained)
    tflops, gbps, rows = matmul_tflops(), copy_gbps(), []
    cmp, select, slc, win, mix, core = layer_parts("triton")
    for hq in layer_hq:
        for T in layer_seqlens:
            xs = layer_inputs(T, hq, trained)
            q, kc, vc, ks, vs, kw, vw, gl = xs
            g = gate_weights(gl)                                               # (3, B, T, HQ)
            with torch.no_grad():
                o_cmp, lse = cmp(q, kc, vc)
                idx = select(q, kc, lse)
            overlap, tile_blocks = print_locality(T, hq, idx)
            floors, dense_ms = layer_floors(T, hq, tflops, gbps), {}

            def add_row(name, p, ms, mem=float("nan")):
                if name == "dense cudnn":
                    dense_ms[p] = ms
                share = floors[name][p] / floors["NSA layer core"][p] if name != "dense cudnn" else float("nan")
                rows.append((T, hq, name, p, ms, dense_ms.get(p, float("nan")) / ms, mem, floors[name][p], share,
                             ms / floors[name][p], source, overlap, tile_blocks))

            def time_part(name, f, fb):
                for p, fn in (("fwd", f), ("fwd+bwd", fb)):
                    if fn is not None:
                        add_row(name, p, bench(captured(fn) if graphs else fn))

            # dense and the layer core, alternately `rounds` times; then dense's (B, HQ, T, D) copies of k and v freed
            pairs = ([("dense cudnn", fwd_bwd(sdpa_backends(is_causal=True)["cudnn"], *dense_inputs(q, ks, vs)))]
                     if dense else []) + [("NSA layer core", fwd_bwd(core, *xs))]
            timed = [(name, p, fn, captured(fn) if graphs else fn)
                     for name, fns in pairs for p, fn in zip(("fwd", "fwd+bwd"), fns)]
            runs = [[bench(replay) for *_, replay in timed] for _ in range(rounds)]
            paired = [(name, p, statistics.median(run[i] for run in runs),
                       peak_extra_gib(fn) if p == "fwd+bwd" else float("nan"))
                      for i, (name, p, fn, _) in enumerate(timed)]
            del pairs, timed
            free_memory()
            for row in paired[:-2]:  # dense's rows first: the speedups' base
                add_row(*row)
            time_part("compressed", *fwd_bwd(lambda *a: cmp(*a)[0], q, kc, vc, g[0]))
            time_part("select_blocks", lambda: select(q, kc, lse), None)
            time_part("selection", *fwd_bwd(lambda q, ks, vs, g: slc(q, ks, vs, idx, g), q, ks, vs, g[1]))
            time_part("window", *fwd_bwd(win, q, kw, vw, g[2]))
            time_part("mix", *fwd_bwd(mix, o_cmp, o_cmp, o_cmp))
            for row in paired[-2:]:
                add_row(*row)
            del xs, q, kc, vc, ks, vs, kw, vw, gl, g, o_cmp, lse, idx
            free_memory()
    print(f"\nlayer core: B={B} H={H} D={D} Dv={Dv} l={cmp_block} d={cmp_stride} l'={sel_block} n={n_select} "
          f"w={window} {dtype}; indices: {source}; {'CUDA graph replays' if graphs else 'eager launches'}; "
          f"speedup = dense cuDNN ms / ms (same T, HQ; the two timed alternately, the median of {rounds} round(s)); "
          f"mem = peak extra GiB of fwd+bwd")
    print(f"floor = FLOPs at {tflops:.3g} TFLOP/s, the mix's bytes at {gbps:.3g} GB/s (both measured above; "
          f"layer_floors says what is counted); share = the part's floor / the layer core's (whose fwd+bwd holds "
          f"select_blocks' forward); x floor = ms / floor")
    print(f"{'T':>7} {'HQ':>3} {'impl':<16} {'pass':<8} {'ms':>10} {'speedup':>8} {'mem GiB':>8} {'floor ms':>9} "
          f"{'share':>6} {'x floor':>8}")
    for T, hq, name, p, ms, sp, mem, floor, share, dist, *_ in rows:
        print(f"{T:>7} {hq:>3} {name:<16} {p:<8} {ms:>10.3f} {sp:>8.2f} {mem:>8.2f} {floor:>9.3f} {share:>6.2f} "
              f"{dist:>8.1f}")
    write_csv(("T", "HQ", "impl", "pass", "ms", "speedup", "peak_extra_gib", "floor_ms", "floor_share", "x_floor",
               "indices", "next_overlap", "tile_blocks"), rows)
    if profile:
        T = max(layer_seqlens)
        print_kernel_times(f"T={T} HQ={layer_hq[-1]} NSA layer core fwd+bwd",
                           fwd_bwd(core, *layer_inputs(T, layer_hq[-1], trained))[1], reps=5)


def layer_sweep(trained):
    """Launch configs of nsa_kernels.py's kernels at the largest T (first HQ): each variant of one kernel (of the
    CONFIG entry this G takes), others at default; the branches run gated, as in the layer."""
    T, hq = max(layer_seqlens), layer_hq[0]
    cmp, select, slc, win, mix, core = layer_parts("triton")
    q, kc, vc, ks, vs, kw, vw, gl = layer_inputs(T, hq, trained)
    g = gate_weights(gl)                                                       # (3, B, T, HQ)
    with torch.no_grad():
        lse = cmp(q, kc, vc)[1]
    cmp_f, cmp_fb = fwd_bwd(lambda *a: cmp(*a)[0], q, kc, vc, g[0])
    win_f, win_fb = fwd_bwd(win, q, kw, vw, g[2])
    entry = {name: nsa_kernels.launch_entry(name, hq // H, max(D, Dv)) for name in ("fwd", "dq", "dkv", "select")}
    ops = {entry["fwd"]: [("cmp fwd", cmp_f), ("win fwd", win_f)],
           entry["dq"]: [("cmp fwd+bwd", cmp_fb), ("win fwd+bwd", win_fb)],
           entry["select"]: [("select", lambda: select(q, kc, lse))]}
    ops[entry["dkv"]] = ops[entry["dq"]]
    capped = [dict(M=64, BN=64, num_warps=4, num_stages=2, maxnreg=128)]      # four blocks per SM at D = 64
    grid = {entry["fwd"]: [dict(M=m, BN=n, num_warps=w, num_stages=s) for m, n, w, s in
                           ((128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2))]
            + capped,
            entry["dq"]: [dict(M=m, BN=n, num_warps=w, num_stages=s) for m, n, w, s in
                          ((128, 64, 8, 2), (128, 32, 4, 2), (128, 64, 4, 3), (64, 64, 4, 2))] + capped,
            entry["dkv"]: [dict(M=m, BN=n, num_warps=w, num_stages=s) for m, n, w, s in
                           ((64, 128, 8, 2), (64, 64, 8, 2), (32, 128, 4, 2), (64, 128, 4, 3), (128, 64, 8, 2),
                            (64, 64, 4, 3), (64, 32, 4, 2))],
            entry["select"]: [dict(M=m, tokens=0, num_warps=w, num_stages=s) for m, w, s in
                              ((256, 4, 2), (256, 4, 3), (128, 4, 2), (128, 4, 3), (64, 4, 3), (512, 16, 3))] +
                             [dict(tokens=t, num_warps=4, num_stages=s) for t, s in
                              ((32, 3), (32, 2), (16, 3), (64, 3))]}
    sweep_configs(f"layer sweep T={T} HQ={hq}: ms of each op under each config of one kernel", nsa_kernels.CONFIG,
                  grid, ops)


# -----------------------------------------------------------------------------
# mode = "decode": one decode step at cache length S, for S in decode_seqlens and each batch size in decode_batches.
# "attention" = nsa_attention.decode_attention (compressed -> select_blocks -> selection -> window -> gate mix over a
# filled static cache) with nsa_kernels' launches and with the torch reference, whose branches are also timed alone
# (--profile=True: the Triton step per kernel), against dense F.scaled_dot_product_attention of one query over S
# cached keys (each SDPA backend that runs; the speedup is over the fastest). "layer" = a whole NSAAttention.decode
# step (projections, cache writes, compression MLP, attention, output projection) against DenseAttention.decode.
# Every timed function is compiled (inductor) and replayed from a CUDA graph, as sample.py runs its step, so launch
# overhead is out of the numbers.

def graphed(fn):
    """fn compiled, warmed up and captured in a CUDA graph; returns the replay. fn itself on the CPU."""
    return captured(torch.compile(fn, fullgraph=True)) if cuda else fn


def captured(fn):
    """fn warmed up on a side stream and captured in a CUDA graph; returns the replay. fn itself on the CPU."""
    if not cuda:
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def replay():
        g.replay()
    replay.fn = fn  # the replay reads what fn's closure holds (inputs, a fixed do): it lives as long as the replay
    return replay


def decode_config(hq, **over):
    from model import GPTConfig
    return GPTConfig(**{**dict(n_embd=hq * D, n_head=hq, n_kv_head=H, cmp_block=cmp_block, cmp_stride=cmp_stride,
                               sel_block=sel_block, n_select=n_select, n_init=n_init, n_local=n_local, window=window),
                        **over})


def fill_random(cache):
    for name, buf in cache.named_buffers():
        if buf.is_floating_point() and name.startswith(("k_", "v_")):
            buf.normal_()


def decode_check():
    """NSAAttention prefill (Triton kernels on CUDA) then compiled decode steps vs forward over the whole sequence."""
    from nsa_attention import NSAAttention
    cfg = decode_config(8, n_embd=8 * 64, n_kv_head=2, cmp_hidden=64)
    T0, N, b = (1000, 64, 2) if cuda else (70, 6, 2)
    torch.manual_seed(seed)
    attn = NSAAttention(cfg).to(device).eval()
    x = torch.randn(b, T0 + N, cfg.n_embd, device=device)
    with torch.no_grad():
        ref = attn(x)                                                          # (b, T0 + N, C)
        attn.setup_cache(b, T0 + N)
        attn.prefill(x[:, :T0], torch.full((b,), T0, device=device))
        step = torch.compile(attn.decode, fullgraph=True, mode="reduce-overhead") if cuda else attn.decode
        err = 0.0
        for t in range(T0, T0 + N):
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            o = step(x[:, t:t + 1], torch.full((b,), t, device=device))[:, 0]  # (b, C)
            err = max(err, rel_rmse(o, ref[:, t]))
    print(f"decode check: prefill {T0} + {N} compiled decode steps vs forward, fp32: max rel RMSE {err:.2e} "
          f"({'ok' if err <= 1e-3 else 'FAIL'})")


def run_decode():
    from model import DenseAttention
    from nsa_attention import NSAAttention, decode_compressed, decode_select, decode_selection, decode_window
    if check:
        decode_check()
    cfg, tri_cfg, ref_cfg = decode_config(HQ), decode_config(HQ, backend="triton"), decode_config(HQ, backend="torch")
    scale, rows = D ** -0.5, []
    for S in decode_seqlens:
        for b in decode_batches:
            torch.manual_seed(seed)
            torch._dynamo.reset()  # every shape compiles its own graphs: stay under dynamo's recompile limit
            reads = nsa_attention.decode_reads(S, cmp_block, cmp_stride, sel_block, n_select, window)
            dense_ms = {}
            with torch.no_grad():
                q4 = torch.randn(b, HQ, 1, D, device=device, dtype=dt)
                k, v = (torch.randn(b, H, S, D, device=device, dtype=dt) for _ in range(2))
                for name, sdpa in sdpa_backends(enable_gqa=True).items():  # one query over all S keys: not causal
                    try:
                        dense_ms[name] = bench(graphed(lambda: sdpa(q4, k, v)))
                    except Exception as e:  # backend unavailable for this shape / GPU / GQA
                        print(f"S={S} B={b} dense {name}: skipped ({str(e).splitlines()[0][:80]})")
                del q4, k, v
                base = min(dense_ms.values()) if dense_ms else float("nan")
                for name, ms in dense_ms.items():
                    rows.append((S, b, "attention", f"dense sdpa {name}", ms, base / ms, S))
                cache = nsa_attention.nsa_cache(b, S, HQ, H, D, cfg, device, dt)
                fill_random(cache)
                q = torch.randn(b, HQ, D, device=device, dtype=dt)
                g = torch.softmax(torch.randn(b, HQ, 3, device=device), dim=-1)
                pos = torch.full((b,), S - 1, device=device)
                _, p, _ = decode_compressed(q, cache.k_cmp, cache.v_cmp, pos, cmp_block, cmp_stride, scale)
                idx, _ = decode_select(p, pos, cmp_block, cmp_stride, sel_block, n_select, n_init, n_local,
                                       cache.sel_score.shape[-1])
                parts = {
                    "nsa decode (triton)": (lambda: nsa_attention.decode_attention(q, cache, pos, g, tri_cfg),
                                            sum(reads)),
                    "nsa decode (torch ref)": (lambda: nsa_attention.decode_attention(q, cache, pos, g, ref_cfg),
                                               sum(reads)),
                    "  ref compressed": (lambda: decode_compressed(q, cache.k_cmp, cache.v_cmp, pos, cmp_block,
                                                                   cmp_stride, scale), reads[0]),
                    "  ref select_blocks": (lambda: decode_select(p, pos, cmp_block, cmp_stride, sel_block, n_select,
                                                                  n_init, n_local, cache.sel_score.shape[-1]), 0),
                    "  ref selection": (lambda: decode_selection(q, cache.k_slc, cache.v_slc, idx, pos, sel_block,
                                                                 scale), reads[1]),
                    "  ref window": (lambda: decode_window(q, cache.k_win, cache.v_win, pos, scale), reads[2])}
                for name, (fn, n_read) in parts.items():
                    replay = graphed(fn)
                    ms = bench(replay)
                    rows.append((S, b, "attention", name, ms, base / ms, n_read))
                    if profile and name == "nsa decode (triton)":
                        print_kernel_times(f"S={S} B={b} nsa decode step (triton)", replay, reps=50, top=8)
                del cache, q, p, idx, parts
                free_memory()
                # whole layer step: projections + cache writes + attention + output projection
                layer_ms = {}
                for name, cls in (("dense layer decode", DenseAttention), ("nsa layer decode", NSAAttention)):
                    layer = cls(cfg).to(device=device, dtype=dt).eval()
                    layer.setup_cache(b, S)
                    fill_random(layer.kv_cache)
                    x = torch.randn(b, 1, cfg.n_embd, device=device, dtype=dt)
                    layer_ms[name] = bench(graphed(lambda: layer.decode(x, pos)))
                    rows.append((S, b, "layer", name, layer_ms[name], layer_ms["dense layer decode"] / layer_ms[name],
                                 S if cls is DenseAttention else sum(reads)))
                    del layer, x
                    free_memory()
    print(f"\ndecode step: HQ={HQ} H={H} D={D} l={cmp_block} d={cmp_stride} l'={sel_block} n={n_select} w={window} "
          f"{dtype}; speedup = fastest dense ms / ms (attention), dense layer ms / ms (layer); reads = tokens per KV "
          f"group (nsa_attention.py, \"Decode reads\")")
    print(f"{'S':>7} {'B':>3} {'what':<10} {'impl':<24} {'ms':>9} {'speedup':>8} {'reads':>7}")
    for S, b, what, name, ms, sp, n_read in rows:
        print(f"{S:>7} {b:>3} {what:<10} {name:<24} {ms:>9.4f} {sp:>8.2f} {n_read:>7}")
    write_csv(("S", "B", "what", "impl", "ms", "speedup", "reads"), rows)


# -----------------------------------------------------------------------------

def main():
    if indices != "select" and mode != "selection" and not (indices == "trained" and mode == "layer"):
        raise ValueError(f"--indices={indices} is not for --mode={mode}: the layer core selects its own blocks "
                         f"(from random or, with trained, a model's q and k_cmp); decode fills its cache at random")
    if indices == "trained" and not (ckpt and text):
        raise ValueError("--indices=trained needs --ckpt=<out_dir of a trained model> and --text=<prepared data dir>")
    torch.manual_seed(seed)
    print(f"device: {torch.cuda.get_device_name() if cuda else 'cpu (Triton interpreter)'}; torch {torch.__version__}, "
          f"triton {triton.__version__}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    globals()[f"run_{mode}"]()  # run_selection, run_layer or run_decode (the modes check_choice allows above)


if __name__ == "__main__":
    main()
