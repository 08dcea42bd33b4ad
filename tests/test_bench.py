"""bench.py's three modes run end to end on CPU (tiny shapes, kernels in the interpreter): each passes its own
correctness check against the fp32 reference and writes the table it prints to --csv."""
import csv
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(tmp_path, *args):
    out = tmp_path / "table.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "bench.py", f"--csv={out}", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout, list(csv.DictReader(open(out)))


def test_selection_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--seqlens=(40,)")
    assert "check T=40" in text and "(ok)" in text
    assert {(r["impl"], r["pass_"]) for r in rows} >= {("nsa selection (triton)", "fwd"),
                                                        ("nsa selection (triton)", "fwd+bwd")}
    assert all(float(r["ms"]) > 0 for r in rows)


def test_decode_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--mode=decode")
    assert "decode check" in text and "(ok)" in text
    impls = {r["impl"] for r in rows}
    assert {"nsa decode (triton)", "nsa decode (torch ref)", "nsa layer decode", "dense layer decode"} <= impls
    # reads column: the "Decode reads" formula of nsa_attention.py at S = 256 for the CPU shapes (l=16, d=8, l'=16, n=4, w=512)
    assert next(r for r in rows if r["impl"] == "nsa decode (triton)")["reads"] == str(31 + 64 + 256)


@pytest.mark.slow
def test_layer_mode(tmp_path):
    text, rows = run_bench(tmp_path, "--mode=layer")
    assert "layer check" in text and "(ok)" in text
    assert {"NSA layer core", "compressed", "gate"} <= {r["impl"] for r in rows}
