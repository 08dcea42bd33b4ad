# python train.py config/track_a_shakespeare.py                       (a GPU; the dense twin: config/track_a_dense.py)
# Track A: byte-level Shakespeare (python prepare_data.py), T=1024, 6 layers x 384 wide, 6 query / 2 KV heads (G=3,
# head dim 64): 12.6M parameters with NSA, 9.5M with dense attention (NSA adds phi, the gate and per-branch K/V).
# NSA hyperparameters, scaled from the paper's (l=32, d=16, l'=64, n=16, w=512 for 64k) so every branch matters at
# T=1024: with the paper's values the selection alone (16 x 64 = 1024 tokens) would cover the whole context and the
# window half of it, so NSA would be dense attention three times over. Here:
#   l=16, d=8 : 127 compressed tokens at T=1024, each a summary of 16 bytes (about 3 words);
#   l'=32, n=8: 8 selected blocks of 32 = 256 of 1024 tokens (a quarter), of which 1 initial + 2 local are forced,
#               so 5 blocks are chosen by the compressed scores (Eq. 8-10);
#   w=128     : the window covers the last ~2 lines of verse, the local detail a byte model needs.
# train.py prints how many keys a query then reads on average (compressed + selected + window; dense: (T+1)/2).
# Results (loss against the dense twin, speed): RESULTS.md, "Track A: NSA vs dense" and "Training speed, Track A".
out_dir = "out-track-a-nsa"
data_dir = "data/shakespeare_byte"
eval_every = 250
eval_iters = 20
log_every = 10
diag_every = 100
save_every = 1000
# data: 16 x 1024 bytes = 16,384 tokens per step; 5000 steps = 82M tokens, about 18 passes over the 4.66M train bytes.
# Without dropout the model memorises them and val loss climbs after its early minimum (RESULTS.md, "Without
# dropout"); dropout = 0.2 (as nanoGPT's shakespeare_char) slows that down.
batch_size = 16
block_size = 1024
gradient_accumulation_steps = 1
# model
n_layer = 6
n_head = 6
n_kv_head = 2
n_embd = 384
attn = "nsa"
dropout = 0.2
cmp_block = 16
cmp_stride = 8
sel_block = 32
n_select = 8
n_init = 1
n_local = 2
window = 128
cmp_hidden = 128
# optimizer
learning_rate = 1e-3
max_iters = 5000
warmup_iters = 100
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
weight_decay = 0.1
grad_clip = 1.0
# system
dtype = "bfloat16"
compile = True
compile_mode = "reduce-overhead"  # CUDA graphs: at T=1024 NSA is launch-bound without them (RESULTS.md)
