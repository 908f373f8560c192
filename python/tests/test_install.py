"""`pip install .` into a fresh virtual environment (Debian's pip and
setuptools, no index): the installed package imports from outside the
source tree and works. Reuses this build's CMake tree, so it builds nothing
new."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pip_install_from_the_repository(tmp_path):
    build = os.environ.get("DELTASYNC_BUILD_DIR")
    if not build:
        pytest.skip("DELTASYNC_BUILD_DIR is not set (run through ctest)")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    env = dict(os.environ, DELTASYNC_BUILD_DIR=build)
    env.pop("PYTHONPATH", None)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-index", ROOT],
                   check=True, env=env, cwd=tmp_path)
    code = ("import deltasync as ds, numpy as np\n"
            "assert ds.__file__.startswith(%r), ds.__file__\n"
            "a = np.zeros(8, np.float32); b = a.copy(); b[2] = 1\n"
            "assert list(ds.diff(b, a).positions) == [2]\n"
            "import deltasync.adapters.sglang\n"
            "print(ds.__version__)\n") % str(venv)
    out = subprocess.run([py, "-c", code], check=True, env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "0.1.0"
