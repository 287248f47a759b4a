"""benchmarks/block_cache.py runs end to end in a tiny mode on the LLaMA backbone with ``--row-major --parts`` and
prints the row-major rows and the parts' limit beside the FLOP limit (no timing assertions)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_row_major_rows_and_the_parts_limit_are_printed():
    args = "--backbone llama --prompt-len 16 --answer-len 16 --block 8 --vocab 64 --reps 1 --row-major --parts"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "benchmarks/block_cache.py", *args.split()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for row in ("none", "prefix", "dual", "none (row-major)", "prefix (row-major)", "dual (row-major)"):
        assert re.search(rf"^\| {re.escape(row)} \| \d+\.\d{{3}} \|", out, re.M), row
    assert re.search(r"^\| none \(row-major\) \| [\d.]+ \| [\d.]+ \| 1\.00× \|", out, re.M)  # against its own none
    assert re.search(r"^the parts alone \(medians\): full pass [\d.]+ ms, head at the block [\d.]+ ms", out, re.M)
    assert re.search(r"^GFLOP/s: full pass's layers [\d.]+, dual window's layers \(8 positions\) [\d.]+", out, re.M)
    limits = dict(re.findall(r"^\| (none|prefix|dual) \| [\d.]+ \| ([\d.]+)× \| [\d.]+ \| [\d.]+× \|$", out, re.M))
    # a limit each, positive (its size is a timing: at this tiny shape on a shared machine a part's median can be an
    # outlier, and the test asserts no timing)
    assert limits["none"] == "1.00" and float(limits["prefix"]) > 0 and float(limits["dual"]) > 0, out
