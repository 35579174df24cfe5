"""megatron_ext/config/docs.py: the flag tables and their section of docs/flags.md."""

from __future__ import annotations

from megatron_ext.config import docs

PAGE = "# Flags\n\nintro\n\n<!-- flags:begin -->\nstale\n<!-- flags:end -->\n\ntail\n"


def test_write_flags_page_rewrites_only_the_section(tmp_path):
    page = tmp_path / "flags.md"
    page.write_text(PAGE)
    assert docs.write_flags_page(page) is True
    text = page.read_text()
    assert text == ("# Flags\n\nintro\n\n<!-- flags:begin -->\n" + docs.flags_markdown()
                    + "<!-- flags:end -->\n\ntail\n")
    assert docs.write_flags_page(page) is False
    assert page.read_text() == text


def test_the_default_page_is_docs_flags_md():
    assert docs.FLAGS_PAGE.parts[-2:] == ("docs", "flags.md")
    assert docs.FLAGS_PAGE.exists()


def test_main_prints_the_tables_and_writes_nothing(capsys, tmp_path, monkeypatch):
    page = tmp_path / "flags.md"
    page.write_text(PAGE)
    monkeypatch.setattr(docs, "FLAGS_PAGE", page)
    docs.main([])
    assert capsys.readouterr().out == docs.flags_markdown()
    assert page.read_text() == PAGE


def test_main_write_rewrites_the_page(capsys, tmp_path, monkeypatch):
    page = tmp_path / "flags.md"
    page.write_text(PAGE)
    monkeypatch.setattr(docs, "FLAGS_PAGE", page)
    docs.main(["--write"])
    assert "rewritten" in capsys.readouterr().out
    assert docs.flags_markdown() in page.read_text()
    docs.main(["--write"])
    assert "already up to date" in capsys.readouterr().out
