"""A small GPT decoder whose attention is NSA (nsa_attention.py) or dense causal SDPA, chosen by GPTConfig.attn.
Token embedding -> n_layer x (RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual) -> RMSNorm -> head.
train.py trains it, sample.py samples from it, bench.py times its attention.
"""
import contextlib
import csv
import inspect
import io
import json
import math
import os
import resource
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nsa_attention import (DecodeCache, NSAAttention, check_cu_seqlens, check_heads, check_prefill, positions, rope,
                           tokens_read_per_query)
from prepare_data import atomic_write


@dataclass
class GPTConfig:
    vocab_size: int = 257          # byte tokenizer: 256 bytes + EOT
    block_size: int = 1024         # longest training sequence
    n_layer: int = 6
    n_head: int = 8                # HQ, query heads
    n_kv_head: int = 2             # H, key/value heads (GQA group G = n_head // n_kv_head)
    n_embd: int = 512
    mlp_hidden: int = 0            # SwiGLU hidden size; 0 -> 8/3 * n_embd rounded up to a multiple of 64
    attn: str = "nsa"              # "nsa" | "dense"
    tie_embeddings: bool = True
    ignore_index: int = -1         # targets equal to this are left out of the loss
    dropout: float = 0.0           # on the embedding and each residual branch while training (off in eval/decode)
    rope_theta: float = 10000.0
    # NSA (the definition in nsa_attention.py): l, d, l', n, forced blocks, w, gate, phi's hidden size, kernels
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    n_select: int = 16
    n_init: int = 1
    n_local: int = 2
    window: int = 512
    gate: str = "softmax"          # "softmax" | "sigmoid"
    cmp_hidden: int = 256
    backend: str = "auto"          # "auto" | "torch" | "triton"


PRESETS = {  # small shapes for tests
    "tiny": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=256, cmp_block=8, cmp_stride=4,
                 sel_block=16, n_select=4, window=32, cmp_hidden=32),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DenseAttention(nn.Module):
    """Causal GQA attention through F.scaled_dot_product_attention: the baseline every NSA run is compared with."""

    def __init__(self, config):
        super().__init__()
        C, HQ, H = check_heads(config)
        self.HQ, self.H, self.D, self.theta = HQ, H, C // HQ, config.rope_theta
        self.wq = nn.Linear(C, HQ * self.D, bias=False)
        self.wkv = nn.Linear(C, 2 * H * self.D, bias=False)
        self.wo = nn.Linear(HQ * self.D, C, bias=False)

    def forward(self, x, cu_seqlens=None):
        return self._forward(x, cu_seqlens)[0]

    def _forward(self, x, cu_seqlens):
        """forward's output (B, T, C) and its keys (with RoPE) and values (B, T, H, D), which prefill caches."""
        B, T, C = x.shape
        pos = positions(cu_seqlens, T, x.device)                               # (T,)
        q = rope(self.wq(x).view(B, T, self.HQ, self.D), pos, self.theta)      # (B, T, HQ, D)
        k, v = self.wkv(x).view(B, T, 2, self.H, self.D).unbind(2)             # (B, T, H, D) each
        k = rope(k, pos, self.theta)
        if cu_seqlens is None:
            mask = None
        else:  # block-diagonal causal mask: same sequence and not in the future
            seq = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(T, device=x.device), right=True)
            mask = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, enable_gqa=True)   # (B, HQ, T, D)
        return self.wo(o.transpose(1, 2).reshape(B, T, C)), k, v

    # -- decode: a static K/V cache, as NSAAttention's (same methods, nsa_attention.py's DecodeCache) --

    def setup_cache(self, batch_size, max_len, device=None, dtype=None):
        """Allocate a static K/V cache (B, H, max_len, D) for batch_size rows of up to max_len tokens."""
        w = self.wq.weight
        shape, dt = (batch_size, self.H, max_len, self.D), dtype or w.dtype
        self.kv_cache = DecodeCache(batch_size, max_len, device or w.device, k=(shape, dt), v=(shape, dt),
                                    reads=((batch_size, self.H, 1), torch.int64))

    def prefill(self, x, lengths):
        """forward(x) for right-padded rows x (B, T, C) with lengths (B,); caches K/V of positions 0..T-1."""
        c = getattr(self, "kv_cache", None)
        check_prefill(c, x.shape[0], x.shape[1], lengths)
        out, k, v = self._forward(x, None)
        c.k[:, :, :x.shape[1]], c.v[:, :, :x.shape[1]] = k.transpose(1, 2), v.transpose(1, 2)
        return out

    def decode(self, x, pos):
        """One token per row: x (B, 1, C) at positions pos (B,) int64 -> (B, 1, C); reads (B, H, 1) = pos + 1."""
        c, B = self.kv_cache, x.shape[0]
        rows = torch.arange(B, device=x.device)                                # (B,)
        q = rope(self.wq(x).view(1, B, self.HQ, self.D), pos, self.theta)[0]   # (B, HQ, D): rows act as T for rope
        k, v = self.wkv(x[:, 0]).view(B, 2, self.H, self.D).unbind(1)          # (B, H, D) each
        c.k[rows, :, pos] = rope(k[None], pos, self.theta)[0]
        c.v[rows, :, pos] = v
        allowed = torch.arange(c.k.shape[2], device=x.device)[None, :] <= pos[:, None]   # (B, S)
        o = F.scaled_dot_product_attention(q[:, :, None], c.k, c.v, attn_mask=allowed[:, None, None],
                                           enable_gqa=True)                    # (B, HQ, 1, D)
        c.reads.copy_(allowed.sum(-1)[:, None, None].expand(B, self.H, 1))
        return self.wo(o.reshape(B, 1, self.HQ * self.D))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden = config.mlp_hidden or 64 * math.ceil(8 * config.n_embd / 3 / 64)
        self.w_in = nn.Linear(config.n_embd, 2 * hidden, bias=False)            # gate and up projections, fused
        self.w_out = nn.Linear(hidden, config.n_embd, bias=False)

    def forward(self, x):
        a, b = self.w_in(x).chunk(2, dim=-1)
        return self.w_out(F.silu(a) * b)                                        # SwiGLU


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(config.n_embd), RMSNorm(config.n_embd)
        self.attn = NSAAttention(config) if config.attn == "nsa" else DenseAttention(config)
        self.mlp = MLP(config)
        self.dropout = config.dropout

    def forward(self, x, cu_seqlens=None):
        x = x + F.dropout(self.attn(self.norm1(x), cu_seqlens), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.norm2(x)), self.dropout, self.training)


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.attn not in ("nsa", "dense"):
            raise ValueError(f"attn must be 'nsa' or 'dense', got {config.attn!r}")
        if not 0.0 <= config.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {config.dropout}")
        if not 0 < config.vocab_size <= 65536:
            raise ValueError(f"vocab_size must be in [1, 65536] (uint16 tokens), got {config.vocab_size}")
        if min(config.n_layer, config.n_embd, config.block_size) < 1 or config.mlp_hidden < 0:
            raise ValueError(f"n_layer, n_embd and block_size must be >= 1 and mlp_hidden >= 0, got {config.n_layer}, "
                             f"{config.n_embd}, {config.block_size}, {config.mlp_hidden}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # residual projections scaled down with depth (GPT-2)
            if name.endswith(("wo.weight", "w_out.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        for block in self.blocks:  # the NSA gate's last layer starts at zero ("Gate"), whatever _init_weights did
            if config.attn == "nsa":
                nn.init.zeros_(block.attn.gate[-1].weight)

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx, targets=None, cu_seqlens=None):
        """idx (B, T) int64 token ids; targets (B, T) or None; cu_seqlens int32 (N + 1,) with B == 1.
        Returns logits (B, T, vocab; detached when targets are given) and the mean cross-entropy over
        targets != ignore_index (or None)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got {tuple(idx.shape)}")
        B, T = idx.shape
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"targets must be (B, T) = {tuple(idx.shape)}, got {tuple(targets.shape)}")
        check_cu_seqlens(cu_seqlens, B, T, idx.device)
        x = F.dropout(self.wte(idx), self.config.dropout, self.training)       # (B, T, C)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        logits = self.lm_head(self.norm(x))                                    # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1),
                                   ignore_index=self.config.ignore_index)
            # the gradient flows through the loss; logits that required grad would have the compiled backward take a
            # zero gradient of their full size (B, T, vocab) as input, filled (and under CUDA graphs copied) each step
            logits = logits.detach()
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW; matrices decay, norms, biases, embeddings (token and phi's position tables) do not."""
        no_decay = lambda n, p: p.dim() < 2 or n.endswith(("wte.weight", "_pos"))
        params = dict(self.named_parameters())  # tied head: one entry, named wte.weight
        groups = [{"params": [p for n, p in params.items() if not no_decay(n, p)], "weight_decay": weight_decay},
                  {"params": [p for n, p in params.items() if no_decay(n, p)], "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    def keys_per_query(self, T, cu_seqlens=None):
        """Mean keys a query attends to at sequence length T: NSA counts what it really reads (Table 4). With
        cu_seqlens (N + 1,), the mean over the queries of the packed sequences instead."""
        c = self.config
        if cu_seqlens is not None:
            lens = [n for n in (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() if n]
            return sum(n * self.keys_per_query(n) for n in lens) / sum(lens)
        if c.attn == "dense":
            return (T + 1) / 2
        return sum(tokens_read_per_query(T, c.cmp_block, c.cmp_stride, c.sel_block, c.n_select, c.window))

    def flops_per_token(self, T):
        """Training FLOPs per token: 6 per weight plus attention's 2 matmuls (q.k and p.v) x 3 for fwd+bwd."""
        c = self.config
        attn = 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * self.keys_per_query(T)
        return 6 * self.num_params() + attn

    def estimate_mfu(self, tokens_per_iter, T, dt, peak_flops=None):
        """Model FLOPs utilisation: achieved training FLOP/s over the device's bf16 peak (0 when unknown)."""
        peak = peak_flops or peak_flops_of(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
        return self.flops_per_token(T) * tokens_per_iter / dt / peak if peak else 0.0

    # -- decode (sample.py drives it): each attention layer keeps a static cache, attn.kv_cache (nsa_attention.py's
    # decode section); prefill fills it from right-padded prompts, decode_step adds one token per row --

    def setup_cache(self, batch_size, max_len, device=None, dtype=None):
        """Allocate every layer's decode cache for batch_size rows of up to max_len tokens (prompt + new)."""
        if not (isinstance(batch_size, int) and batch_size > 0 and isinstance(max_len, int) and max_len > 0):
            raise ValueError(f"batch_size and max_len must be positive ints, got {batch_size!r}, {max_len!r}")
        for block in self.blocks:
            block.attn.setup_cache(batch_size, max_len, device, dtype)

    def prefill(self, idx, lengths):
        """Batched prefill of ragged prompts: idx (B, T) right-padded, row b's prompt is idx[b, :lengths[b]].
        Fills the caches and returns logits (B, T, vocab), equal to forward(idx)'s (padding never leaks into a
        row's first lengths[b] positions: every branch is causal). Decode then goes on at pos = lengths."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got {tuple(idx.shape)}")
        x = self.wte(idx)                                                      # (B, T, C)
        for block in self.blocks:
            x = x + block.attn.prefill(block.norm1(x), lengths)
            x = x + block.mlp(block.norm2(x))
        return self.lm_head(self.norm(x))                                      # (B, T, vocab)

    def decode_step(self, idx, pos):
        """One token per row: idx (B,) int64 at positions pos (B,) int64 -> logits (B, vocab) for position pos + 1.
        Shapes are static and pos is a tensor, so torch.compile traces it once (mode="reduce-overhead" on CUDA)."""
        x = self.wte(idx)[:, None]                                             # (B, 1, C)
        for block in self.blocks:
            x = x + block.attn.decode(block.norm1(x), pos)
            x = x + block.mlp(block.norm2(x))
        return self.lm_head(self.norm(x))[:, 0]                                # (B, vocab)

    def decode_reads(self):
        """Tokens the last decode step read, per layer, row, KV group and branch: (n_layer, B, H, 3) for NSA
        (compressed, selected, window), (n_layer, B, H, 1) for dense."""
        return torch.stack([block.attn.kv_cache.reads for block in self.blocks])


def peak_flops_of(device_name):
    """Dense bf16 tensor-core peak by device name (FLOP/s); 0 for unknown devices such as the CPU."""
    table = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}
    return next((v for k, v in table.items() if k in device_name), 0.0)


# ---- checkpoints, exports, the training log, NSA statistics, the machine: for train.py, sample.py and bench.py ----

def load_checkpoint(path, keys=("model_args", "model")):
    """The dict that train.py saved at path, tensors on the CPU. A missing, empty, truncated or foreign file, one
    without `keys`, or one whose weights are not finite is a ValueError of one line that names the file."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found: train a model first (python train.py ...) or point --out_dir at one")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # EOFError, UnpicklingError, RuntimeError (a broken zip), ...
        raise ValueError(f"{path} is not a readable checkpoint ({type(e).__name__}): it is empty, truncated or not "
                         f"written by train.py; train again or use another out_dir") from e
    missing = [k for k in keys if k not in ckpt] if isinstance(ckpt, dict) else list(keys)
    if missing:
        raise ValueError(f"{path} is not a train.py checkpoint: it lacks {', '.join(missing)}")
    if "model" in ckpt and not all(t.isfinite().all() for t in ckpt["model"].values() if t.is_floating_point()):
        raise ValueError(f"{path} holds non-finite weights (nan or inf): use an earlier checkpoint or train again")
    return ckpt


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}


def write_safetensors(f, tensors, metadata):
    """Writes {name: tensor} to the binary file f as safetensors, no library needed: the header's length (8 bytes,
    little-endian), the JSON header (dtype, shape, data_offsets per tensor; __metadata__), the raw tensors."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = dict(dtype=SAFETENSORS_DTYPES[t.dtype], shape=list(t.shape),
                            data_offsets=[offset, offset + len(data)])
        blobs.append(data)
        offset += len(data)
    head = json.dumps(dict(header, __metadata__=metadata), separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    f.writelines([len(head).to_bytes(8, "little"), head, *blobs])


def read_safetensors(path):
    """{name: tensor} of a .safetensors file as write_safetensors writes it; ValueError naming path if it is not one."""
    dtypes = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    try:
        if len(data) < 8 or n > len(data) - 8:
            raise ValueError(f"a header of {n} bytes does not fit a file of {len(data)}")
        header = json.loads(data[8:8 + n])
        header.pop("__metadata__", None)
        body, state = memoryview(data)[8 + n:], {}
        for name, h in header.items():
            a, b = h["data_offsets"]
            if h["dtype"] not in dtypes or not 0 <= a <= b <= len(body):
                raise ValueError(f"tensor {name!r}: dtype {h['dtype']} or offsets {a}..{b} not readable")
            raw = bytearray(body[a:b])
            t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
            state[name] = t.view(dtypes[h["dtype"]]).reshape(h["shape"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from e
    return state


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
    load_weights(model, state, path)
    return model.eval(), train_cfg


def load_weights(model, state, path):
    """model.load_state_dict(state); weights that do not fit are a one-line ValueError naming path and the first
    difference (load_state_dict lists every one, a line each)."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]   # a header, then one per difference
        raise ValueError(f"{path}: the weights do not match model_args ({lines[-1] if len(lines) == 1 else lines[1]}"
                         f"{f'; {len(lines) - 2} more' if len(lines) > 2 else ''})") from None


def export_safetensors(model, out_dir, config_json):
    """out_dir/model.safetensors (a tied lm_head.weight left out: config_json says tie_embeddings) and the dict
    config_json as out_dir/config.json (the GPTConfig arguments sample.py rebuilds the model from), each atomically."""
    tied = model.config.tie_embeddings
    state = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    path = os.path.join(out_dir, "model.safetensors")
    info = dict(format="pt", source="nanoNSA train.py", step=str(config_json.get("step", "")))
    atomic_write(path, lambda f: write_safetensors(f, state, info))
    atomic_write(os.path.join(out_dir, "config.json"), lambda f: f.write(json.dumps(config_json, indent=1).encode()))
    print(f"exported {path} and config.json")


BRANCHES = ("cmp", "slc", "win")  # NSA's branches in the order of the gate's weights


class TrainLog:
    """train_log.csv of a run: a row per logged step (kind "train") and per evaluation ("eval"), missing columns
    empty; an NSA model's rows also have nsa_stats' columns. plot() draws loss.png from it."""

    def __init__(self, path, config, compare_dir=""):
        self.path, self.png, self.compare_dir = path, os.path.join(os.path.dirname(path), "loss.png"), compare_dir
        self.name, self.title = config.attn, f"{config.attn}, T={config.block_size}"
        self.fields = ["kind", "step", "loss", "val_loss", "val_ppl", "lr", "grad_norm", "tokens_per_s", "mfu",
                       "mem_gib", "keys_per_query"]
        if config.attn == "nsa":
            self.fields += [f"L{i}_{s}_{b}{m}" for i in range(config.n_layer) for b in BRANCHES
                            for s, m in (("gate", "_mean"), ("gate", "_std"), ("share", ""))]

    def append(self, **row):
        new = not os.path.exists(self.path)
        try:
            with open(self.path, "a", newline="") as f:
                w = csv.DictWriter(f, fieldnames=self.fields)
                if new:
                    w.writeheader()
                w.writerow(row)
        except OSError as e:
            raise ValueError(f"cannot write {self.path}: {e.strerror}") from e

    def truncate(self, step):
        """Keeps the rows of steps before `step` and its evaluation (a resumed run drops what a crashed run logged
        after its last checkpoint)."""
        if not os.path.exists(self.path):
            return
        with open(self.path) as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) < step or (r["kind"] == "eval" and
                                                                              int(r["step"]) == step)]
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.fields)
        w.writeheader()
        w.writerows(rows)
        atomic_write(self.path, lambda f: f.write(buf.getvalue().encode()))

    def plot(self):
        """loss.png beside the log: train and val loss against steps, also those of compare_dir's train_log.csv
        (another run, e.g. the dense twin) when it has one; skipped without matplotlib."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        runs, other = [(self.path, self.name)], os.path.join(self.compare_dir, "train_log.csv")
        if self.compare_dir and os.path.exists(other):
            runs.append((other, os.path.basename(os.path.normpath(self.compare_dir))))
        fig, ax = plt.subplots(figsize=(7, 4))
        for n, (path, label) in enumerate(runs):
            with open(path) as f:
                rows = list(csv.DictReader(f))
            for kind, key, curve in (("train", "loss", "train (per step)"), ("eval", "val_loss", "val")):
                pts = [(int(r["step"]), float(r[key])) for r in rows if r["kind"] == kind and r[key]]
                if pts:
                    ax.plot(*zip(*pts), label=f"{label} {curve}", marker="o" if kind == "eval" else None,
                            color=f"C{2 * n + (kind == 'eval')}", alpha=1.0 if kind == "eval" else 0.5)
        ax.set(xlabel="step", ylabel="loss (nats/token)", title=self.title)
        ax.legend()
        fig.tight_layout()
        atomic_write(self.png, lambda f: fig.savefig(f, format="png", dpi=120))
        plt.close(fig)


@torch.no_grad()
def nsa_stats(model, x, cu_seqlens=None, autocast=contextlib.nullcontext()):
    """Per layer and branch: gate mean/std over tokens and heads, and the branch's share of the gated output norm,
    ||g_b * o_b|| / sum_b' ||g_b' * o_b'||. From an eager no-grad forward of the NSA model on one batch (under the
    autocast context given), with each NSAAttention recording its gate weights (B, T, HQ, 3) and gated branch
    outputs g_b * o_b (B, T, HQ, D). In eval mode: no dropout, so the statistics draw no random numbers (a training
    run stays the same whatever its statistics interval)."""
    stats, attns, training = {}, [block.attn for block in model.blocks], model.training
    for attn in attns:
        attn.record = True
    model.eval()
    try:
        with autocast:
            model(x, None, cu_seqlens)
    finally:
        model.train(training)
        for attn in attns:
            attn.record = False
    for i, attn in enumerate(attns):
        rec = attn.__dict__.pop("recorded")
        g = rec["gate"].float()                                                # (B, T, HQ, 3) gate weights
        norms = torch.stack([rec[name].float().norm() for name in BRANCHES])
        for b, name in enumerate(BRANCHES):
            stats[f"L{i}_gate_{name}_mean"] = g[..., b].mean().item()
            stats[f"L{i}_gate_{name}_std"] = g[..., b].std().item()
            stats[f"L{i}_share_{name}"] = (norms[b] / norms.sum()).item()
    return stats


def peak_memory_gib(device):
    """Peak memory of this process so far: CUDA allocations on a CUDA device, else the peak RSS (Linux: KiB)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def resolve_device(device, backend="auto"):
    """The device train.py / sample.py run on: 'auto' is cuda where available, else cpu; anything else is checked,
    and backend='triton' needs CUDA (or the interpreter, TRITON_INTERPRET=1). A bad choice is a ValueError."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s): "
                         f"use --device=cpu or --device=auto")
    if backend == "triton" and dev.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend='triton' runs the Triton kernels, which need a CUDA device (or TRITON_INTERPRET=1 "
                         "on the CPU): use --backend=auto")
    return device


def cpu_threads():
    """Torch threads for work on the CPU: OMP_NUM_THREADS when set, else 1. Torch's default of one per core stalls
    when another process holds a core (each op waits for its slowest thread), and a count that followed the load
    would change CPU rounding from run to run; the small CPU runs here gain little from more threads."""
    n = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, int(n)) if n.isdigit() else 1
