"""Build the CPU kernel extension in place: ``python -m engine.kernels.build``.

Configures engine/kernels/CMakeLists.txt against the installed MLX wheel and nanobind, builds
in engine/kernels/build/ and copies the module next to this file, where engine.kernels finds
it. setup.sh runs this; rebuild after changing the C++ sources or the MLX version.
Exit status 0 when built, 1 with one line on stderr saying why not.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUILD = HERE / "build"


def _tool(name: str) -> str | None:
    # The venv's own bin first (PyPI cmake/ninja), then PATH.
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def module_name() -> str:
    return "_ext" + sysconfig.get_config_var("EXT_SUFFIX")


def build(verbose: bool = False) -> Path:
    """Build and install the module; return its path. Raises RuntimeError with the reason."""
    cmake = _tool("cmake")
    if cmake is None:
        raise RuntimeError("cmake not found (pip install cmake)")
    if shutil.which("c++") is None and shutil.which("g++") is None and shutil.which("clang++") is None:
        raise RuntimeError("no C++ compiler found (apt-get install g++)")
    ninja = _tool("ninja")
    cfg = [cmake, "-S", str(HERE), "-B", str(BUILD), f"-DPython_EXECUTABLE={sys.executable}",
           "-DCMAKE_BUILD_TYPE=Release"]
    if ninja:
        cfg += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    out = None if verbose else subprocess.PIPE
    for cmd in (cfg, [cmake, "--build", str(BUILD), "-j", "2"]):
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            tail = (r.stdout or "").strip().splitlines()[-15:]
            raise RuntimeError("build failed:\n" + "\n".join(tail))
    built = BUILD / module_name()
    if not built.exists():
        raise RuntimeError(f"build produced no {built.name}")
    target = HERE / built.name
    tmp = target.with_suffix(".tmp")
    shutil.copy2(built, tmp)
    tmp.replace(target)  # atomic: a running process keeps its mapped copy
    return target


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except RuntimeError as e:
        print(f"engine.kernels.build: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
