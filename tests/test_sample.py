"""sample.py end to end on tiny checkpoints built here in train.py's formats (ckpt.pt with model_args/model/config, and
model.safetensors + config.json): runs, is deterministic with a seed, greedy decode equals greedy full forwards,
sample 0 streams as it is generated, and missing/corrupt checkpoints, a tokenizer that does not fit, empty prompts and
--plot_selection fail (one line on the command line) or work as documented."""
import json
import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

from model import GPT, GPTConfig, PRESETS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "sample.py")


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """out_dir with a ckpt.pt of the tiny NSA preset (random weights, sharper attention), train.py's keys."""
    d = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    args = dict(PRESETS["tiny"], vocab_size=257)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight.mul_(4.0)
            block.attn.wkv.weight.mul_(4.0)
    torch.save(dict(model=model.state_dict(), model_args=args, iter_num=0,
                    config=dict(dataset="shakespeare", data_dir=str(d / "no_data_here"))), d / "ckpt.pt")
    return d


def run_sample(monkeypatch, capsys, *args):
    """Run sample.py in this process (as `python sample.py ARGS`) and return what it printed."""
    monkeypatch.setattr(sys, "argv", ["sample.py", *args])
    runpy.run_path(SAMPLE, run_name="__main__")
    return capsys.readouterr().out


def samples(out, n):
    """The n printed samples (text before each separator line)."""
    out = "".join(line for line in out.splitlines(True) if not line.startswith("Overriding"))
    parts = out.split("---------------\n")
    assert len(parts) == n + 1, out
    return parts[:n]


BASE = ["--device=cpu", "--dtype=float32", "--compile=False", "--num_samples=2", "--max_new_tokens=40"]


def test_runs_and_is_deterministic_with_a_seed(monkeypatch, capsys, ckpt_dir):
    a = run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", "--start=ROMEO:", "--seed=7", *BASE)
    b = run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", "--start=ROMEO:", "--seed=7", *BASE)
    c = run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", "--start=ROMEO:", "--seed=8", *BASE)
    sa, sb, sc = samples(a, 2), samples(b, 2), samples(c, 2)
    assert sa == sb
    assert sa != sc
    assert all(s.startswith("ROMEO:") for s in sa)
    assert "tokens/s" in a and "2 x 40 tokens on cpu" in a


def test_prompt_from_file_and_top_p(monkeypatch, capsys, ckpt_dir, tmp_path):
    (tmp_path / "p.txt").write_text("To be, or not to be")
    out = run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", f"--start=FILE:{tmp_path / 'p.txt'}",
                     "--top_p=0.5", "--top_k=0", *BASE)
    assert all(s.startswith("To be, or not to be") for s in samples(out, 2))


def test_greedy_generate_equals_greedy_forward(monkeypatch, ckpt_dir):
    # sample.generate (ragged prefill + cached steps) picks the same tokens as argmax over full forwards
    monkeypatch.setattr(sys, "argv", ["sample.py"])
    mod = runpy.run_path(SAMPLE)                                               # the functions, without main()
    model, _ = mod["load_model"](str(ckpt_dir))
    prompts = [[72, 105, 33, 10, 65], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    new, _ = mod["generate"](model, prompts, 30, temperature=0.0)
    for b, p in enumerate(prompts):
        seq = torch.tensor([p])
        with torch.no_grad():
            for _ in range(30):
                seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
        assert new[b].tolist() == seq[0, len(p):].tolist(), b


def test_safetensors_export_loads(monkeypatch, capsys, ckpt_dir, tmp_path):
    # train.py's export: model.safetensors without the tied lm_head.weight, config.json = model_args + tokenizer
    ckpt = torch.load(ckpt_dir / "ckpt.pt", weights_only=True)
    header, blobs, off = {}, [], 0
    for name, t in ckpt["model"].items():
        if name == "lm_head.weight":
            continue
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = dict(dtype="F32", shape=list(t.shape), data_offsets=[off, off + len(data)])
        blobs.append(data)
        off += len(data)
    head = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    (tmp_path / "config.json").write_text(json.dumps(dict(ckpt["model_args"], tokenizer="byte")))
    a = run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", "--start=Hi", "--seed=3", *BASE)
    b = run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", "--start=Hi", "--seed=3", *BASE)
    assert samples(a, 2) == samples(b, 2)


def test_missing_corrupt_checkpoint_and_empty_prompt(monkeypatch, capsys, ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="no checkpoint in out_dir"):
        run_sample(monkeypatch, capsys, f"--out_dir={tmp_path / 'nothing'}", *BASE)
    for data in (b"not a checkpoint at all", b"", (ckpt_dir / "ckpt.pt").read_bytes()[:3000]):  # random, empty, cut
        (tmp_path / "ckpt.pt").write_bytes(data)
        with pytest.raises(ValueError, match="^" + re.escape(f"{tmp_path}/ckpt.pt is not a readable checkpoint")):
            run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", *BASE)
    torch.save({"weights": {}}, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="ckpt.pt is not a train.py checkpoint: it lacks model_args, model"):
        run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", *BASE)
    with pytest.raises(ValueError, match="is empty"):
        run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", "--start=", *BASE)
    with pytest.raises(ValueError, match="no such file"):
        run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", f"--start=FILE:{tmp_path / 'none.txt'}", *BASE)


def test_plot_selection(monkeypatch, capsys, ckpt_dir, tmp_path):
    png = tmp_path / "sel.png"
    args = [f"--out_dir={ckpt_dir}", f"--plot_selection={png}", "--plot_layer=1", "--plot_group=1", *BASE]
    with pytest.raises(ValueError, match=r"plot_layer must be in \[0, 2\)"):
        run_sample(monkeypatch, capsys, *args, "--plot_layer=2")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs matplotlib: pip install matplotlib"):
            run_sample(monkeypatch, capsys, *args)
        return
    out = run_sample(monkeypatch, capsys, *args)
    assert f"wrote {png}" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_streams_sample_0_as_it_is_generated(monkeypatch, capsys, ckpt_dir):
    args = [f"--out_dir={ckpt_dir}", "--seed=4", "--temperature=1.5", *BASE]  # a random model: invalid UTF-8 too
    assert samples(run_sample(monkeypatch, capsys, *args), 2) == samples(run_sample(monkeypatch, capsys, *args,
                                                                                    "--stream=False"), 2)
    monkeypatch.setattr(sys, "argv", ["sample.py"])
    mod = runpy.run_path(SAMPLE)
    model, _ = mod["load_model"](str(ckpt_dir))
    tok, prompt, printed, got = mod["load_tokenizer"]("byte", {}, 257), [65, 0xE2, 0x82], [], []  # ends mid-char
    show = mod["print_row0"](tok, prompt)

    def on_token(tokens):                                                      # what was printed by each token
        got.append(tokens.clone())
        show(tokens)
        printed.append(capsys.readouterr().out)
    new, _ = mod["generate"](model, [prompt, prompt], 40, temperature=1.5, generator=torch.Generator().manual_seed(0),
                             on_token=on_token)
    show(None)
    printed.append(capsys.readouterr().out)
    assert torch.equal(torch.stack(got, dim=1), new)                           # every token, as it was sampled
    assert len([p for p in printed[:-1] if p]) > 10                            # text came out during generation
    assert "".join(printed) == tok.decode(prompt + new[0].tolist()) + "\n"


def test_tokenizer_must_fit_the_model(monkeypatch, capsys, tmp_path):
    args = dict(PRESETS["tiny"], vocab_size=50257)                            # a GPT-2 vocabulary
    torch.save(dict(model=GPT(GPTConfig(**args)).state_dict(), model_args=args), tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="tokenizer 'byte' has 257 tokens, the model 50257: pass the tokenizer it "
                                         "was trained with"):
        run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", "--tokenizer=byte", *BASE)
    assert "----" not in capsys.readouterr().out                               # before generating anything


def test_cli_subprocess(ckpt_dir, tmp_path):
    # the real command line, as a user runs it; a user error is one line
    cmd = [sys.executable, SAMPLE, f"--out_dir={ckpt_dir}", "--start=ab", "--max_new_tokens=5", "--num_samples=1",
           "--compile=False", "--device=cpu"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "1 x 5 tokens on cpu" in r.stdout
    (tmp_path / "ckpt.pt").write_bytes((ckpt_dir / "ckpt.pt").read_bytes()[:1000])
    r = subprocess.run(cmd + [f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {tmp_path}/ckpt.pt is not a readable checkpoint")
    assert len(r.stderr.splitlines()) == 1, r.stderr


def cli_error(*args):
    """Run `python sample.py ARGS` (Triton not interpreted) and return its stderr: one `error: ` line, exit status 1."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, SAMPLE, *args], cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, r.stderr
    return r.stderr


def test_bad_device_or_backend_is_one_line(monkeypatch, capsys, ckpt_dir):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = [f"--out_dir={ckpt_dir}", "--dtype=float32", "--compile=False", "--num_samples=1", "--max_new_tokens=3"]
    for bad in ("--device=gpu", "--device=mps", "--device=cuda:7"):
        for more in ([], ["--needle=True"]):
            with pytest.raises(ValueError, match="^device"):
                run_sample(monkeypatch, capsys, *args, bad, *more)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device='cuda', but this machine has 0 CUDA device"):
            run_sample(monkeypatch, capsys, *args, "--device=cuda")
        with pytest.raises(ValueError, match="^backend='triton' runs the Triton kernels, which need a CUDA device"):
            run_sample(monkeypatch, capsys, *args, "--backend=triton")
    out = run_sample(monkeypatch, capsys, *args)                              # device="auto"
    assert f"1 x 3 tokens on {'cuda' if torch.cuda.is_available() else 'cpu'} " in out
    assert cli_error(*args, "--device=gpu").startswith("error: device must be 'auto', 'cpu', 'cuda' or 'cuda:N'")


def test_triton_checkpoint_on_the_cpu_is_one_line(monkeypatch, capsys, ckpt_dir, tmp_path):
    # a checkpoint trained with backend='triton', sampled on the CPU without --backend: its backend is checked too
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ckpt = torch.load(ckpt_dir / "ckpt.pt", weights_only=True)
    torch.save(dict(ckpt, model_args=dict(ckpt["model_args"], backend="triton")), tmp_path / "ckpt.pt")
    with pytest.raises(ValueError, match="^backend='triton' .* use --backend=auto"):
        run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", *BASE)
    run_sample(monkeypatch, capsys, f"--out_dir={tmp_path}", "--backend=auto", *BASE)


def test_prompt_file_not_utf8_is_one_line(monkeypatch, capsys, ckpt_dir, tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe")
    start = f"--start=FILE:{tmp_path / 'bin.txt'}"
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'bin.txt'} is not UTF-8 text (invalid start byte at "
                                                   f"byte 0): save the prompt as UTF-8")):
        run_sample(monkeypatch, capsys, f"--out_dir={ckpt_dir}", start, *BASE)
    assert "is not UTF-8 text" in cli_error(f"--out_dir={ckpt_dir}", start, "--device=cpu")


def test_safetensors_of_another_shape_is_one_line(ckpt_dir, tmp_path):
    # model.safetensors beside a config.json whose n_embd differs: one line naming the file and the first mismatch
    from model import export_safetensors, load_model
    model, _ = load_model(str(ckpt_dir))
    args = torch.load(ckpt_dir / "ckpt.pt", weights_only=True)["model_args"]
    export_safetensors(model, str(tmp_path), dict(args, n_embd=2 * args["n_embd"], tokenizer="byte"))
    err = cli_error(f"--out_dir={tmp_path}", "--device=cpu", "--compile=False")
    assert err.startswith(f"error: {tmp_path / 'model.safetensors'}: the weights do not match model_args (size "
                          f"mismatch for "), err


@pytest.mark.slow
def test_end_to_end_on_a_cpu_smoke_checkpoint(monkeypatch, capsys, tmp_path):
    # train.py config/cpu_smoke.py for a few steps on a tiny corpus, then sample from its ckpt.pt and from its
    # model.safetensors export: same samples (the tokenizer comes from the data dir's meta.json)
    import numpy as np
    from prepare_data import prepare
    rng = np.random.default_rng(0)
    words = "the king queen lord speaks to his her my good night day sweet love death fair sir".split()
    (tmp_path / "c.txt").write_text("\n".join(" ".join(rng.choice(words, size=6)) for _ in range(300)) + "\n")
    prepare(dataset="text", input=str(tmp_path / "c.txt"), out_dir=str(tmp_path / "data"), num_proc=1)
    capsys.readouterr()                                                        # drop prepare's progress lines
    out = tmp_path / "out"
    cmd = [sys.executable, "train.py", "config/cpu_smoke.py", f"--data_dir={tmp_path / 'data'}", f"--out_dir={out}",
           "--block_size=64", "--max_iters=4", "--lr_decay_iters=4", "--warmup_iters=1", "--eval_every=4",
           "--eval_iters=1", "--save_every=4", "--diag_every=0"]
    r = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    args = [f"--out_dir={out}", "--start=the king", "--seed=5", *BASE]
    a = samples(run_sample(monkeypatch, capsys, *args), 2)
    os.remove(out / "ckpt.pt")                                                # now only the safetensors export
    b = samples(run_sample(monkeypatch, capsys, *args), 2)
    assert a == b and all(s.startswith("the king") for s in a)
