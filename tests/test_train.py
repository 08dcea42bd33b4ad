"""CPU tests of train.py, run as subprocesses on tiny shards built here (config/cpu_smoke.py at T=64, 8 steps):
loss falls; resume continues bit for bit; 2-rank DDP (gloo, torchrun) matches 1 process with the same global batch;
a STOP file ends cleanly with a checkpoint; faults injected into the child (a NaN loss, a NaN gradient with a finite
loss, NaN weights, a full disk) never cost the last good checkpoint. User errors found before the first step (an
earlier run in out_dir, a checkpoint that does not fit, a short split) run train.py in this process."""
import csv
import importlib.util
import json
import os
import resource
import runpy
import shutil
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


# Runs train.py (sys.argv[2:]) with faults at the steps in the JSON sys.argv[1], e.g. {"nan_grad": [1]}: nan_loss makes
# that step's training loss NaN, nan_grad one gradient NaN (the loss stays finite), nan_weights one weight NaN after
# that step's update. Steps are counted by clip_grad_norm_, which train.py calls once per step after the backward.
FAULTS = """
import json, math, runpy, sys, torch, model
from torch.optim.optimizer import register_optimizer_step_post_hook
at, sys.argv = json.loads(sys.argv[1]), sys.argv[2:]
step, forward, clip = [0], model.GPT.forward, torch.nn.utils.clip_grad_norm_
def nan_loss(self, *args):
    logits, loss = forward(self, *args)
    return logits, loss * math.nan if self.training and step[0] in at.get("nan_loss", []) else loss
def nan_grad(params, *args, **kwargs):
    params = list(params)
    if step[0] in at.get("nan_grad", []):
        params[0].grad.fill_(math.nan)
    step[0] += 1
    return clip(params, *args, **kwargs)
def nan_weights(optimizer, args, kwargs):
    if step[0] - 1 in at.get("nan_weights", []):
        optimizer.param_groups[0]["params"][0].data.fill_(math.nan)
model.GPT.forward, torch.nn.utils.clip_grad_norm_ = nan_loss, nan_grad
register_optimizer_step_post_hook(nan_weights)
runpy.run_path("train.py", run_name="__main__")
"""


def train(data_dir, out_dir, *args, nproc=1, expect_rc=0, faults=None, file_limit=0):
    """Runs train.py (under torchrun when nproc > 1) with config/cpu_smoke.py, COMMON and args; returns its output.
    faults: {fault: [steps]} injected by FAULTS; file_limit: the largest file (bytes) the run may write."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     f"--nproc_per_node={nproc}"]
    if faults:
        launcher += ["-c", FAULTS, json.dumps(faults)]
    cmd = launcher + ["train.py", "config/cpu_smoke.py", f"--data_dir={data_dir}", f"--out_dir={out_dir}", *COMMON,
                      *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")  # an abort prints each thread's Python stack
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, resource.RLIM_INFINITY))  # noqa: E731
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
                       preexec_fn=limit if file_limit else None)
    assert r.returncode == expect_rc, f"{cmd} returned {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    if expect_rc:  # a user error or a stopped run: one error line, no traceback
        assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr
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
    """The uninterrupted 8-step run that the other tests compare with; its output in output.txt beside it."""
    out = tmp_path_factory.mktemp("full")
    (out.parent / "output.txt").write_text(train(data_dir, str(out)))
    return str(out)


def test_loss_decreases_and_logs(full_run):
    text = open(os.path.join(os.path.dirname(full_run), "output.txt")).read()
    over = [line for line in text.splitlines() if line.startswith("Overriding")]
    assert over[0] == "Overriding config with config/cpu_smoke.py (25 keys)" and len(over) == 2, over  # not one a key
    assert over[1].startswith(f"Overriding: data_dir='") and "block_size=64, batch_size=2, " in over[1], over
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


def test_resume_counts_tokens_at_the_checkpoints_block_size(full_run, data_dir, tmp_path):
    # without a config file the default block_size is 1024, the checkpoint's 64: a step's tokens (and tokens/s, MFU)
    out = tmp_path / "run"
    shutil.copytree(full_run, out)
    cmd = [sys.executable, "train.py", f"--data_dir={data_dir}", f"--out_dir={out}", "--init_from=resume",
           "--compile=False", "--dtype=float32", "--max_iters=9",
           *(a for a in COMMON if not a.startswith(("--block_size", "--max_it")))]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens per step: 256 (2 micro-batches x 2 x 64)" in r.stdout, r.stdout


def test_sigterm_while_saving_leaves_no_temp_file(data_dir, tmp_path):
    # the signal arrives while ckpt.pt.tmp is written (as `timeout` or a scheduler would send it): the write unwinds
    term = ("import os, runpy, signal, sys, torch\nsave = torch.save\n"
            "def save_then_term(*args, **kwargs):\n    save(*args, **kwargs)\n    os.kill(os.getpid(), signal.SIGTERM)\n"
            "torch.save, sys.argv = save_then_term, sys.argv[1:]\nrunpy.run_path('train.py', run_name='__main__')\n")
    cmd = [sys.executable, "-c", term, "train.py", "config/cpu_smoke.py", f"--data_dir={data_dir}",
           f"--out_dir={tmp_path}", *COMMON]
    r = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 128 + 15, (r.returncode, r.stderr[-2000:])
    names = os.listdir(tmp_path)
    assert "ckpt.pt" not in names and not [f for f in names if f.endswith(".tmp")], names


def test_eval_only_resume_evaluates_the_checkpoint_and_writes_nothing(full_run, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(full_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    text = train(data_dir, str(out), "--init_from=resume", "--eval_only=True")
    final = log_rows(full_run, "eval")[-1]                                     # the full run's eval at step 8
    assert f"step 8: train loss {float(final['loss']):.4f}, val loss {float(final['val_loss']):.4f}" in text, text
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


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
    assert "compile_mode must be 'auto', 'default' or 'reduce-overhead', got 'fast'" in text


def test_nan_loss_stops_and_keeps_last_checkpoint(data_dir, tmp_path):
    out = str(tmp_path)
    text = train(data_dir, out, "--attn=dense", faults={"nan_loss": [5]}, expect_rc=1)
    assert "error: loss is nan at step 5" in text and "(step 4)" in text
    ckpt = load_ckpt(out)
    assert ckpt["iter_num"] == 4 and ckpt["model_args"]["attn"] == "dense"
    assert all(torch.isfinite(t).all() for t in ckpt["model"].values())
    assert not (tmp_path / "model.safetensors").exists()


def test_nan_gradient_is_skipped_and_nan_weights_are_never_saved(full_run, data_dir, tmp_path):
    # step 1: a NaN gradient with a finite loss is not applied and the run goes on; step 7's update makes a weight
    # NaN: the checkpoint due at step 8 is refused and the error names step 4's as the last good one
    out = str(tmp_path)
    text = train(data_dir, out, faults={"nan_grad": [1], "nan_weights": [7]}, expect_rc=1)
    assert "step 1: gradient norm nan with a finite loss" in text and "update skipped" in text
    assert f"error: the weights are not finite at step 8, so {out}/ckpt.pt was not written. " in text
    assert f"Last good checkpoint: {out}/ckpt.pt (step 4)" in text
    ckpt = load_ckpt(out)
    assert ckpt["iter_num"] == 4 and all(torch.isfinite(t).all() for t in ckpt["model"].values())
    loss, rows = losses(out), log_rows(out, "train")
    assert rows[1]["grad_norm"] == "nan" and sorted(loss) == list(range(8))
    assert loss[0] == losses(full_run)[0] and loss[1] == losses(full_run)[1]  # same weights, same batches until then
    assert all(np.isfinite(v) for v in loss.values())                          # step 1's NaN update was not applied


def test_gradient_not_finite_many_steps_in_a_row_stops(data_dir, tmp_path):
    text = train(data_dir, str(tmp_path), "--max_iters=4", "--max_skipped_steps=2", faults={"nan_grad": [1, 2]},
                 expect_rc=1)
    assert "error: the gradient norm was not finite at 2 steps in a row, the last at step 2. " in text
    assert "Last good checkpoint: none written by this run" in text and not (tmp_path / "ckpt.pt").exists()


def test_full_disk_names_the_file_and_leaves_no_temp_file(data_dir, tmp_path):
    # files may not pass 200 kB: the log and loss.png fit, the ~2 MB checkpoint at the end of step 1 does not
    text = train(data_dir, str(tmp_path), "--max_iters=1", file_limit=200_000, expect_rc=1)
    assert f"error: cannot write {tmp_path}/ckpt.pt: File too large" in text
    assert sorted(os.listdir(tmp_path)) == sorted(["train_log.csv"] + ["loss.png"] * bool(
        importlib.util.find_spec("matplotlib")))                               # no ckpt.pt, no ckpt.pt.tmp


@pytest.fixture
def train_here(monkeypatch):
    """Runs train.py in this process (for errors found before the first step); torch's global state is restored."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)                     # configurator.py sets its own
    state = torch.get_rng_state(), torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32, \
        torch.backends.cudnn.allow_tf32

    def run(data_dir, out_dir, *args):
        monkeypatch.setattr(sys, "argv", ["train.py", "config/cpu_smoke.py", f"--data_dir={data_dir}",
                                          f"--out_dir={out_dir}", *COMMON, *args])
        runpy.run_path("train.py", run_name="__main__")
    yield run
    torch.set_rng_state(state[0])
    torch.set_num_threads(state[1])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = state[2:]


def test_an_earlier_run_is_replaced_only_when_asked(full_run, data_dir, tmp_path, train_here):
    for name in ("model.safetensors", "config.json"):                          # an export alone is a run's too
        shutil.copy(os.path.join(full_run, name), tmp_path)
        with pytest.raises(ValueError, match=f"{tmp_path}/{name} is from an earlier run"):
            train_here(data_dir, tmp_path)
        os.remove(tmp_path / name)
    for name in ("ckpt.pt", "train_log.csv"):
        shutil.copy(os.path.join(full_run, name), tmp_path)
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    with pytest.raises(ValueError, match=f"{tmp_path}/ckpt.pt is from an earlier run: continue it with "
                                         r"--init_from=resume, choose another --out_dir, or pass --overwrite=True"):
        train_here(data_dir, tmp_path)
    assert {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)} == before
    train_here(data_dir, tmp_path, "--overwrite=True", "--max_iters=0")       # asked: a new run from step 0
    assert load_ckpt(tmp_path)["iter_num"] == 0 and losses(tmp_path) == {}
    assert [r["step"] for r in log_rows(tmp_path, "eval")] == ["0"]


def test_init_from_a_checkpoint_starts_a_new_run_at_another_length(full_run, data_dir, tmp_path, train_here):
    """A length curriculum's next stage: another run's weights and architecture, this run's block_size, step 0."""
    out = str(tmp_path / "stage2")
    train(data_dir, out, f"--init_from={full_run}/ckpt.pt", "--block_size=128", "--max_iters=0")
    ckpt, before = load_ckpt(out), load_ckpt(full_run)
    assert ckpt["iter_num"] == 0 and ckpt["model_args"]["block_size"] == 128
    assert {k: v for k, v in ckpt["model_args"].items() if k != "block_size"} == \
        {k: v for k, v in before["model_args"].items() if k != "block_size"}
    for name, t in before["model"].items():
        assert torch.equal(ckpt["model"][name], t), name
    assert float(log_rows(out, "eval")[0]["val_loss"]) < float(log_rows(full_run, "eval")[0]["val_loss"]) - 0.5
    with pytest.raises(ValueError, match=r"continues .*ckpt.pt in its architecture, but this run sets n_layer=4 "
                                         r"\(the checkpoint has 2\)"):
        train_here(data_dir, tmp_path / "other", f"--init_from={full_run}/ckpt.pt", "--n_layer=4")
    with pytest.raises(ValueError, match=r"init_from='nope.pt' is neither 'scratch', 'resume' nor a checkpoint file"):
        train_here(data_dir, tmp_path / "other", "--init_from=nope.pt")


def gpt2_like_data(root, n=4096):
    """A data dir of random GPT-2 token ids in prepare_data.py's format (no tokenizer needed)."""
    from prepare_data import FORMAT_VERSION, write_shard
    os.makedirs(root)
    tokens = np.random.default_rng(0).integers(0, 50257, size=n)
    splits = {s: dict(documents=1, tokens=n, shards=[dict(file=f"{s}_0000.bin", tokens=n,
                                                          crc32=write_shard(os.path.join(root, f"{s}_0000.bin"),
                                                                            tokens, "gpt2", 50257, 50256))])
              for s in ("train", "val")}
    with open(os.path.join(root, "meta.json"), "w") as f:
        json.dump(dict(version=FORMAT_VERSION, tokenizer="gpt2", vocab_size=50257, eot=50256, splits=splits), f)
    return str(root)


def test_resume_refuses_what_does_not_fit_the_checkpoint(full_run, data_dir, tmp_path, train_here):
    shutil.copy(os.path.join(full_run, "ckpt.pt"), tmp_path)
    with pytest.raises(ValueError, match=r"init_from='resume' continues .*ckpt.pt in its architecture, but this run "
                                         r"sets n_layer=4 \(the checkpoint has 2\)"):
        train_here(data_dir, tmp_path, "--init_from=resume", "--n_layer=4")
    with pytest.raises(ValueError, match=r"ckpt.pt was trained on byte tokens \(vocab 257\) but data_dir=.* holds "
                                         r"gpt2 tokens \(vocab 50257\): use data of its tokenizer, e.g. its --data_dir="):
        train_here(gpt2_like_data(tmp_path / "gpt2"), tmp_path, "--init_from=resume")
    ckpt = load_ckpt(full_run)
    ckpt["model_args"]["mlp_hidden"] = 128                                     # the weights' is 8/3 * 64 -> 192
    torch.save(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match=r"ckpt.pt: the weights do not match model_args \(size mismatch for "
                                         r"blocks.0.mlp.w_in.weight: .*; 3 more\)$"):
        train_here(data_dir, tmp_path, "--init_from=resume")
    for data in (b"", open(os.path.join(full_run, "ckpt.pt"), "rb").read()[:5000], os.urandom(5000)):
        (tmp_path / "ckpt.pt").write_bytes(data)                               # empty, truncated, random
        with pytest.raises(ValueError, match=f"^{tmp_path}/ckpt.pt is not a readable checkpoint"):
            train_here(data_dir, tmp_path, "--init_from=resume")


def test_found_before_the_first_step(data_dir, tmp_path, train_here):
    val = json.load(open(os.path.join(data_dir, "meta.json")))["splits"]["val"]["tokens"]   # shorter than train
    with pytest.raises(ValueError, match=f"block_size={val} needs a val shard of at least {val + 1} tokens, the "
                                         f"longest val shard in {data_dir} has {val}"):
        train_here(data_dir, tmp_path / "new", f"--block_size={val}")         # no out_dir left behind (below)
    with pytest.raises(ValueError, match="max_skipped_steps must be >= 1"):
        train_here(data_dir, tmp_path / "new", "--max_skipped_steps=0")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=f"cannot write to out_dir='{tmp_path}/file/out'"):
        train_here(data_dir, tmp_path / "file" / "out")
    with pytest.raises(ValueError, match="unknown config key 'bach_size' .*did you mean 'batch_size'"):
        train_here(data_dir, tmp_path, "--bach_size=4")
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        train_here(data_dir, tmp_path / "new", "--device=gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda', but this machine has 0 CUDA device"):
            train_here(data_dir, tmp_path / "new", "--device=cuda")
        if os.environ.get("TRITON_INTERPRET") != "1":
            with pytest.raises(ValueError, match="backend='triton' runs the Triton kernels, which need a CUDA device"):
                train_here(data_dir, tmp_path / "new", "--backend=triton")
    with pytest.raises(ValueError, match=r"learning_rate, .* must be >= 0 and beta1, beta2 in \[0, 1\), got -1.0"):
        train_here(data_dir, tmp_path / "new", "--learning_rate=-1")
    with pytest.raises(ValueError, match=r"mlp_hidden >= 0, got 2, 64, 64, -5"):
        train_here(data_dir, tmp_path / "new", "--mlp_hidden=-5")
    config = tmp_path / "config.py"
    for text, want in (("batch_size = 2\nbatch_size = \n", ", line 2: SyntaxError: invalid syntax"),
                       ("batch_size = undefined_name\n", ", line 1: NameError: name 'undefined_name' is not defined"),
                       ('{"batch_size": 2}\n', " sets no config key: it is run as Python, `key = value` lines")):
        config.write_text(text)
        with pytest.raises(ValueError, match=f"^config file {config}{want}$"):
            train_here(data_dir, tmp_path / "new", str(config))
    config.unlink()
    assert os.listdir(tmp_path) == ["file"]                                   # nothing written


@pytest.mark.gpu
def test_gpu_cuda_graphs_accumulate_like_plain_compile(data_dir, tmp_path):
    # two micro-batches a step (COMMON) under CUDA graphs: a replay overwrites the last one's gradients, so train.py
    # sums them in buffers of its own; the losses follow the plain compiled run's (same kernels, fp32, no dropout)
    gpu = ["--device=cuda", "--compile=True", "--dtype=float32", "--dropout=0.0"]
    plain, graphs = str(tmp_path / "plain"), str(tmp_path / "graphs")
    assert "torch.compile mode default" in train(data_dir, plain, *gpu, "--compile_mode=default")
    assert "torch.compile mode reduce-overhead" in train(data_dir, graphs, *gpu)  # auto: graphs for NSA on one GPU
    a, b = losses(graphs), losses(plain)
    print(f"losses graphs {a}\nlosses plain  {b}")
    assert sorted(a) == sorted(b) == list(range(8))
    assert max(abs(a[k] - b[k]) for k in b) < 1e-3


@pytest.mark.gpu
def test_gpu_compiled_bf16_resume_matches(data_dir, tmp_path):
    # CUDA, torch.compile, bf16 autocast, the Triton kernels and dropout (RNG states in the checkpoint): a run cut after
    # step 4 and resumed logs the losses of the uninterrupted run. Not bit for bit: two identical CUDA runs can differ
    # before the cut already, so the bound is 5e-4, a hundredth of the change from one step to the next here
    gpu = ["--device=cuda", "--compile=True", "--dtype=bfloat16", "--dropout=0.1"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    train(data_dir, full, *gpu)
    train(data_dir, cut, *gpu, "--max_iters=4")
    train(data_dir, cut, *gpu, "--init_from=resume")
    a, b = losses(cut), losses(full)
    print(f"losses resumed {a}\nlosses full    {b}")
    assert sorted(a) == sorted(b) == list(range(8))
    assert max(abs(a[k] - b[k]) for k in b) < 5e-4


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_gpu_ddp_under_cuda_graphs_matches_one_process(data_dir, tmp_path):
    # 2 NCCL ranks x 1 micro-batch under CUDA graphs, which auto now picks for NSA with DDP too (no DDP wrapper: the
    # step all-reduces its own gradient buffer), log the losses of 1 process x the same 2 micro-batches
    gpu = ["--device=cuda", "--compile=True", "--dtype=float32", "--dropout=0.0"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train(data_dir, one, *gpu)
    text = train(data_dir, two, *gpu, nproc=2)
    assert "2 rank(s) on cuda:0" in text and "torch.compile mode reduce-overhead" in text, text
    a, b = losses(two), losses(one)
    print(f"losses 2 ranks {a}\nlosses 1 rank  {b}")
    assert sorted(a) == sorted(b) == list(range(8))
    assert max(abs(a[k] - b[k]) for k in b) < 1e-3
