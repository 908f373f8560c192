"""Builds deltasync's C++ extension with the project's CMake for `pip install .`.

The package's metadata is in pyproject.toml. The extension is the CMake
target `_deltasync` (python/CMakeLists.txt), built for the interpreter that
runs pip. Environment:
  DELTASYNC_BUILD_DIR  CMake build directory to use (default: build/pip);
                       an existing configured tree is reused as it is
  DELTASYNC_CMAKE_ARGS extra configure arguments, e.g. -DDELTASYNC_WITH_CUDA=OFF
  DELTASYNC_JOBS       parallel build jobs (default: all cores)
"""

import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        build = os.environ.get("DELTASYNC_BUILD_DIR") or os.path.join(ROOT, "build", "pip")
        build = os.path.abspath(build)
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
            args = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                    "-DDELTASYNC_BUILD_TESTS=OFF", "-DDELTASYNC_BUILD_BENCH=OFF",
                    "-DDELTASYNC_WITH_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"]
            if shutil.which("ninja"):
                args += ["-G", "Ninja"]
            args += shlex.split(os.environ.get("DELTASYNC_CMAKE_ARGS", ""))
            subprocess.run(args, check=True)
        jobs = os.environ.get("DELTASYNC_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", build, "--target", "_deltasync", "-j", jobs],
                       check=True)
        built = os.path.join(build, "python", "deltasync")
        so = [f for f in os.listdir(built) if f.startswith("_deltasync") and f.endswith(".so")]
        if len(so) != 1:
            raise RuntimeError(f"deltasync: expected one _deltasync*.so in {built}, found {so}")
        dest = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copyfile(os.path.join(built, so[0]), dest)


setup(ext_modules=[CMakeExtension("deltasync._deltasync")], cmdclass={"build_ext": CMakeBuild})
