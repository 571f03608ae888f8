"""The notebook runs top to bottom; the ``sguard peace`` CLI works end to end."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from sguard.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_notebook_executes_top_to_bottom_in_quick_mode(monkeypatch: pytest.MonkeyPatch,
                                                       tmp_path: Path) -> None:
    """nbclient runs every cell of notebooks/peace_simulation.ipynb without error."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager

    monkeypatch.setenv("PEACE_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(ROOT / "notebooks" / "peace_simulation.ipynb", as_version=4)
    # a private "python3" kernel that is this very interpreter (the project venv)
    spec_dir = write_kernel_spec(overrides={"argv": [sys.executable, "-m", "ipykernel_launcher",
                                                     "-f", "{connection_file}"]})
    KernelSpecManager().install_kernel_spec(spec_dir, "python3", prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    kernel = "python3"
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name=kernel,
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.get("outputs", []))
    assert "quick mode" in outputs
    assert "svr1.1 -> svr1.2 -> svr2.2" in outputs and "deferred to t+1: ['svr2.1']" in outputs
    assert "peace-paper" in outputs and "peace-paper-caps" not in outputs
    assert "improved t=0: svr2.1 -> svr2.2 -> svr1.1" in outputs
    assert "improved deferred: []" in outputs
    assert "mcf deferred: []" in outputs
    assert "r=2 peace        vs hdfs-fair" in outputs and "r=3 peace        vs hdfs-fair" in outputs
    assert "fluid lower bounds on makespan" in outputs


def test_cli_simulate_writes_a_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sguard peace simulate ... --plot out.png` prints the table and writes the PNG."""
    out = tmp_path / "fig10.png"
    js = tmp_path / "rows.json"
    rc = main(["peace", "simulate", "--writers", "4", "--sizes-mb", "128", "--policies", "peace",
               "peace-paper", "peace-mcf", "hdfs", "hdfs-fair", "--replication", "2", "3",
               "--plot", str(out), "--json", str(js), "--no-progress"])
    assert rc == 0
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"
    text = capsys.readouterr().out
    assert "peace " in text and "peace-paper" in text and "hdfs" in text and js.exists()
    assert "peace-mcf" in text and "hdfs-fair" in text
    assert "vs hdfs-fair" in text
    import json
    rows = json.loads(js.read_text())["rows"]
    assert {r["replication"] for r in rows} == {2, 3}


def test_cli_schedule_prints_figure5_and_rejects_unknown_writer(capsys: pytest.CaptureFixture[str]
                                                                ) -> None:
    """`sguard peace schedule` prints a validated schedule; a bad writer exits 2."""
    assert main(["peace", "schedule", "--request", "svr1.1,2,1", "--request", "svr2.1,2,1"]) == 0
    out = capsys.readouterr().out
    assert "certificate valid" in out and "svr1.1 -> svr1.2" in out
    assert "2 chunks in 1 timesteps" in out  # improved (default): both fit at once
    assert main(["peace", "schedule", "--variant", "paper", "--seed", "0", "--request",
                 "svr1.1,2,1", "--request", "svr2.1,2,1"]) == 0
    assert "certificate valid" in capsys.readouterr().out
    assert main(["peace", "schedule", "--request", "ghost,2,1"]) == 2
    assert "unknown server" in capsys.readouterr().err


def test_every_peace_leaf_parser_sets_func() -> None:
    """Each `sguard peace` leaf has a callable func default."""
    parser = build_parser()
    for argv in (["peace", "simulate"], ["peace", "schedule", "--request", "a,1,1"],
                 ["peace", "serve"]):
        assert callable(parser.parse_args(argv).func)


def test_cli_serve_runs_briefly(capsys: pytest.CaptureFixture[str]) -> None:
    """`sguard peace serve --serve-s` binds 127.0.0.1 and stops by itself."""
    assert main(["peace", "serve", "--serve-s", "0.2"]) == 0
    assert "127.0.0.1" in capsys.readouterr().out
