"""The generated results tables of the site (docs/benchmarks/tables.md) are what scripts/docs_tables.py makes from
benchmarks/results/*.json now: a results JSON rewritten, or the page edited by hand, fails here."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_tables  # noqa: E402

sys.path.remove(str(ROOT / "scripts"))


def test_committed_tables_are_generated():
    assert docs_tables.PAGE.read_text() == docs_tables.generate(), \
        "docs/benchmarks/tables.md is out of date: run python scripts/docs_tables.py"


def test_check_mode_fails_on_a_hand_edit(tmp_path, monkeypatch, capsys):
    """Planted bug: one figure of the page changed by hand; ``--check`` exits 1 and shows the line."""
    page = tmp_path / "tables.md"
    page.write_text(docs_tables.generate().replace("| 50 |", "| 51 |", 1))
    monkeypatch.setattr(docs_tables, "PAGE", page)
    monkeypatch.setattr(docs_tables, "ROOT", tmp_path)
    assert docs_tables.main(["--check"]) == 1
    assert "| 51 |" in capsys.readouterr().out
    page.write_text(docs_tables.generate())
    assert docs_tables.main(["--check"]) == 0


def test_every_table_names_its_command():
    for title, rel, _, _ in docs_tables.TABLES:
        doc = __import__("json").loads((docs_tables.RESULTS / rel).read_text())
        assert docs_tables.command_of(doc) or rel in docs_tables.KNOWN_COMMANDS, f"{rel} records no command"
