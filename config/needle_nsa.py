# python prepare_data.py --dataset=needle --needle_min_len=1024 --needle_train_tokens=64_000_000
# python train.py config/needle_nsa.py  (after stage 1)
# python sample.py --out_dir=out-needle-nsa --needle=True          (accuracy over 1k..64k x depth 0..100%)
# Pass-key retrieval, stage 2 of the length curriculum: the stage-1 model (config/needle_nsa_1k.py) goes on at T=8192,
# on rows of whole documents of 1024..8193 tokens, where the needle is mostly outside the window and the selection
# must find its block (train.py prints how many keys a query reads).
# Dense twin: config/needle_dense.py (same data, steps, seed).
exec(open("config/needle_nsa_1k.py").read())
out_dir = "out-needle-nsa"
init_from = "out-needle-nsa-1k/ckpt.pt"  # stage 1's weights, a fresh optimizer and schedule
data_dir = "data/needle_byte"
# data: 4 rows of 8192 = 32,768 tokens per step, packed as one var-length batch (the dense twin takes the same rows as
# 4 micro-batches of 1: its document mask is T x T)
batch_size = 4
block_size = 8192
# optimizer: a step cap; on one GPU add --max_seconds= to stop on time (with a checkpoint)
learning_rate = 1e-3
max_iters = 4000
warmup_iters = 100
lr_decay_iters = 4000
min_lr = 1e-4
