"""docs/results.md's index of benchmarks/results/ is generated, and must be current."""

from benchmarks import results_index


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
