"""The README's first command on a fresh virtual environment: install, then the default bench."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_fresh_venv_installs_and_runs_default_bench(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # the CPU build of torch that this machine keeps on disk; a plain `pip install .` may pick a CUDA build
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + [str(ROOT)], check=True)
    env = dict(os.environ, FLASHDRAFT_CACHE=os.environ.get("FLASHDRAFT_CACHE", str(Path.home() / ".cache" / "flashdraft")))
    out = subprocess.run([str(venv / "bin" / "flashdraft"), "bench", "--max-tokens", "24", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "speedup" in out.stdout.lower() or "dflash" in out.stdout.lower()
