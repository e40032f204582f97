"""Run the fenced blocks of a Markdown page in order and check the outputs it quotes.

Every ``bash``, ``console`` and ``python`` block of a tested page must be preceded (on the line
just above the fence, blank lines allowed) by one directive, so that no command escapes:

``<!-- doc-test: run -->``
    executed in the default suite (bash: one ``bash -e`` script; python: in the page's one
    interpreter session, so a block continues the previous one like a notebook; console: every
    ``$ `` line is run and the lines after it must appear in what it prints).
``<!-- doc-test: run slow -->``
    executed only by the slow test (it trains, or starts Ray).
``<!-- doc-test: check COMMAND -->``
    not executed as written (it would recurse into the test suite, or needs a cluster);
    COMMAND is run instead to check it works (e.g. ``bash scripts/test.sh --collect-only ...``).
``<!-- doc-test: skip REASON -->``
    not executed; the reason is shown in the page's source.
``<!-- doc-test: output -->``
    (on a text block) lines that the previous executed block must print. Numbers match within
    5 % (integers exactly), ``...`` matches anything.

Blocks run in a temporary directory holding copies of ``examples/``, ``scripts/``, ``setup.cfg``
and ``tests/``; ``HOME`` points there too (so ``~/ray_results`` is fresh) and ``.venv`` is a view
of the interpreter running the tests (installed already, so the scripts install nothing).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^<!--\s*doc-test:\s*(run slow|run|check|skip|output)\b\s*(.*?)\s*-->\s*$")
CODE = ("bash", "console", "python", "sh")
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


@dataclass
class Block:
    page: str
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    kind: Optional[str]  # run, run slow, check, skip, output or None
    arg: str = ""

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(page: Path) -> list:
    """The fenced blocks of ``page`` with their directives."""
    lines = page.read_text().splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        line = lines[i]
        m = DIRECTIVE.match(line.strip())
        if m:
            pending = (m.group(1), m.group(2))
        elif line.startswith("```"):
            lang, start, body = line[3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            kind, arg = pending or (None, "")
            blocks.append(Block(page.name, start, lang, "\n".join(body) + "\n", kind, arg))
            pending = None
        elif line.strip():
            pending = None  # a directive applies to the fence right below it only
        i += 1
    return blocks


def untagged(blocks: list) -> list:
    return [b.where() for b in blocks if b.lang in CODE and b.kind in (None, "output")]


# -- the sandbox -------------------------------------------------------------------------------

def sandbox(tmp: Path) -> dict:
    """Prepare ``tmp`` as the working directory; returns the environment of the commands."""
    for name in ("examples", "scripts", "tests"):
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "setup.cfg", tmp / "setup.cfg")
    venv = tmp / ".venv"  # a view of the running venv, with the install stamps of bootstrap.sh
    venv.mkdir()
    for name in ("bin", "lib", "lib64", "include", "pyvenv.cfg"):
        if (Path(sys.prefix) / name).exists():
            (venv / name).symlink_to(Path(sys.prefix) / name)
    for stamp in (".ray_dhp_installed", ".ray_dhp_installed_test"):
        (venv / stamp).touch()
    (tmp / "home").mkdir()
    env = dict(os.environ)
    env.update(HOME=str(tmp / "home"), PATH=f"{venv}/bin:{env.get('PATH', '')}",
               RAY_DHP_VENV=str(venv), RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.25",
               PYTHONUNBUFFERED="1", RAY_DEDUP_LOGS="1")
    env.pop("RAY_ADDRESS", None)
    return env


# -- running -----------------------------------------------------------------------------------

def _run(cmd: list, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


_SESSION = r"""
import sys, traceback
scope = {"__name__": "__main__"}
while True:
    n = sys.stdin.readline()
    if not n:
        break
    code = sys.stdin.read(int(n))
    ok = "0"
    try:
        exec(compile(code, "<doc block>", "exec"), scope)
    except BaseException:
        traceback.print_exc()
        ok = "1"
    sys.stderr.flush()
    print("\n@@doc-block-done@@" + ok, flush=True)
"""


class PythonSession:
    """One interpreter for the page's python blocks (names persist from block to block)."""

    def __init__(self, cwd: Path, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", _SESSION], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)

    def run(self, code: str) -> tuple:
        self.proc.stdin.write(f"{len(code)}\n{code}")
        self.proc.stdin.flush()
        out = []
        for line in self.proc.stdout:
            if line.startswith("@@doc-block-done@@"):
                return "".join(out), int(line.strip()[-1])
            out.append(line)
        return "".join(out), self.proc.wait()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def run_block(block: Block, cwd: Path, env: dict, timeout: float = 600,
              session: Optional[PythonSession] = None) -> str:
    """Execute ``block``; its combined output. AssertionError naming the block on failure."""
    if block.kind == "check":
        procs = [_run(["bash", "-c", block.arg], cwd, env, timeout)]
    elif block.lang == "python":
        out, rc = session.run(block.text)
        assert rc == 0, f"{block.where()} failed:\n{out[-4000:]}"
        return out
    elif block.lang == "console":
        return _run_console(block, cwd, env, timeout)
    else:
        procs = [_run(["bash", "-e", "-c", block.text], cwd, env, timeout)]
    out = "".join(p.stdout + p.stderr for p in procs)
    bad = [p for p in procs if p.returncode != 0]
    assert not bad, f"{block.where()} failed (exit {bad[0].returncode}):\n{out[-4000:]}"
    return out


def _run_console(block: Block, cwd: Path, env: dict, timeout: float) -> str:
    """``$ command`` lines are run; the lines up to the next ``$`` must be in its output."""
    chunks, out = [], ""
    for line in block.text.splitlines():
        if line.startswith("$ "):
            chunks.append((line[2:], []))
        elif chunks and line.strip():
            chunks[-1][1].append(line)
    for command, expected in chunks:
        p = _run(["bash", "-c", command], cwd, env, timeout)
        out += p.stdout + p.stderr
        check_output(expected, p.stdout + p.stderr, f"{block.where()} ($ {command})")
    return out


# -- tolerant comparison -----------------------------------------------------------------------

def _pattern(line: str) -> tuple:
    """(regex of ``line`` with numbers and ``...`` as wildcards, the numbers it quotes)."""
    parts, numbers, pos = [], [], 0
    token = re.compile(rf"(\.\.\.)|(?<![\w.])({NUMBER})(?![\w])")
    for m in token.finditer(line):
        parts.append(re.escape(line[pos:m.start()]))
        if m.group(1):
            parts.append(".*?")
        else:
            parts.append(f"({NUMBER})")
            numbers.append(m.group(2))
        pos = m.end()
    parts.append(re.escape(line[pos:]))
    return "".join(parts), numbers


def _close(quoted: str, got: str) -> bool:
    if re.fullmatch(r"-?\d+", quoted):
        return quoted == got
    return math.isclose(float(quoted), float(got), rel_tol=0.05, abs_tol=_rounding(quoted))


def _rounding(text: str) -> float:
    """Half the last digit's step of a fixed-point number (0.005 for 5.93), 0 otherwise."""
    m = re.fullmatch(r"-?\d+\.(\d+)", text)
    return 0.5 * 10 ** -len(m.group(1)) if m else 0.0


def check_output(expected: list, output: str, where: str) -> None:
    """Every expected line occurs in ``output`` (numbers within 5 % or their rounding)."""
    for line in expected:
        regex, numbers = _pattern(line.strip())
        hits = [m for m in re.finditer(regex, output)]
        ok = any(all(_close(q, g) for q, g in zip(numbers, m.groups())) for m in hits)
        assert ok, (f"{where}: the page quotes\n  {line.strip()}\nbut the command printed "
                    f"{'only ' + repr([m.group(0) for m in hits][:3]) if hits else 'no such line'}"
                    f":\n{output[-3000:]}")


def run_page(page: Path, tmp: Path, *, slow: bool) -> list:
    """Run the page's blocks in order (``run slow`` ones only if ``slow``); the blocks run."""
    blocks = parse(page)
    assert not untagged(blocks), f"blocks without a doc-test directive: {untagged(blocks)}"
    env = sandbox(tmp)
    session = PythonSession(tmp, env)
    done, last = [], None  # last: output of the previous executed block (None if skipped)
    try:
        for block in blocks:
            if block.kind == "output":
                if last is not None:
                    check_output([ln for ln in block.text.splitlines() if ln.strip()], last,
                                 f"{block.where()} (output of the block above)")
                continue
            if block.kind in ("run", "check") or (block.kind == "run slow" and slow):
                last = run_block(block, tmp, env, session=session)
                done.append(block.where())
            elif block.lang in CODE:
                last = None
    finally:
        session.close()
    return done
