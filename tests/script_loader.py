"""Loading a file of scripts/ as a module, for the tests of the benchmark and report scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str, module_name: str | None = None) -> ModuleType:
    """scripts/<filename> imported as a module (registered in sys.modules, where dataclasses look
    their module up)."""
    name = module_name or Path(filename).stem
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
