# python train.py config/track_a_dense.py
# Track A's dense twin: every setting of config/track_a_shakespeare.py (same data, width, depth, batch, schedule,
# seed, hence the same batches), with causal SDPA attention instead of NSA. Compare val loss at equal steps.
exec(open("config/track_a_shakespeare.py").read())
attn = "dense"
out_dir = "out-track-a-dense"
