"""bench/BENCHMARKS.md links every results folder, and bench/'s folders name their scripts."""

from __future__ import annotations

from markdown_links import broken_links, relative_links

from mext_testing import ROOT

BENCH = ROOT / "bench"
PAGE = BENCH / "BENCHMARKS.md"
RESULTS = BENCH / "results"
SCRIPTS = (".py", ".sh")


def test_every_results_entry_is_linked_from_the_benchmarks_page():
    linked = {path.relative_to(RESULTS).parts[0] for path, _ in relative_links(PAGE)
              if path.is_relative_to(RESULTS) and path != RESULTS}
    entries = sorted(entry.name for entry in RESULTS.iterdir())
    assert entries, "no bench/results entries: the path is wrong"
    assert [name for name in entries if name not in linked] == []


def test_every_link_of_the_benchmarks_page_resolves():
    assert relative_links(PAGE), "no links found: the pattern is broken"
    assert broken_links(PAGE, ROOT) == []


def test_no_experiment_diff_under_results():
    # Code that did not land lives in git history or a branch, not in bench/results.
    assert [str(p.relative_to(ROOT)) for p in RESULTS.rglob("*.diff")] == []


def test_every_script_of_a_bench_folder_is_named_in_its_readme():
    folders = sorted(p for p in BENCH.iterdir() if p.is_dir() and p != RESULTS)
    assert {p.name for p in folders} >= {"gpu", "cpu", "peers"}
    for folder in folders:
        readme = (folder / "README.md").read_text()
        scripts = sorted(p.name for p in folder.iterdir() if p.suffix in SCRIPTS)
        assert scripts, f"{folder.relative_to(ROOT)} holds no script"
        assert [name for name in scripts if f"[{name}]({name})" not in readme] == [], (
            f"{folder.relative_to(ROOT)}/README.md: give each script a line")


def test_bench_holds_scripts_only_in_its_folders():
    assert sorted(p.name for p in BENCH.iterdir() if p.suffix in SCRIPTS) == []
