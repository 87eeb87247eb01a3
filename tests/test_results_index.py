"""Generated from benchmarks/results/, and current: docs/results.md's index, the README's headline."""

from benchmarks import headline, results_index


def test_results_index_is_current():
  assert results_index.main(["--check"]) == 0, "run: python -m benchmarks.results_index --write"


def test_a_stale_index_is_seen():
  doc = results_index.DOC.read_text()
  start = doc.index(results_index.START)
  stale = doc[:start] + results_index.START + "\n" + doc[doc.index(results_index.END):]
  assert results_index.render(stale) == doc != stale


def test_every_kept_result_is_cited():
  rows = results_index.index().splitlines()
  assert not [r for r in rows if "nothing (archive it)" in r]


def test_readme_headline_table_is_generated_from_the_results():
  assert headline.main(["--check"]) == 0, "run: python -m benchmarks.headline --write"
  readme = headline.README.read_text()
  stale = readme.replace(headline.rows()[0], headline.rows()[0].replace(" ms |", " ms (old) |", 1))
  assert stale != readme and headline.render(stale) == readme
