"""The documentation's shape: a short front page (README.md) with the two commands and an index of
docs/, every relative link in README.md, docs/ and mlxstack/README.md pointing at a file (and a
heading) that exists, no journal wording. Pure text: no model, no MLX."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = sorted(DOCS.glob("*.md"))
LINKED = [README, REPO / "mlxstack" / "README.md", *PAGES]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(path: Path) -> str:
    """The file's text without fenced code blocks and inline code spans (no links live there)."""
    text = _FENCE.sub("", path.read_text())
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]{2,}|`", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in _LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


def test_slug_follows_github():
    assert slug("Structured output and tool_choice") == "structured-output-and-tool_choice"
    assert slug("Attention on a CPU: an exp that is not a libm call") == "attention-on-a-cpu-an-exp-that-is-not-a-libm-call"
    assert slug("Sampling defaults (greedy means greedy)") == "sampling-defaults-greedy-means-greedy"
    assert slug("One model across machines (DISTRIBUTED)") == "one-model-across-machines-distributed"


def test_front_page_is_at_most_150_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines: move detail into docs/"


def test_front_page_keeps_the_two_commands_and_the_test_time():
    text = README.read_text()
    assert "python3 install_and_run.py          #" in text
    assert "python3 install_and_run.py --test   #" in text
    assert re.search(r"about [\d,]+ tests, ~[\d-]+ minutes on 2 cores", text)
    assert 'not e2e and not slow' in text                      # the fast tier, one line


@pytest.mark.parametrize("path", LINKED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{path.relative_to(REPO)}: " + "; ".join(broken)


def test_the_docs_index_lists_every_page():
    index = README.read_text().split("## Documentation", 1)
    assert len(index) == 2, "README.md has no '## Documentation' section"
    listed = {Path(t.partition("#")[0]).name for t in relative_links_in(index[1]) if t.startswith("docs/")}
    missing = sorted(p.name for p in PAGES if p.name not in listed)
    assert not missing, f"README's docs index lacks {missing}"
    assert len(PAGES) >= 12


def relative_links_in(text: str) -> list[str]:
    return _LINK.findall(text)


def test_front_page_settings_are_real_settings():
    from mlxstack.config.settings import SPEC_BY_NAME

    section = README.read_text().split("## Settings most people change", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([A-Z0-9_]+)`(?:, `([A-Z0-9_]+)`)?", section, re.M)
    named = [n for pair in names for n in pair if n]
    assert len(named) >= 8
    assert not [n for n in named if n not in SPEC_BY_NAME], named


def test_layer_table_names_every_package():
    from tests.test_layers import ALLOWED

    text = (DOCS / "architecture.md").read_text().split("## Layers", 1)[1]
    rows = set(re.findall(r"^\| `([a-z]+)/` \|", text, re.M))
    assert rows == set(ALLOWED), rows ^ set(ALLOWED)


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(REPO)))
def test_no_journal_wording(path):
    """Figures carry their date and command, never the work log's "stop N" / "interim state"."""
    text = path.read_text()
    found = re.findall(r"\b[Ss]top \d+\b|\bthis stop\b|\bthe stop\b|\binterim state\b", text)
    assert not found, f"{path.relative_to(REPO)}: {found}"
