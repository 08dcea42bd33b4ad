# python train.py config/track_a_dense.py
# Track A's dense twin: every setting of config/track_a_shakespeare.py (same data, width, depth, batch, schedule,
# seed, hence the same batches), with causal SDPA attention instead of NSA. Compare val loss at equal steps
# (--compare_dir=out-track-a-nsa draws both in loss.png; results: RESULTS.md, "Track A: NSA vs dense").
exec(open("config/track_a_shakespeare.py").read())
attn = "dense"
out_dir = "out-track-a-dense"
