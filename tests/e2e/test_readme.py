"""The command blocks of README.md and of every page under docs/, as a newcomer copies them.

Every shell block (of every page, each written to run from the repo root) is checked without running it: bash parses it, every `raylane` subcommand and
flag is one the parser knows, every config loads with its `--set` keys, every file, script,
make target and `scripts/cluster.sh` verb it names exists. Blocks with no marker are then run
for real, each in a scratch folder that sees the repo's tracked files through links, so nothing
is written into the repo. An HTML comment on the line before a block's fence marks one that a
test should not run:

    <!-- readme-test: slow: WHY -->   trains, sweeps or starts servers (other tests run those);
                                      its `raylane check` and `--version` commands still run here
    <!-- readme-test: skip: WHY -->   needs what this machine lacks (AWS, a second node, a GPU);
                                      a program WHY names (`needs a cluster and helm`) need
                                      not be installed here

and its run test is skipped with that reason. On a fresh clone every block runs by hand, in
order, slow ones included."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import raylane
from tests.conftest import REPO, cli_env

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
MARK = re.compile(r"<!--\s*readme-test:\s*(slow|skip)\s*:?\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
# The repo's own files a block may read; a run's outputs (runs/, mlflow.db, s.json, exported/)
# land in the scratch folder beside these links, never in the repo.
TRACKED = [
    "app",
    "pipelines",
    "examples",
    "scripts",
    "docs",
    "bench",
    "Makefile",
    "pyproject.toml",
    "constraints-cpu.txt",
    "cluster.yaml",
    "README.md",
]
SEPARATORS = {"&&", "||", ";", "|", "&"}
# Slurm's client commands run where the cluster is; here `make slurm` installs them, or not.
SLURM_CLIENT = {"sbatch", "scancel", "squeue", "sinfo"}
VENV_BIN = Path(sys.prefix) / "bin"


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    mark: str | None = None  # slow | skip
    reason: str = ""
    page: str = "README.md"  # relative to the repo

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: Path = README) -> list[Block]:
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang, body = len(m.group(1)), m.group(2), []
        i += 1
        while not FENCE.match(lines[i]) or FENCE.match(lines[i]).group(2):
            body.append(lines[i][indent:])
            i += 1
        start = i - len(body)
        before = next((ln for ln in reversed(lines[: start - 1]) if ln.strip()), "")
        mark = MARK.search(before)
        found.append(
            Block(
                start, lang, "\n".join(body) + "\n", *(mark.groups() if mark else ()), page=str(page.relative_to(REPO))
            )
        )
        i += 1
    return found


BLOCKS = [b for page in PAGES for b in blocks(page)]
SHELL = [b for b in BLOCKS if b.lang in SHELL_LANGS]


def commands(block: Block) -> list[list[str]]:
    """The simple commands of a block, in order, each its argv with leading VAR=value kept."""
    text = block.text.replace("\\\n", " ")
    if block.lang == "console":  # prompts: `$ cmd`; the other lines are output
        text = "\n".join(ln[2:] for ln in text.splitlines() if ln.startswith("$ "))
    found = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, argv = True, []
        for token in [*lexer, ";"]:
            if token in SEPARATORS:
                found += [argv] if argv else []
                argv = []
            else:
                argv.append(token)
    return found


def split_env(argv: list[str]) -> tuple[list[str], list[str]]:
    n = next((i for i, a in enumerate(argv) if not re.match(r"^[A-Za-z_]\w*=", a)), len(argv))
    return argv[:n], argv[n:]


def resolve(cwd: Path, token: str) -> Path:
    """A path as the block's shell sees it; the repo's .venv is this interpreter's environment."""
    path = Path(os.path.normpath(cwd / token))
    venv = REPO / ".venv"
    if not venv.exists() and path.is_relative_to(venv):
        return Path(sys.prefix) / path.relative_to(venv)
    return path


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:", (REPO / "Makefile").read_text(), re.M))


def cluster_verbs() -> set[str]:
    return set(re.findall(r"^\s*(\w+)\)", (REPO / "scripts/cluster.sh").read_text(), re.M))


def parse(parser, argv: list[str], prog: str):
    """argparse's verdict on argv, its error as an AssertionError."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            raise AssertionError(f"{prog} {shlex.join(argv)}: {err.getvalue().strip()}") from None


def check_raylane(argv: list[str], cwd: Path) -> None:
    """raylane's own parser accepts argv, and the config it names loads with its --set keys."""
    from raylane.cli import parser

    if argv == ["--version"]:
        return
    args = parse(parser(), argv, "raylane")
    if args.command == "export" and "$" not in args.checkpoint:  # else computed when the block runs
        where = resolve(cwd, args.checkpoint)
        assert where.is_dir() or _created(where), f"raylane export {args.checkpoint}: no such checkpoint"
    config = getattr(args, "config", None)
    if config is None:
        return
    source = str(cwd / config) if (cwd / config).exists() else config  # else a shipped name
    from raylane.config import ConfigError
    from raylane.config.sweep import is_sweep_file

    try:
        sweep = args.command == "tune" or (args.command == "check" and is_sweep_file(source))
    except ConfigError:  # no such file yet: the block makes it (checked below)
        sweep = False
    if sweep:
        from raylane.config.sweep import load_sweep

        load_sweep(source, args.overrides)
    elif args.command == "autotune":
        from raylane.config import autotune

        autotune.space(*autotune.load(source, args.overrides))
    else:
        from raylane.config import load_config

        try:
            load_config(source, args.overrides)
        except ConfigError as exc:  # a path the block makes first (its model, its data)
            # A model's path not made yet reads as a Hugging Face hub id, named as written.
            named = [str(c) for c in _CREATED] + [f"'{os.path.relpath(c, cwd)}" for c in _CREATED]
            if not any(n in str(exc) for n in named):
                raise


def check_command(argv: list[str], cwd: Path) -> Path:
    """Checks one simple command; returns the directory the next one runs in."""
    _, argv = split_env(argv)
    prog, rest = argv[0], argv[1:]
    if prog == "cd":
        target = resolve(cwd, rest[0])
        assert target.is_dir(), f"cd {rest[0]}: no such folder"
        return target
    if prog in ("source", "."):
        assert resolve(cwd, rest[0]).is_file(), f"{prog} {rest[0]}: no such file"
        return cwd
    if prog == "export":
        return cwd
    if "/" in prog:
        assert os.access(resolve(cwd, prog), os.X_OK), f"{prog}: no such executable"
    elif prog not in SLURM_CLIENT:
        installed = (VENV_BIN / prog).exists() or shutil.which(prog)
        assert installed or prog in _LACKING, f"{prog}: not installed"
    name = Path(prog).name
    if name == "make":
        assert set(rest) <= make_targets(), f"make {' '.join(rest)}: no such target"
    elif name == "raylane":
        check_raylane(rest, cwd)
    elif name == "cluster.sh":
        assert rest[0] in cluster_verbs(), f"cluster.sh {rest[0]}: no such verb"
        if rest[0] == "submit":  # `raylane train CONFIG --set run.storage_path=... ARGS`
            check_raylane(["train", *rest[1:]], cwd)
    elif name == "sbatch":  # sbatch [--OPTION=VALUE ...] SCRIPT ARGS: the script's are `raylane train`'s
        script = next(i for i, a in enumerate(rest) if not a.startswith("-"))
        assert resolve(cwd, rest[script]).is_file(), f"sbatch {rest[script]}: no such script"
        if rest[script].endswith("slurm-ray.sbatch"):
            check_raylane(["train", *rest[script + 1 :]], cwd)
    elif name == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = parse(get_args_parser(), rest, "torchrun")
        assert parsed.module and parsed.training_script == "raylane", shlex.join(argv)
        check_raylane(parsed.training_script_args, cwd)
    return cwd


# Paths a block's own commands make before later ones use them (a marker's "creates A, B"): what
# names them is checked once they exist, not before.
_CREATED: list[Path] = []
CREATES = re.compile(r"creates\s+([^;]+)")


# Programs a skip marker names as what this machine lacks ("needs a Kubernetes cluster and helm"):
# its block may run them though they are not installed here; any other program must be.
_LACKING: set[str] = set()


def _created(path: Path) -> bool:
    return any(path.resolve().is_relative_to(c) for c in _CREATED)


def check_block(block: Block) -> None:
    parsed = subprocess.run(["bash", "-n"], input=block.text, capture_output=True, text=True)
    assert parsed.returncode == 0, f"{block.id}: {parsed.stderr}"
    found = CREATES.search(block.reason)
    _CREATED[:] = [(REPO / p.strip()).resolve() for p in found.group(1).split(",")] if found else []
    _LACKING.clear()
    if block.mark == "skip":
        _LACKING.update(re.findall(r"[\w.-]+", block.reason))
    cwd = REPO
    for argv in commands(block):
        cwd = check_command(argv, cwd)


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_block_is_valid(block: Block):
    """Parses, and names only subcommands, flags, config keys, files and targets that exist."""
    check_block(block)


@pytest.mark.parametrize(
    "text, error",
    [
        ("raylane train digits --sett train.max_epochs=1\n", "unrecognized arguments: --sett"),
        ("raylane trian digits\n", "invalid choice: 'trian'"),
        ("raylane check digits --set train.max_epoch=1\n", "train.max_epoch"),
        ("raylane tune pipelines/digits-sweep.yaml --set sweep.metrc=accuracy\n", "sweep.metrc"),
        ("raylane train pipelines/digitz.yaml\n", "digitz"),
        ("cd examples/own-modle\n", "no such folder"),
        ("make runn\n", "no such target"),
        ("scripts/cluster.sh uup\n", "no such verb"),
        ("scripts/clusterr.sh up\n", "no such executable"),
        ("torchrun --standalone --nproc_per_node 2 --max-restart 1 -m raylane trian digits\n", "invalid choice"),
        ("torchrun --nprocs 2 -m raylane train digits\n", "unrecognized arguments: --nprocs"),
        ("raylane export runs/<run name>/checkpoint_<step> --out m.safetensors\n", "raylane export"),
        ("sbatch --nodes=2 scripts/slurm-ray.sbatch digits --set train.max_epoch=1\n", "train.max_epoch"),
        ("sbatch --nodes=2 scripts/slurm-ray.sbach digits\n", "no such script"),
        ("raylane train digits && (\n", "syntax error"),
    ],
)
def test_the_checks_catch_what_a_reader_could_not_run(text, error):
    with pytest.raises(Exception) as caught:
        check_block(Block(1, "bash", text))
    assert error in str(caught.value)


def test_a_skip_marker_excuses_only_the_programs_it_names():
    absent = "raylane-absent-tool"  # stands for helm, which a machine may or may not have
    check_block(Block(1, "bash", f"{absent} version\n", "skip", f"needs a Kubernetes cluster and {absent}"))
    with pytest.raises(AssertionError, match=f"{absent}x: not installed"):
        check_block(Block(1, "bash", f"{absent}x version\n", "skip", f"needs a Kubernetes cluster and {absent}"))
    with pytest.raises(AssertionError, match=f"{absent}: not installed"):
        check_block(Block(1, "bash", f"{absent} version\n", "slow", f"needs {absent}"))


def test_markers_and_other_blocks(tmp_path):
    """Every marker sits on a shell block; the YAML blocks parse (a sweep loads) and the Python
    blocks compile."""
    for page in PAGES:
        name = str(page.relative_to(REPO))
        marked = sum(1 for ln in page.read_text().splitlines() if MARK.match(ln.strip()))  # not one quoted in prose
        assert marked == sum(1 for b in SHELL if b.mark and b.page == name), (
            f"{name}: a readme-test marker not right before a shell block"
        )
    assert len(SHELL) >= 20 and any(not b.mark for b in SHELL)  # 13 in the README before docs/ took most
    for b in BLOCKS:
        if b.lang == "python":
            try:
                compile(b.text, b.id, "exec")
            except SyntaxError as exc:  # a fragment of build()'s body, as docs/pipelines.md shows some
                if "'return' outside function" not in str(exc):
                    raise
                compile("def build(cfg):\n" + textwrap.indent(b.text, "    "), b.id, "exec")
        elif b.lang == "yaml" and "sweep" in yaml.safe_load(b.text):
            from raylane.config.sweep import load_sweep

            (tmp_path / "sweep.yaml").write_text(b.text)
            load_sweep(str(tmp_path / "sweep.yaml"))


README_MAX_LINES = 260
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto: are not checked


def _outside_code(page: Path) -> list[str]:
    lines, fenced = [], False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(page: Path) -> list[str]:
    """The page's link targets, leaving out code blocks and `code spans`."""
    return LINK.findall(re.sub(r"`[^`]*`", "", "\n".join(_outside_code(page))))


def anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens, -N on repeats."""
    found, seen = set(), {}
    for line in _outside_code(page):
        m = re.match(r"^#{1,6}\s+(.+?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n, seen[slug] = seen.get(slug, 0), seen.get(slug, 0) + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def test_the_readme_is_a_front_page():
    """The README stays a front page; what it does not hold belongs on a page under docs/."""
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_resolve(page: Path):
    """Every relative link of the README and the docs pages names a file that exists, and a
    heading of it where it names one."""
    assert not broken_links(page), f"{page.relative_to(REPO)}: " + "; ".join(broken_links(page))


def test_the_link_check_catches_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other\n\n## Sweeps: `raylane tune`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[a](other.md#sweeps-raylane-tune) [b](other.md#sweeps) [c](gone.md) `[d](gone.md)`\n"
        "[e](#here) [f](https://example.com/x)\n\n## Here\n\n```bash\necho [g](gone.md)\n```\n"
    )
    assert broken_links(page) == ["other.md#sweeps: no heading #sweeps in other.md", "gone.md: no such file"]


def test_every_docs_page_is_linked_from_the_readme_or_the_index():
    """A page nobody links to is a page nobody finds."""
    linked = {
        (page.parent / t.partition("#")[0]).resolve()
        for page in (README, REPO / "docs" / "README.md")
        if page.exists()
        for t in links(page)
        if not SCHEME.match(t) and t.partition("#")[0]
    }
    orphans = [str(p.relative_to(REPO)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not orphans, f"not linked from README.md or docs/README.md: {orphans}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A folder that looks like a clone after `make run`: links to the tracked files, the
    virtualenv, and one finished run's checkpoint under runs/ (one process, 2 steps)."""
    root = tmp_path_factory.mktemp("readme")
    for name in TRACKED:
        if (REPO / name).exists():
            (root / name).symlink_to(REPO / name)
    (root / ".venv").symlink_to(Path(sys.prefix))
    # In this process, where the checks above have imported torch already: seconds less than a CLI run.
    summary = raylane.train(
        "regression", ["train.max_steps=2", "mlflow.enabled=false", f"run.storage_path={root / 'runs'}"], local=True
    )
    assert summary.status == raylane.Status.FINISHED, summary
    return root


def _env(root: Path) -> dict[str, str]:
    # As after `source .venv/bin/activate`, which the README asks for once per shell.
    env = cli_env(root)
    env.update(VIRTUAL_ENV=str(root / ".venv"), PATH=f"{root / '.venv' / 'bin'}:{env['PATH']}")
    return env


def _run(script: str, root: Path, what: str) -> None:
    out = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=root,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"{what} exited {out.returncode}:\n{out.stdout}{out.stderr}"


def _fast(argv: list[str]) -> bool:
    _, argv = split_env(argv)
    return Path(argv[0]).name == "raylane" and (argv[1:2] == ["check"] or "--version" in argv or "--help" in argv)


@pytest.mark.parametrize("block", SHELL, ids=[b.id for b in SHELL])
def test_block_runs(block: Block, scratch: Path):
    """An unmarked block runs as written; of a marked one, only its fast raylane commands."""
    if not block.mark:
        _run(block.text, scratch, block.id)
        for argv in commands(block):  # what it says it writes is there
            for flag, path in zip(argv, argv[1:], strict=False):
                assert flag not in ("--out", "--summary-json") or (scratch / path).is_file(), f"{block.id}: no {path}"
        return
    fast, where = [], []  # a fast command runs in the folder the block's `cd`s took it to
    for argv in commands(block):
        if split_env(argv)[1][:1] == ["cd"]:
            where.append(shlex.join(split_env(argv)[1]))
        elif _fast(argv):
            fast.append(argv)
            _run(" && ".join([*where, shlex.join(argv)]), scratch, f"{block.id}: {shlex.join(argv)}")
    ran = f"; ran its {len(fast)} fast command(s)" if fast else ""
    pytest.skip(f"{block.id} {block.mark}: {block.reason}{ran}")
