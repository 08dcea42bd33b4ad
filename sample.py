"""Sample from a trained model: loads out_dir/ckpt.pt (train.py) or model.safetensors + config.json, prefills the prompt
into each layer's static decode cache (model.py, nsa_attention.py) and generates one token per step, printing sample 0
as it comes and then tokens/s. `python sample.py --out_dir=out --start="ROMEO:"`; `--plot_selection=sel.png` draws
which blocks NSA read at each step.
"""
import json
import os
import time

import torch

from model import GPT, GPTConfig, cpu_threads, load_checkpoint, read_safetensors

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
device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu | cuda | cuda:1 ...
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"  # or float16
compile = torch.cuda.is_available()  # compile the one-token step (CUDA: mode="reduce-overhead", one CUDA graph a step)
tokenizer = ""  # "" = from the checkpoint's data dir meta.json (or vocab_size 257 -> byte, 50257 -> gpt2); byte | gpt2
backend = ""  # "" = the checkpoint's NSA kernel backend; auto | torch | triton
plot_selection = ""  # FILE.png: selected blocks, their scores and the gate mix at each generated position (matplotlib)
plot_layer = 0  # layer that plot_selection draws
plot_group = 0  # KV group that plot_selection draws (batch row 0)
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
# -----------------------------------------------------------------------------


def load_model(out_dir, backend=""):
    """The GPT of out_dir/ckpt.pt (train.py), else of out_dir/model.safetensors + config.json, in eval mode on the CPU;
    and its training config dict."""
    path, st_path, json_path = (os.path.join(out_dir, f) for f in ("ckpt.pt", "model.safetensors", "config.json"))
    if os.path.exists(path):
        ckpt = load_checkpoint(path)
        model_args, state, train_cfg = ckpt["model_args"], ckpt["model"], ckpt.get("config", {})
    elif os.path.exists(st_path):
        if not os.path.exists(json_path):
            raise ValueError(f"{st_path} needs {json_path} beside it (the GPTConfig arguments)")
        state, path = read_safetensors(st_path), st_path
        try:
            with open(json_path) as f:
                train_cfg = json.load(f)
        except ValueError as e:
            raise ValueError(f"{json_path} is not valid JSON ({e})") from e
        fields = GPTConfig.__dataclass_fields__
        model_args = train_cfg.get("model_args", {k: v for k, v in train_cfg.items() if k in fields})
        train_cfg = train_cfg.get("config", train_cfg)
    else:
        raise ValueError(f"no checkpoint in out_dir={out_dir!r}: expected ckpt.pt (train.py) or model.safetensors + "
                         f"config.json")
    if backend:
        model_args = {**model_args, "backend": backend}
    try:
        model = GPT(GPTConfig(**model_args))
    except TypeError as e:
        raise ValueError(f"{path}: model_args do not fit GPTConfig ({e})") from e
    if model.config.tie_embeddings and "lm_head.weight" not in state and "wte.weight" in state:
        state = {**state, "lm_head.weight": state["wte.weight"]}  # safetensors keeps one copy of a tied weight
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{path}: the weights do not match model_args ({e})") from e
    return model.eval(), train_cfg


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
        with open(path, encoding="utf-8") as f:
            return f.read()
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
def generate(model, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, generator=None, compile=False,
             record_layer=-1, on_token=None):
    """Sample max_new_tokens after each prompt (a list of token-id lists, lengths may differ: right-padded prefill
    with per-row positions). Returns (new tokens (B, max_new_tokens) on the CPU, stats dict); with record_layer >= 0
    stats["record"] holds that layer's sel_idx, sel_score, gate and reads of row 0 at every decode step.
    on_token(tokens) is called with each step's new tokens (B,) as soon as they are sampled (a host sync each)."""
    dev = model.lm_head.weight.device
    B, T = len(prompts), max(len(p) for p in prompts)
    idx = torch.zeros(B, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    idx, lengths = idx.to(dev), torch.tensor([len(p) for p in prompts], device=dev)   # (B, T), (B,)
    model.setup_cache(B, T + max_new_tokens)
    step = model.decode_step
    if compile:
        step = torch.compile(step, fullgraph=True, mode="reduce-overhead" if dev.type == "cuda" else None)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    logits = model.prefill(idx, lengths)[torch.arange(B, device=dev), lengths - 1]   # (B, vocab)
    out, rec = [sample_next(logits, temperature, top_k, top_p, generator)], []
    if on_token:
        on_token(out[-1])
    sync()
    t1 = t2 = time.perf_counter()
    pos = lengths
    for i in range(max_new_tokens - 1):
        if dev.type == "cuda" and compile:
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(out[-1], pos)                                            # (B, vocab)
        out.append(sample_next(logits, temperature, top_k, top_p, generator))
        if on_token:
            on_token(out[-1])
        if record_layer >= 0:
            c = model.blocks[record_layer].attn.kv_cache
            rec.append([t[0].clone() for t in (c.sel_idx, c.sel_score, c.gate, c.reads)] + [pos[0].clone()])
        pos = pos + 1
        if i == 0:
            sync()
            t2 = time.perf_counter()                                           # after the first step (and compilation)
    new = torch.stack(out, dim=1).cpu()                                        # (B, max_new_tokens)
    t3 = time.perf_counter()
    steps = max(0, max_new_tokens - 2)
    stats = dict(prefill_s=t1 - t0, first_step_s=t2 - t1, steps=steps, decode_s=t3 - t2,
                 tokens_per_s=B * steps / (t3 - t2) if steps else 0.0)
    if record_layer >= 0:
        stats["record"] = [torch.stack([r[k] for r in rec]).cpu() for k in range(5)] if rec else None
    return new, stats


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


def plot_selection_png(path, record, config, layer, group):
    """Draw, for one layer and KV group of batch row 0: the compressed-attention scores of every selection block
    (Eq. 10) at each generated position, the blocks actually read on top, and the gate mix of the three branches."""
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
    from prepare_data import atomic_write
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)


def main():
    if max_new_tokens < 1 or num_samples < 1:
        raise ValueError(f"max_new_tokens and num_samples must be >= 1, got {max_new_tokens}, {num_samples}")
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0, top_k >= 0, 0 < top_p <= 1, got {temperature}, {top_k}, {top_p}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if torch.device(device).type == "cpu":
        torch.set_num_threads(cpu_threads())
    torch.manual_seed(seed)
    model, train_cfg = load_model(out_dir, backend)
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


if __name__ == "__main__":
    main()
