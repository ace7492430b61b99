"""The README's 30-second example runs as written (with fewer classes, to stay quick)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_example_runs(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as fh:
        code = re.findall(r"```python\n(.*?)```", fh.read(), re.S)[0]
    assert "ds_xc.initialize" in code and "1_000_000" in code
    script = tmp_path / "example.py"
    script.write_text(code.replace("1_000_000", "20_000") + "\nprint('LOSS', float(loss))\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # a plain `python example.py`
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "latest").is_file()
    loss = float(re.search(r"LOSS ([0-9.]+)", proc.stdout).group(1))
    assert 0.0 < loss < 100.0
