"""Sample from a trained model: loads out_dir/ckpt.pt (train.py) or model.safetensors + config.json, prefills the prompt
into each layer's static decode cache (model.py, nsa_attention.py) and generates one token per step (decode(), the
loop that the needle evaluation at the end drives too), printing sample 0 as it comes and then tokens/s.
`python sample.py --out_dir=out --start="ROMEO:"`; `--plot_selection=sel.png` draws which blocks NSA read at each step.
"""
import os
import time

import torch

from model import cpu_threads, load_model, resolve_device
from prepare_data import atomic_write, stop_on_sigterm

# -----------------------------------------------------------------------------
out_dir = "out"  # where train.py wrote ckpt.pt (or model.safetensors + config.json)
start = "\n"  # the prompt, or "FILE:path" to read it from a UTF-8 file
num_samples = 4  # samples, drawn together as one batch
stream = True  # print sample 0 token by token as it is generated (a host sync per token); the others when done
max_new_tokens = 200  # tokens generated per sample
temperature = 0.8  # 1.0 = the model's distribution, < 1 sharper, 0 = greedy (argmax)
top_k = 200  # keep only the k most likely tokens (0 = all)
top_p = 1.0  # nucleus: keep the fewest most likely tokens whose mass reaches top_p (1.0 = all)
seed = 1337
device = "auto"  # auto (cuda where available, else cpu) | cpu | cuda | cuda:1 ...
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"  # or float16
compile = torch.cuda.is_available()  # compile the one-token step (CUDA: mode="reduce-overhead", one CUDA graph a step)
tokenizer = ""  # "" = from the checkpoint's data dir meta.json (or vocab_size 257 -> byte, 50257 -> gpt2); byte | gpt2
backend = ""  # "" = the checkpoint's NSA kernel backend; auto | torch | triton
plot_selection = ""  # FILE.png: selected blocks, their scores and the gate mix at each generated position (matplotlib)
plot_layer = 0  # layer that plot_selection draws
plot_group = 0  # KV group that plot_selection draws (batch row 0)
# needle in a haystack (needle=True; section at the end): accuracy over context lengths x depths, keys read, tokens/s
needle = False  # run the needle evaluation on data of `prepare_data.py --dataset=needle` instead of sampling
needle_lengths = (1024, 2048, 4096, 8192, 16384, 32768, 65536)  # needle: context lengths (prompt tokens)
needle_depths = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # needle: where the needle sits in the filler
needle_trials = 4  # needle: documents per (length, depth), each with its own filler, name and key
needle_count = 1  # needle: needles per document; > 1 is the multi-needle variant (the question asks one of them)
needle_steps = 32  # needle: greedy decode steps per document; the answer is the first 5, all but the first timed
needle_batch_tokens = 1 << 20  # needle: prompt tokens decoded as one batch (rows = this // length, at least 1)
needle_data = ""  # needle: the --dataset=needle directory (val filler and answers); "" = the checkpoint's data_dir
needle_out = ""  # needle: path prefix of the CSV and PNGs; "" = out_dir/needle
needle_compare = ""  # needle: another model's needle CSV, drawn beside this one in the heatmap
needle_plot_length = 32768  # needle, NSA: context length of the selection plot (its depth-50% document); 0 = none
needle_val_rows = 32  # needle: val rows whose answers are scored teacher-forced (loss and accuracy on the marks)
needle_seed = 1234  # needle: seed of the evaluation documents (filler offsets, names, keys)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------


def load_tokenizer(name, train_cfg, vocab_size):
    """get_tokenizer of: the name given, else the checkpoint data's meta.json, else a guess from vocab_size."""
    from prepare_data import default_data_dir, get_tokenizer, load_meta
    if not name:
        data_dir = train_cfg.get("data_dir") or ""
        if not data_dir and train_cfg.get("dataset") and train_cfg.get("tokenizer"):
            data_dir = default_data_dir(train_cfg["dataset"], train_cfg["tokenizer"])
        if data_dir and os.path.exists(os.path.join(data_dir, "meta.json")):
            name = load_meta(data_dir)["tokenizer"]
        else:
            name = train_cfg.get("tokenizer") or {257: "byte", 50257: "gpt2"}.get(vocab_size, "")
    if not name:
        raise ValueError(f"cannot tell the tokenizer of a model with vocab_size={vocab_size}: "
                         f"pass --tokenizer=byte or --tokenizer=gpt2")
    tok = get_tokenizer(name)
    if tok.vocab_size != vocab_size:
        raise ValueError(f"tokenizer {name!r} has {tok.vocab_size} tokens, the model {vocab_size}: pass the "
                         f"tokenizer it was trained with, or leave --tokenizer empty to take it from the checkpoint")
    return tok


def read_prompt(start):
    """The prompt text: start itself, or the contents of the file named by "FILE:path"."""
    if start.startswith("FILE:"):
        path = start[5:]
        if not os.path.isfile(path):
            raise ValueError(f"start={start!r}: no such file {path!r}")
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"start={start!r}: {path} is not UTF-8 text ({e.reason} at byte {e.start}): save the "
                             f"prompt as UTF-8") from None
        except OSError as e:
            raise ValueError(f"start={start!r}: cannot read {path} ({e.strerror})") from None
    return start


def sample_next(logits, temperature, top_k, top_p, generator):
    """Next token per row from logits (B, vocab): argmax at temperature 0, else a draw after top-k and top-p cuts.
    Stays on the device (no host sync)."""
    if temperature == 0:
        return logits.argmax(dim=-1)                                           # (B,)
    logits = logits.float() / temperature                                      # (B, vocab)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]                 # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        srt, order = torch.sort(logits, dim=-1, descending=True)               # (B, vocab)
        p = torch.softmax(srt, dim=-1)
        drop = p.cumsum(dim=-1) - p >= top_p                                   # mass before this token already enough
        logits = logits.scatter(-1, order, srt.masked_fill(drop, float("-inf")))
    probs = torch.softmax(logits, dim=-1)                                      # (B, vocab)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]              # (B,)


@torch.no_grad()
def decode(model, tok, pos, steps, pick, how="eager", on_token=None, record=False):
    """The decode loop of generate and needle_decode, over the caches that model.prefill filled: each step reads tok
    (B,) at pos (B,) int64, and pick(logits (B, vocab)) gives the tokens (B,) that on_token(tokens) sees and the next
    step reads. how: 'eager' | 'compile' (on CUDA a CUDA graph per step) | 'graph' (CUDA: one captured graph replayed
    after the first step). Returns each step's tokens, the synced perf_counter times of the start, the end of the
    first step (compilation, capture) and the end, and with record=True each NSA layer's (sel_idx, sel_score, gate,
    reads, pos) of row 0 at every step, stacked on the CPU as plot_selection_png takes them (else None)."""
    cuda, caches = tok.device.type == "cuda", [block.attn.kv_cache for block in model.blocks]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tok, pos = tok.clone(), pos.clone()                                        # the steps' static inputs (B,), (B,)
    step = model.decode_step
    if how == "compile":
        step = torch.compile(step, fullgraph=True, mode="reduce-overhead" if cuda else None)
    out, rec = [], []
    sync()
    t0 = t1 = time.perf_counter()
    for i in range(steps):
        if how == "compile" and cuda:
            torch.compiler.cudagraph_mark_step_begin()
        out.append(pick(step(tok, pos)))                                       # (B,)
        if on_token:  # the caches still hold this step's reads, blocks and gate
            on_token(out[-1])
        if record:
            rec.append([[t[0].clone() for t in (c.sel_idx, c.sel_score, c.gate, c.reads)] + [pos[0].clone()]
                        for c in caches])
        tok.copy_(out[-1])
        pos.add_(1)
        if i == 0:
            if how == "graph" and cuda:
                step = captured_step(model, tok, pos)
            sync()
            t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    rec = [[torch.stack([r[i][k] for r in rec]).cpu() for k in range(5)] for i in range(len(caches))] if rec else None
    return out, (t0, t1, t2), rec


def captured_step(model, tok, pos):
    """model.decode_step on the static tok, pos as one captured CUDA graph (its replay and logits), else itself."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):                                          # records the step, runs nothing
            logits = model.decode_step(tok, pos)
        return lambda tok, pos: graph.replay() or logits
    except RuntimeError as e:
        print(f"note: CUDA graph capture failed ({e}); timing eager steps")
        return model.decode_step


@torch.no_grad()
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, generator=None, compile=False,
             record_layer=-1, on_token=None):
    """Sample max_new_tokens after each prompt (a list of token-id lists, lengths may differ: right-padded prefill
    with per-row positions), the first from the prefill's logits, the others by decode(). Returns (new tokens
    (B, max_new_tokens) on the CPU, stats dict); with record_layer >= 0 stats["record"] holds that layer's sel_idx,
    sel_score, gate, reads and pos of row 0 at every decode step. on_token(tokens) is called with each step's new
    tokens (B,) as soon as they are sampled (a host sync each)."""
    dev = model.lm_head.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    idx = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    idx, lengths = idx.to(dev), torch.tensor([len(p) for p in prompts], device=dev)   # (B, T), (B,)
    model.setup_cache(B, T + max_new_tokens)
    pick = lambda logits: sample_next(logits, temperature, top_k, top_p, generator)  # noqa: E731
    t_start = time.perf_counter()
    first = pick(model.prefill(idx, lengths)[torch.arange(B, device=dev), lengths - 1])   # (B,)
    if on_token:
        on_token(first)
    out, (t0, t1, t2), rec = decode(model, first, lengths, max_new_tokens - 1, pick, "compile" if compile else "eager",
                                    on_token, record_layer >= 0)
    steps = max(0, max_new_tokens - 2)
    stats = dict(prefill_s=t0 - t_start, first_step_s=t1 - t0, steps=steps, decode_s=t2 - t1,
                 tokens_per_s=B * steps / (t2 - t1) if steps else 0.0)
    if record_layer >= 0:
        stats["record"] = rec[record_layer] if rec else None
    return torch.stack([first] + out, dim=1).cpu(), stats                     # (B, max_new_tokens)


def print_row0(tok, prompt):
    """An on_token callback for generate() that prints the prompt and then row 0's text as its tokens arrive; called
    with None, it prints what is left and ends the line. Text that ends in U+FFFD (a character whose bytes have not
    all arrived) waits for the next token, so the pieces add up to tok.decode(prompt + row 0)."""
    pending = list(prompt)

    def on_token(tokens):
        if tokens is not None:
            pending.append(int(tokens[0]))
        text = tok.decode(pending)
        if tokens is None or not text.endswith("\ufffd"):
            print(text, end="\n" if tokens is None else "", flush=True)
            pending.clear()
    return on_token


def plot_selection_png(path, record, config, layer, group, mark_block=-1):
    """Draw, for one layer and KV group of batch row 0: the compressed-attention scores of every selection block
    (Eq. 10) at each generated position, the blocks actually read on top, and the gate mix of the three branches.
    mark_block >= 0 draws a line at that block (the needle evaluation marks the pass key's block)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401
    idx, score, gate, reads, pos = record                                      # (N, H, n), (N, H, nb), (N, HQ, 3), ...
    G = config.n_head // config.n_kv_head
    pos = pos.numpy()
    nb = int(pos.max()) // config.sel_block + 1                                # blocks any drawn position can read
    s = score[:, group, :nb].float()                                           # (N, nb)
    s = s / s.amax(dim=1, keepdim=True).clamp_min(1e-30)                       # each position's scores on [0, 1]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, layout="constrained",
                                   gridspec_kw=dict(height_ratios=[3, 1]))
    x0, x1 = pos[0] - 0.5, pos[-1] + 0.5
    im = ax1.imshow(s.T.numpy(), aspect="auto", origin="lower", cmap="Greys", extent=(x0, x1, -0.5, nb - 0.5),
                    vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=[ax1, ax2], pad=0.01, shrink=0.7, anchor=(0.0, 1.0), label="block score / row max (Eq. 10)")
    ax1.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    sel = idx[:, group].long()                                                 # (N, n)
    px = torch.from_numpy(pos)[:, None].expand_as(sel)[sel >= 0]
    ax1.scatter(px.numpy(), sel[sel >= 0].numpy(), s=12, c="tab:red", marker="s", label="block read")
    if mark_block >= 0:  # the needle evaluation: the block that holds the pass key
        ax1.axhline(mark_block, color="tab:blue", lw=0.8, ls=":", label=f"needle (block {mark_block})")
    ax1.set_ylabel(f"selection block j (l'={config.sel_block} tokens)")
    ax1.set_title(f"NSA layer {layer}, KV group {group}: blocks read (red) over their compressed scores (grey)")
    ax1.legend(loc="upper left")
    g = gate[:, group * G:(group + 1) * G].float().mean(dim=1).numpy()        # (N, 3) mean over the group's heads
    for k, name in enumerate(("compressed", "selected", "window")):
        ax2.plot(pos, g[:, k], label=name)
    ax2.set_xlabel("position of the generated token")
    ax2.set_ylabel(f"gate ({config.gate})")
    ax2.set_xlim(x0, x1)
    ax2.legend(loc="best", ncol=3)
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def load_checked():
    """load_model(out_dir, backend), then device checked against the backend the model runs on (the checkpoint's,
    when backend is not set)."""
    model, train_cfg = load_model(out_dir, backend)
    resolve_device(device, model.config.backend)
    return model, train_cfg


def main():
    stop_on_sigterm()
    global device
    device = resolve_device(device, backend)
    check_choice(dtype=("float32", "bfloat16", "float16"))
    if torch.device(device).type == "cpu":
        torch.set_num_threads(cpu_threads())
    if needle:
        return needle_main()
    if max_new_tokens < 1 or num_samples < 1:
        raise ValueError(f"max_new_tokens and num_samples must be >= 1, got {max_new_tokens}, {num_samples}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}")
    torch.manual_seed(seed)
    model, train_cfg = load_checked()
    cfg = model.config
    if plot_selection:
        if cfg.attn != "nsa":
            raise ValueError(f"--plot_selection needs an NSA model, this checkpoint has attn={cfg.attn!r}")
        if not (0 <= plot_layer < cfg.n_layer and 0 <= plot_group < cfg.n_kv_head):
            raise ValueError(f"plot_layer must be in [0, {cfg.n_layer}) and plot_group in [0, {cfg.n_kv_head}), "
                             f"got {plot_layer}, {plot_group}")
        try:
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise ValueError("--plot_selection needs matplotlib: pip install matplotlib") from e
    tok = load_tokenizer(tokenizer, train_cfg, cfg.vocab_size)
    prompt = tok.encode(read_prompt(start))
    if not prompt:
        raise ValueError(f"start={start!r} is empty: give a prompt of at least one token (--start=TEXT or FILE:path)")
    model.to(device=device, dtype=getattr(torch, dtype))
    gen = torch.Generator(device=device).manual_seed(seed)
    show = print_row0(tok, prompt) if stream else None
    new, stats = generate(model, [prompt] * num_samples, max_new_tokens, temperature, top_k, top_p, gen, compile,
                          plot_layer if plot_selection else -1, show)
    for b, row in enumerate(new.tolist()):
        if show and b == 0:
            show(None)                                                         # the rest of sample 0
        else:
            print(tok.decode(prompt + row))
        print("---------------")
    print(f"{num_samples} x {max_new_tokens} tokens on {device} ({dtype}, {cfg.attn}, compile={compile}): prefill of "
          f"{len(prompt)} tokens {stats['prefill_s'] * 1e3:.0f} ms, first step {stats['first_step_s'] * 1e3:.0f} ms, "
          f"then {stats['tokens_per_s']:.1f} tokens/s")
    if plot_selection and stats["record"] is not None:
        plot_selection_png(plot_selection, stats["record"], cfg, plot_layer, plot_group)
        print(f"wrote {plot_selection}")


# -----------------------------------------------------------------------------
# needle in a haystack: a pass key hidden at a chosen depth of Shakespeare filler (prepare_data.needle_document), the
# question at the end, greedy decode through the KV cache. Per context length: accuracy at each depth, the keys a
# decode step reads, decode tokens/s; for NSA, whether the selected branch read the needle's block at the answer step.


def needle_prompts(filler, length, depths, trials, count, seed):
    """Prompts of `length` tokens, depth-major: int64 (N, length), keys (N, KEY_DIGITS), key positions (N,) and depth
    index (N,) with N = len(depths) * trials. The same (seed, length, depth, trial) gives the same document."""
    import numpy as np
    from prepare_data import KEY_DIGITS, needle_document
    prompts, keys, key_pos, depth_ix = [], [], [], []
    for i, depth in enumerate(depths):
        for t in range(trials):
            tokens, kp, ap = needle_document(filler, length, depth, np.random.default_rng([seed, length, i, t]), count)
            prompts.append(tokens[:ap].astype(np.int64))
            keys.append(tokens[ap:ap + KEY_DIGITS].astype(np.int64))
            key_pos.append(kp)
            depth_ix.append(i)
    return (torch.from_numpy(np.stack(prompts)), torch.from_numpy(np.stack(keys)), torch.tensor(key_pos),
            torch.tensor(depth_ix))


@torch.no_grad()
def needle_decode(model, prompts, steps, record=False):
    """Greedy decode of `steps` tokens after prompts (B, L) on the model's device. The prefill takes the first L - 1
    tokens, so the first decode step (the answer step) reads the last prompt token and predicts the first answer
    token. On CUDA the later steps replay one captured CUDA graph. Returns (tokens (B, steps) on the CPU, the answer
    step's selected blocks (n_layer, B, H, n) for NSA else None, its reads (n_layer, B, H, branches), seconds of the
    steps - 1 timed steps, and with record=True decode()'s record of row 0 at every step)."""
    B, L = prompts.shape
    model.setup_cache(B, L + steps)
    lengths = torch.full((B,), L - 1, dtype=torch.long, device=prompts.device)
    model.prefill(prompts[:, :-1], lengths)
    nsa, answer = model.config.attn == "nsa", []

    def at_answer(tokens):                                                     # the first step: every row's reads
        if not answer:
            answer.append(torch.stack([b.attn.kv_cache.sel_idx for b in model.blocks]).cpu() if nsa else None)
            answer.append(model.decode_reads().cpu())
    out, (_, t1, t2), rec = decode(model, prompts[:, -1], lengths, steps, lambda logits: logits.argmax(-1), "graph",
                                   at_answer, record)
    return torch.stack(out, dim=1).cpu(), *answer, t2 - t1, rec


@torch.no_grad()
def needle_val(model, data_dir, rows):
    """Teacher-forced loss (nats per digit), digit accuracy and key accuracy on the answers of the first `rows` val
    rows that hold one (prepare_data.needle_answers), each row one var-length forward over its documents."""
    import numpy as np
    import torch.nn.functional as F
    from prepare_data import KEY_DIGITS, load_meta, needle_answers, open_shard
    meta, marks = load_meta(data_dir), needle_answers(data_dir, "val")
    dev, eot = model.lm_head.weight.device, meta["eot"]
    losses, hits = [], []
    shard, R = open_shard(os.path.join(data_dir, meta["splits"]["val"]["shards"][0]["file"])), meta["row_tokens"]
    for r in np.unique(marks[:, 1] // R)[:rows]:
        row = torch.from_numpy(shard[r * R:(r + 1) * R].astype(np.int64))     # (R,) one training row
        x = row[:-1]                                                           # (T,)
        starts = torch.nonzero((x == eot) | (torch.arange(len(x)) == 0))[:, 0]
        cu = torch.cat([starts, torch.tensor([len(x)])]).to(torch.int32)       # (N + 1,) a sequence per document
        logits = model(x[None].to(dev), cu_seqlens=cu.to(dev))[0][0].float()  # (T, vocab)
        for ans in marks[marks[:, 1] // R == r, 3] - r * R:
            at = torch.arange(ans - 1, ans - 1 + KEY_DIGITS)                   # positions whose next token is a digit
            losses.append(F.cross_entropy(logits[at.to(dev)], row[at + 1].to(dev), reduction="none").cpu())
            hits.append(logits[at.to(dev)].argmax(-1).cpu() == row[at + 1])
    losses, hits = torch.stack(losses), torch.stack(hits)                      # (answers, KEY_DIGITS) each
    return dict(answers=len(hits), loss=losses.mean().item(), digit_acc=hits.float().mean().item(),
                key_acc=hits.all(-1).float().mean().item())


def needle_grid(model, filler):
    """The evaluation: for each context length, every (depth, trial) document decoded in batches of
    needle_batch_tokens. Returns one dict per (length, depth) (the CSV rows) and, for NSA with
    needle_plot_length, the selection record of the depth-50% document at that length."""
    from prepare_data import KEY_DIGITS
    cfg, nsa = model.config, model.config.attn == "nsa"
    dev = model.lm_head.weight.device
    rows = []
    for L in needle_lengths:
        prompts, keys, key_pos, depth_ix = needle_prompts(filler, L, needle_depths, needle_trials, needle_count,
                                                          needle_seed)
        per = max(1, needle_batch_tokens // L)
        correct, hit, reads, seconds, timed = [], [], [], 0.0, 0
        for a in range(0, len(prompts), per):
            new, sel, rd, s, _ = needle_decode(model, prompts[a:a + per].to(dev), needle_steps)
            correct.append((new[:, :KEY_DIGITS] == keys[a:a + per]).all(-1))    # (b,)
            reads.append(rd.sum(-1).double().mean())
            seconds, timed = seconds + s, timed + new.shape[0] * (needle_steps - 1)
            if nsa:  # the needle's block(s): where its key digits stand
                lo = (key_pos[a:a + per] // cfg.sel_block)[None, :, None, None]
                hi = ((key_pos[a:a + per] + KEY_DIGITS - 1) // cfg.sel_block)[None, :, None, None]
                hit.append(((sel >= lo) & (sel <= hi)).any(-1).float())        # (n_layer, b, H)
        correct, hit = torch.cat(correct), torch.cat(hit, dim=1) if nsa else None
        for i, depth in enumerate(needle_depths):
            mine = depth_ix == i
            row = dict(model=cfg.attn, length=L, depth=depth, trials=int(mine.sum()),
                       accuracy=round(correct[mine].float().mean().item(), 4),
                       keys_read=round(torch.stack(reads).mean().item(), 1),
                       tokens_per_s=round(timed / seconds, 1) if seconds else "",
                       ms_per_step=round(1e3 * seconds / max(1, needle_steps - 1) / -(-len(prompts) // per), 3),
                       batch=min(per, len(prompts)), sel_hit="", sel_hit_best_layer="")
            if nsa:
                row["sel_hit"] = round(hit[:, mine].mean().item(), 4)
                row["sel_hit_best_layer"] = round(hit[:, mine].mean(dim=(1, 2)).max().item(), 4)
            rows.append(row)
        r = rows[-1]
        print(f"length {L}: accuracy {correct.float().mean().item():.3f}, {r['keys_read']:.0f} keys read per token, "
              f"{r['tokens_per_s']} tokens/s ({r['ms_per_step']} ms per step of {r['batch']} rows)"
              + (f", needle block selected {hit.mean().item():.3f}" if nsa else ""), flush=True)
    record = None
    if nsa and needle_plot_length:
        prompts, keys, key_pos, _ = needle_prompts(filler, needle_plot_length, (0.5,), 1, needle_count, needle_seed)
        new, sel, _, _, rec = needle_decode(model, prompts.to(dev), needle_steps, record=True)
        block = int(key_pos[0]) // cfg.sel_block
        layers = [i for i in range(cfg.n_layer) if (sel[i, 0] == block).any()]
        record = dict(block=block, layer=layers[0] if layers else 0, layers=layers, rec=rec,
                      correct=bool((new[0, :KEY_DIGITS] == keys[0]).all()))
    return rows, record


def read_needle_csv(path):
    """(model name, lengths, depths, accuracy (n_depths, n_lengths) as nested lists) of a needle CSV."""
    import csv
    with open(path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path} holds no rows of a needle evaluation")
    lengths = sorted({int(r["length"]) for r in rows})
    depths = sorted({float(r["depth"]) for r in rows})
    acc = {(int(r["length"]), float(r["depth"])): float(r["accuracy"]) for r in rows}
    return rows[0]["model"], lengths, depths, [[acc.get((L, d), float("nan")) for L in lengths] for d in depths]


def plot_needle_heatmap(path, csv_paths, train_len):
    """The paper's Fig. 5 layout: context length across, needle depth down (0% at the top), the accuracy of each
    cell in colour (red 0 .. green 1) and in numbers; one panel per CSV; a dashed line after the training length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tables = [read_needle_csv(p) for p in csv_paths]
    fig, axes = plt.subplots(1, len(tables), figsize=(5.2 * len(tables) + 1, 4.4), squeeze=False, layout="constrained")
    for ax, (name, lengths, depths, acc) in zip(axes[0], tables):
        im = ax.imshow(acc, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        for i, row in enumerate(acc):
            for j, a in enumerate(row):
                ax.text(j, i, f"{100 * a:.0f}", ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L >= 1024 else str(L) for L in lengths])
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}" for d in depths])
        if train_len in lengths[:-1]:
            ax.axvline(lengths.index(train_len) + 0.5, color="k", ls="--", lw=1)
        mean = sum(a for row in acc for a in row) / sum(len(row) for row in acc)
        ax.set(xlabel="context length (tokens)", ylabel="needle depth (%)", title=f"{name}: mean accuracy {mean:.2f}")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="accuracy")
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def needle_main():
    """sample.py --needle=True: the evaluation of out_dir's model; writes <needle_out>.csv, .png (heatmap) and, for
    NSA, <needle_out>_selection.png (plot_selection_png of the depth-50% document at needle_plot_length)."""
    import csv
    import io
    from prepare_data import KEY_DIGITS, load_meta, needle_min_length
    if not needle_lengths or min(needle_lengths) < needle_min_length(needle_count):
        raise ValueError(f"needle_lengths must be >= {needle_min_length(needle_count)} tokens for "
                         f"needle_count={needle_count}, got {needle_lengths}")
    if not needle_depths or not all(0.0 <= d <= 1.0 for d in needle_depths):
        raise ValueError(f"needle_depths must lie in [0, 1], got {needle_depths}")
    if needle_trials < 1 or needle_steps < KEY_DIGITS or needle_batch_tokens < 1 or not 1 <= needle_count <= 24:
        raise ValueError(f"need needle_trials >= 1, needle_steps >= {KEY_DIGITS}, needle_batch_tokens >= 1 and "
                         f"needle_count in [1, 24], got {needle_trials}, {needle_steps}, {needle_batch_tokens}, "
                         f"{needle_count}")
    torch.manual_seed(seed)
    model, train_cfg = load_checked()
    cfg = model.config
    data_dir = needle_data or train_cfg.get("data_dir", "")
    meta = load_meta(data_dir) if data_dir else {}
    if meta.get("dataset") != "needle":
        raise ValueError(f"needle=True needs the directory of `prepare_data.py --dataset=needle` (its val filler): "
                         f"pass --needle_data=DIR (got {data_dir!r})")
    with open(os.path.join(data_dir, meta["needle"]["filler_val"]), "rb") as f:
        filler = f.read()
    model.to(device=device, dtype=getattr(torch, dtype))
    prefix = needle_out or os.path.join(out_dir, "needle")
    val = needle_val(model, data_dir, needle_val_rows)
    print(f"val answers, teacher-forced: {val['answers']} keys, loss {val['loss']:.4f} nats per digit, digit "
          f"accuracy {val['digit_acc']:.3f}, key accuracy {val['key_acc']:.3f}")
    rows, record = needle_grid(model, filler)
    table = io.StringIO()
    w = csv.DictWriter(table, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    atomic_write(prefix + ".csv", lambda f: f.write(table.getvalue().encode()))
    lengths = list(needle_lengths)
    print(f"\n{cfg.attn} accuracy (rows: depth %, columns: context length; {needle_trials} documents per cell)")
    print("depth " + "".join(f"{L:>7}" for L in lengths))
    for d in needle_depths:
        print(f"{100 * d:5.0f} " + "".join(f"{r['accuracy']:7.2f}" for r in rows if r["depth"] == d))
    per_length = [next(r for r in rows if r["length"] == L) for L in lengths]
    for key in ("keys_read", "tokens_per_s", "ms_per_step") + (("sel_hit",) if cfg.attn == "nsa" else ()):
        vals = [r[key] if key != "sel_hit" else
                sum(x["sel_hit"] for x in rows if x["length"] == L) / len(needle_depths)
                for L, r in zip(lengths, per_length)]
        print(f"{key:>12} " + " ".join(f"{v:>9.4g}" if v != "" else f"{'':>9}" for v in vals))
    print(f"wrote {prefix}.csv")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("matplotlib is not installed: no heatmap or selection plot (pip install matplotlib)")
        return
    plot_needle_heatmap(prefix + ".png", [prefix + ".csv"] + ([needle_compare] if needle_compare else []),
                        cfg.block_size)
    print(f"wrote {prefix}.png")
    if record is not None:
        plot_selection_png(prefix + "_selection.png", record["rec"][record["layer"]], cfg, record["layer"], 0,
                           record["block"])
        print(f"wrote {prefix}_selection.png: layer {record['layer']}, KV group 0, {needle_plot_length} tokens, "
              f"needle in block {record['block']} (selected at the answer step in layers {record['layers']}), "
              f"answer {'right' if record['correct'] else 'wrong'}")


if __name__ == "__main__":
    main()
