# python prepare_data.py --dataset=needle --needle_block_size=1024 --needle_min_len=128 --needle_train_tokens=32_000_000 \
#   --out_dir=data/needle_1k_byte
# python train.py config/needle_nsa_1k.py      (stage 1 of 2; then config/needle_nsa.py)
# Pass-key retrieval, stage 1 of a length curriculum: documents of 128..1025 tokens, so the model finds the copy step
# (the digits after the earlier "#") where the needle is never far; stage 2 (config/needle_nsa.py) goes on at T=8192
# from this checkpoint. 4 layers x 256, 4 query heads / 1 KV head (head dim 64), 3.73M parameters. NSA with the
# paper's block sizes (l=32, d=16, l'=64, n=16, w=512, 1 initial + 2 local blocks forced): at T <= 1024 the 16
# selected blocks cover every key, so here the selected branch learns to read the needle; at 8k it must also find it.
# Dense twin: config/needle_dense_1k.py (same data, steps, seed).
out_dir = "out-needle-nsa-1k"
data_dir = "data/needle_1k_byte"
eval_every = 250
eval_iters = 8
log_every = 50
diag_every = 250
save_every = 1000
# data: 32 rows of 1024 = 32,768 tokens per step, packed as one var-length batch; every target is a key digit (the
# dataset's needle_loss="answers"), so the logged loss is nats per answer digit (ln 10 = 2.30 is a guess)
batch_size = 32
block_size = 1024
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
# optimizer
learning_rate = 2e-3
max_iters = 1000
warmup_iters = 100
lr_decay_iters = 1000
min_lr = 2e-4
weight_decay = 0.1
grad_clip = 1.0
# system: CUDA graphs (one micro-batch per step), since at this size NSA's many small kernels leave the GPU waiting
dtype = "bfloat16"
compile = True
compile_mode = "reduce-overhead"
