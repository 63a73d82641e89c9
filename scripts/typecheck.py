"""mypy over the repo at the level the code passes today, and over a user's project beside it.

1. `mypy` (settings in pyproject.toml) on app/raylane. The errors it found when the check came in
   are listed in .ci/mypy-baseline.txt (file, message and code; no line numbers, which move with
   every edit): any error not listed fails, so that no new one lands. Fixing listed ones is
   welcome: `python scripts/typecheck.py --update` then shrinks the list.
2. A small project in a temporary folder (outside the repo) that imports raylane: mypy must
   resolve `raylane.loop.trainer` through the editable install and read its types."""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASELINE = REPO / ".ci" / "mypy-baseline.txt"
ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*)$")
USER_PROJECT = """import raylane
from raylane.loop.trainer import Trainer

reveal_type(Trainer.run_step)
summary: raylane.TrainSummary = raylane.train("train.yaml")
reveal_type(summary.steps)
"""


def mypy(*args: str, cwd: Path = REPO) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary", "--cache-dir", str(REPO / ".mypy_cache"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 1) or "error: Cannot" in out.stderr:
        raise SystemExit(f"mypy did not run: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.splitlines()


def keyed(lines: list[str]) -> collections.Counter[str]:
    return collections.Counter(_key(m) for line in lines if (m := ERROR.match(line)))


def _key(match: re.Match[str]) -> str:
    # Some messages name a line ("already defined on line 74"): it moves with every edit too.
    message = re.sub(r"line \d+", "line N", match["message"])
    return f"{match['file']}: {message}"


def check_repo(update: bool) -> int:
    lines = mypy()
    found = keyed(lines)
    if update:
        BASELINE.write_text("".join(f"{key}\n" for key in sorted(found.elements())))
        print(f"typecheck: {sum(found.values())} known errors written to {BASELINE.relative_to(REPO)}")
        return 0
    known = collections.Counter(BASELINE.read_text().splitlines()) if BASELINE.exists() else collections.Counter()
    new = found - known
    if new:
        shown = [line for line in lines if (m := ERROR.match(line)) and _key(m) in new]
        print("typecheck: mypy errors that are not in .ci/mypy-baseline.txt:\n" + "\n".join(shown), file=sys.stderr)
        return 1
    fixed = sum((known - found).values())
    print(
        f"typecheck: no new mypy errors ({sum(found.values())} known"
        + (f"; {fixed} fixed: `python scripts/typecheck.py --update` shrinks the list)" if fixed else ")")
    )
    return 0


def check_user_project() -> int:
    with tempfile.TemporaryDirectory(prefix="raylane-user-") as folder:
        (Path(folder) / "use.py").write_text(USER_PROJECT)
        # The repo's settings (its heavy libraries read as untyped): a project's own config
        # would differ, but what is checked here is that raylane resolves from outside.
        lines = mypy("--config-file", str(REPO / "pyproject.toml"), "use.py", cwd=Path(folder))
    revealed = [line for line in lines if "Revealed type" in line]
    ok = (
        len(revealed) == 2
        and "raylane.loop.trainer.Trainer" in revealed[0]
        and "int | None" in revealed[1]
        and not any(": error:" in line for line in lines)
    )
    if not ok:
        print(
            "typecheck: mypy does not resolve raylane from a project beside the install:\n" + "\n".join(lines),
            file=sys.stderr,
        )
        return 1
    print("typecheck: a user's project resolves raylane.loop.trainer and raylane.TrainSummary")
    return 0


if __name__ == "__main__":
    update = "--update" in sys.argv[1:]
    raise SystemExit(check_repo(update) or (0 if update else check_user_project()))
