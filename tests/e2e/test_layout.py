"""The package's layout is its architecture: the loop never imports Ray, and the installed
package is `raylane` alone."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import raylane.loop


def test_no_loop_module_imports_ray():
    modules = [m.name for m in pkgutil.walk_packages(raylane.loop.__path__, "raylane.loop.")]
    assert "raylane.loop.trainer" in modules and "raylane.loop.run" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(n for n in sys.modules if n == 'ray' or n.startswith('ray.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"a raylane.loop module imported Ray: {out}"


def test_every_module_of_the_package_imports():
    """Every module, Ray's included, imports on its own: the architecture test reads imports from
    the source and a unit test never loads the Ray launcher, so a name missing at import time (a
    type alias evaluated at module level, say) would otherwise show only when a run starts."""
    code = (
        "import importlib, pkgutil, raylane\n"
        "names = [m.name for m in pkgutil.walk_packages(raylane.__path__, 'raylane.')"
        " if not m.name.startswith(('raylane.pipelines', 'raylane.__main__'))]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip()) > 100  # every subpackage walked, not the top level alone
