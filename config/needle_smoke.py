# python prepare_data.py --dataset=needle --needle_block_size=256 --needle_min_len=128 --needle_train_tokens=200_000 \
#   --needle_val_tokens=20_000 --out_dir=data/needle_smoke_byte
# python train.py config/needle_smoke.py
# python sample.py --out_dir=out-needle-smoke --needle=True --needle_lengths="(128, 256, 512)" \
#   --needle_depths="(0.0, 0.5, 1.0)" --needle_trials=2 --needle_steps=8 --needle_plot_length=512 --needle_val_rows=4
# Seconds on a CPU: the needle pipeline end to end (data, training, evaluation) at the tiny sizes of cpu_smoke.py.
# Twenty steps do not learn the pass key (config/needle_nsa_1k.py does, on a GPU): the point is that every piece
# runs (tests/test_needle.py).
exec(open("config/cpu_smoke.py").read())  # its model: 2 layers, width 64; l=8, d=4, l'=16, n=4, w=32
out_dir = "out-needle-smoke"
data_dir = "data/needle_smoke_byte"
eval_every = 10
eval_iters = 2
diag_every = 10
save_every = 10
# data: 2 rows of 256 tokens per step, each a run of whole documents; attention stops at document starts
batch_size = 2
block_size = 256
doc_batches = True
# optimizer: 20 steps
max_iters = 20
lr_decay_iters = 20
# (float32 and eager, as cpu_smoke.py: doc_batches on the PyTorch reference cannot be compiled)
