"""mkdocs hook: links from docs/ to the repository's own files (notebooks, benchmark scripts).

A page links a file outside docs/ by its path from the page, ``[outliers](../notebooks/outliers.ipynb)``,
so the link works where the Markdown is read on its own (a clone, a code host).  mkdocs knows
only the files in docs/ and would take such a link for a broken one.  This hook copies each
linked repository file into the site, under ``repo/``, and points the link at the copy: the
site stays whole offline, and a link to a file that does not exist is left as it was, which
``mkdocs build --strict`` reports and fails on.  Markdown files are not copied (mkdocs would
take them for pages of the site): a page names them in code instead of linking them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[2]
#: ``](../path)`` or ``](../path#anchor)`` in a page at the top of docs/.
LINK = re.compile(r"\]\(\.\./([^)#\s]+)(#[^)\s]*)?\)")
#: Where the copies go in the site.
PREFIX = "repo/"


def _linked(text: str) -> list[str]:
    """Repository paths linked from a page's Markdown that exist as files."""
    return [m.group(1) for m in LINK.finditer(text) if _copied(m.group(1))]


def _copied(path: str) -> bool:
    """Whether the site gets a copy of the repository file at ``path``."""
    return not path.endswith(".md") and (REPO / path).is_file()


def on_files(files: Files, config: Any) -> Files:
    """Add every repository file a page links to the site's files."""
    docs = Path(config["docs_dir"])
    for page in sorted(docs.glob("*.md")):
        for path in _linked(page.read_text(encoding="utf-8")):
            if files.get_file_from_path(PREFIX + path) is None:
                files.append(File.generated(config, PREFIX + path, abs_src_path=str(REPO / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Point links to existing repository files at their copies."""
    if "/" in page.file.src_uri:  # pages in subfolders would need ../../: none are
        return markdown

    def to_copy(m: re.Match[str]) -> str:
        if not _copied(m.group(1)):
            return m.group(0)
        return f"]({PREFIX}{m.group(1)}{m.group(2) or ''})"

    return LINK.sub(to_copy, markdown)
