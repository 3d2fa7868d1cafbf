"""The bare-JAX host-memory probe (benchmarks/host_memory_tpu.py) runs on any backend: on the CPU
it writes the JSON the chip run writes, with the memory figures `stellax check` reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_probe_writes_the_process_memory_before_importing_stellax(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    out = tmp_path / "host_memory.json"
    proc = subprocess.run([sys.executable, "benchmarks/host_memory_tpu.py", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["format"] == "stellax-host-memory" and doc["device"] == "cpu"
    memory = doc["host_memory"]
    assert memory["peak_rss"] > 50e6 and memory["rss"] > 50e6      # a JAX process holds more than 50 MB
    # the figure taken before stellax was imported, from the same monotone counter as peak_rss
    assert 50e6 < doc["ru_maxrss_kb"] * 1024 <= memory["peak_rss"]
    assert "host" in proc.stdout
