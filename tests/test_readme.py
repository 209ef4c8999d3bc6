"""The front page's and docs/'s commands, copied verbatim, work on this machine (what a new user would type).

Rules (the pages' authors rely on them):
- Every fenced ```bash (or ```sh) block of README.md and of each docs/*.md page is run, one command per line (a
  trailing backslash continues a line), each line in its own `bash -c` from the root of a temporary copy of the
  repository, in page order. A failing command (exit status != 0, or a curl answer that is a JSON error) fails
  the test.
- A comment line containing `skipped by tests/test_readme.py` skips the whole block; at the end of a command it
  skips that command. Use it for installs and GPU-only commands, saying why (`# needs a GPU: skipped by ...`).
- The commands `.ci/run` runs (its install lines, joined by `&&` or not, and its test command) are not run here:
  CI runs them. The README's test command must be `.ci/run`'s, verbatim; any other install or whole-suite
  pytest command must carry the marker.
- Every ```python block is run as a script the same way; the marker anywhere in it skips the block.
- A command containing `minidsa serve` is started in the background on a free port (its `--port N`, or
  the default 8000, is replaced, a trailing `&` dropped) and awaited on /health. Later blocks get
  `localhost:N` / `127.0.0.1:N` rewritten to that port; the server is stopped before the first later
  block that does not mention port N, or at the end of the page.
- README.md: at least 3 commands must run, among them `minidsa generate`, `minidsa bench`, `minidsa serve` and
  a curl to the server.
- Every relative link of a page (and of tests/README.md) resolves. Every `minidsa ...` command of a page parses
  with minidsa's own argument parser, and every `--flag` a page names in its prose is one of minidsa's flags (or
  a listed flag of another tool).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field

import pytest
from test_examples import example_env, free_port, running_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
CI_RUN = os.path.join(REPO, ".ci", "run")
PAGES = ["README.md"] + sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
MARKER = "skipped by tests/test_readme.py"
SHELL_LANGS = ("bash", "sh")
COMMAND_TIMEOUT_S = 300
NESTED_ENV = "MINIDSA_IN_README_TEST"  # set for the commands: a README pytest command must not rerun this file

FENCE_RE = re.compile(r"^([ \t]*)```[ \t]*([\w+-]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
SERVE_RE = re.compile(r"\bminidsa(?:\.cli)?\s+serve\b")
BACKGROUND_RE = re.compile(r"(?<![&|])&\s*(#.*)?$")
PORT_RE = re.compile(r"--port(?:\s+|=)(\d+)")
DEFAULT_PORT = 8000
INSTALL_RE = re.compile(r"\b(?:pip3?|uv pip|conda|apt(?:-get)?)\s+install\b")
PYTEST_RE = re.compile(r"\bpytest\b")
PYTEST_FILE_RE = re.compile(r"\btests/\S+\.py\b")


@dataclass
class Block:
    lang: str  # "bash" or "python"
    line: int  # README line of the opening fence
    commands: list[tuple[int, str]] = field(default_factory=list)  # (README line, command); python: one script
    skipped: bool = False  # the whole block carries the marker
    marked: list[str] = field(default_factory=list)  # single commands that carry the marker


def extract_blocks(text: str) -> list[Block]:
    blocks = []
    for m in FENCE_RE.finditer(text):
        lang = m.group(2).lower()
        start = text.count("\n", 0, m.start()) + 1
        body = textwrap.dedent(m.group(3))
        if lang in SHELL_LANGS:
            blocks.append(_shell_block(body, start))
        elif lang == "python":
            blocks.append(Block("python", start, [(start + 1, body)], skipped=MARKER in body))
    return blocks


def _shell_block(body: str, start: int) -> Block:
    block = Block("bash", start)
    pending, pending_line = "", 0
    for offset, raw in enumerate(body.splitlines(), 1):
        line = raw.rstrip()
        if not pending and line.lstrip().startswith("#"):
            if MARKER in line:
                block.skipped = True
            continue
        if not pending:
            pending_line = start + offset
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        cmd = (pending + line).strip()
        pending = ""
        _add_command(block, pending_line, cmd)
    _add_command(block, pending_line, pending.strip())  # a block ending in a continuation
    return block


def _add_command(block: Block, line: int, cmd: str) -> None:
    if not cmd:
        return
    if MARKER in cmd:
        block.marked.append(cmd)
    else:
        block.commands.append((line, cmd))


def server_command(cmd: str, port: int) -> tuple[str, int]:
    """(the command run in the background on `port`, the port the README meant)."""
    cmd = BACKGROUND_RE.sub(lambda m: m.group(1) or "", cmd).rstrip()
    m = PORT_RE.search(cmd)
    readme_port = int(m.group(1)) if m else DEFAULT_PORT
    if m:
        cmd = cmd[:m.start(1)] + str(port) + cmd[m.end(1):]
    else:
        cmd = SERVE_RE.sub(lambda s: f"{s.group(0)} --port {port}", cmd, count=1)
    return cmd, readme_port


def rewrite_port(text: str, readme_port: int | None, port: int | None) -> str:
    if readme_port is None or port is None:
        return text
    return re.sub(rf"\b(?:localhost|127\.0\.0\.1|0\.0\.0\.0):{readme_port}\b", f"127.0.0.1:{port}", text)


def mentions_port(block: Block, readme_port: int) -> bool:
    return any(re.search(rf":{readme_port}\b", c) for _, c in block.commands)


def check_curl_answer(cmd: str, stdout: str, where: str) -> None:
    """curl exits 0 on HTTP errors: a JSON error body counts as a failure too."""
    if not re.match(r"\s*curl\b", cmd):
        return
    assert stdout.strip(), f"{where}: curl printed nothing"
    with contextlib.suppress(ValueError):
        body = json.loads(stdout)
        assert not (isinstance(body, dict) and "error" in body), f"{where}: server answered an error: {stdout}"


def ci_commands(path: str = CI_RUN) -> list[str]:
    """The commands `.ci/run` runs, in order (not its shell settings, `cd` or comments)."""
    commands = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if not line or line.startswith("#") or re.match(r"(set|cd)\b", line):
                continue
            commands.append(line)
    return commands


def is_ci_command(cmd: str, ci: list[str]) -> bool:
    """`cmd` is one of .ci/run's commands, or several of them joined by `&&`."""
    return cmd in ci or all(part.strip() in ci for part in cmd.split(" && "))


@dataclass
class RunLog:
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    ci: list[str] = field(default_factory=list)  # .ci/run's commands: CI runs them
    servers: list[str] = field(default_factory=list)
    curls_to_server: int = 0


def refuse_unmarked(blocks: list[Block], ci: list[str], name: str = "README.md") -> None:
    """Checked before anything runs: an install would re-point this machine's packages at a temp copy, and the
    whole suite would run this test again (and take far longer than a README command may)."""
    for block in blocks:
        if block.skipped or block.lang != "bash":
            continue
        for line, cmd in block.commands:
            if is_ci_command(cmd, ci):
                continue
            if INSTALL_RE.search(cmd):
                raise AssertionError(f"{name} line {line}: {cmd!r} installs packages: mark it '{MARKER}'")
            if PYTEST_RE.search(cmd) and not PYTEST_FILE_RE.search(cmd):
                raise AssertionError(f"{name} line {line}: {cmd!r} runs the whole test suite: mark it "
                                     f"'{MARKER}', make it .ci/run's test command, or name test files")


def run_readme(text: str, workdir: str, logdir: str, timeout: float = COMMAND_TIMEOUT_S,
               ci: list[str] | None = None, name: str = "README.md") -> RunLog:
    """Run every command of a page's text in `workdir`; AssertionError naming the page's line on failure.
    `ci`: the commands .ci/run runs (not run here)."""
    ci = ci or []
    blocks = extract_blocks(text)
    refuse_unmarked(blocks, ci, name)
    env = example_env(**{NESTED_ENV: "1"})
    log = RunLog()
    server = contextlib.ExitStack()
    readme_port: int | None = None
    port: int | None = None
    with server:
        for block in blocks:
            log.skipped += block.marked
            if block.skipped:
                log.skipped += [c for _, c in block.commands]
                continue
            if readme_port is not None and not mentions_port(block, readme_port):
                server.close()  # the blocks using the server are done
                readme_port = port = None
            for line, cmd in block.commands:
                where = f"{name} line {line}: {cmd!r}"
                if block.lang == "bash" and is_ci_command(cmd, ci):
                    log.ci.append(cmd)
                    continue
                if block.lang == "bash" and SERVE_RE.search(cmd):
                    server.close()
                    port = free_port()
                    bg_cmd, readme_port = server_command(cmd, port)
                    server_log = os.path.join(logdir, f"server-{os.path.basename(name)}-{line}.log")
                    server.enter_context(running_server(bg_cmd, port, server_log, cwd=workdir, env=env))
                    log.servers.append(cmd)
                    log.ran.append(cmd)
                    continue
                run_cmd = rewrite_port(cmd, readme_port, port)
                if block.lang == "python":
                    script = os.path.join(logdir, f"{os.path.basename(name)}_block_{line}.py")
                    with open(script, "w") as f:
                        f.write(run_cmd)
                    argv = [sys.executable, script]
                else:
                    argv = ["bash", "-c", run_cmd]
                try:
                    proc = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True,
                                          timeout=timeout)
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{where} did not finish in {timeout} s") from None
                assert proc.returncode == 0, (f"{where} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                                              f"\n--- stderr\n{proc.stderr[-3000:]}")
                if block.lang == "bash":
                    check_curl_answer(run_cmd, proc.stdout, where)
                    if port is not None and run_cmd != cmd and re.match(r"\s*curl\b", cmd):
                        log.curls_to_server += 1
                log.ran.append(cmd)
    return log


def copy_repo(dest: str) -> str:
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", ".pytest_cache", "out", "build", "dist",
                                    ".whl", ".gl", "tiny-*")
    shutil.copytree(REPO, dest, ignore=ignore)
    return dest


# -- the README and docs/ themselves ----------------------------------------------------------------------------

def read_page(page: str) -> str:
    with open(os.path.join(REPO, page), encoding="utf-8") as f:
        return f.read()


@pytest.mark.skipif(os.environ.get(NESTED_ENV) == "1", reason="already inside a README command (no recursion)")
@pytest.mark.parametrize("page", PAGES)
def test_page_commands_run_verbatim(page, tmp_path):
    workdir = copy_repo(str(tmp_path / "repo"))
    logdir = tmp_path / "logs"
    logdir.mkdir()
    log = run_readme(read_page(page), workdir, str(logdir), ci=ci_commands(), name=page)
    if page != "README.md":
        return
    assert len(log.ran) >= 3, f"only {len(log.ran)} README commands ran: {log.ran}"
    ran = "\n".join(log.ran)
    for needed in ("minidsa generate", "minidsa bench"):
        assert needed in ran, f"the README must show `{needed}` (unmarked): ran {log.ran}"
    assert log.servers, "the README must show `minidsa serve` (unmarked)"
    assert log.curls_to_server >= 1, "the README must query the running server with curl"


@pytest.mark.smoke
def test_the_readme_test_command_is_what_ci_runs():
    """The project's standard: the README holds the install + main-job commands and one test command, and
    .ci/run runs exactly that test command (after its install lines), smoke subset first."""
    ci = ci_commands()
    assert ci and PYTEST_RE.search(ci[-1]), f".ci/run must end with the test command: {ci}"
    installs, test_command = ci[:-1], ci[-1]
    assert installs and all(INSTALL_RE.search(c) for c in installs), f".ci/run installs, then tests: {ci}"
    commands = [cmd for b in extract_blocks(read_page("README.md")) if b.lang == "bash" and not b.skipped
                for _, cmd in b.commands]
    assert test_command in commands, f"the README must show .ci/run's test command verbatim: {test_command!r}"
    assert any(is_ci_command(c, installs) and INSTALL_RE.search(c) for c in commands), \
        f"the README must show .ci/run's install lines {installs} (joined by && or not)"
    install_at = next(i for i, c in enumerate(commands) if is_ci_command(c, installs))
    assert commands[install_at + 1].startswith("minidsa bench"), "the main job follows the install"
    first, *rest = test_command.split(" && ")
    assert first == "python3 -m pytest -q -m smoke tests", f"the smoke subset runs first: {test_command!r}"
    assert rest and all('-m "not smoke"' in r for r in rest), f"then everything else, once: {test_command!r}"
    assert "python3 -m pytest -q -m smoke tests" in read_page("README.md"), "the README names the smoke command"


def minidsa_flags() -> set[str]:
    """Every option of every `minidsa` subcommand (engine flags come from EngineConfig's fields)."""
    import argparse

    from minidsa import cli

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            flags.update(o for o in action.option_strings if o.startswith("--"))

    walk(cli.build_parser())
    return flags


# Flags the pages name that belong to another tool than `minidsa`.
OTHER_TOOLS_FLAGS = {
    "--index-url": "pip",
    "--nproc-per-node": "torchrun",
    "--url": "examples/stream_client.py",
    "--arch": "examples/make_tiny_checkpoint.py",
    "--mtp": "examples/make_tiny_checkpoint.py",
    "--out": "examples/make_tiny_checkpoint.py",
    "--num-prompts": "examples/offline_batch.py",
}
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
INLINE_CODE_RE = re.compile(r"`([^`]+)`")
ENV_ASSIGN_RE = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def minidsa_command_lines(text: str) -> list[str]:
    """The `minidsa ...` commands of a page's shell blocks (skipped ones too: they must be right as well)."""
    found = []
    for block in extract_blocks(text):
        if block.lang != "bash":
            continue
        for cmd in [c for _, c in block.commands] + block.marked:
            for part in re.split(r"\s(?:&&|\|\||\|)\s", cmd.split(" #")[0]):
                part = ENV_ASSIGN_RE.sub("", part.strip())
                if part.startswith("minidsa "):
                    found.append(part)
    return found


@pytest.mark.smoke
@pytest.mark.parametrize("page", PAGES)
def test_documented_commands_and_flags_exist(page):
    from minidsa import cli

    text = read_page(page)
    parser = cli.build_parser()
    for cmd in minidsa_command_lines(text):
        try:
            parser.parse_args(shlex.split(cmd)[1:])
        except SystemExit as e:
            raise AssertionError(f"{page}: `{cmd}` does not parse (exit {e.code})") from None
    known = minidsa_flags() | set(OTHER_TOOLS_FLAGS)
    prose = FENCE_RE.sub("", text)
    named = {flag for span in INLINE_CODE_RE.findall(prose) for flag in FLAG_RE.findall(span)}
    assert not named - known, f"{page} names flags that no `minidsa` command has: {sorted(named - known)}"


LINK_RE = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.smoke
@pytest.mark.parametrize("page", PAGES + ["tests/README.md"])
def test_relative_links_resolve(page):
    """Every link of a page to a file or folder of the repository points at one that exists."""
    base = os.path.dirname(os.path.join(REPO, page))
    missing = []
    for target in LINK_RE.findall(read_page(page)):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the page
        if not os.path.exists(os.path.normpath(os.path.join(base, target.split("#")[0]))):
            missing.append(target)
    assert not missing, f"{page} links to files that do not exist: {missing}"


# -- the runner's own rules, on small READMEs ------------------------------------------------------------------

EXAMPLE = """\
Intro.

```bash
pip install -e ".[dev]"   # skipped by tests/test_readme.py
echo one \\
  two > out.txt
```

```bash
# needs a GPU: skipped by tests/test_readme.py
exit 3
```

```python
print("hi")
```

```text
not a command
```
"""


@pytest.mark.smoke
def test_extract_blocks_rules():
    blocks = extract_blocks(EXAMPLE)
    assert [b.lang for b in blocks] == ["bash", "bash", "python"]
    assert blocks[0].commands == [(5, "echo one    two > out.txt")] and not blocks[0].skipped
    assert blocks[1].skipped
    assert blocks[2].commands == [(15, 'print("hi")\n')]
    assert server_command("minidsa serve --port 8000 &  # background", 1234) == \
        ("minidsa serve --port 1234 # background", 8000)
    assert server_command("minidsa serve --model tiny", 99) == ("minidsa serve --port 99 --model tiny", 8000)
    assert rewrite_port("curl -s http://localhost:8000/v1/models", 8000, 4321) == \
        "curl -s http://127.0.0.1:4321/v1/models"


def test_runner_runs_and_fails_loudly(tmp_path):
    log = run_readme(EXAMPLE, str(tmp_path), str(tmp_path))
    assert log.ran == ["echo one    two > out.txt", 'print("hi")\n']
    assert log.skipped == ['pip install -e ".[dev]"   # skipped by tests/test_readme.py', "exit 3"]
    assert (tmp_path / "out.txt").read_text().split() == ["one", "two"]
    with pytest.raises(AssertionError, match=r"line 2: 'false' exited 1"):
        run_readme("```bash\nfalse\n```\n", str(tmp_path), str(tmp_path))
    with pytest.raises(AssertionError, match="exited 1"):
        run_readme("```python\nraise SystemExit(1)\n```\n", str(tmp_path), str(tmp_path))
    for unmarked in ("pip install -e .", "python3 -m pytest -q -n 2 tests"):
        with pytest.raises(AssertionError, match="mark it"):  # refused before anything runs
            run_readme(f"```bash\ntouch ran.txt\n{unmarked}\n```\n", str(tmp_path), str(tmp_path))
        assert not (tmp_path / "ran.txt").exists()
    ci = ["python3 -m pip install -q torch==2.13.0", "python3 -m pip install -q -e .", "python3 -m pytest -q tests"]
    log = run_readme("```bash\npython3 -m pip install -q torch==2.13.0 && python3 -m pip install -q -e .\n"
                     "echo main job\npython3 -m pytest -q tests\n```\n", str(tmp_path), str(tmp_path), ci=ci)
    assert log.ran == ["echo main job"] and log.ci == [" && ".join(ci[:2]), ci[2]]  # CI runs those itself
