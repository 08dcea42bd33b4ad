"""CPU tests of train.py, run as subprocesses on tiny shards built here (config/cpu_smoke.py at T=64, 8 steps):
loss falls; resume continues bit for bit; 2-rank DDP (gloo, torchrun) matches 1 process with the same global batch;
a STOP file ends cleanly with a checkpoint; a NaN loss stops with an error and leaves the last checkpoint intact."""
import csv
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 8 steps of 2 micro-batches x 2 sequences x 64 bytes; eval, checkpoint and NSA statistics every 4 steps
COMMON = ["--block_size=64", "--batch_size=2", "--gradient_accumulation_steps=2", "--max_iters=8", "--lr_decay_iters=8",
          "--warmup_iters=2", "--eval_every=4", "--eval_iters=2", "--log_every=1", "--save_every=4", "--diag_every=4"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Byte shards of a small synthetic corpus (prepare_data.py, dataset=text): 40 KB of short generated sentences."""
    from prepare_data import prepare
    root = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    words = "the king queen lord speaks to his her my good night day sweet love death fair sir".split()
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(1000)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    prepare(dataset="text", input=str(root / "corpus.txt"), out_dir=str(root / "bytes"), num_proc=1)
    return str(root / "bytes")


def train(data_dir, out_dir, *args, nproc=1, expect_rc=0):
    """Runs train.py (under torchrun when nproc > 1) with config/cpu_smoke.py, COMMON and args; returns its output."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    cmd = launcher + ["train.py", "config/cpu_smoke.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}", *COMMON, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == expect_rc, f"{' '.join(cmd)} returned {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def log_rows(out_dir, kind):
    with open(os.path.join(out_dir, "train_log.csv")) as f:
        return [r for r in csv.DictReader(f) if r["kind"] == kind]


def losses(out_dir):
    return {int(r["step"]): float(r["loss"]) for r in log_rows(out_dir, "train")}


def load_ckpt(out_dir):
    return torch.load(os.path.join(out_dir, "ckpt.pt"), map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def full_run(data_dir, tmp_path_factory):
    """The uninterrupted 8-step run that the other tests compare with."""
    out = str(tmp_path_factory.mktemp("full"))
    train(data_dir, out)
    return out


def test_loss_decreases_and_logs(full_run):
    loss = losses(full_run)
    assert sorted(loss) == list(range(8))
    assert loss[7] < loss[0] - 0.5, loss
    evals = log_rows(full_run, "eval")
    assert [int(r["step"]) for r in evals] == [0, 4, 8]
    assert float(evals[-1]["val_loss"]) < float(evals[0]["val_loss"]) - 0.5
    assert abs(float(evals[-1]["val_ppl"]) - np.exp(float(evals[-1]["val_loss"]))) < 1e-2
    diag = [r for r in log_rows(full_run, "train") if r["L0_gate_cmp_mean"]]
    assert [int(r["step"]) for r in diag] == [0, 4]
    for r in diag:  # softmax gate: the three branch means sum to 1; the output shares too
        assert abs(sum(float(r[f"L1_gate_{b}_mean"]) for b in ("cmp", "slc", "win")) - 1) < 1e-3
        assert abs(sum(float(r[f"L1_share_{b}"]) for b in ("cmp", "slc", "win")) - 1) < 1e-3
    assert 0 < float(diag[0]["keys_per_query"]) <= 64 * 3
    assert abs(float(diag[0]["L0_gate_slc_mean"]) - 1 / 3) < 0.05               # zero-initialised gate: even mix


def test_checkpoint_and_export(full_run):
    ckpt = load_ckpt(full_run)
    assert ckpt["iter_num"] == 8 and ckpt["model_args"]["n_layer"] == 2 and ckpt["tokenizer"] == "byte"
    assert {"model", "optimizer", "config", "rng", "best_val_loss"} <= set(ckpt)
    with open(os.path.join(full_run, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == 257 and cfg["attn"] == "nsa" and cfg["tie_embeddings"]
    with open(os.path.join(full_run, "model.safetensors"), "rb") as f:  # parse the format by hand
        n = int.from_bytes(f.read(8), "little")
        header, body = json.loads(f.read(n)), f.read()
    meta = header.pop("__metadata__")
    assert meta["step"] == "8" and "lm_head.weight" not in header
    assert set(header) == set(ckpt["model"]) - {"lm_head.weight"}
    for name, h in header.items():
        a, b = h["data_offsets"]
        t = torch.frombuffer(bytearray(body[a:b]), dtype=torch.float32).view(h["shape"])
        assert torch.equal(t, ckpt["model"][name]), name
    if importlib.util.find_spec("safetensors"):  # optional: the reference reader agrees
        from safetensors.torch import load_file
        assert all(torch.equal(t, ckpt["model"][k]) for k, t in load_file(os.path.join(full_run, "model.safetensors")).items())
    assert os.path.exists(os.path.join(full_run, "loss.png")) == bool(importlib.util.find_spec("matplotlib"))


def test_resume_is_bit_exact(full_run, data_dir, tmp_path):
    out = str(tmp_path)
    train(data_dir, out, "--max_iters=4")  # the same run, cut after step 4 (lr_decay_iters stays 8)
    assert load_ckpt(out)["iter_num"] == 4
    train(data_dir, out, "--init_from=resume")
    assert losses(out) == losses(full_run)  # every logged step, from one CSV that the resume truncated and extended
    assert [r["val_loss"] for r in log_rows(out, "eval")] == [r["val_loss"] for r in log_rows(full_run, "eval")]
    a, b = load_ckpt(out), load_ckpt(full_run)
    for name, t in b["model"].items():
        assert torch.equal(a["model"][name], t), name
    assert torch.equal(a["rng"]["data"], b["rng"]["data"])


def test_ddp_two_ranks_matches_one_process(full_run, data_dir, tmp_path):
    out = str(tmp_path)
    text = train(data_dir, out, "--max_iters=4", nproc=2)  # 2 ranks x 1 micro-batch = the same 2 micro-batches
    assert "2 rank(s) on cpu" in text
    ddp, one = losses(out), losses(full_run)
    assert sorted(ddp) == [0, 1, 2, 3]
    for step, loss in ddp.items():
        assert abs(loss - one[step]) < 2e-5, (step, loss, one[step])  # measured: equal to the 6 logged decimals


def test_stop_file_ends_cleanly_with_doc_batches(data_dir, tmp_path):
    out = str(tmp_path)
    (tmp_path / "STOP").write_text("")
    text = train(data_dir, out, "--doc_batches=True", "--activation_checkpointing=True")
    assert "stopping at step 1: STOP file" in text
    assert load_ckpt(out)["iter_num"] == 1 and not (tmp_path / "STOP").exists()
    assert [int(r["step"]) for r in log_rows(out, "eval")] == [0, 1]
    assert (tmp_path / "model.safetensors").exists()


def test_compile_mode_errors(data_dir, tmp_path):
    text = train(data_dir, str(tmp_path), "--compile_mode=fast", expect_rc=1)
    assert "compile_mode must be 'default' or 'reduce-overhead', got 'fast'" in text
    text = train(data_dir, str(tmp_path), "--compile=True", "--compile_mode=reduce-overhead", expect_rc=1)
    assert "needs one micro-batch per rank and step, got gradient_accumulation_steps=2" in text


def test_nan_loss_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    out = str(tmp_path)
    text = train(data_dir, out, "--nan_at_step=5", "--attn=dense", expect_rc=1)
    assert "error: loss is nan at step 5" in text and "(step 4)" in text
    ckpt = load_ckpt(out)
    assert ckpt["iter_num"] == 4 and ckpt["model_args"]["attn"] == "dense"
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.gpu
def test_gpu_compiled_bf16_resume_matches(data_dir, tmp_path):
    # CUDA, torch.compile, bf16 autocast, the Triton kernels and dropout (RNG states in the checkpoint): a run cut after
    # step 4 and resumed logs the losses of the uninterrupted run. Not bit for bit: two identical CUDA runs can differ
    # before the cut already (H100, 2026-11-23: by 1.6e-5 at step 2 in one of two measurements; resumed vs
    # uninterrupted at most 1.2e-4), so the bound is 5e-4, a hundredth of the change from one step to the next here
    gpu = ["--device=cuda", "--compile=True", "--dtype=bfloat16", "--dropout=0.1"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train(data_dir, full, *gpu)
    train(data_dir, cut, *gpu, "--max_iters=4")
    train(data_dir, cut, *gpu, "--init_from=resume")
    a, b = losses(cut), losses(full)
    print(f"losses resumed {a}\nlosses full    {b}")
    assert sorted(a) == sorted(b) == list(range(8))
    assert max(abs(a[k] - b[k]) for k in b) < 5e-4
