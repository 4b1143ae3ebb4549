"""The shape of ``xnnquant --help`` and of each command's ``--help``.

As well-kept command lines print it: the usage line, then ONE line saying what the program
(or the command) does, the options, then examples.  The top-level help gives each command
one line.  The text is plain: no reStructuredText markup (``double backticks``) from the
docstrings, no line wider than the 80-column terminal it is formatted for, and every
example line is a command line the parser accepts.
"""

from __future__ import annotations

import shlex

import pytest

from xnnquant import cli

COMMANDS = sorted(cli.build_parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def help_text(args: list[str], capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The lines ``xnnquant ARGS --help`` prints on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as info:
        cli.main([*args, "--help"])
    assert info.value.code == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out.splitlines()


def description(lines: list[str]) -> str:
    """The first paragraph after the usage lines; asserts it is one line."""
    after_usage = lines[lines.index("") + 1:]
    paragraph = after_usage[:after_usage.index("")]
    assert len(paragraph) == 1, paragraph
    return paragraph[0]


def example_commands(lines: list[str]) -> list[str]:
    """The command lines of the ``examples:`` section (continuation lines joined)."""
    section = lines[lines.index("examples:") + 1:]
    section = section[:section.index("")] if "" in section else section
    commands: list[str] = []
    continued = False
    for line in section:
        text = line.strip().split("  (")[0].strip()  # a note in parentheses after two spaces
        if continued:
            commands[-1] += " " + text
        else:
            commands.append(text)
        continued = commands[-1].endswith("\\")
        commands[-1] = commands[-1].rstrip("\\ ")
    return commands


def test_program_help(capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = help_text([], capsys, monkeypatch)
    assert lines[0] == "usage: xnnquant [-h] COMMAND ..."
    assert description(lines) == cli.DESCRIPTION
    listed = lines[lines.index("commands:") + 2:]
    for name in COMMANDS:  # one line each: the name, then its summary on the same line
        row = next(line for line in listed if line.split()[:1] == [name])
        assert len(row.split(maxsplit=1)) == 2, row
        following = listed[listed.index(row) + 1]
        assert following == "" or following.split()[0] in COMMANDS, (row, following)
    assert example_commands(lines)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_is_plain_text_that_fits(command: str | None, capsys: pytest.CaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    lines = help_text([command] if command else [], capsys, monkeypatch)
    text = "\n".join(lines)
    assert "``" not in text and ":func:" not in text
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = help_text([command], capsys, monkeypatch)
    assert lines[0].startswith(f"usage: xnnquant {command} ")
    line = description(lines)
    assert line[0].isupper() and line.endswith("."), line
    examples = example_commands(lines)
    assert examples and all(example.startswith(f"xnnquant {command}") for example in examples), examples


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_examples_parse(command: str | None, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example is a command line the parser takes (options spelled as they are)."""
    lines = help_text([command] if command else [], capsys, monkeypatch)
    parser = cli.build_parser()
    for example in example_commands(lines):
        words = shlex.split(example)
        if words[0] == "make":
            continue
        assert words[0] == "xnnquant", example
        parser.parse_args(words[1:])  # exits with status 2 on an unknown option or a bad value
