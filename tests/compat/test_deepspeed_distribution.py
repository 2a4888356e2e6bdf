"""The `deepspeed` compatibility distribution (compat/deepspeed/): installs into a fresh virtual
environment, makes `import deepspeed` and every mirrored `deepspeed.*` path zerokit's, reports
its version through package metadata (what transformers and Accelerate check), and uninstalls
cleanly. The fresh venv reuses this interpreter's packages through PYTHONPATH (no torch
download); the venv's own site-packages comes first, so it wins over any real DeepSpeed there.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = r"""
import importlib, importlib.metadata as md, sys
print("version", md.version("deepspeed"))
import deepspeed, zerokit.compat.deepspeed as compat
assert deepspeed is compat, deepspeed
for path in %(paths)r:
    alias = importlib.import_module(path.replace("zerokit.compat.deepspeed", "deepspeed", 1))
    assert alias is importlib.import_module(path), path
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus, zero_wrapper_for_fp_tensor_constructor
from deepspeed.ops.adam import FusedAdam, DeepSpeedCPUAdam
try:
    import deepspeed.inference
except ModuleNotFoundError as e:
    assert "does not mirror" in str(e), e
else:
    raise AssertionError("an unmirrored path imported")
print("ok")
"""


def _run(cmd: list[str], env: dict | None = None) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout}\n{out.stderr}"
    return out.stdout


@pytest.mark.slow
def test_install_import_uninstall(tmp_path):
    from test_deepspeed_api import MIRRORED

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    src = tmp_path / "deepspeed-compat"
    shutil.copytree(os.path.join(REPO, "compat", "deepspeed"), src)  # the build writes beside it
    _run([py, "-m", "pip", "install", "--quiet", "--no-deps", str(src)])
    venv_site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [venv_site, os.path.join(REPO, "src"), sysconfig.get_paths()["purelib"]]))
    out = _run([py, "-c", PROBE % {"paths": sorted(MIRRORED)}], env)
    assert "version 0.19.8+zerokit" in out and out.strip().endswith("ok"), out
    _run([py, "-m", "pip", "uninstall", "--yes", "--quiet", "deepspeed"])
    left = [n for n in os.listdir(venv_site) if n.lower().startswith("deepspeed")]
    assert not left, f"left behind after uninstall: {left}"
