# torchrun --standalone --nproc_per_node=2 train.py config/track_b_8k.py          (two GPUs; dense twin: add
#   --attn=dense --out_dir=out-track-b-dense). Data: python prepare_data.py --tokenizer=gpt2 (Shakespeare, 1.44M
#   train tokens); for a real corpus: --dataset=fineweb_edu --max_tokens=... and --data_dir=data/fineweb_edu_gpt2.
# Track B: GPT-2 BPE (vocab 50257), T=8192, 6 layers x 384 wide, 6 query / 2 KV heads (head dim 64): 36.7M parameters
# with NSA (19.3M of them the tied embedding), 28.7M dense. NSA with the paper's defaults (l=32, d=16, l'=64, n=16,
# w=512, 1 initial + 2 local blocks forced); train.py prints how many keys a query reads on average.
# Results (speed and loss against the dense twin): RESULTS.md, "Track B".
out_dir = "out-track-b-nsa"
data_dir = "data/shakespeare_gpt2"
eval_every = 50
eval_iters = 8
log_every = 5
diag_every = 50
save_every = 100
# data: 2 ranks x 1 micro-batch x 8 x 8192 = 131,072 tokens per step (one GPU: 2 micro-batches of 8). Micro-batches
# of 8 ran faster than 4 for both attentions, at twice the memory (RESULTS.md, "Track B: micro-batches of 8"); a
# smaller GPU can take --batch_size=4 --gradient_accumulation_steps=4, the same tokens per step.
batch_size = 8
block_size = 8192
gradient_accumulation_steps = 2
# model
n_layer = 6
n_head = 6
n_kv_head = 2
n_embd = 384
attn = "nsa"
cmp_block = 32
cmp_stride = 16
sel_block = 64
n_select = 16
n_init = 1
n_local = 2
window = 512
cmp_hidden = 256
# optimizer: a step-capped run (300 steps = 39M tokens)
learning_rate = 1e-3
max_iters = 300
warmup_iters = 30
lr_decay_iters = 300
min_lr = 1e-4
weight_decay = 0.1
grad_clip = 1.0
# system
dtype = "bfloat16"
compile = True
