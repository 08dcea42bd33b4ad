# python train.py config/needle_dense.py    (after config/needle_dense_1k.py)
# The dense twin of config/needle_nsa.py: the same data, rows per step, width, depth, schedule and seed (hence the
# same batches), with causal SDPA attention (a document mask under doc_batches) instead of NSA: 2.30M parameters.
# The 4 rows of a step go through as 4 micro-batches of one row, so the mask is 8192 x 8192, not 32768 x 32768.
exec(open("config/needle_nsa.py").read())
attn = "dense"
out_dir = "out-needle-dense"
init_from = "out-needle-dense-1k/ckpt.pt"
batch_size = 1
gradient_accumulation_steps = 4
compile_mode = "default"
eval_iters = 32  # evaluations read as many rows as NSA's (1 row x 32 batches)
