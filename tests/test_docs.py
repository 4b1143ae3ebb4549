"""Every example of README.md and docs/*.md runs, so none goes stale.

What is checked, page by page:

* ```` ```python ```` blocks run in the order of the page, in one namespace per page (a block
  may use what an earlier block of its page defined), in a fresh working directory (files
  the examples write land there).  Examples run on tiny models, so the whole file stays fast.
* ```` ```pycon ```` blocks are doctests: each ``>>>`` line runs in the page's namespace and
  must print what the block shows (``...`` stands for any text).
* ```` ```sh ```` blocks: each command is checked without running it: ``xnnquant ...`` is
  parsed by the command line's own parser (commands, options and their values), ``make T``
  must be a target of the Makefile, ``python FILE`` (or ``python -m MODULE``) an existing file
  or module, ``mkdocs build|serve`` the docs' own commands.  Anything else fails.
* A block preceded by ``<!-- skip: REASON -->`` (on the line before its fence) is not run;
  the reason must be given.  Used sparingly: a block that needs large weights or files.
* Relative links of README.md point at files that exist (mkdocs checks those of docs/).
* The notebook plots copied into docs/img/notebooks/ are the notebooks' own outputs.
"""

from __future__ import annotations

import base64
import doctest
import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
PLOTS = REPO / "docs" / "img" / "notebooks"


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, first line number (1-based, after the fence),
    code (dedented to the fence) and the skip reason, if any."""

    page: Path
    lang: str
    line: int
    code: str
    skip: str | None

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, lang = len(fence["indent"]), fence["lang"]
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        previous = lines[i - 1] if i else ""
        skip = SKIP.match(previous)
        if skip is not None:
            assert skip["reason"], f"{page.name}:{i}: <!-- skip: --> needs its reason"
        body = [line[indent:] for line in lines[i + 1:end]]
        found.append(Block(page, lang, i + 2, "\n".join(body) + "\n", skip["reason"] if skip else None))
        i = end + 1
    return found


def _ids(pages: list[Path]) -> list[str]:
    return [str(p.relative_to(REPO)) for p in pages]


def test_every_page_is_found() -> None:
    assert {p.name for p in PAGES} >= {"README.md", "index.md", "exporting.md", "llm.md", "cli.md", "benchmarks.md",
                                      "errors.md", "formats.md", "static_int8.md", "accuracy.md", "api.md"}


@pytest.mark.xnnpack
@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_python_examples_run(page: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks(page):
        if block.skip or block.lang not in ("python", "pycon"):
            continue
        if block.lang == "python":
            # the code keeps its line numbers in the page, so a traceback points at the page's line
            code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
            exec(code, namespace)
        else:
            _doctest(block, namespace)
    capsys.readouterr()  # what the examples print is not checked here (pycon blocks check it)


def _doctest(block: Block, namespace: dict[str, object]) -> None:
    test = doctest.DocTestParser().get_doctest(block.code, namespace, block.where(), str(block.page), block.line - 1)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    failures: list[str] = []
    runner.run(test, out=failures.append, clear_globs=False)
    namespace.update(test.globs)  # a DocTest runs on a copy: later blocks see what this one defined
    assert runner.failures == 0, "".join(failures)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_shell_examples_name_real_commands(page: Path) -> None:
    from xnnquant import cli

    parser = cli.build_parser()
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))
    for block in blocks(page):
        if block.skip or block.lang not in ("sh", "shell", "bash"):
            continue
        for command in _commands(block.code):
            words = shlex.split(command)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            where = f"{block.where()}: {command!r}"
            program = Path(words[0]).name
            if program == "xnnquant":
                try:
                    parser.parse_args(words[1:])
                except SystemExit:
                    pytest.fail(f"{where}: the command line's parser refuses it (see the message above)")
            elif program == "make":
                assert set(words[1:]) <= targets, f"{where}: not a target of the Makefile"
            elif program in ("python", "python3"):
                if words[1] == "-m":
                    import importlib.util

                    assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module {words[2]}"
                    paths = words[3:]
                else:
                    paths = words[1:2]
                for path in paths:
                    if path.endswith((".py", ".ipynb")):
                        assert (REPO / path).is_file(), f"{where}: no file {path}"
            elif program == "mkdocs":
                assert words[1:2] in (["build"], ["serve"]), where
            else:
                pytest.fail(f"{where}: a command this test cannot check; mark the block <!-- skip: reason -->")


def _commands(code: str) -> list[str]:
    """The command lines of a shell block: comments dropped, continuation lines joined."""
    commands: list[str] = []
    continued = False
    for raw in code.splitlines():
        line = raw.split(" #")[0].strip() if not raw.lstrip().startswith("#") else ""
        if continued:
            commands[-1] += " " + line
        elif line:
            commands.append(line)
        continued = line.endswith("\\")
        if commands:
            commands[-1] = commands[-1].rstrip("\\ ")
    return commands


def test_readme_links_exist() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)", text):
        assert (REPO / target).exists(), f"README.md links {target}, which does not exist"


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text(encoding="utf-8").splitlines()) < 200


@pytest.mark.parametrize("plot", sorted(PLOTS.glob("*.png")), ids=lambda p: p.name)
def test_notebook_plots_are_the_notebooks_outputs(plot: Path) -> None:
    """docs/img/notebooks/NAME-cellK.png is the PNG output of code cell K of notebooks/NAME.ipynb
    (``XNNQUANT_UPDATE_PLOTS=1`` copies it anew after a notebook was re-run and saved)."""
    name, cell = re.fullmatch(r"(.+)-cell(\d+)\.png", plot.name).groups()
    cells = json.loads((REPO / "notebooks" / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]
    images = [o["data"]["image/png"] for o in cells[int(cell)].get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1, f"cell {cell} of {name}.ipynb has {len(images)} plots"
    data = base64.b64decode(images[0])
    if os.environ.get("XNNQUANT_UPDATE_PLOTS") == "1":
        plot.write_bytes(data)
    same = plot.read_bytes() == data  # a bool: pytest's diff of two PNGs' bytes took 336 s when they differed
    assert same, f"{plot.name} is not the notebook's plot: XNNQUANT_UPDATE_PLOTS=1 copies it"


def test_blocks_and_skip_markers(tmp_path: Path) -> None:
    """The extraction itself: fences (indented ones too), line numbers, the skip marker and its reason."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- skip: needs 4 GB of weights -->\n```python\nraise SystemExit\n```\n"
                    "- item\n\n    ```sh\n    make test\n    ```\n", encoding="utf-8")
    found = blocks(page)
    assert [(b.lang, b.line, b.code, b.skip) for b in found] == [
        ("python", 4, "x = 1\n", None), ("python", 9, "raise SystemExit\n", "needs 4 GB of weights"),
        ("sh", 14, "make test\n", None)]
    page.write_text("<!-- skip: -->\n```python\nx = 1\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="needs its reason"):
        blocks(page)
