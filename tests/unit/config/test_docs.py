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
    readme = tmp_path / "README.md"
    readme.write_text(README)
    monkeypatch.setattr(docs, "FLAGS_PAGE", page)
    monkeypatch.setattr(docs, "README", readme)
    docs.main(["--write"])
    assert capsys.readouterr().out.splitlines() == ["docs/flags.md: rewritten",
                                                    "README.md: rewritten"]
    assert docs.flags_markdown() in page.read_text()
    assert "\n".join(docs.refused_markdown()) in readme.read_text()
    docs.main(["--write"])
    assert capsys.readouterr().out.splitlines() == ["docs/flags.md: already up to date",
                                                    "README.md: already up to date"]


README = "# R\n\ntext\n<!-- refused-flags:begin -->\nold\n<!-- refused-flags:end -->\nmore\n"


def test_write_readme_table_rewrites_only_the_table(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert docs.write_readme_table(readme) is True
    assert readme.read_text() == ("# R\n\ntext\n<!-- refused-flags:begin -->\n"
                                  + "\n".join(docs.refused_markdown())
                                  + "\n<!-- refused-flags:end -->\nmore\n")
    assert docs.write_readme_table(readme) is False


def test_refused_table_has_a_row_per_reason_naming_every_refusal():
    from megatron_ext.config import megatron_compat as mc

    rows = docs.refused_markdown()[2:]
    text = "\n".join(rows)
    assert len(rows) == len({why for _, why in mc.refused_groups()})
    for flag in [*mc.REFUSED, *(p + "*" for p in mc.REFUSED_PREFIXES), *mc.REFUSED_VALUES]:
        assert f"`{flag}" in text, flag
    assert "`--context-parallel-size (other than 1)`" in text


def test_the_readme_table_is_up_to_date():
    readme = docs.README.read_text()
    start = readme.index(docs.REFUSED_BEGIN) + len(docs.REFUSED_BEGIN)
    section = readme[start:readme.index(docs.REFUSED_END)]
    assert section == "\n".join(docs.refused_markdown()) + "\n", (
        "README.md's refused-flags table is stale: regenerate with "
        "python -m megatron_ext.config.docs --write")
