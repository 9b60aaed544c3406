"""Build the installable agent wheel: the `agent` package plus the native library (libggswarm.so).

    .venv/bin/python scripts/build_agent_wheel.py [--out dist] [--version 0.2.0] [--native-lib PATH]

`build_wheel()` is the reusable part (tests build a v1 and a v2 with it): it stages a copy of the
package in a temporary directory, puts the native library at `agent/_native/libggswarm.so`, stamps the
version (pyproject and `agent.__version__`, which the agent reports to the control plane) and runs
`pip wheel` on the copy, so the checkout is never written to. The wheel is tagged `py3-none-<platform>`:
the library does not depend on the Python ABI, but it is built for this platform and against the ggml
of llama-cpp-python 0.3.36 (the `llamacpp` extra pins it; the binding preloads that ggml at run time,
see `agent.backends.ggswarm_lib`).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE_LIB = REPO / "native" / "build" / "libggswarm.so"
PACKAGED_LIB = Path("agent") / "_native" / "libggswarm.so"

# setup.py of the staged copy only: metadata stays in pyproject.toml; this makes the wheel a platform
# wheel (it carries a shared library) without tying it to one CPython ABI.
_SETUP_PY = """\
from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        return ("py3", "none", super().get_tag()[2])


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PlatformWheel})
"""


class WheelBuildError(RuntimeError):
    """The wheel could not be built; the message says which step failed."""


def _stamp_version(staging: Path, version: str) -> None:
    if not re.fullmatch(r"[0-9]+(\.[0-9]+)*([ab]|rc|\.post|\.dev)?[0-9]*", version):
        raise WheelBuildError(f"{version!r} is not a PEP 440 version")
    pyproject = staging / "pyproject.toml"
    text, n = re.subn(r'(?m)^version = "[^"]*"$', f'version = "{version}"', pyproject.read_text(), count=1)
    if n != 1:
        raise WheelBuildError('pyproject.toml has no `version = "..."` line to stamp')
    pyproject.write_text(text)
    init = staging / "agent" / "__init__.py"
    text, n = re.subn(r'(?m)^__version__ = "[^"]*"$', f'__version__ = "{version}"', init.read_text(), count=1)
    if n != 1:
        raise WheelBuildError('agent/__init__.py has no `__version__ = "..."` line to stamp')
    init.write_text(text)


def _repo_version() -> str:
    m = re.search(r'(?m)^version = "([^"]*)"$', (REPO / "pyproject.toml").read_text())
    if m is None:
        raise WheelBuildError("pyproject.toml has no version")
    return m.group(1)


def build_native(python: str = sys.executable) -> Path:
    """Run native/build.sh against `python`'s llama-cpp-python; returns the library's path."""
    proc = subprocess.run(
        ["bash", str(REPO / "native" / "build.sh")],
        env={**os.environ, "PYTHON": python},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise WheelBuildError(f"native/build.sh failed:\n{proc.stderr.strip()}")
    return NATIVE_LIB


def build_wheel(
    out_dir: str | Path,
    version: str | None = None,
    native_lib: str | Path | None = None,
    python: str = sys.executable,
) -> Path:
    """Build the agent wheel into `out_dir` and return its path.

    `version` overrides pyproject's version (and `agent.__version__`); `native_lib` defaults to
    native/build/libggswarm.so, built with native/build.sh when missing. `python` runs `pip wheel` and
    must have setuptools (no build isolation: no network needed).
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    lib = Path(native_lib) if native_lib else NATIVE_LIB
    if not lib.is_file():
        if native_lib:
            raise WheelBuildError(f"{lib} does not exist")
        lib = build_native(python)
    with tempfile.TemporaryDirectory(prefix="agent-wheel-") as tmp:
        staging = Path(tmp) / "src"
        staging.mkdir()
        shutil.copy2(REPO / "pyproject.toml", staging / "pyproject.toml")
        shutil.copy2(REPO / "README.md", staging / "README.md")
        shutil.copytree(
            REPO / "agent",
            staging / "agent",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_native"),
        )
        (staging / PACKAGED_LIB).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, staging / PACKAGED_LIB)
        (staging / "setup.py").write_text(_SETUP_PY)
        if version:
            _stamp_version(staging, version)
        before = set(out.glob("*.whl"))
        proc = subprocess.run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-build-isolation",
                "--quiet",
                "-w",
                str(out),
                str(staging),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise WheelBuildError(f"pip wheel failed:\n{proc.stdout}{proc.stderr}".strip())
    want = version or _repo_version()
    wheels = sorted(out.glob(f"gguf_swarm_agent-{want}-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        new = sorted(set(out.glob("*.whl")) - before)
        raise WheelBuildError(f"pip wheel succeeded but no gguf_swarm_agent-{want} wheel is in {out} ({new})")
    return wheels[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "dist"), help="directory for the wheel (default: dist/)")
    p.add_argument("--version", help="version to stamp (default: pyproject's)")
    p.add_argument("--native-lib", help="libggswarm.so to package (default: native/build/libggswarm.so)")
    args = p.parse_args(argv)
    try:
        path = build_wheel(args.out, args.version, args.native_lib)
    except WheelBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
