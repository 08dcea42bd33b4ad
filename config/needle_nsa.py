# python prepare_data.py --dataset=needle && python train.py config/needle_nsa.py
# python sample.py --out_dir=out-needle-nsa --needle=True          (accuracy over 1k..64k x depth 0..100%)
# Pass-key retrieval at T=8192 on one GPU: 4 layers x 256, 4 query heads / 1 KV head (head dim 64), 3.73M parameters
# (fp32 model.safetensors: 14.2 MiB). NSA with the paper's block sizes (l=32, d=16, l'=64, n=16, w=512, 1 initial + 2
# local blocks forced), so a decode step at 8k reads 511 compressed + 1,024 selected + 512 window keys, and its
# trained selection indices have the block sizes bench.py uses. Dense twin: config/needle_dense.py (same data, steps,
# seed).
# Data: rows of 8,193 tokens, each a run of whole documents (256 .. 8,193 tokens, 90% with a pass key in Shakespeare
# filler, 10% plain text); with doc_batches attention stops at each document start, as in the evaluation.
out_dir = "out-needle-nsa"
data_dir = "data/needle_byte"
eval_every = 250
eval_iters = 8
log_every = 50
diag_every = 250
save_every = 1000
# data: 4 rows of 8192 = 32,768 tokens per step, packed as one var-length batch (the dense twin takes the same rows as
# 4 micro-batches of 1: its document mask is T x T)
batch_size = 4
block_size = 8192
gradient_accumulation_steps = 1
doc_batches = True
# model
n_layer = 4
n_head = 4
n_kv_head = 1
n_embd = 256
mlp_hidden = 512
attn = "nsa"
cmp_block = 32
cmp_stride = 16
sel_block = 64
n_select = 16
n_init = 1
n_local = 2
window = 512
cmp_hidden = 64
# optimizer: a step cap; on one GPU add --max_seconds= to stop on time (with a checkpoint)
learning_rate = 2e-3
max_iters = 4000
warmup_iters = 100
lr_decay_iters = 4000
min_lr = 2e-4
weight_decay = 0.1
grad_clip = 1.0
# system: CUDA graphs (one micro-batch per step), since at this size NSA's many small kernels leave the GPU waiting
dtype = "bfloat16"
compile = True
compile_mode = "reduce-overhead"
