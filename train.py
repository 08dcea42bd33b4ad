"""Trains the GPT of model.py (NSA or dense attention) on the token shards of prepare_data.py, nanoGPT style.
One process: `python train.py config/cpu_smoke.py`; DDP: `torchrun --nproc_per_node=2 train.py config/track_b_8k.py`.
Writes out_dir/ckpt.pt (read by sample.py and init_from='resume'), train_log.csv, loss.png, model.safetensors."""
import functools
import math
import os
import sys
import tempfile
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from model import (GPT, GPTConfig, TrainLog, cpu_threads, export_safetensors, load_checkpoint, load_weights, nsa_stats,
                   peak_memory_gib, resolve_device)
from prepare_data import TokenShards, atomic_write, stop_on_sigterm

stop_on_sigterm()  # a checkpoint being written when SIGTERM comes leaves no temp file

# -----------------------------------------------------------------------------
# default config values: byte-level Shakespeare, NSA, Track A's model (12.6M parameters; config/track_a_shakespeare.py
# trains it with its own dropout, betas and schedule)
# I/O
out_dir = "out"  # checkpoints, train_log.csv, loss.png, model.safetensors + config.json
data_dir = "data/shakespeare_byte"  # written by prepare_data.py: train_*.bin, val_*.bin, meta.json
init_from = "scratch"  # 'scratch' | 'resume' (continues out_dir/ckpt.pt bit for bit, in its architecture) | the path
# of another run's ckpt.pt: a new run from its weights and architecture, with this run's block_size, data and schedule
# (the next stage of a length curriculum: config/needle_nsa.py)
overwrite = False  # let a new run (init_from other than 'resume') replace an earlier run's checkpoint, log and export
eval_every = 250  # steps between evaluations of train/val loss
eval_iters = 20  # batches per evaluation (the same batches every time, split over the ranks)
log_every = 10  # steps between log lines / train_log.csv rows
diag_every = 50  # steps between NSA statistics (gates, branch norms) from an extra eager forward; 0 = never
save_every = 500  # steps between checkpoints (one is always written at the end, on STOP and on max_seconds)
max_seconds = 0.0  # stop cleanly (with a checkpoint) after this many seconds of training; 0 = no limit
eval_only = False  # evaluate once (init_from='resume': the saved checkpoint) and exit, out_dir's files untouched
export = True  # write model.safetensors + config.json at the end
compare_dir = ""  # another run's out_dir (e.g. the dense twin): loss.png also draws its curves, at equal steps
seed = 1337  # model init and the data stream; same seed, same device, same flags -> same run
# data
batch_size = 16  # sequences per micro-batch per rank
block_size = 1024  # sequence length T
gradient_accumulation_steps = 1  # micro-batches per optimizer step over all ranks (must divide by world size)
doc_batches = False  # pack the batch as one (1, B*T) row with cu_seqlens: attention stops at document starts
# model (GPTConfig; vocab_size comes from the data's meta.json)
n_layer = 6  # transformer blocks
n_head = 6  # query heads HQ
n_kv_head = 2  # key/value heads H
n_embd = 384  # model width
mlp_hidden = 0  # SwiGLU hidden size; 0 = 8/3 * n_embd rounded up to a multiple of 64
attn = "nsa"  # 'nsa' | 'dense'
tie_embeddings = True  # lm_head shares the token embedding
rope_theta = 10000.0  # RoPE base
dropout = 0.0  # on the embedding and each residual branch (training only); >0 for small data that a model memorises
cmp_block = 16  # NSA l: compression block length
cmp_stride = 8  # NSA d: compression stride
sel_block = 32  # NSA l': selection block length
n_select = 8  # NSA n: selected blocks per query (incl. the forced ones)
n_init = 1  # forced initial blocks
n_local = 2  # forced local blocks
window = 128  # NSA w: sliding-window length
gate = "softmax"  # 'softmax' | 'sigmoid' branch gate
cmp_hidden = 128  # hidden size of the compression MLP phi
backend = "auto"  # 'auto' (Triton on CUDA, reference elsewhere) | 'torch' | 'triton'
# optimizer: AdamW, warmup then cosine decay
learning_rate = 1e-3  # peak learning rate
max_iters = 5000  # optimizer steps
weight_decay = 0.1  # on matrices only (model.configure_optimizers)
beta1 = 0.9  # AdamW beta1
beta2 = 0.95  # AdamW beta2
grad_clip = 1.0  # clip the global gradient norm to this; 0 = no clipping (the norm is still logged)
max_skipped_steps = 10  # a step whose gradient norm is not finite is not applied; stop after this many in a row
decay_lr = True  # warmup + cosine; False = constant learning_rate
warmup_iters = 100  # linear warmup steps
lr_decay_iters = 5000  # cosine reaches min_lr here (usually = max_iters)
min_lr = 1e-4  # learning rate after lr_decay_iters
# system
device = "auto"  # 'auto' (cuda if available) | 'cpu' | 'cuda' | 'cuda:1'
dtype = "bfloat16"  # autocast dtype: 'bfloat16' | 'float16' (with GradScaler) | 'float32' (no autocast)
compile = True  # torch.compile(model, dynamic=False, fullgraph=True) for training and eval
compile_mode = "auto"  # torch.compile mode: 'default', 'reduce-overhead' (replays CUDA graphs) or 'auto': CUDA graphs
#                        for NSA on CUDA without doc_batches (where they were measured to pay), else default
activation_checkpointing = False  # recompute each block in the backward: less memory, ~1/3 more compute
# -----------------------------------------------------------------------------
_config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str))]
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
config = {k: globals()[k] for k in _config_keys}  # what this run used, saved in the checkpoint
check_choice(dtype=("bfloat16", "float16", "float32"),
             compile_mode=("auto", "default", "reduce-overhead"))
if min(batch_size, block_size, gradient_accumulation_steps, eval_every, eval_iters, log_every, save_every,
       max_skipped_steps) < 1:
    raise ValueError("batch_size, block_size, gradient_accumulation_steps, eval_every, eval_iters, log_every, "
                     "save_every and max_skipped_steps must be >= 1")
if min(learning_rate, min_lr, weight_decay, grad_clip, warmup_iters, lr_decay_iters) < 0 or \
        not (0 <= beta1 < 1 and 0 <= beta2 < 1):
    raise ValueError("learning_rate, min_lr, weight_decay, grad_clip, warmup_iters and lr_decay_iters must be >= 0 "
                     f"and beta1, beta2 in [0, 1), got {learning_rate}, {min_lr}, {weight_decay}, {grad_clip}, "
                     f"{warmup_iters}, {lr_decay_iters}, {beta1}, {beta2}")
if doc_batches and batch_size * block_size >= 2**31:
    raise ValueError(f"doc_batches needs batch_size * block_size < 2**31, got {batch_size * block_size}")
# out_dir: an earlier run's checkpoint and log are replaced only when asked (made once the run is set up, below)
ckpt_path, log_path, stop_path = (os.path.join(out_dir, f) for f in ("ckpt.pt", "train_log.csv", "STOP"))
export_paths = [os.path.join(out_dir, f) for f in ("model.safetensors", "config.json")]
earlier = [path for path in (ckpt_path, log_path, *export_paths) if os.path.exists(path)]
if init_from != "resume" and earlier and not overwrite:
    raise ValueError(f"{earlier[0]} is from an earlier run: continue it with --init_from=resume, choose another "
                     f"--out_dir, or pass --overwrite=True to replace it")

# -----------------------------------------------------------------------------
# DDP / device: torchrun sets RANK, LOCAL_RANK, WORLD_SIZE; NCCL on CUDA, gloo on CPU
device = resolve_device(device, backend)
if doc_batches and compile and attn == "nsa" and (backend == "torch" or not device.startswith("cuda")):
    raise ValueError("doc_batches=True with attn='nsa' on the PyTorch reference (CPU or backend='torch') needs "
                     "compile=False: the reference splits sequences on the host, which fullgraph cannot trace")
ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
else:
    rank, local_rank, world = 0, 0, 1
master = rank == 0  # logs, checkpoints, exports
if gradient_accumulation_steps % world:
    raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
                     f"world size {world}")
accum = gradient_accumulation_steps // world  # micro-batches per step on this rank
device_type = "cuda" if device.startswith("cuda") else "cpu"
if compile_mode == "auto":  # NSA's many small kernels leave the GPU waiting for Python; dense's few large ones do not
    compile_mode = "reduce-overhead" if attn == "nsa" and device_type == "cuda" and not doc_batches else "default"
graphs = compile and compile_mode == "reduce-overhead"  # CUDA graphs on CUDA (cudagraph trees)
if device_type == "cpu":
    torch.set_num_threads(cpu_threads())
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.autocast(device_type=device_type, dtype=ptdtype)

# -----------------------------------------------------------------------------
# data: one shared stream of batches (the same generator state on every rank); rank r takes every world-th batch,
# so the global batch of a step does not depend on the number of ranks, and the generator state is the data position
train_data, val_data = TokenShards(data_dir, "train"), TokenShards(data_dir, "val")
meta = train_data.meta
train_gen = torch.Generator().manual_seed(seed)


def get_batch(data, gen, mine=True):
    """The next micro-batch of the shared stream on the device (mine=False: another rank's, drawn to advance gen):
    x, y (B, T) int64, cu_seqlens None; with doc_batches x, y (1, B*T), cu_seqlens int32 (N + 1,), under compile
    padded with empty sequences to a power of two."""
    x, y, cu = data.doc_batch(batch_size, block_size, gen) if doc_batches else (
        *data.random_batch(batch_size, block_size, gen), None)                 # (B, T) or (1, B*T); (N + 1,)
    if not mine:
        return None
    if cu is not None and compile:  # few shapes, few recompiles (eager skips it: the reference loops over sequences)
        n = max(32, 1 << (len(cu) - 1).bit_length())                            # 32, 64, 128, ...: the next power of 2
        cu = torch.cat([cu, cu[-1:].repeat(n - len(cu))])                      # (n,) trailing empty sequences
    if device_type == "cuda":
        return tuple(None if t is None else t.pin_memory().to(device, non_blocking=True) for t in (x, y, cu))
    return tuple(None if t is None else t.to(device) for t in (x, y, cu))


def next_batch(data, gen):
    """This rank's next micro-batch: the ranks take turns over the shared stream."""
    return [get_batch(data, gen, r == rank) for r in range(world)][rank]


# -----------------------------------------------------------------------------
# model: from scratch, or from a checkpoint in its architecture (a setting that contradicts it is an error)
model_keys = [k for k in GPTConfig.__dataclass_fields__ if k in config]  # GPTConfig's fields that are settings here
model_args = dict(vocab_size=meta["vocab_size"], **{k: globals()[k] for k in model_keys})
iter_num, best_val_loss, ckpt = 0, float("inf"), None
if init_from != "scratch":
    resume = init_from == "resume"
    start_path = ckpt_path if resume else init_from
    if not resume and not os.path.isfile(start_path):
        raise ValueError(f"init_from={init_from!r} is neither 'scratch', 'resume' nor a checkpoint file: train that "
                         f"run first, or fix the path")
    ckpt = load_checkpoint(start_path, ("model", "model_args") + (
        ("optimizer", "scaler", "iter_num", "best_val_loss", "rng") if resume else ()))
    saved = ckpt["model_args"]
    own = ("backend",) if resume else ("backend", "block_size")  # what this run decides, not the checkpoint
    clash = [f"{k}={globals()[k]!r} (the checkpoint has {saved[k]!r})" for k in model_keys
             if k in _overrides and k not in own and globals()[k] != saved[k]]
    if clash:
        raise ValueError(f"init_from={init_from!r} continues {start_path} in its architecture, but this run sets "
                         f"{', '.join(clash)}: drop those settings, or train a new model from scratch")
    if saved["vocab_size"] != meta["vocab_size"]:
        raise ValueError(f"{start_path} was trained on {ckpt.get('tokenizer')} tokens (vocab {saved['vocab_size']}) "
                         f"but data_dir={data_dir!r} holds {meta['tokenizer']} tokens (vocab {meta['vocab_size']}): "
                         f"use data of its tokenizer, e.g. its --data_dir={ckpt.get('config', {}).get('data_dir')!r}")
    model_args.update({k: v for k, v in saved.items() if k not in own})
    block_size = model_args["block_size"]  # the batches' length too
    config.update({k: model_args[k] for k in model_keys})
    if resume:
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
for data in (train_data, val_data):  # both splits up front: val is first read after the whole first train eval
    data.check_block_size(block_size)
model = GPT(GPTConfig(**model_args))
if ckpt is not None:
    load_weights(model, ckpt["model"], start_path)
model.to(device)
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size  # block_size: a resumed run's checkpoint's
if activation_checkpointing:  # the block's own forward, recomputed in the backward; state_dict keys unchanged
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
if master:
    print(f"{world} rank(s) on {device}, {dtype}; tokens per step: {tokens_per_iter:,} "
          f"({gradient_accumulation_steps} micro-batches x {batch_size} x {block_size})"
          + (f"; torch.compile mode {compile_mode}" if compile else ""))
    print(f"{model.num_params() / 1e6:.2f}M parameters, attn={model_args['attn']}, "
          f"{model.keys_per_query(block_size):.0f} keys read per query at T={block_size}")

# -----------------------------------------------------------------------------
# optimizer (fused AdamW on CUDA), GradScaler for float16, then compile and DDP wrap (raw_model stays uncompiled)
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
if init_from == "resume":
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    torch.set_rng_state(ckpt["rng"]["torch"])
    if device_type == "cuda" and ckpt["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    train_gen.set_state(ckpt["rng"]["data"])
ckpt = None  # free the memory
raw_model = model
if compile:
    model = torch.compile(model, dynamic=False, fullgraph=True, mode=compile_mode)
params = list(raw_model.parameters())
if graphs:  # a replay overwrites the last one's outputs, gradients included: micro-batches add into buffers of our own,
    # views of one flat buffer, which a DDP run all-reduces itself after the last micro-batch (DDP's wrapper cannot
    # hook into a graph's backward)
    flat_grad = torch.zeros(sum(p.numel() for p in params), device=device)
    for p, g in zip(params, flat_grad.split([p.numel() for p in params])):
        p.grad = g.view_as(p)
if ddp and graphs:  # every rank starts from rank 0's weights, as DDP's wrapper makes them
    for p in params:
        dist.broadcast(p.detach(), 0)
elif ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)


def forward(x, y, cu):
    """(logits, loss) of the training model; under CUDA graphs the next call may overwrite them (a new graph step)."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    return model(x, y, cu)


@torch.no_grad()
def estimate_loss():
    """Mean loss over the same eval_iters batches of each split every time (a fixed generator seed)."""
    out = {}
    model.eval()
    for split, data in (("train", train_data), ("val", val_data)):
        gen, total = torch.Generator().manual_seed(seed + 1), torch.zeros(2, device=device)  # (loss sum, batches)
        for i in range(eval_iters):
            batch = get_batch(data, gen, mine=i % world == rank)
            if batch is not None:
                with ctx:
                    total += torch.stack([forward(*batch)[1].float(), torch.ones((), device=device)])
        if ddp:
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out


def get_lr(it):
    """Linear warmup for warmup_iters steps, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def fail(why):
    """Ends every rank; rank 0 prints one error line: what went wrong, the last good checkpoint, what to try."""
    if master:
        have = f"{ckpt_path} (step {saved_step})" if saved_step >= 0 else "none written by this run"
        print(f"error: {why}. Last good checkpoint: {have}. Try a lower learning_rate, a longer warmup_iters, "
              f"grad_clip > 0 or dtype='bfloat16'.", file=sys.stderr)
    if ddp:
        dist.destroy_process_group()
    sys.exit(1)


# -----------------------------------------------------------------------------
# training loop: out_dir is made (and found unwritable) here, so a run that fails to start leaves none behind
try:
    os.makedirs(out_dir, exist_ok=True)
    tempfile.TemporaryFile(dir=out_dir).close()
except OSError as e:
    raise ValueError(f"cannot write to out_dir={out_dir!r} ({e.strerror}): choose another --out_dir") from None
start_iter, resumed = iter_num, init_from == "resume"
log = TrainLog(log_path, raw_model.config, compare_dir)  # train_log.csv and loss.png (rank 0)
if master and not resumed and not eval_only:  # overwrite=True (else an error above): the earlier run's files go
    for path in earlier:
        os.remove(path)
if master and resumed and not eval_only:
    log.truncate(start_iter)  # rows a crashed run wrote after its last checkpoint go
data_state = train_gen.get_state()  # the data position of the batch held in X (what a checkpoint saves)
X, Y, CU = next_batch(train_data, train_gen)
saved_step = start_iter if resumed else -1  # the step of the last good checkpoint on disk (-1: none yet)
skipped = 0  # steps in a row whose gradient norm was not finite
stop_reason, t_start, t_log, last_log_iter = "", time.time(), time.time(), iter_num
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = lr
    last = stop_reason or iter_num >= max_iters
    if eval_only or (iter_num % eval_every == 0 or last) and not (resumed and iter_num == start_iter):
        t_eval = time.time()
        losses = estimate_loss()
        t_log += time.time() - t_eval  # eval time is not training time
        if master:
            best_val_loss, ppl = min(best_val_loss, losses["val"]), math.exp(min(losses["val"], 50))
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, val ppl {ppl:.2f}")
            if not eval_only:
                log.append(kind="eval", step=iter_num, loss=f"{losses['train']:.6f}",
                           val_loss=f"{losses['val']:.6f}", val_ppl=f"{ppl:.4f}", lr=lr)
                log.plot()
    if eval_only:
        break
    if last or (iter_num % save_every == 0 and iter_num > start_iter):
        if not all(p.isfinite().all() for p in raw_model.parameters()):  # the same on every rank
            fail(f"the weights are not finite at step {iter_num}, so {ckpt_path} was not written")
        if master:  # everything a bit-exact resume needs, the data position included
            rng = dict(torch=torch.get_rng_state(), data=data_state,
                       cuda=torch.cuda.get_rng_state_all() if device_type == "cuda" else [])
            atomic_write(ckpt_path, functools.partial(torch.save, dict(
                model=raw_model.state_dict(), optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
                model_args=model_args, config=config, iter_num=iter_num, best_val_loss=best_val_loss,
                tokenizer=meta["tokenizer"], eot=meta["eot"], rng=rng)))
            print(f"saved {ckpt_path} at step {iter_num}")
            saved_step = iter_num
    if last:
        break

    # forward, backward, update: loss scaled by 1/accum; with DDP the ranks' gradients are averaged once a step, by
    # DDP's wrapper during the last micro-step's backward, or under CUDA graphs after it
    X_first, CU_first = X, CU
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(accum):
        if isinstance(model, DDP):
            model.require_backward_grad_sync = micro_step == accum - 1
        with ctx:
            _, loss = forward(X, Y, CU)
            loss = loss / accum
        loss_sum += loss.detach().float()
        if micro_step == accum - 1:
            data_state = train_gen.get_state()
        X, Y, CU = next_batch(train_data, train_gen)  # fetch the next batch while the device works
        if graphs:  # the replay's gradients added to ours in one multi-tensor add, not one launch per parameter
            torch._foreach_add_([p.grad for p in params], torch.autograd.grad(scaler.scale(loss), params))
        else:
            scaler.scale(loss).backward()
    if ddp and graphs:
        dist.all_reduce(flat_grad, op=dist.ReduceOp.AVG)
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    # one small all-reduce per step: the global mean loss, and rank 0's STOP / time-limit decision
    stop_flag = master and (os.path.exists(stop_path) or 0 < max_seconds <= time.time() - t_start)
    flags = torch.stack([loss_sum, torch.tensor(float(stop_flag), device=device)])
    if ddp:
        dist.all_reduce(flags)
    loss_f, norm_f = flags[0].item() / world, grad_norm.item()  # the norm of the all-reduced gradients: one value
    if not math.isfinite(loss_f):
        fail(f"loss is {loss_f} at step {iter_num} (lr {lr:.3g}, grad norm {norm_f:.3g}); stopped without updating "
             f"the weights")
    skipped = 0 if math.isfinite(norm_f) else skipped + 1
    if not skipped:
        scaler.step(optimizer)
    elif master:  # an overflow in the backward: not applied (float16's GradScaler also lowers its scale)
        print(f"step {iter_num}: gradient norm {norm_f} with a finite loss {loss_f:.4f}: update skipped")
    if skipped >= max_skipped_steps:
        fail(f"the gradient norm was not finite at {skipped} steps in a row, the last at step {iter_num}")
    scaler.update()
    optimizer.zero_grad(set_to_none=not graphs)

    # logging (rank 0): a line and a train_log.csv row; NSA statistics from an extra eager forward every diag_every
    diag_now = model_args["attn"] == "nsa" and diag_every > 0 and iter_num % diag_every == 0
    if master and (iter_num % log_every == 0 or diag_now):
        dt = (time.time() - t_log) / max(1, iter_num + 1 - last_log_iter)  # mean seconds per step since the last log
        tok_s, mem = tokens_per_iter / dt, peak_memory_gib(device)
        mfu = raw_model.estimate_mfu(tokens_per_iter // world, block_size, dt)
        row = dict(kind="train", step=iter_num, loss=f"{loss_f:.6f}", lr=f"{lr:.6g}", grad_norm=f"{norm_f:.4f}",
                   tokens_per_s=f"{tok_s:.1f}", mfu=f"{mfu:.4f}", mem_gib=f"{mem:.3f}",
                   keys_per_query=f"{raw_model.keys_per_query(block_size, CU_first):.1f}")
        if diag_now:
            row.update({k: f"{v:.4f}" for k, v in nsa_stats(raw_model, X_first, CU_first, ctx).items()})
        log.append(**row)
        print(f"step {iter_num}: loss {loss_f:.4f}, lr {lr:.3g}, grad norm {norm_f:.3f}, "
              f"{dt * 1000:.1f} ms/step, {tok_s:,.0f} tok/s, MFU {mfu * 100:.1f}%, mem {mem:.2f} GiB")
        t_log, last_log_iter = time.time(), iter_num + 1  # the next interval starts after logging and statistics
    iter_num += 1
    if flags[1].item() > 0:
        stop_reason = "STOP file" if os.path.exists(stop_path) else f"max_seconds={max_seconds}"
        if master:
            print(f"stopping at step {iter_num}: {stop_reason}")
            if os.path.exists(stop_path):
                os.remove(stop_path)  # consumed, so that init_from='resume' does not stop at once

if master and export and not eval_only:
    export_safetensors(raw_model, out_dir, dict(model_args, tokenizer=meta["tokenizer"], eot=meta["eot"],
                                                step=iter_num, architecture="nanoNSA GPT"))
    log.plot()
if ddp:
    del model  # the DDP wrapper goes before its process group does, not at interpreter exit
    dist.barrier()  # the ranks leave together: one that tore down while rank 0 still exported could abort (SIGABRT)
    dist.destroy_process_group()
