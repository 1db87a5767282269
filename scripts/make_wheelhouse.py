#!/usr/bin/env python3
"""Download the Python packages the container image needs into a wheelhouse, for a build without a package index
(docker/Dockerfile installs from docker/wheelhouse with `--no-index` when it holds a requirements.txt; without
one, the build runs this script itself, against the package index).

    python scripts/make_wheelhouse.py --cpu --torch torch==2.13.0    # the plain Debian base, CPU torch, this Python
    python scripts/make_wheelhouse.py --extras gateway --python-version 3.10   # the official Triton base (GPU)

Run it on a machine that reaches the package index, with the Python of the image (or `--python-version` for
another one; Debian bookworm's is 3.11, Triton 24.10's 3.10). It writes the wheels and `requirements.txt` (the
project's requirements as pyproject.toml states them, with `--torch` in place of torch's); pip resolves them
again at install time, from the wheelhouse alone.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10 (the official Triton 24.10 base): the TOML reader pip carries
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / "docker" / "wheelhouse"
# What a CPU-only image leaves out: OpenAI's Triton compiles the GPU kernels, and s2tts runs without it on a CPU
# (s2tts/kernels.py); it is the largest package after torch.
GPU_ONLY = ("triton",)
# manylinux tags of glibc 2.17 to 2.35 (Ubuntu 22.04, the official Triton 24.10 base): what --python-version
# downloads for, since pip then knows nothing about the target's glibc.
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64"]


def requirement_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;@]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(extras: list[str], torch: str | None, cpu: bool) -> list[str]:
    """The project's requirements and those of `extras`, from pyproject.toml; where the `test` extra pins a version
    of one (`==`), that version: the image gets what the test suite runs (tritonclient 2.51.0, the server's release;
    later ones refuse the request parameters the gateway sends)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        sys.exit(f"no such extra in pyproject.toml: {', '.join(unknown)} (there are: {', '.join(optional)})")
    tested = {requirement_name(r): r for r in optional.get("test", []) if "==" in r}
    out = []
    for r in list(project["dependencies"]) + [r for e in extras for r in optional[e]]:
        name = requirement_name(r)
        if cpu and name in GPU_ONLY:
            continue
        r = torch if torch and name == "torch" else tested.get(name, r)
        if r not in out:
            out.append(r)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", nargs="?", default=str(DEFAULT_DIR), help="the wheelhouse (default %(default)s)")
    ap.add_argument("--extras", default="server,gateway",
                    help="the project's extras: server (tritonserver from the nvidia-pytriton wheel, for a base "
                         "without it) and gateway (default %(default)s; the official Triton base needs only gateway)")
    ap.add_argument("--torch", help="torch's requirement instead of pyproject's, e.g. torch==2.13.0 (where pip finds "
                                    "a CPU wheel of that version, or with PIP_EXTRA_INDEX_URL set to PyTorch's CPU index)")
    ap.add_argument("--cpu", action="store_true", help=f"an image for CPUs only: leave out {', '.join(GPU_ONLY)}")
    ap.add_argument("--python-version", help="the image's Python (e.g. 3.10) when it is not the one running this")
    args = ap.parse_args(argv)

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.whl"), out / "requirements.txt"]:  # another resolution's wheels would go in the image
        old.unlink(missing_ok=True)
    reqs = requirements([e for e in args.extras.split(",") if e], args.torch, args.cpu)
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--only-binary=:all:",
           "-d", str(out)]
    if args.python_version:
        cmd += ["--python-version", args.python_version, "--implementation", "cp"]
        cmd += [a for tag in MANYLINUX for a in ("--platform", tag)]
    r = subprocess.run([*cmd, *reqs])
    if r.returncode:
        print(f"pip download failed (exit {r.returncode}): {' '.join(cmd + reqs)}", file=sys.stderr)
        return r.returncode
    (out / "requirements.txt").write_text("".join(f"{r}\n" for r in reqs))
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"wheelhouse {out}: {len(wheels)} wheels, {size / 2**20:.0f} MiB; requirements.txt: {len(reqs)} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
