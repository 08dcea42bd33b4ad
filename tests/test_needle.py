"""CPU tests of the needle-in-a-haystack task: prepare_data.py --dataset=needle is deterministic, every answer mark
points at the key its needle holds, rows are runs of whole documents; config/needle_smoke.py trains and sample.py
--needle=True evaluates it end to end (and a dense checkpoint). A `gpu` test checks the CUDA-graph decode."""
import csv
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest
import torch

import prepare_data as pd
from model import GPT, GPTConfig, PRESETS
from nsa_attention import decode_reads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "sample.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")
SMALL = dict(block_size=256, min_len=128, train_tokens=20_000, val_tokens=3_000, plain_frac=0.1)  # rows of 257 tokens
DIGITS = set(b"0123456789")

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A 60 KB filler text of short generated lines (a single file: its last 10% is the val filler)."""
    rng = np.random.default_rng(0)
    words = "the king queen lord speaks to his her my good night day sweet love death fair sir".split()
    lines = [" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(1500)]
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def needle_dir(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("needle"))
    pd.prepare_needle(out, corpus, multi_frac=0.3, **SMALL)
    return out


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


def _text(tokens):
    return bytes(np.asarray(tokens, dtype=np.uint8))


def test_generator_is_deterministic(corpus, needle_dir, tmp_path):
    pd.prepare_needle(str(tmp_path / "again"), corpus, multi_frac=0.3, **SMALL)
    assert _files(tmp_path / "again") == _files(needle_dir)
    pd.prepare_needle(str(tmp_path / "seed"), corpus, multi_frac=0.3, seed=7, **SMALL)
    other = _files(tmp_path / "seed")
    assert other["train_0000.bin"] != _files(needle_dir)["train_0000.bin"]
    before = os.stat(os.path.join(needle_dir, "train_0000.bin")).st_mtime_ns
    pd.prepare_needle(needle_dir, corpus, multi_frac=0.3, **SMALL)             # up to date: nothing rewritten
    assert os.stat(os.path.join(needle_dir, "train_0000.bin")).st_mtime_ns == before


@pytest.mark.parametrize("split", ["train", "val"])
def test_answers_are_where_the_marks_say(needle_dir, split):
    meta, marks = pd.load_meta(needle_dir), pd.needle_answers(needle_dir, split)
    rows = [pd.open_shard(os.path.join(needle_dir, e["file"])) for e in meta["splits"][split]["shards"]]
    assert meta["row_tokens"] == 257                                           # rows of whole documents, back to back
    assert all(len(r) % 257 == 0 and (r[::257] == 256).all() for r in rows)
    assert len(marks) == meta["splits"][split]["needles"] > 0
    assert meta["splits"][split]["documents"] > len(marks)                     # plain documents are mixed in
    for shard, start, key_pos, ans in marks.tolist():
        row, k = rows[shard], pd.KEY_DIGITS
        key = _text(row[key_pos:key_pos + k])
        assert row[start] == 256 and 256 not in row[start + 1:ans + k + 2]    # one document from EOT to the answer
        assert set(key) <= DIGITS and _text(row[ans:ans + k]) == key           # the answer is the needle's key
        assert len(set(key)) == k                                              # distinct digits: one induction step each
        assert _text(row[ans + k:ans + k + 2]) == b".\n" and ((ans + k + 2) % 257 == 0 or row[ans + k + 2] == 256)
        needle = _text(row[start:key_pos + k]).rsplit(b"The pass key of ", 1)[1]   # b"NAME is #12345"
        name = needle.split(b" ")[0].decode()
        assert needle == f"{name} is {pd.KEY_MARK}".encode() + key
        assert _text(row[start:ans]).endswith(pd.question_text(name).encode())


def test_needle_document_depth_length_and_multi_needle():
    filler = b"".join(b"line %d of the filler text\n" % i for i in range(400))
    rng = np.random.default_rng(0)
    L, q = 600, len(pd.question_text("november"))
    tokens, key_pos, ans = pd.needle_document(filler, L, 0.0, rng)
    assert len(tokens) == L + pd.KEY_DIGITS + 2 and ans == L and tokens[0] == 256 and key_pos < 40
    tokens, key_pos, ans = pd.needle_document(filler, L, 1.0, rng)
    assert ans - key_pos < q + len(pd.needle_text("november", "12345")) + 32  # right before the question
    tokens, key_pos, ans = pd.needle_document(filler, L, 0.5, rng, count=3)
    text = _text(tokens[1:])
    assert text.count(b"The pass key of ") == 4 and text.count(b"Remember it.") == 3
    asked = text[ans - 1:].split(b".")[0]
    name = text[:ans - 1].rsplit(b"The pass key of ", 1)[1].split(b" ")[0]
    assert text.count(b"The pass key of " + name + b" is #" + asked) == 2       # the needle and the answer
    assert _text(tokens[key_pos:key_pos + pd.KEY_DIGITS]) == asked
    with pytest.raises(ValueError, match="needs length"):
        pd.needle_document(filler, 50, 0.5, rng)


def _read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


EVAL = ["--needle=True", "--needle_lengths=(128, 300)", "--needle_depths=(0.0, 0.5, 1.0)", "--needle_trials=2",
        "--needle_steps=6", "--needle_plot_length=300", "--needle_val_rows=3", "--needle_batch_tokens=700"]


def test_smoke_config_trains_and_evaluates(corpus, tmp_path):
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    r = subprocess.run([sys.executable, "prepare_data.py", "--dataset=needle", f"--input={corpus}", f"--out_dir={data}",
                        "--needle_block_size=256", "--needle_min_len=128", "--needle_train_tokens=40_000",
                        "--needle_val_tokens=3_000"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "train.py", "config/needle_smoke.py", f"--data_dir={data}", f"--out_dir={out}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    evals = [float(x["val_loss"]) for x in _read_csv(os.path.join(out, "train_log.csv")) if x["kind"] == "eval"]
    assert evals[-1] < evals[0]
    r = subprocess.run([sys.executable, SAMPLE, f"--out_dir={out}", *EVAL], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "val answers, teacher-forced: " in r.stdout and "wrote" in r.stdout
    rows = _read_csv(os.path.join(out, "needle.csv"))
    assert [(int(x["length"]), float(x["depth"])) for x in rows] == [(L, d) for L in (128, 300) for d in (0, .5, 1)]
    for x in rows:
        assert x["model"] == "nsa" and int(x["trials"]) == 2 and 0 <= float(x["accuracy"]) <= 1
        assert float(x["keys_read"]) == sum(decode_reads(int(x["length"]), 8, 4, 16, 4, 32))   # every layer, group
        assert 0 <= float(x["sel_hit"]) <= float(x["sel_hit_best_layer"]) <= 1 and float(x["tokens_per_s"]) > 0
    assert int(rows[-1]["batch"]) == 2                                         # 700 // 300 rows per decode batch
    if "matplotlib is not installed" not in r.stdout:
        assert os.path.getsize(os.path.join(out, "needle.png")) > 0
        assert "needle in block" in r.stdout and os.path.getsize(os.path.join(out, "needle_selection.png")) > 0


def test_dense_checkpoint_evaluates_beside_another(needle_dir, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    args = dict(PRESETS["tiny"], vocab_size=257, attn="dense")
    torch.save(dict(model=GPT(GPTConfig(**args)).state_dict(), model_args=args, config=dict(data_dir=needle_dir)),
               tmp_path / "ckpt.pt")
    other = tmp_path / "other.csv"
    other.write_text("model,length,depth,accuracy\nnsa,128,0.0,1.0\nnsa,128,0.5,0.5\nnsa,128,1.0,0.0\n")
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--out_dir={tmp_path}", *EVAL[:-3], "--needle_val_rows=2",
                                      f"--needle_compare={other}", f"--needle_out={tmp_path / 'dense'}"])
    runpy.run_path(SAMPLE, run_name="__main__")
    out = capsys.readouterr().out
    rows = _read_csv(tmp_path / "dense.csv")
    assert [float(x["keys_read"]) for x in rows] == [128.0] * 3 + [300.0] * 3   # dense reads the whole context
    assert all(x["model"] == "dense" and x["sel_hit"] == "" for x in rows) and "sel_hit" not in out
    assert not os.path.exists(tmp_path / "dense_selection.png")


@pytest.mark.gpu
def test_cuda_graph_decode_equals_greedy_forward(needle_dir, monkeypatch):
    """needle_decode's captured steps give the tokens of greedy full forwards (fp32, sharpened random weights)."""
    monkeypatch.setattr(sys, "argv", ["sample.py"])
    mod = runpy.run_path(SAMPLE)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS["tiny"], vocab_size=257)).cuda().eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(4.0)
            block.attn.wkv.weight.mul_(4.0)
    filler = open(os.path.join(needle_dir, "needle_filler_val.bin"), "rb").read()
    prompts = mod["needle_prompts"](filler, 300, (0.0, 0.5), 2, 1, 0)[0].cuda()
    new = mod["needle_decode"](model, prompts, 8)[0]
    idx = prompts
    with torch.no_grad():
        for _ in range(8):
            idx = torch.cat([idx, model(idx)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(new, idx[:, prompts.shape[1]:].cpu())


def test_training_windows_are_whole_rows(needle_dir):
    data = pd.TokenShards(needle_dir, "train")
    x, y = data.random_batch(16, 256, torch.Generator().manual_seed(0))
    assert (x[:, 0] == 256).all()                                              # every window starts a row (EOT)
    assert torch.equal(x[:, 1:][y[:, :-1] >= 0], y[:, :-1][y[:, :-1] >= 0])    # y is x shifted (where not masked)
    with pytest.raises(ValueError, match="block_size=256"):
        data.random_batch(2, 128, torch.Generator())


def test_loss_mask_keeps_answers_and_plain_text(needle_dir):
    """needle_loss='answers': a retrieval document's only targets are its key's digits; plain documents keep all."""
    data, R = pd.TokenShards(needle_dir, "train"), 257
    marks = pd.needle_answers(needle_dir, "train")
    x, y = data.random_batch(64, 256, torch.Generator().manual_seed(1))
    kept = y >= 0
    assert kept.any() and not kept.all()
    assert torch.equal(y[kept], torch.cat([x[:, 1:], y[:, -1:]], 1)[kept])    # a kept target is the next token
    shard = torch.from_numpy(pd.open_shard(os.path.join(needle_dir, "train_0000.bin")).astype(np.int64))
    rows = shard.view(-1, R)                                                   # (rows, R)
    plain_targets = 0
    for b in range(len(x)):
        r = int(torch.nonzero((rows[:, :256] == x[b]).all(1))[0])              # the row of window b
        counted = set((torch.nonzero(kept[b])[:, 0] + 1 + r * R).tolist())    # token offsets that are targets
        expect = set(range(r * R + 1, (r + 1) * R))                           # the row's targets, every one ...
        for _, start, _, ans in marks[(marks[:, 1] >= r * R) & (marks[:, 1] < (r + 1) * R)].tolist():
            expect -= set(range(start, ans + pd.KEY_DIGITS + 2))              # ... but retrieval documents' ...
            expect |= set(range(ans, ans + pd.KEY_DIGITS)) - {(r + 1) * R}    # ... which keep their key's digits
            plain_targets -= pd.KEY_DIGITS
        assert counted == expect
        plain_targets += len(expect)
    assert plain_targets > 0                                                   # plain documents were in the batch


def test_loss_mask_of_the_wrong_length_is_a_clear_error(corpus, tmp_path):
    out = str(tmp_path / "needle")
    pd.prepare_needle(out, corpus, **SMALL)
    np.save(os.path.join(out, "loss_mask_train.npy"), np.ones(10, dtype=np.uint8))
    with pytest.raises(ValueError, match="loss_mask_train.npy .* 10 entries"):
        pd.TokenShards(out, "train")
