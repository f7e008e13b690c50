"""benchmarks/_harness.py: a case in a child process, the process's own memory, the
options passed on to a child, results and Markdown sections written in place."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load_harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_harness", ROOT / "benchmarks" / "_harness.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


harness = _load_harness()

CHILD = """
import json, os, sys
print("noise before the result")
if sys.argv[1] == "fail":
    sys.stderr.write("Traceback ...\\nValueError: bad case\\n")
    raise SystemExit(3)
print(json.dumps({"case": sys.argv[1], "omp": os.environ.get("OMP_NUM_THREADS"),
                  "mkl": os.environ.get("MKL_NUM_THREADS"),
                  "offline": os.environ.get("HF_HUB_OFFLINE"), "extra": os.environ.get("X")}))
"""


def test_run_child_reads_the_last_json_line_with_the_thread_count(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    row = harness.run_child([script, "a"], 3, extra_env={"X": "y"})
    assert row == {"case": "a", "omp": "3", "mkl": "3", "offline": "1", "extra": "y"}


def test_a_failed_child_names_its_last_error_line(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    with pytest.raises(harness.ChildFailedError, match="ValueError: bad case") as info:
        harness.run_child([script, "fail"])
    assert info.value.last_line == "ValueError: bad case"
    assert info.value.stderr.startswith("Traceback")


def test_run_cases_runs_each_case_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    rows = harness.run_cases(["x", "y"], lambda case: {"case": case, "n": len(case)})
    assert rows == [{"case": "x", "n": 1}, {"case": "y", "n": 1}]
    assert capsys.readouterr().err.splitlines() == [
        '{"case": "x", "n": 1}',
        '{"case": "y", "n": 1}',
    ]


def test_the_peak_is_at_least_the_resident_size() -> None:
    rss, peak = harness.vm_kib("VmRSS"), harness.vm_kib("VmHWM")
    assert 0 < rss <= peak
    assert harness.vm_mib("VmHWM") == pytest.approx(harness.vm_kib("VmHWM") / 1024, rel=0.5)
    assert harness.vm_kib("NoSuchField") == 0
    assert harness.vm_mib("NoSuchField") != harness.vm_mib("NoSuchField")  # NaN


def test_options_parse_and_pass_on_to_a_child() -> None:
    parser = argparse.ArgumentParser()
    harness.add_data_options(parser, max_train=16, max_val=None, shapes=("seq_len", "epochs"))
    harness.add_run_options(parser, threads=2)
    args = parser.parse_args(["--seq-len", "32", "--seed", "5", "--child", "case"])
    assert (args.max_train, args.max_val, args.epochs, args.threads) == (16, None, None, 2)
    keys = ("max_train", "max_val", "seq_len", "epochs", "threads", "seed")
    assert harness.forward(args, keys) == [
        "--max-train", "16", "--seq-len", "32", "--threads", "2", "--seed", "5",
    ]  # fmt: skip
    assert args.child == "case" and "--child" not in parser.format_help()


def test_write_section_replaces_between_markers_and_appends_new_ones(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    markers = ("<!-- t:start -->", "<!-- t:end -->")
    harness.write_section(doc, markers, "first", title="Doc", heading="### t")
    assert doc.read_text() == "# Doc\n\n### t\n\n<!-- t:start -->\nfirst\n<!-- t:end -->\n"
    doc.write_text(doc.read_text() + "\nafter\n")
    harness.write_section(doc, markers, "| a |\n| b |", title="Doc", heading="### t")
    text = doc.read_text()
    assert text == "# Doc\n\n### t\n\n<!-- t:start -->\n| a |\n| b |\n<!-- t:end -->\n\nafter\n"
    other = ("<!-- u:start -->", "<!-- u:end -->")
    harness.write_section(doc, other, "second", title="Doc")
    assert doc.read_text() == text.rstrip() + "\n\n<!-- u:start -->\nsecond\n<!-- u:end -->\n"


def test_write_results_writes_json_under_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")
    path = harness.write_results("case-x", {"rows": [1, 2]}, indent=1)
    assert path == tmp_path / "results" / "case-x.json"
    assert path.read_text() == '{\n "rows": [\n  1,\n  2\n ]\n}\n'
