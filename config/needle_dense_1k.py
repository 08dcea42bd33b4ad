# python train.py config/needle_dense_1k.py    (stage 1 of 2; then config/needle_dense.py)
# The dense twin of config/needle_nsa_1k.py: the same data, tokens per step, width, depth, schedule and seed, with
# causal SDPA attention (a document mask under doc_batches) instead of NSA: 2.30M parameters. The 32 rows of a step
# go through as 4 micro-batches of 8 rows packed into one sequence (a document mask of 8192 x 8192).
exec(open("config/needle_nsa_1k.py").read())
attn = "dense"
out_dir = "out-needle-dense-1k"
batch_size = 8
gradient_accumulation_steps = 4
compile_mode = "default"
eval_iters = 32  # evaluations read as many rows as NSA's (8 rows x 32 batches)
