# python train.py config/cpu_smoke.py
# A few seconds on 2 CPU cores: the tiny NSA model (model.PRESETS["tiny"] dims at T=128) on byte-level Shakespeare.
# Used by the README quickstart, tests/test_train.py and config/needle_smoke.py; leaves out-cpu-smoke/ckpt.pt for
# sample.py.
out_dir = "out-cpu-smoke"
data_dir = "data/shakespeare_byte"
eval_every = 15
eval_iters = 4
log_every = 5
diag_every = 15
save_every = 15
# data: 4 x 128 bytes per step
batch_size = 4
block_size = 128
# model: 2 layers, width 64, 4 query / 2 KV heads; NSA blocks scaled to T=128 (l=8, d=4, l'=16, n=4, w=32):
# 4 selected blocks of 16 = half of the context, so selection is sparse yet matters, and the window is a quarter
n_layer = 2
n_head = 4
n_kv_head = 2
n_embd = 64
cmp_block = 8
cmp_stride = 4
sel_block = 16
n_select = 4
window = 32
cmp_hidden = 32
# optimizer: 30 steps
learning_rate = 3e-3
max_iters = 30
warmup_iters = 5
lr_decay_iters = 30
min_lr = 3e-4
# system: float32 and no compile, so it runs the same on any CPU (and on a GPU)
dtype = "float32"
compile = False
