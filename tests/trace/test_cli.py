"""``netdist trace merge | summary | why`` end to end through the ``netdist`` entry point,
and ``plot_timeline`` writing a real PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from netdist.cli import main as cli_main
from netdist.errors import ConfigError
from netdist.trace.analysis import load_trace_dir, merge
from netdist.trace.plot import plot_timeline
from netdist.trace.schema import validate_netdist_trace
from tests.trace import synth

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETDIST_DEBUG", raising=False)


def _png(path: Path) -> bytes:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000
    return data


def test_trace_is_a_listed_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert "trace" in cli_main.COMMANDS
    assert cli_main.main(["trace", "--help"]) == 0
    out = capsys.readouterr().out
    actions = [line.split()[0] for line in out.splitlines() if line.startswith("    ")]
    assert actions == ["merge", "summary", "why"]


def test_merge_writes_a_valid_trace_next_to_the_rank_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path, ranks=[0, 1, 3])
    assert cli_main.main(["trace", "merge", str(tmp_path)]) == 0
    out = tmp_path / "merged.trace.json"
    n = sum(len(synth.rank_trace(r)["traceEvents"]) for r in (0, 1, 3))
    assert capsys.readouterr().out == f"wrote {out}: {n} events of 3 ranks; missing ranks 2\n"
    merged = json.loads(out.read_text())
    assert validate_netdist_trace(merged) == []
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 3}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    # the merged file in DIR is not taken for a rank file next time
    assert cli_main.main(["trace", "merge", str(tmp_path)]) == 0


def test_merge_to_an_output_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path / "job")
    out = tmp_path / "all.json"
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == merge(load_trace_dir(tmp_path / "job"))
    assert capsys.readouterr().out.startswith(f"wrote {out}: ")
    assert cli_main.main(["trace", "merge", str(tmp_path / "job"), "-o",
                          str(tmp_path / "no" / "x.json")]) == 2
    assert capsys.readouterr().err == (f"netdist trace: error: output directory "
                                       f"{tmp_path / 'no'} does not exist\n")


def test_summary_text_names_the_straggler(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path)
    assert cli_main.main(["trace", "summary", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "trace of 4 of 4 ranks, 240 events; clocks aligned to within 30.0 us"
    assert lines[1] == ("straggler: rank 2 arrived last in 50 of 50 collectives, late by "
                        "49.9 ms (median)")


def test_summary_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path / "job")
    png = tmp_path / "timeline.png"
    assert cli_main.main(["trace", "summary", str(tmp_path / "job"), "--json",
                          "--plot", str(png)]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [(s["rank"], s["last_in"], s["of"]) for s in data["stragglers"]] == [(2, 50, 50)]
    assert data["stragglers"][0]["median_late_by_us"] == pytest.approx(50_000.0, rel=0.10)
    assert len(data["arrivals"]) == 50
    assert captured.err == f"wrote {png}\n"
    _png(png)


def test_why_names_the_stopped_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_dumps(tmp_path, synth.sigstop_dumps(stopped=(2,), seq=42))
    assert cli_main.main(["trace", "why", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Rank 2 stopped: it left no flight-recorder dump")
    assert f"all_reduce seq 42 of group {synth.GROUP}" in out
    assert out.count("\n") == 1


@pytest.mark.parametrize("action", ["merge", "summary"])
def test_a_truncated_rank_file_is_one_line_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], action: str) -> None:
    synth.write_trace_dir(tmp_path)
    path = synth.trace_path(tmp_path, 3)
    path.write_text(path.read_text()[:-40])
    assert cli_main.main(["trace", action, str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"netdist trace: error: trace file {path} is not valid JSON "
                          f"(truncated?): ")
    assert err.count("\n") == 1


def test_why_without_dumps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main.main(["trace", "why", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"netdist trace: error: no flight-recorder dumps (flight_rank_*.json) in {tmp_path}: "
        f"ranks write them on a lost peer or a timeout in a collective, or on SIGUSR1\n")


def test_plot_without_matplotlib_says_how_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_trace_dir(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"^plotting a trace needs matplotlib: "
                                          r"pip install 'netdist\[plot\]'$"):
        plot_timeline(load_trace_dir(tmp_path), tmp_path / "x.png")
    assert cli_main.main(["trace", "summary", str(tmp_path), "--plot",
                          str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == ("netdist trace: error: --plot needs matplotlib: "
                                       "pip install 'netdist[plot]'\n")
    assert not (tmp_path / "x.png").exists()


def test_plot_from_a_merged_trace_and_without_collectives(tmp_path: Path) -> None:
    synth.write_trace_dir(tmp_path / "job", ranks=[0, 1, 3], collectives=12)
    merged = merge(load_trace_dir(tmp_path / "job"))
    assert plot_timeline(merged, tmp_path / "merged.png") == tmp_path / "merged.png"
    _png(tmp_path / "merged.png")
    synth.write_trace_dir(tmp_path / "idle", collectives=0)
    _png(plot_timeline(load_trace_dir(tmp_path / "idle"), tmp_path / "idle.png"))


def test_module_entry_point(tmp_path: Path) -> None:
    synth.write_dumps(tmp_path, synth.sigstop_dumps())
    done = subprocess.run([sys.executable, "-m", "netdist.cli.main", "trace", "why",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Rank 2 stopped:")
