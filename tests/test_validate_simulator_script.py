"""scripts/validate_simulator.py's command line (bad input refused before any engine starts; the cores it runs on
named in its report) and scripts/device_validation.sh, the same validation prepared for a quiet lent machine."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("validate_simulator", ROOT / "scripts" / "validate_simulator.py")
assert _spec is not None and _spec.loader is not None
validate_simulator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate_simulator)


def test_cores_that_the_machine_lacks_are_refused_naming_the_option(tmp_path, capsys):
    before = os.sched_getaffinity(0)
    with pytest.raises(SystemExit) as stopped:
        validate_simulator.main(["--out", str(tmp_path / "report.json"), "--cpus", "4096"])
    assert stopped.value.code == 2
    assert "--cpus must list cores of this machine" in capsys.readouterr().err
    assert os.sched_getaffinity(0) == before  # nothing changed, no engine started
    assert not (tmp_path / "report.json").exists()
    for wrong in ("two,three", f"{min(before)},4096", ""):
        with pytest.raises(SystemExit):
            validate_simulator.main(["--out", str(tmp_path / "report.json"), "--cpus", wrong or ","])
        assert "--cpus must list cores" in capsys.readouterr().err
    assert os.sched_getaffinity(0) == before


def test_too_few_repeats_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        validate_simulator.main(["--out", str(tmp_path / "report.json"), "--repeats", "1"])
    assert stopped.value.code == 2 and "--repeats must be at least 2" in capsys.readouterr().err


def test_the_report_names_the_cores_the_script_ran_on():
    before = os.sched_getaffinity(0)
    total = os.cpu_count()
    assert validate_simulator.cpu_label().endswith(
        f"{len(before)} cores" if len(before) == total else f"{len(before)} of its {total} cores")
    if total and total > 1:
        try:
            os.sched_setaffinity(0, {min(before)})
            assert validate_simulator.cpu_label().endswith(f"1 of its {total} cores")
        finally:
            os.sched_setaffinity(0, before)


def test_the_device_script_parses_and_runs_the_validation_pinned():
    script = ROOT / "scripts" / "device_validation.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert "scripts/validate_simulator.py --cpus" in text and 'CUDA_VISIBLE_DEVICES=""' in text
