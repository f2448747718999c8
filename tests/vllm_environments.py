"""Test helpers for the interpreter that runs vLLM (`EYRIE_VLLM_PYTHON`): another environment, emulated."""

from __future__ import annotations

import sys
from pathlib import Path

BLOCK = """
import sys
BLOCKED = {blocked!r}
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed in this environment")
sys.meta_path.insert(0, _Block())
"""


def wrapper(folder: Path, blocked: tuple[str, ...] = ("prefect",)) -> Path:
    """An interpreter at another path: this venv's Python behind a shell script, with `blocked` unimportable there
    (a sitecustomize on its PYTHONPATH)."""
    site = folder / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCK.format(blocked=set(blocked)))
    script = folder / "python"
    script.write_text(f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    script.chmod(0o755)
    return script
