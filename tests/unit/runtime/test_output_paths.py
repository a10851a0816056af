"""Output paths (--out, --json, --plot) are checked when the arguments are parsed, before any measuring."""

import argparse
import os

import pytest

from spdkfac.perfmodels import PerfModel
from spdkfac.perfmodels.__main__ import main as perfmodels_main
from spdkfac.runtime.output_path import output_file, unwritable_reason
from spdkfac.simulate import cli as simulate_cli
from spdkfac.simulate import main


def test_unwritable_reason_names_the_problem(tmp_path):
    (tmp_path / "file").write_text("")
    assert unwritable_reason(tmp_path / "out.json") is None
    assert unwritable_reason(tmp_path / "missing" / "out.json") == f"its directory {tmp_path / 'missing'} does not exist"
    assert unwritable_reason(tmp_path) == "it is a directory"
    assert unwritable_reason(tmp_path / "file" / "out.json") == f"{tmp_path / 'file'} is not a directory"
    assert unwritable_reason(tmp_path / "file" / "out.json", make_parents=True) == f"{tmp_path / 'file'} is not a directory"
    assert unwritable_reason(tmp_path / "new" / "deeper" / "out.json", make_parents=True) is None
    assert unwritable_reason("out.json") is None  # a bare name: the current folder


def test_output_file_is_an_argparse_type_naming_the_path(tmp_path):
    check = output_file()
    assert check(str(tmp_path / "x.json")) == str(tmp_path / "x.json")
    with pytest.raises(argparse.ArgumentTypeError, match=f"cannot write {tmp_path}: it is a directory"):
        check(str(tmp_path))


def _no_work(monkeypatch, module, name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"{name} ran before the output path was checked")

    monkeypatch.setattr(module, name, refuse)


def test_predict_refuses_an_unwritable_json_before_predicting(tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch, simulate_cli, "load_profiles")
    out = tmp_path / "no" / "p.json"
    with pytest.raises(SystemExit) as exc:
        main(["predict", "--profile", "p.json", "--perf-model", "m.json", "--json", str(out)])
    assert exc.value.code == 2
    assert f"argument --json: cannot write {out}: its directory" in capsys.readouterr().err


def test_profile_refuses_an_unwritable_out_before_profiling(tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch, simulate_cli, "measure_profile")
    with pytest.raises(SystemExit):
        main(["profile", "--out", str(tmp_path)])
    assert f"argument --out: cannot write {tmp_path}: it is a directory" in capsys.readouterr().err


def test_perfmodels_plot_refuses_an_unwritable_out_before_loading(tmp_path, capsys, monkeypatch):
    _no_work(monkeypatch, PerfModel, "load")
    with pytest.raises(SystemExit):
        perfmodels_main(["plot", "m.json", "--out", str(tmp_path / "no" / "m.png")])
    assert "argument --out: cannot write" in capsys.readouterr().err


def test_perfmodels_plot_refuses_an_unwritable_default_out_before_plotting(tmp_path, capsys, monkeypatch):
    from spdkfac.perfmodels import plot

    _no_work(monkeypatch, plot, "plot_perf_model")
    PerfModel.default().save(tmp_path / "m.json")
    (tmp_path / "m.png").mkdir()  # where the default --out (next to the JSON) would go
    with pytest.raises(SystemExit):
        perfmodels_main(["plot", str(tmp_path / "m.json")])
    assert f"cannot write {tmp_path / 'm.png'} (the default --out of plot): it is a directory" in capsys.readouterr().err


def test_benchmark_out_is_checked_when_the_arguments_are_parsed(tmp_path, capsys):
    from benchmarks.common import workload_parser

    ap = workload_parser("doc", iters=1, out_name="x.json")
    assert ap.parse_args(["--out", str(tmp_path / "new" / "x.json")]).out == str(tmp_path / "new" / "x.json")  # save_json makes folders
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        ap.parse_args(["--out", str(tmp_path / "file" / "x.json")])
    assert f"cannot write {tmp_path / 'file' / 'x.json'}: {tmp_path / 'file'} is not a directory" in capsys.readouterr().err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert unwritable_reason(folder / "out.json") == "no permission to write there"
        assert unwritable_reason(folder / "new" / "out.json", make_parents=True) == "no permission to write there"
    finally:
        folder.chmod(0o700)
