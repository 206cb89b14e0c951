"""docs/cost-model.md's profile tables are the shipped profile files, row for
row: a parameter changed in a file and not in the doc (or the other way)
fails here.  ``python tests/costmodel/test_cost_doc.py`` prints the tables."""
from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "cost-model.md"
PROFILES = ROOT / "src" / "dspx" / "costmodel" / "profiles"


def _num(v) -> str:
    return f"{v:,.0f}" if float(v) == int(v) and abs(v) >= 1 or v == 0 else f"{v:g}"


def table(name: str) -> list[str]:
    """The markdown table of profile ``name``, from its JSON file."""
    params = json.loads((PROFILES / f"{name}.json").read_text())["params"]
    rows = ["| parameter | value | unit | status | range | source |", "|---|---|---|---|---|---|"]
    for key, p in params.items():
        rng = " – ".join(map(_num, p["range"])) if "range" in p else ""
        source = p["source"].replace("|", "\\|")
        rows.append(f"| `{key}` | {_num(p['value'])} | {p['unit']} | {p['status']} | {rng} | {source} |")
    return rows


def doc_table(name: str) -> list[str]:
    """The table after ``<!-- profile table: NAME -->`` in the doc, up to the first blank line."""
    lines = DOC.read_text().splitlines()
    start = lines.index(f"<!-- profile table: {name} -->") + 1
    end = next(i for i in range(start, len(lines)) if not lines[i].strip())
    return lines[start:end]


def test_the_docs_profile_tables_are_the_profile_files():
    names = sorted(p.stem for p in PROFILES.glob("*.json"))
    assert names == ["c7x-j722s", "j6-vision"]
    for name in names:
        assert doc_table(name) == table(name), f"docs/cost-model.md's {name} table differs from {name}.json"


def test_the_doc_stays_short_and_keeps_the_seed_comparison():
    text = DOC.read_text()
    assert len(text.splitlines()) <= 300
    assert "## The seed's two figures" in text


if __name__ == "__main__":
    for n in ("j6-vision", "c7x-j722s"):
        print(f"<!-- profile table: {n} -->")
        print("\n".join(table(n)))
        print()
