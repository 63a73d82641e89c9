"""The package's layout is its architecture: the loop never imports Ray, and the installed
package is `raylane` alone."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import raylane.loop


def test_no_loop_module_imports_ray():
    modules = [f"raylane.loop.{m.name}" for m in pkgutil.iter_modules(raylane.loop.__path__)]
    assert "raylane.loop.trainer" in modules and "raylane.loop.run" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"a raylane.loop module imported Ray: {out}"
