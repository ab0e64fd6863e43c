"""Docs that are true: every command README.md and docs/*.md show (code blocks but ```text ones,
which hold output; indented blocks; inline code) is tried with `--help` or a dry run, and must
name a command, module, script, flag, make target and file that exist:

- `scd-serve CMD [SUB] ...`: CMD (and bench's SUB) exists, `scd-serve CMD --help` works, and
  every `--flag` shown is one of that command's flags;
- `python -m MODULE ...` / `python scripts/X.py ...`: `--help` works (the module imports) and
  every `--flag` shown is in its help; pytest's test paths exist;
- `make TARGET`: the Makefile has a recipe for it;
- `bash FILE`, `docker ... -f FILE`, `kubectl ... -k DIR`: the file or directory exists.

Values (P, DIR, 1gbit) are not checked: they are the reader's. Commands of other tools (pip,
curl, git, docker compose without -f) are left alone.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from scd_serve import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOOLS = r"scd-serve|make|python3?|\.venv/bin/python|\.venv/bin/scd-serve|bash|docker|kubectl"
COMMAND = re.compile(rf"^(?:\$ )?(?:[A-Z_]+=\S*\s+)*(?:(?:nice -n \d+|time|timeout \d+)\s+)*(?P<cmd>(?:{TOOLS})(?:\s.*)?)$")
PLACEHOLDERS = {"COMMAND"}  # `scd-serve COMMAND`: the usage line, not a command


def commands() -> list[tuple[str, str]]:
    """(where, command line) of every command shown, continuation lines joined, comments cut."""
    found: list[tuple[str, str]] = []
    for doc in DOCS:
        fenced, output, held = False, False, ""
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            if line.strip().startswith("```"):
                fenced = not fenced
                output = fenced and line.strip() == "```text"  # a command's output, shown as such
                continue
            if output:
                continue
            if fenced or line.startswith("    "):
                body = line if fenced else line[4:]
                if not held and body[:1].isspace():  # a diagram or output, not a command line
                    continue
                text = (held + " " + body.strip()).strip()
                held = text[:-1] if text.endswith("\\") else ""
                if not held and (m := COMMAND.match(text.split(" # ")[0].strip())):
                    found.append((where, m["cmd"]))
                continue
            for span in re.findall(r"`([^`]+)`", line):
                if m := COMMAND.match(span.strip()):
                    found.append((where, m["cmd"]))
    return found


def flags_in(tokens: list[str]) -> list[str]:
    """The --flags a command line shows ([--opt VALUE] brackets and --opt=VALUE forms included)."""
    return [t.strip("[](),;'\"").split("=")[0] for t in tokens if t.lstrip("[(").startswith("--")]


def parser_flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@functools.cache
def scd_serve_flags(command: str, sub: str | None) -> set[str]:
    parser = cli.build_parser(command)
    action = next(a for a in parser._actions if a.dest == "command")
    sp = action.choices[command]
    subs = [a for a in sp._actions if hasattr(a, "choices") and isinstance(a.choices, dict)]
    if subs and sub is not None:
        assert sub in subs[0].choices, f"scd-serve {command} has no subcommand {sub!r}"
        sp = subs[0].choices[sub]
    return parser_flags(sp)


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    res = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"{' '.join(argv)} --help failed: {res.stderr[-800:]}"
    return res.stdout


@functools.cache
def make_targets() -> set[str]:
    """Targets of the Makefile that have a recipe (a tab-indented line after them)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    return {m.group(1) for i, line in enumerate(lines[:-1]) if (m := re.match(r"^([A-Za-z][\w-]*):", line))
            and lines[i + 1].startswith("\t")}


def check(line: str) -> str:
    """Raise AssertionError naming what is missing; -> what was checked."""
    tokens = shlex.split(line.replace("[", " [").replace("]", "] "), posix=True)
    tool, args = tokens[0], tokens[1:]
    if tool.endswith("scd-serve"):
        if not args or args[0] in PLACEHOLDERS:
            return "usage line"
        name = args[0]
        assert name in cli.COMMANDS, f"scd-serve has no command {name!r}"
        sub = args[1] if len(args) > 1 and not args[1].startswith("-") and name == "bench" else None
        with pytest.raises(SystemExit) as done:  # --help imports the command's module
            cli.main([name, *([sub] if sub else []), "--help"])
        assert done.value.code == 0
        known = scd_serve_flags(name, sub)
        missing = [f for f in flags_in(args) if f not in known]
        assert not missing, f"scd-serve {name}{' ' + sub if sub else ''} has no flag(s) {missing}"
        return f"scd-serve {name}{' ' + sub if sub else ''} --help, {len(flags_in(args))} flags"
    if tool == "make":
        target = next((a for a in args if not a.startswith("-") and "=" not in a), "all")
        assert target in make_targets(), f"the Makefile has no recipe for `make {target}`"
        return f"make {target}: recipe"
    if tool in ("python", "python3", ".venv/bin/python"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module == "pytest":
                paths = [a.split("::")[0] for a in rest if a.startswith("tests")]
                assert all((ROOT / p).exists() for p in paths), f"missing test path in {paths}"
                return f"pytest paths {paths}"
            text = help_text((sys.executable, "-m", module))
        else:
            script, rest = args[0], args[1:]
            assert (ROOT / script).is_file(), f"no script {script}"
            text = help_text((sys.executable, script))
        missing = [f for f in flags_in(rest) if f not in text]
        assert not missing, f"{line.split()[0:3]} has no flag(s) {missing}"
        return f"{' '.join(args[:2])} --help, {len(flags_in(rest))} flags"
    if tool == "bash":
        assert (ROOT / args[0]).is_file(), f"no file {args[0]}"
        return f"file {args[0]}"
    paths = [args[i + 1] for i, a in enumerate(args[:-1])  # compose's `logs -f NAME` follows, names no file
             if a in ("-f", "-k") and ("/" in args[i + 1] or args[i + 1].endswith((".yml", ".yaml")))]
    for p in paths:
        assert (ROOT / p).exists(), f"`{tool}` names {p}, which does not exist"
    return f"{tool}: files {paths}" if paths else f"{tool}: not ours, not checked"


COMMANDS = commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) > 50  # the extraction itself works (README + docs/*.md)


@pytest.mark.parametrize("where,line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_documented_command_exists_with_its_flags(where, line):
    check(line)
