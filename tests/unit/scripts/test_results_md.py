"""scripts/results_md.py: RESULTS.md from result JSON files in the shapes the benchmarks write."""

import importlib.util
import json
import math
import pkgutil
from pathlib import Path

import pytest

import benchmarks.report as report
from benchmarks.report import common

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("results_md", ROOT / "scripts" / "results_md.py")
results_md = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results_md)

MACHINE = {
    "cpu": "x86_64",
    "cores": 16,
    "torch": "2.13.0+cu128",
    "torch_threads": 4,
    "cuda": "Test GPU 80GB",
    "python": "3.11.7",
    "retained_freed_memory": True,
    "horovod_cycle_time_ms": "20",
    "bound_cores": [0, 1],
}
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


def _row(variant, mean, **extra):
    return {
        "variant": variant,
        "mean_s": mean,
        "stdev_s": 0.0123,
        **{p: 0.001 * (i + 1) for i, p in enumerate(PARTS)},
        "rss_mb": 1234.0,
        "kfac_state_mb": 100.0,
        **extra,
    }


def _write(folder: Path, name: str, obj) -> None:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    """A results folder holding iteration_time, fusion_policies, inverse_placement and one convergence run."""
    res = tmp_path / "results"
    res.mkdir()
    iteration_args = {
        "model": "resnet50",
        "resolution": 32,
        "batch_size": 4,
        "iters": 6,
        "perf_model": "p.json",
        "threads": 1,
        "warmup": 2,
        "device": "auto",
        "rounds": 1,
        "interleave": True,
        "variants": ["sgd", "dkfac", "mpdkfac", "spdkfac", "-pipe+lbp"],
        "update_freq": [10, 100],
        "out": None,
    }
    table = [
        _row("sgd", 0.5),
        _row("dkfac", 4.321, SP1=1.0, SP2=0.97),
        _row("mpdkfac", 4.2, SP1=1.03, SP2=1.0),
        _row(
            "spdkfac",
            2.777,
            SP1=1.556,
            SP2=1.512,
            SP1_lo=1.411,
            SP1_hi=1.699,
            SP2_lo=1.4,
            SP2_hi=1.6,
            vs_sgd=5.554,
            vs_sgd_lo=5.1,
            vs_sgd_hi=6.0,
            factor_steps_s=9.876,
            factor_steps_n=1,
            other_steps_s=1.234,
            other_steps_n=5,
        ),
        _row("-pipe+lbp", 2.9, SP1=1.49, SP2=1.45),
    ]
    _write(
        res,
        "iteration_time.json",
        {
            "args": iteration_args,
            "machine": MACHINE,
            "world_size": 4,
            "engine": "torch",
            "table": table,
            "samples": {r["variant"]: [r["mean_s"]] * 6 for r in table},
        },
    )
    (res / "iteration_time.png").write_bytes(b"\x89PNG")
    fusion = {
        p: {
            "factor_compute": 0.3901,
            "blocked": 0.28,
            "factor_comm_nonoverlap": nonover,
            "factor_comm_total": 0.6191,
            "hidden": hidden,
            "factor_stage": stage,
            "factor_unpack": 0.9,
            "iteration": 5.5,
            "groups": groups,
        }
        for p, nonover, hidden, stage, groups in (
            ("optimal", 0.1719, 0.72, 0.5621, {"A": 35, "G": 37}),
            ("naive", 0.5616, 0.0, 0.9331, {"A": 1, "G": 1}),
        )
    }
    _write(
        res,
        "fusion_policies.json",
        {
            "args": {"model": "resnet50", "out": "/elsewhere/fusion_policies.json"},
            "world_size": 2,
            "engine": "horovod",
            "sgd": {"blocked": 0.11, "iteration": 0.36},
            "results": fusion,
            "samples": {},
        },
    )
    _write(
        res,
        "inverse_placement.json",
        {
            "args": {"model": "resnet50", "rounds": 3},
            "machine": MACHINE,
            "world_size": 2,
            "engine": "horovod",
            "results": {
                "lbp": {"median_s": 6.4139, "samples": [6.4], "predicted_s": 5.5882, "local_factors": 51},
                "seq": {"median_s": 10.0924, "samples": [10.1], "predicted_s": 9.6456, "local_factors": 0},
                "local": {"median_s": 10.3582, "samples": [10.4], "predicted_s": 10.9266, "local_factors": 108},
            },
            "summary": {
                "lower_bound_s": 5.6257,
                "lbp_over_lower_bound": 1.1401,
                "lbp_speedup_vs_seq": 1.5735,
                "lbp_speedup_vs_local": 1.6149,
                "lbp_speedup_vs_seq_interval": [1.55, 1.87],
                "lbp_speedup_vs_local_interval": None,
                "inverse_model_mean_rel_error": 0.0964,
                "inverse_model_max_rel_error_d>=512": 0.1178,
                "broadcast_model_mean_rel_error": 0.443,
            },
            "single_inversions": {"64": 0.0002},
            "broadcasts": {"64": 0.0013},
        },
    )
    _write(
        res,
        "model_stats.json",
        {
            "num_classes": 1000,
            "models": {
                "resnet50": {
                    "params": 25557032,
                    "layers": 54,
                    "num_a": 54,
                    "num_g": 54,
                    "a_elems": 62312345,
                    "g_elems": 14612345,
                    "max_dim": 4608,
                    "matches_paper": {"params_m": True, "layers": True, "a_elems_m": True, "g_elems_m": False},
                    "arithmetic": {
                        "resolution": 224,
                        "batch_size": 32,
                        "gflop": {},
                        "factor_every": 10,
                        "workers": 2,
                        "floor": 1.2345,
                        "floor_distributed_preconditioning": 1.1321,
                    },
                }
            },
        },
    )
    run = res / "convergence" / "mnist_run"
    optimizers = {
        "sgd": {
            "chosen_lr": 0.025,
            "best_test_acc": 0.937,
            "final_test_loss": 0.2129,
            "epochs_to_target": 20,
            "seconds_to_target": 29.296,
            "epochs_ratio": 1.0,
            "seconds_ratio": 1.0,
            "curve": [],
        },
        "spdkfac:factor_update_freq=10,inv_update_freq=10": {
            "chosen_lr": 0.05,
            "best_test_acc": 0.967,
            "final_test_loss": 0.1132,
            "epochs_to_target": 9,
            "seconds_to_target": 12.051,
            "epochs_ratio": 0.45,
            "seconds_ratio": 0.4114,
            "curve": [],
        },
        "spdkfac:kl_clip=0.0001": {
            "chosen_lr": 0.05,
            "best_test_acc": 0.93,
            "final_test_loss": 0.3,
            "epochs_to_target": None,
            "seconds_to_target": None,
            "epochs_ratio": None,
            "seconds_ratio": None,
            "curve": [],
        },
    }
    _write(
        run,
        "convergence.json",
        {
            "args": {
                "data": ["mnist5k"],
                "batch_sizes": [256],
                "optimizers": list(optimizers),
                "epochs": 20,
                "lr_grid": ["sgd=0.0125,0.025"],
                "interleave": True,
                "kl_clip": None,
                "grids": {"sgd": [0.0125]},
                "out": "/tmp/somewhere",
            },
            "machine": MACHINE,
            "engine": "horovod",
            "world_size": 2,
            "settings": [
                {
                    "data": "mnist5k",
                    "batch_size": 256,
                    "global_batch": 512,
                    "steps_per_epoch": 7,
                    "reference": "sgd",
                    "target_test_acc": 0.937,
                    "optimizers": optimizers,
                }
            ],
        },
    )
    (run / "convergence_mnist5k_b256.png").write_bytes(b"\x89PNG")
    return res


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_tables_hold_the_numbers(results: Path, tmp_path: Path):
    out = tmp_path / "doc" / "RESULTS.md"
    assert results_md.main(["--results", str(results), "--out", str(out)]) == 0
    text = out.read_text()

    ms = _section(text, "Model statistics")
    assert "| resnet50 | 25.6 | 54 | 62.3 | 14.6 | 4608 | differs: g_elems_m | 1.23x | 1.13x |" in ms
    assert "224×224, batch 32, factors every 10" in ms

    it = _section(text, "Iteration time")
    assert "| **SPD-KFAC** | 2777 ± 12 |" in it
    assert "1.56x (1.41–1.70)" in it
    assert "1.51x (1.40–1.60)" in it
    assert "5.55x (5.10–6.00)" in it
    assert "| D-KFAC | 4321 ± 12 |" in it
    assert "1.00x" in it
    assert "0.97x" in it
    assert "9.88 s (n=1)" in it
    assert "1.23 s (n=5)" in it
    assert "torchrun --nproc_per_node 4 -m benchmarks.iteration_time" in it
    assert "--variants sgd dkfac mpdkfac spdkfac -pipe+lbp" in it
    assert "--interleave" in it
    assert "--update-freq 10 100" in it
    assert "--out" not in it  # None: the default path
    assert "16 cores" in it
    assert "GPU Test GPU 80GB" in it
    assert "4 worker(s) via torch" in it
    assert "HOROVOD_CYCLE_TIME=20" in it
    assert "results/iteration_time.png" in it

    fu = _section(text, "Pipelined factor communication")
    assert "| optimal | 35/37 | 390 | 172 | 619 | 72% | 562 | 1.66x |" in fu
    assert "| naive | 1/1 | 390 | 562 | 619 | 0% | 933 | 1.00x |" in fu
    assert "Machine: not recorded." in fu
    assert "/elsewhere" not in fu
    assert "fusion_policies.png" not in fu  # no plot in the folder: no link

    pl = _section(text, "Placement of the inversions")
    assert "| LBP (SPD-KFAC) | 6.41 s | 5.59 s | 51 |" in pl
    assert "| Non-Dist (D-KFAC) | 10.36 s | 10.93 s | 108 |" in pl
    assert "LBP vs Seq-Dist: 1.57x (1.55–1.87)" in pl
    assert "LBP vs Non-Dist: 1.61x" in pl
    assert "5.63 s: 1.14x" in pl
    assert "mean 10%" in pl
    assert "12%" in pl

    cv = _section(text, "Time to accuracy: mnist_run")
    assert "| `sgd` | 0.025 | 93.7% | 0.213 | 20 (1.00x) | 29.3 (1.00x) |" in cv
    assert "| `spdkfac:factor_update_freq=10,inv_update_freq=10` | 0.05 | 96.7% | 0.113 | 9 (0.45x) | 12.1 (0.41x) |" in cv
    assert "not reached" in cv
    assert f"--out {results}/convergence/mnist_run" in cv
    assert "--grids" not in cv
    assert "--kl-clip" not in cv
    assert "(../results/convergence/mnist_run/convergence_mnist5k_b256.png)" in cv
    assert "_per_seed.png" not in cv  # plot_curves.py --per-seed's figure is linked only where it was drawn
    (results / "convergence" / "mnist_run" / "convergence_mnist5k_b256_per_seed.png").write_bytes(b"\x89PNG")
    cv = _section(results_md.build(results, tmp_path / "docs" / "RESULTS.md"), "Time to accuracy: mnist_run")
    assert "![test accuracy and loss, mnist_run, each seed](../results/convergence/mnist_run/convergence_mnist5k_b256_per_seed.png)" in cv

    missing_files = ("hook_overhead.json", "agreement_cost.json", "simulator_check.json", "soak.json", "fault_matrix.json")
    for missing in missing_files:  # optional: a note
        assert f"_No `{results}/{missing}`: section skipped._" in text
    assert _section(text, "Not present").count("`") == 2 * len(missing_files)


def test_the_fault_matrix_table(results: Path, tmp_path: Path):
    outcome = dict(case="truncate checkpoint.pt", group="damage", engine="torch", survived=True, detected=True, nothing_lost=True)
    frozen = dict(case="SIGSTOP rank 1", group="frozen", engine="horovod", survived=False, detected=None, nothing_lost=True)
    summary = dict(cases=2, tried=2, survived=1, detected_with_clear_message=1, to_detect=1, nothing_lost=2, all_ok=1)
    _write(
        results,
        "fault_matrix.json",
        {
            "summary": summary,
            "outcomes": [{**outcome, "seconds": 15.4, "notes": []}, {**frozen, "seconds": 44.0, "notes": ["took 44 s"]}],
            "command": "python -m benchmarks.fault_matrix --engines torch horovod",
        },
    )
    out = tmp_path / "RESULTS.md"
    assert results_md.main(["--results", str(results), "--out", str(out)]) == 0
    fm = _section(out.read_text(), "Fault matrix")
    assert "2 cases tried (2 in all): 1 survived, 1 of 1 detected with a clear message, 2 lost nothing; 1 fully as expected." in fm
    assert "| torch | damage | truncate checkpoint.pt | yes | yes | yes | 15 s |  |" in fm
    assert "| horovod | frozen | SIGSTOP rank 1 | **no** | — | yes | 44 s | took 44 s |" in fm
    assert "python -m benchmarks.fault_matrix --engines torch horovod" in fm


def test_output_is_deterministic(results: Path, tmp_path: Path):
    out = tmp_path / "RESULTS.md"
    first = results_md.build(results, out, "benchmarks/results")
    assert results_md.build(results, out, "benchmarks/results") == first
    assert "](results/iteration_time.png)" in first


def test_malformed_json_names_the_file(results: Path, tmp_path: Path, capsys):
    bad = results / "inverse_placement.json"
    bad.write_text('{"results": {"lbp": ')
    out = tmp_path / "RESULTS.md"
    with pytest.raises(results_md.ResultsError, match=r"inverse_placement\.json: not valid JSON"):
        results_md.build(results, out)
    assert results_md.main(["--results", str(results), "--out", str(out)]) == 1
    assert str(bad) in capsys.readouterr().err
    assert not out.exists()


def test_missing_key_names_the_file(results: Path, tmp_path: Path):
    path = results / "iteration_time.json"
    data = json.loads(path.read_text())
    del data["table"]
    path.write_text(json.dumps(data))
    with pytest.raises(results_md.ResultsError, match=r"iteration_time\.json: missing 'table'"):
        results_md.build(results, tmp_path / "RESULTS.md")


def test_no_results_folder(tmp_path: Path):
    with pytest.raises(results_md.ResultsError, match="no such results folder"):
        results_md.build(tmp_path / "absent", tmp_path / "RESULTS.md")


def test_dho2_cost_section_lists_each_worker_count(tmp_path):
    build = results_md.build
    results = tmp_path / "results"
    (results / "dho2_cost").mkdir(parents=True)
    for size, basis in ((1, 4 * 2**20), (2, 2 * 2**20)):
        record = {
            "args": {"model": "mnist_cnn", "refresh_every": 5, "iters": 20, "out": "x"},
            "machine": {"cpu": "test"},
            "engine": "horovod" if size > 1 else "single",
            "world_size": size,
            "model": "mnist_cnn",
            "params": 41642,
            "lanczos_steps": 22,
            "grad_s": 0.01,
            "refresh_s": 0.4,
            "update_s": 0.0008,
            "per_iteration_s": 0.0908,
            "memory": {"lanczos_basis": basis, "eigenvectors": 2**20},
        }
        (results / "dho2_cost" / f"w{size}.json").write_text(json.dumps(record))
    text = build(results, tmp_path / "RESULTS.md")
    section = _section(text, "DHO2: time per iteration and curvature memory per worker")
    assert "| 1 (single) | mnist_cnn (n=41642, m=22) | 10 | 400 (every 5) | 0.8 | 91 | 4.00 | 1.00 |" in section
    assert "| 2 (horovod) |" in section
    assert "| 2.00 | 1.00 |" in section
    assert "Not present" in text  # the other sections' notes are unchanged
    assert "analytic" not in section  # files from before the prediction: no prediction table
    from benchmarks.dho2_cost import predicted_memory

    record["predicted_memory"] = predicted_memory(41642, 22, record["memory"], (2, 64))
    (results / "dho2_cost" / "w2.json").write_text(json.dumps(record))
    section = _section(build(results, tmp_path / "RESULTS.md"), "DHO2: time per iteration and curvature memory per worker")
    basis_64 = math.ceil(41642 / 64) * 22 * 4
    assert f"| 64 | {basis_64 / 2**20:.3f} | 1.00 | {(basis_64 + 2**20) / 2**20:.2f} |" in section
    assert f"| 2 | {20821 * 22 * 4 / 2**20:.3f} |" in section
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "DHO2" not in build(empty, tmp_path / "R2.md")  # absent: no section, no note


def test_simulator_check_shows_the_error_per_phase(tmp_path: Path, monkeypatch, capsys):
    """The check on the stored measurement and profiles: per-phase shares add up to each variant's error, and
    RESULTS.md shows them; a check from before the phases were recorded renders without that table."""
    from benchmarks import simulator_check
    from spdkfac.simulate import PHASES

    stored = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "simulator_check"
    res = tmp_path / "results"
    res.mkdir()
    argv = [
        "simulator_check",
        str(stored / "iteration_time.json"),
        "--profile",
        str(stored / "profile_before.json"),
        str(stored / "profile_after.json"),
        "--perf-model",
        str(stored / "perfmodel.json"),
        "--out",
        str(res / "simulator_check.json"),
    ]
    monkeypatch.setattr("sys.argv", argv)
    simulator_check.main()
    printed = capsys.readouterr().out
    assert "per phase: measured / predicted ms" in printed
    data = json.loads((res / "simulator_check.json").read_text())
    measured = {r["variant"]: r for r in json.loads((stored / "iteration_time.json").read_text())["table"]}
    for row in data["rows"]:
        shares = [e["share_of_iteration"] for e in row["phase_errors"]]
        assert [e["phase"] for e in row["phase_errors"]] == list(PHASES)
        if measured[row["variant"]]["Other"] > 0:  # the rest of the iteration: the measured phases add up to it
            assert sum(shares) == pytest.approx(row["rel_error"], abs=1e-9)
        got = simulator_check.measured_phases(measured[row["variant"]])
        for e in row["phase_errors"]:
            assert e["measured_s"] == pytest.approx(got[e["phase"]])
            assert e["predicted_s"] == pytest.approx(row["predicted_phases"][e["phase"]])
        assert sum(row["predicted_phases"][p] for p in PHASES) == pytest.approx(row["predicted_s"])
    text = results_md.build(res, tmp_path / "RESULTS.md")
    section = _section(text, "Scale simulator against measurements")
    assert "Per phase of the measured breakdown" in section
    first = data["rows"][0]["phase_errors"][0]
    cell = f"{first['measured_s'] * 1e3:.0f} / {first['predicted_s'] * 1e3:.0f} ({first['share_of_iteration']:+.1%})"
    assert f"| FF&BP | {cell} |" in section
    for row in data["rows"]:
        row.pop("phase_errors")
    (res / "simulator_check.json").write_text(json.dumps(data))
    assert "Per phase" not in _section(results_md.build(res, tmp_path / "RESULTS.md"), "Scale simulator against measurements")


def test_simulator_check_shows_the_whole_checks_command_and_the_machines_load(tmp_path: Path):
    res = tmp_path / "results"
    res.mkdir()
    row = {"workers": 2, "variant": "sgd", "update_freq": [1, 1], "measured_s": 0.3, "predicted_s": 0.27, "rel_error": -0.1}
    data = {"rows": [row], "largest_abs_error": 0.1, "contention": True, "machine": {"cores": 2}}
    loaded = dict(data, load_average=[9.0, 8.0, 7.5], script="bash benchmarks/simulator_check.sh --iters 3", script_seconds=1500)
    (res / "simulator_check.json").write_text(json.dumps(loaded))
    section = _section(results_md.build(res, tmp_path / "RESULTS.md"), "Scale simulator against measurements")
    assert "Made by `bash benchmarks/simulator_check.sh --iters 3` in 25 min." in section
    assert "when predicted: 9.0 / 8.0 / 7.5 on 2 cores (a loaded machine: indicative only)" in section
    (res / "simulator_check.json").write_text(json.dumps(dict(loaded, load_average_when="measured")))
    section = _section(results_md.build(res, tmp_path / "RESULTS.md"), "Scale simulator against measurements")
    assert "Machine load (1/5/15 min) when measured: 9.0 / 8.0 / 7.5" in section
    (res / "simulator_check.json").write_text(json.dumps(dict(data, load_average=[2.1, 2.0, 2.2])))
    section = _section(results_md.build(res, tmp_path / "RESULTS.md"), "Scale simulator against measurements")
    assert "(a quiet machine)" in section
    assert "Made by" not in section


def test_update_fusion_section_shows_the_speed_up_over_the_unfused_run(tmp_path: Path):
    res = tmp_path / "results"
    args = {"model": "mobilenet_v2_32", "resolution": 32, "batch_size": 32, "iters": 4, "warmup": 2, "update_freq": [10, 100]}
    rows = [
        _row("sgd", 0.200),
        _row("sgd:update_fusion=forward", 0.160),
        _row("spdkfac", 0.400),
        _row("spdkfac:update_fusion=backward", 0.500),
    ]
    samples = {"sgd": [0.2, 0.2, 0.3], "sgd:update_fusion=forward": [0.2, 0.16, 0.2]}  # paired ratios 1.0, 1.25, 1.5
    d = {"args": args, "machine": MACHINE, "world_size": 1, "engine": "single", "table": rows, "samples": samples}
    _write(res, "update_fusion.json", d)
    text = results_md.build(res, tmp_path / "RESULTS.md")
    section = text.split("## Update fusion")[1]
    assert "| SGD | forward | 160 ± 12 | 1 | 7 | 1.25x | 1.25x (1.00–1.50) |" in section
    assert "| **SPD-KFAC** | backward | 500 ± 12 | 1 | 7 | 0.80x |  |" in section
    assert "benchmarks.iteration_time" in section
    assert "update_fusion.json" not in results_md.build(tmp_path, tmp_path / "R.md")  # optional: no note when absent
    _write(res, "update_fusion_resnet50_w2.json", {**d, "args": {**args, "model": "resnet50"}, "world_size": 2})
    second = results_md.build(res, tmp_path / "RESULTS.md").split(
        "## Update fusion: the update in the next forward pass or in backward (resnet50_w2)"
    )[1]
    assert "resnet50 at 32×32, batch 32 per worker, 2 worker(s)" in second


def test_update_cost_section_shows_the_share_of_the_update(tmp_path: Path):
    res = tmp_path / "results"
    d = {"args": {"batch_size": 32, "iters": 20}, "machine": MACHINE, "model": "mobilenet_v2_32", "parameters": 2236682}
    d.update(tensors=158, fwd_bwd_s=4.0, update_s=0.032, update_share=0.032 / 4.032, update_gb_per_s=2.5, update_bytes=80520552)
    _write(res, "update_cost.json", d)
    section = results_md.build(res, tmp_path / "RESULTS.md").split("## Update fusion: what the separate update pass costs")[1]
    assert "| 4000 ms | 32.0 ms | 0.8% | 2.5 GB/s |" in section
    assert "benchmarks.update_cost" in section


def test_convergence_race_shows_the_second_target_the_seeds_and_the_issue_targets(tmp_path: Path):
    """A run against AdamW and SOAP: epochs to AdamW's best, per-seed medians and ranges, each K-FAC configuration's targets."""

    def opt(lr, acc, loss, e, s, e2, s2, seeds_acc, seeds_e):
        return {
            "chosen_lr": lr,
            "best_test_acc": acc,
            "final_test_loss": loss,
            "epochs_to_target": e,
            "seconds_to_target": s,
            "epochs_ratio": None if e is None else e / 10,
            "seconds_ratio": None if s is None else s / 20.0,
            "epochs_to_second": e2,
            "seconds_to_second": s2,
            "curve": [],
            "lr_grid": {repr(lr): {"lr": lr, "best_test_acc": acc}, "0.5": {"lr": 0.5, "best_test_acc": 0.1}},
            "per_seed": {
                "seeds": [0, 1, 2],
                "best_test_acc": seeds_acc,
                "best_test_acc_median": sorted(seeds_acc)[1],
                "best_test_acc_range": [min(seeds_acc), max(seeds_acc)],
                "epochs_to_target": seeds_e,
                "epochs_to_target_median": None if None in seeds_e else sorted(seeds_e)[1],
                "epochs_to_target_range": [min(x for x in seeds_e if x is not None), max(x for x in seeds_e if x is not None)],
            },
        }

    optimizers = {
        "sgd": opt(0.05, 0.95, 0.2, 10, 20.0, None, None, [0.94, 0.95, 0.96], [10, 9, 11]),
        "adamw": opt(0.005, 0.97, 0.1, 4, 9.0, 8, 18.0, [0.96, 0.97, 0.975], [4, 4, 5]),
        "soap": opt(0.005, 0.98, 0.08, 2, 12.0, 3, 18.0, [0.98, 0.98, 0.98], [2, 2, 3]),
        "spdkfac": opt(0.05, 0.985, 0.15, 2, 30.0, 3, 45.0, [0.98, 0.985, 0.99], [2, 3, None]),
    }
    run = tmp_path / "results" / "convergence" / "race"
    setting = {"data": "mnist5k", "batch_size": 256, "global_batch": 512, "steps_per_epoch": 7, "reference": "sgd"}
    setting.update(target_test_acc=0.95, second_reference="adamw", second_target_test_acc=0.97, optimizers=optimizers)
    _write(run, "convergence.json", {"args": {"epochs": 12}, "world_size": 2, "settings": [setting], "partial": True, "epochs_done": 9})
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: race")
    assert "Partial: the run was stopped after 9 of its 12 epochs" in section
    assert "Second target: `adamw`'s best test accuracy, 97.0%." in section
    assert "| `soap` | 0.005 | 98.0% | 0.080 | 2 (0.20x) | 12.0 (0.60x) | 3 | 18.0 |" in section
    assert "| `sgd` | 0.05 | 95.0% | 0.200 | 10 (1.00x) | 20.0 (1.00x) | not reached | not reached |" in section
    assert "| `spdkfac` | 0.005: 98.5%, 0.5: 10.0% | 0.985 (0.980–0.990) |" not in section  # the grid is sorted by LR
    assert "| `spdkfac` | 0.05: 98.5%, 0.5: 10.0% | 0.985 (0.980–0.990) |" in section
    assert "– (2–3), 1 of 3 not reached" in section
    assert "| `spdkfac` | yes (2 vs 2) | no (30 vs 9) | yes (98.5% vs 98.0%) | no (0.150 vs 0.100) |" in section
    # With the seed-by-seed comparison the benchmark records, the cell says what the difference is worth.
    optimizers["spdkfac"]["paired_best_test_acc"] = {
        "soap": {"mean": 0.005, "standard_error": 0.0029, "seeds": 3, "wins": 2, "ties": 1, "losses": 0}
    }
    _write(run, "convergence.json", {"args": {"epochs": 12}, "world_size": 2, "settings": [setting]})
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: race")
    assert "| yes (98.5% vs 98.0%; per seed +0.50 ± 0.29 points, 2–1–0) |" in section
    # A contender in two configurations: each target is held against its best value among them.
    optimizers["soap:weight_decay=2.0"] = opt(0.005, 0.99, 0.07, 3, 11.0, 3, 18.0, [0.99, 0.99, 0.99], [3, 3, 3])
    optimizers["adamw:weight_decay=0.5"] = opt(0.005, 0.96, 0.09, 5, 8.0, 8, 18.0, [0.96, 0.96, 0.96], [5, 5, 5])
    optimizers["spdkfac"]["paired_best_test_acc"]["soap:weight_decay=2.0"] = {
        "mean": -0.005,
        "standard_error": 0.001,
        "seeds": 3,
        "wins": 0,
        "ties": 0,
        "losses": 3,
    }
    _write(run, "convergence.json", {"args": {"epochs": 12}, "world_size": 2, "settings": [setting]})
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: race")
    assert "(best accuracy: `soap:weight_decay=2.0`)" in section
    row = "| `spdkfac` | yes (2 vs 2) | no (30 vs 8) | no (98.5% vs 99.0%; per seed -0.50 ± 0.10 points, 0–0–3) | no (0.150 vs 0.090) |"
    assert row in section


def test_eigenbasis_section_gives_each_variant_its_speed_up_over_the_exact_eigen_method(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    rows = [
        {"variant": "spdkfac", "mean_s": 7.0, "stdev_s": 0.1, "InverseComp": 1.0, "InverseComm": 0.5},
        {"variant": "spdkfac:compute_method=eigen", "mean_s": 21.0, "stdev_s": 0.2, "InverseComp": 12.0, "InverseComm": 1.0},
        {"variant": "spdkfac:compute_method=eigen,eigen_refresh=warm", "mean_s": 14.0, "stdev_s": 0.3, "InverseComp": 6.0},
    ]
    record = {"args": {"model": "resnet50", "resolution": 32, "batch_size": 4, "warmup": 2, "iters": 5}, "table": rows}
    (results / "iteration_time_eigenbasis.json").write_text(json.dumps(record))
    section = _section(results_md.build(results, tmp_path / "RESULTS.md"), "Eigen method: exact and warm-started eigenbasis refresh")
    assert "| `spdkfac` | 7000 ± 100 | 1000 | 500 | 3.00x |" in section
    assert "| `spdkfac:compute_method=eigen,eigen_refresh=warm` | 14000 ± 300 | 6000 | – | 1.50x |" in section


def test_main_job_seeds_section_gives_each_seed_and_the_target_against_sgd(tmp_path: Path):
    from benchmarks.main_job_seeds import summary, targets

    def curve(losses, accs):
        return [dict(epoch=i, train_loss=0.1, test_loss=lo, test_acc=a, lr=0.1) for i, (lo, a) in enumerate(zip(losses, accs))]

    curves = {
        "sgd": {"42": curve([0.3, 0.0565], [0.9, 0.983]), "1": curve([0.3, 0.1032], [0.9, 0.969])},
        "spdkfac": {"42": curve([0.1, 0.0233], [0.97, 0.989]), "1": curve([0.1, 0.1100], [0.97, 0.983])},
    }
    runs = {n: {s: {"curve": c, "summary": summary(c), "exit_status": 0} for s, c in per.items()} for n, per in curves.items()}
    runs["sgd"]["1"]["exit_status"] = 1  # trained every epoch, failed in its teardown
    assert runs["spdkfac"]["1"]["summary"] == {
        "final_test_loss": 0.11,
        "final_test_acc": 0.983,
        "best_test_acc": 0.983,
        "min_test_loss": 0.1,
    }
    found = targets(runs)
    assert found["spdkfac"]["per_seed"]["42"] == {
        "final_loss_at_most_sgd": True,
        "final_loss_over_sgd": pytest.approx(0.0233 / 0.0565),
        "best_acc_at_least_sgd": True,
    }
    assert found["spdkfac"]["per_seed"]["1"]["final_loss_at_most_sgd"] is False
    assert found["spdkfac"]["worst_final_loss_over_sgd"] == pytest.approx(0.11 / 0.1032)  # the seed closest to (here above) SGD
    assert not found["spdkfac"]["final_loss_at_most_sgd_every_seed"]
    d = {"command": "python -m benchmarks.main_job_seeds --seeds 42 1", "machine": MACHINE, "engine": "horovod", "world_size": 2}
    d.update(epochs=2, seeds=[42, 1], configs={"sgd": ["--optimizer", "sgd"], "spdkfac": []}, runs=runs, targets=found)
    _write(tmp_path / "results", "main_job_seeds.json", d)
    section = results_md.build(tmp_path / "results", tmp_path / "RESULTS.md").split("## The main job over seeds")[1]
    assert "| `sgd` | `--optimizer sgd` |" in section
    assert "| `spdkfac` | `(defaults)` |" in section
    assert "| seed | `sgd` | `spdkfac` |" in section
    assert "| 42 | 0.0565 (98.3%) | 0.0233 (98.9%) |" in section
    assert (
        "`spdkfac`: final test loss ≤ SGD's for every seed: **no** (seed 42: yes, seed 1: **no**; at most 1.07x SGD's on any seed)."
        in section
    )
    assert "| `spdkfac` | 1 | 0.100 | 0.110 |" in section  # the curve
    assert "Runs that trained every epoch but exited with a non-zero status: `sgd` seed 1 (1)." in section
    assert "python -m benchmarks.main_job_seeds --seeds 42 1" in section
    assert "main_job_seeds.json" not in results_md.build(tmp_path, tmp_path / "R.md")  # optional: no note when absent


def test_main_job_seeds_accepts_a_failed_teardown_only_after_every_epoch():
    from benchmarks.main_job_seeds import finished

    rows = [dict(epoch=i, train_loss=0.1, test_loss=0.1, test_acc=0.9, lr=0.1) for i in range(2)]
    assert finished("...\ndone: log /tmp/x/log.csv, checkpoint /tmp/x/checkpoint.pt\n", rows, 2)
    assert not finished("...\ndone: log /tmp/x/log.csv\n", rows[:1], 2)  # an epoch missing
    assert not finished("epoch 1 ...", rows, 2)  # never said it was done


def test_convergence_with_dho2_gives_kfac_over_dho2_to_the_target(tmp_path: Path):
    """The DHO2 paper's claim as ratios K-FAC / DHO2 (above 1: DHO2 faster), and a target one of them missed."""

    def opt(acc, e, s, epoch_s=None, refresh_s=None):
        return {
            "chosen_lr": 0.01,
            "best_test_acc": acc,
            "final_test_loss": 0.1,
            "epochs_to_target": e,
            "seconds_to_target": s,
            "mean_epoch_s": epoch_s,
            "mean_refresh_s": refresh_s,
            "lr_grid": {"0.01": {"lr": 0.01, "best_test_acc": acc}},
        }

    optimizers = {
        "sgd": opt(0.95, 10, 20.0),
        "spdkfac": opt(0.97, 6, 30.0),
        "spdkfac:factor_update_freq=10,inv_update_freq=10": opt(0.94, None, None),
        "dho2-wa:refresh_every=14": opt(0.96, 4, 12.0, 3.0, 1.25),
        "dho2": opt(0.93, None, None),
    }
    run = tmp_path / "results" / "convergence" / "dho2run"
    setting = {"data": "digits", "batch_size": 32, "reference": "sgd", "target_test_acc": 0.95, "optimizers": optimizers}
    _write(run, "convergence.json", {"args": {"epochs": 10}, "world_size": 2, "settings": [setting]})
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: dho2run")
    assert "The DHO2 paper's claim" in section
    assert "| `dho2-wa:refresh_every=14` | `spdkfac` | 1.50x (6 / 4) | 2.50x (30.0 / 12.0) | 3.0 (1.2) |" in section
    assert "| K-FAC did not reach it (DHO2: 4) | K-FAC did not reach it (DHO2: 12.0) |" in section
    assert "| `dho2` | `spdkfac:factor_update_freq=10,inv_update_freq=10` | neither reached it | neither reached it | – |" in section


def test_convergence_lists_the_runs_that_diverged_at_the_chosen_lr(tmp_path: Path):
    runs = [{"seed": 0, "diverged": None}, {"seed": 1, "diverged": "epoch 7: non-finite averaged gradient at step 138"}]
    dho2 = {
        "chosen_lr": 0.002,
        "best_test_acc": 0.96,
        "lr_grid": {"0.002": {"lr": 0.002, "runs": runs}, "0.004": {"lr": 0.004, "runs": []}},
    }
    sgd = {"chosen_lr": 0.05, "best_test_acc": 0.98, "lr_grid": {"0.05": {"lr": 0.05, "runs": [{"seed": 0, "diverged": None}]}}}
    setting = {"data": "digits", "batch_size": 32, "reference": "sgd", "optimizers": {"sgd": sgd, "dho2": dho2}}
    _write(tmp_path / "results" / "convergence" / "d", "convergence.json", {"args": {}, "settings": [setting]})
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: d")
    assert "- `dho2` stopped on non-finite values in 1 of 2 runs (seed 1: epoch 7: non-finite averaged gradient at step 138)." in section
    assert "`sgd` stopped" not in section


def test_update_fusion_model_section_puts_the_prediction_beside_the_measurement(tmp_path: Path):
    res = tmp_path / "results"
    gains = {"none_s": 0.0276, "forward_s": 0.0246, "backward_s": 0.0246, "forward": 1.12, "backward": 1.122}
    d = {
        "args": {"iters": 5},
        "machine": MACHINE,
        "cpu_device": {"bandwidth": 40e9, "flop_rate": 120e9, "launch_s": 1.4e-6, "cache_bytes": 2**20},
        "cpu": [
            {
                "model": "resnet50",
                "tensors": 161,
                "parameters": 25557032,
                "measured": {"fwd_bwd_s": 0.19, "update_s": 0.021},
                "predicted": {"fwd_bwd_s": 0.146, "update_s": 0.0162, "forward": 1.0, "backward": 0.904},
                "measured_fusion": {"forward": 0.998, "backward": 0.899},
            }
        ],
        "gpu_device": {"bandwidth": 720e9, "flop_rate": 7.85e12, "cache_bytes": 6 * 2**20, "launch_s": [5e-6]},
        "gpu": [
            {
                "model": "mobilenet_v2",
                "tensors": 158,
                "parameters": 3504872,
                "rows": [{"launch_s": 5e-6, "seed": gains, "spdkfac": {**gains, "backward": 0.88}, "seed_sync_after_step": gains}],
            }
        ],
        "seed_reported": {"forward": 1.12, "backward": 1.16},
    }
    _write(res, "update_fusion_model.json", d)
    title = "## Update fusion: the cost model on this CPU and on a V100-class GPU"
    section = results_md.build(res, tmp_path / "RESULTS.md").split(title)[1]
    assert "| resnet50 | 161 / 25.6 M | 190 / 146 | 21.0 / 16.2 | 1.00x / 1.00x | 0.90x / 0.90x |" in section
    assert "| mobilenet_v2 | 158 / 3.5 M | 5 | 27.6 | 1.12x / 1.12x | 1.12x / 0.88x | 1.12x / 1.12x |" in section
    assert "1.12x (forward) and 1.16x (backward)" in section
    assert "benchmarks.update_fusion_model" in section


def test_warm_step_section_gives_each_dimension_its_ratios_and_the_model_total(tmp_path: Path):
    res = tmp_path / "results"
    seconds = {"eigh": 9.0, "warm": 4.5, "subspace": 6.3, "warm_cholqr2": 7.0, "qr": 3.0, "cholqr2": 6.0}
    row = {"dim": 4608, "seconds": seconds, "warm_over_eigh": 0.5, "subspace_over_eigh": 0.7, "warm_cholqr2_over_subspace": 1.11}
    row["cholqr2_over_qr"] = 2.0
    row.update(cholqr2_on_plain_factor="cholesky failed", cholqr2_on_rank_deficient_factor="cholesky failed")
    totals = {"model": "resnet50", "factors": {"4608": 3}, "seconds": {k: 3 * v for k, v in seconds.items()}}
    _write(res, "warm_step.json", {"args": {"model": "resnet50", "repeats": 3}, "machine": MACHINE, "rows": [row], "model_totals": totals})
    section = _section(results_md.build(res, tmp_path / "RESULTS.md"), "Warm eigenbasis step per dimension")
    assert "| 4608 | 9000.0 | 4500.0 | 0.50x | 6300.0 | 0.70x | 7000.0 | 1.11x | 2.00x | cholesky failed | cholesky failed |" in section
    assert "resnet50, every dense factor once: `eigh` 27.00 s, warm 13.50 s (0.50x), subspace 18.90 s (0.70x)" in section
    assert "benchmarks.warm_step --model resnet50 --repeats 3" in section


def test_warm_accuracy_section_gives_each_iterations_errors_per_step(tmp_path: Path):
    res = tmp_path / "results"
    step = {"relative_error": 0.02, "worst_layer_error": 0.05, "worst_layer": "layers.8.conv1", "max_drift": 0.1, "max_residual": 0.01}
    row = {"iteration": 9, "loss": 0.3, "subspace": {**step, "relative_error": 0.118, "worst_layer_error": 0.42}, "ritz": step}
    row["block"] = {**step, "relative_error": 0.03}
    args = {"model": "cifar_resnet20", "resolution": 32, "batch_size": 8, "lr": 0.1, "damping": 0.003, "iters": 20}
    _write(res, "warm_accuracy.json", {"args": args, "machine": MACHINE, "rows": [row]})
    section = _section(results_md.build(res, tmp_path / "RESULTS.md"), "Warm eigenbasis refresh: its preconditioned gradient")
    assert (
        "| 9 | 3.00% (5.0%, layers.8.conv1) | 0.010 | 11.80% (42.0%, layers.8.conv1) | 0.010 | 2.00% (5.0%, layers.8.conv1) | 0.010 |"
        in section
    )
    assert "SGD learning rate 0.1" in section
    assert "one fixed batch of 8" in section
    # a run from before the block step (no column for it), with a new batch every iteration
    del row["block"]
    _write(res, "warm_accuracy_fresh.json", {"args": {**args, "fresh_batches": True}, "machine": MACHINE, "rows": [row]})
    section = _section(
        results_md.build(res, tmp_path / "RESULTS.md"), "Warm eigenbasis refresh: its preconditioned gradient against eigh's, fresh"
    )
    assert "a new random batch of 8 every iteration" in section
    assert "| 9 | 11.80% (42.0%, layers.8.conv1) | 0.010 | 2.00% (5.0%, layers.8.conv1) | 0.010 |" in section
    assert "block step" not in section  # no column for it


def test_kaisa_fraction_sections_one_per_run_with_rounds_and_every_step_runs(tmp_path: Path):
    res = tmp_path / "results"
    row = {
        "grad_workers": 2,
        "step_s": 7.0,
        "decomposition_stage_s": None,
        "amortised_s": 7.0,
        "kfac_mib_max": 881.0,
        "kfac_mib_min": 881.0,
    }
    base = {"workers": 2, "engine": "torch", "native_subgroups": True, "model": "resnet50", "resolution": 32, "batch_size": 4}
    every = {**base, "compute_method": "eigen", "inv_update_freq": 1, "machine": MACHINE, "modelled": [{"fraction": "2/2", "seconds": 9.0}]}
    every["measured"] = [{**row, "fraction": "2/2", "rounds_amortised_s": [7.5, 7.0]}]
    _write(res, "kaisa_fraction_w2_eigen_every.json", every)
    once = {**every, "compute_method": "inverse", "inv_update_freq": 50}
    once["measured"] = [{**row, "fraction": "2/2", "decomposition_stage_s": 50.0, "amortised_s": 8.0}]
    _write(res, "kaisa_fraction_w2_inverse_amortised.json", once)
    text = results_md.build(res, tmp_path / "RESULTS.md")
    every_section = _section(text, "KAISA's grad_worker_fraction: step time and K-FAC memory per worker (w2_eigen_every)")
    assert "2 rounds alternating the fractions, each row the median round" in every_section
    assert "a whole iteration, factors and decompositions updated every step" in every_section
    assert "| 2/2 | 7000 | – | 7000 | 881 | 881 | 9000 |" in every_section
    once_section = _section(text, "KAISA's grad_worker_fraction: step time and K-FAC memory per worker (w2_inverse_amortised)")
    assert "one run, one fraction after another" in once_section
    assert "*amortised*: step + stage / 50" in once_section
    assert "| 2/2 | 7000 | 50000 | 8000 | 881 | 881 | 9000 |" in once_section


def test_a_simulator_check_of_another_workload_gets_its_own_section(tmp_path: Path):
    res = tmp_path / "results"
    res.mkdir()
    row = {"workers": 2, "variant": "sgd", "update_freq": [10, 100], "measured_s": 13.0, "predicted_s": 12.0, "rel_error": -1 / 13}
    data = {"rows": [row], "largest_abs_error": 1 / 13, "contention": True, "machine": {"cores": 2}}
    (res / "simulator_check.json").write_text(json.dumps(dict(data, rows=[dict(row, update_freq=[1, 1], rel_error=0.02)])))
    (res / "simulator_check_224.json").write_text(
        json.dumps(dict(data, script="CHECK_NAME=simulator_check_224 bash benchmarks/simulator_check.sh"))
    )
    text = results_md.build(res, tmp_path / "RESULTS.md")
    assert "| 2 | SGD | 1/1 |" in _section(text, "Scale simulator against measurements")
    other = _section(text, "Scale simulator against measurements (224)")
    assert "| 2 | SGD | 10/100 |" in other
    assert "CHECK_NAME=simulator_check_224 bash benchmarks/simulator_check.sh" in other


def test_a_runs_notes_beside_its_results_show_under_its_title(tmp_path: Path):
    run = tmp_path / "results" / "convergence" / "d"
    setting = {"data": "digits", "batch_size": 32, "reference": "sgd", "optimizers": {"sgd": {"chosen_lr": 0.05, "best_test_acc": 0.98}}}
    _write(run, "convergence.json", {"args": {}, "settings": [setting]})
    (run / "notes.md").write_text("LR grids: one point\nwhere the race chose the LR.\n")
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: d")
    assert section.startswith("## Time to accuracy: d\n\n_LR grids: one point where the race chose the LR._\n\ndigits, 32 per worker")
    (run / "notes.md").unlink()
    section = _section(results_md.build(tmp_path / "results", tmp_path / "RESULTS.md"), "Time to accuracy: d")
    assert section.startswith("## Time to accuracy: d\n\ndigits, 32 per worker")


def test_every_report_module_registers_its_sections_each_in_its_own_place():
    found = report.sections()
    modules = {m.name for m in pkgutil.iter_modules(report.__path__)} - {"common"}
    registering = {getattr(s, "render", type(s)).__module__.rpartition(".")[2] for s in found}
    assert registering == modules  # each benchmark's module registers, found without a list to edit
    assert len({s.order for s in found}) == len(found)  # the order is chosen, not left to the patterns


def test_compile_cost_section_gives_each_arm_and_the_compiled_over_eager_ratios(tmp_path: Path):
    res = tmp_path / "results"

    def arm(median: float, breaks: int, graphs: int, **extra) -> dict:
        stats = {"median": median, "mean": median * 1.5, "min": median, "max": median, "stdev": 0.0, "n": 4}
        return {
            "warmup_seconds": [10.0, 0.5, 0.5],
            "graph_breaks": breaks,
            "graphs": graphs,
            "times": [median] * 4,
            "stats": stats,
            **extra,
        }

    model = {
        "sgd-eager": arm(0.010, 0, 0),
        "sgd-compiled": arm(0.005, 0, 1),
        "kfac-eager": arm(0.020, 0, 0),
        "kfac-compiled": arm(0.016, 0, 1),
        "kfac-compiled-plain-hooks": arm(0.030, 38, 31, graphs_compiled_while_measuring=5),
        "sgd_compiled_over_eager_median": 0.5,
        "sgd_compiled_over_eager_mean": 0.5,
        "kfac_compiled_over_eager_median": 0.8,
        "kfac_compiled_over_eager_mean": 0.8,
        "graphs_compiled_while_measuring": 0,
    }
    _write(
        res, "compile_cost.json", {"args": {"batch_size": 32, "iters": 4, "freq": 10}, "machine": MACHINE, "models": {"mnist_cnn": model}}
    )
    section = results_md.build(res, tmp_path / "RESULTS.md").split("## torch.compile: step time compiled vs eager")[1]
    assert "K-FAC 0.80x median" in section
    assert "| K-FAC, compiled | 16 ms | 24 ms | 11.0 s | 0 | 1 |" in section
    assert "| K-FAC, compiled, hooks as before (alone) | 30 ms | 45 ms | 11.0 s | 38 | 31 (+5 while timed) |" in section
    assert "benchmarks.compile_cost" in section


def test_kfac_pairs_compare_attention_skipped_and_adamw_seed_by_seed():
    from benchmarks.report.convergence import kfac_pairs

    def run(acc: list[float], loss: list[float]) -> dict:
        n = len(acc)
        return {"per_seed": {"seeds": [0, 1, 2][:n], "best_test_acc": acc, "final_test_loss": loss, "epochs_to_second": [None] * n}}

    st = {
        "optimizers": {
            "sgd": run([0.90, 0.91, 0.92], [0.3, 0.3, 0.3]),
            "adamw": run([0.95, 0.96, 0.94], [0.20, 0.22, 0.21]),
            "spdkfac:skip_layers=MultiheadAttention": run([0.94, 0.95, 0.95], [0.25, 0.24, 0.23]),
            "spdkfac": run([0.96, 0.97, 0.96], [0.20, 0.20, 0.20]),
        }
    }
    text = "\n".join(kfac_pairs(st))
    # spdkfac minus skip: +2, +2, +1 points (mean 1.67, standard error 0.33); minus adamw: +1, +1, +2
    assert "| `spdkfac` − `spdkfac:skip_layers=MultiheadAttention` | +1.67 ± 0.33 (3 seeds) | -0.0400 ± 0.0058 (3 seeds) | – |" in text
    assert "| `spdkfac` − `adamw` | +1.33 ± 0.33 (3 seeds) |" in text
    assert "| `spdkfac:skip_layers=MultiheadAttention` − `adamw` |" in text
    assert "`sgd`" not in text
    del st["optimizers"]["spdkfac:skip_layers=MultiheadAttention"]  # no configuration skips a layer: no table
    assert kfac_pairs(st) == []


def test_common_table_helpers_keep_the_labels_order_and_show_unrecorded_arguments():
    rows = common.labelled_rows({"b": "B", "a": "A", "c": "C"}, {"a": 1, "b": 2, "c": None}, lambda key, v: [f"{key}={v}"])
    assert rows == [["B", "b=2"], ["A", "a=1"]]  # labels' order; a None value is no row
    a = common.recorded_args({"args": {"model": "resnet50", "batch_size": None}, "rows": []}, Path("x.json"), "rows")
    assert (a["model"], a["batch_size"], a["iters"]) == ("resnet50", None, "?")
    assert common.model_at(a) == "resnet50 at ?×?"
    with pytest.raises(common.ResultsError, match=r"x\.json: missing 'rows', 'args'"):
        common.recorded_args({}, Path("x.json"), "rows")
