"""What every notebook maker shares: the kernel its notebook runs on, and where it is written."""

import pathlib

import nbformat as nbf


def write(cells: list, name: str) -> None:
  """Writes `cells` as `notebooks/<name>.ipynb` for the python3 kernel."""
  nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {
      "name": "python3", "display_name": "Python 3", "language": "python"}})
  nbf.write(nb, pathlib.Path(__file__).with_name(f"{name}.ipynb"))
