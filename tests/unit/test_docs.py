"""The code blocks of README.md and docs/*.md are real: Python blocks run, command lines parse.

Blocks are fenced with a language: ``python`` (run in a fresh interpreter, must exit 0), ``toml``
(parsed; a claims file must load as ``partir-emu check`` loads it), ``sh``
(command lines: each ``partir-emu ...`` line, also under ``mpirun``/``mpiexec``, is parsed by the
real command-line parser, and for a command that names a scenario the scenario, size, overrides,
mesh and strategy are resolved as the command would, without running it; ``make`` targets must
exist in the Makefile; ``python FILE`` must name a file of the repository), or ``text``
(diagrams and measured output, not code). A block without a language fails the test: every block
says what it is. The README's own command lines are also run, in a test of the slow tier.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from partir_emu.app.cli import main as cli
from partir_emu.app.common import experiment_from_args
from tests.conftest import wall

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGS = ("python", "sh", "toml", "text")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # of the opening fence
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    out, inside, lang, start, body = [], False, "", 0, []
    for k, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if not inside:
                inside, lang, start, body = True, line[3:].strip(), k, []
            else:
                inside = False
                out.append(Block(path, start, lang, "\n".join(body) + "\n"))
        elif inside:
            body.append(line)
    assert not inside, f"{path.relative_to(ROOT)}:{start}: a code block is not closed"
    return out


BLOCKS = [b for p in DOCS for b in _blocks(p)]
PYTHON = [b for b in BLOCKS if b.lang == "python"]
SHELL = [b for b in BLOCKS if b.lang == "sh"]
TOML = [b for b in BLOCKS if b.lang == "toml"]


def _commands(block: Block) -> list[list[str]]:
    out = []
    for line in block.text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(shlex.split(line))
    return out


def _partir_emu_args(tokens: list[str]) -> list[str] | None:
    """The ``partir-emu`` arguments of a command line (after an ``mpirun``/``mpiexec`` and its options)."""
    if "partir-emu" in tokens:
        return tokens[tokens.index("partir-emu") + 1:]
    return None


def _make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))


def test_every_block_says_what_it_is():
    bad = [f"{b}: ```{b.lang}" for b in BLOCKS if b.lang not in LANGS]
    assert not bad, f"code blocks need one of {LANGS} after the fence:\n" + "\n".join(bad)
    assert PYTHON and SHELL


@pytest.mark.parametrize("block", TOML, ids=str)
def test_toml_blocks_parse_and_claims_files_load(block, tmp_path):
    """A ``toml`` block is TOML; one with ``[[claim]]`` entries is a whole claims file that
    ``partir-emu check`` accepts (every configuration it names is in the block)."""
    from partir_emu.app.claims.claims_file import load_claims
    from partir_emu.limits import tomllib

    tomllib.loads(block.text)
    if "[[claim]]" in block.text:
        (tmp_path / "claims.toml").write_text(block.text)
        load_claims(tmp_path / "claims.toml")


@pytest.mark.parametrize("block", SHELL, ids=str)
def test_command_lines_parse_and_name_what_exists(block):
    parser = cli.build_parser()
    for tokens in _commands(block):
        args = _partir_emu_args(tokens)
        where = f"{block}: {' '.join(tokens)}"
        if args is not None:
            try:
                ns = parser.parse_args(args)
            except SystemExit as exc:                  # the parser's one-line error, exit 2
                pytest.fail(f"{where}: the command-line parser refuses it (exit {exc.code})")
            _resolve(ns, where)
        elif tokens[0] == "make":
            missing = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t and t not in _make_targets()]
            assert not missing, f"{where}: no Makefile target {missing}"
        elif tokens[0] in ("python", "mpiexec", "mpirun", "bash"):
            files = [t for t in tokens if t.endswith((".py", ".sh"))]
            assert files and all((ROOT / f).is_file() for f in files), f"{where}: names no file of the repository"
        else:
            pytest.fail(f"{where}: not a command this test knows how to check")


def _resolve(ns: argparse.Namespace, where: str) -> None:
    """Scenario, size, overrides, mesh and strategy as the command resolves them, without running."""
    if not all(hasattr(ns, a) for a in ("scenario", "strategy", "mesh", "size", "overrides")):
        return
    if ns.strategy == "all" or "," in ns.strategy or ns.mesh == "auto":
        return                    # a study's grid: it resolves (and reports) each configuration itself
    try:
        exp = experiment_from_args(ns)
        assert exp.schedule is not None
    except Exception as exc:   # noqa: BLE001  (any refusal is the finding)
        pytest.fail(f"{where}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("block", PYTHON, ids=str)
def test_python_blocks_run(block, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", block.text], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=wall(300))
    assert out.returncode == 0, f"{block} fails:\n{out.stderr[-2000:]}"


README_COMMANDS = [tokens for b in SHELL if b.path.name == "README.md" for tokens in _commands(b)
                   if _partir_emu_args(tokens) is not None]


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("tokens", README_COMMANDS, ids=lambda t: " ".join(t[1:4]))
def test_the_readme_commands_run(tokens, tmp_path):
    exe = Path(sys.executable).parent / "partir-emu"
    args = [str(ROOT / t) if (ROOT / t).is_file() else t for t in tokens[1:]]     # the repository's files
    out = subprocess.run([str(exe), *args, "--report", str(tmp_path / "r.json")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=wall(600), env=dict(os.environ))
    assert out.returncode == 0, f"{' '.join(tokens)} exits {out.returncode}:\n{out.stderr[-2000:]}"
