"""``tools/gpu_tests.sh``: shards, and the one serial re-run of what failed in them (run here on fake gpu tests)."""

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "gpu_tests.sh"
FAKE_TESTS = '''
import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


@pytest.mark.gpu
def test_fails_on_its_first_run():
    """Like a test that ran out of memory beside the other shards."""
    first = HERE / "ran_once"
    if not first.exists():
        first.touch()
        raise AssertionError("out of memory beside the other shards")


@pytest.mark.gpu
def test_passes():
    pass


@pytest.mark.gpu
def test_always_fails():
    raise AssertionError("a real failure")


@pytest.mark.gpu
def test_crashes():
    os._exit(3)
'''


def run_script(tmp_path, selection: str) -> subprocess.CompletedProcess:
    """Runs the script with JOBS=2 on ``selection`` of the fake tests (tests of the file whose names contain it)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: fake gpu tests\n")
    (tmp_path / "test_fake.py").write_text(FAKE_TESTS)
    env = {
        **os.environ,
        "JOBS": "2",
        "OUT": str(tmp_path / "logs"),
        "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "test_fake.py", "-k", selection],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_test_that_passes_alone_passes_the_run_and_is_named(tmp_path):
    result = run_script(tmp_path, "first_run or passes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 tests in 2 shards" in result.stdout
    assert "passed when re-run alone (failed beside other shards): test_fake.py::test_fails_on_its_first_run" in (
        result.stdout
    )
    assert "1 passed" in (tmp_path / "logs" / "rerun.log").read_text()


@pytest.mark.parametrize(
    ("selection", "reruns"),
    [("always_fails or passes", True), ("crashes or passes", False)],
    ids=["fails-again", "crash"],
)
def test_a_real_failure_fails_the_run(tmp_path, selection, reruns):
    result = run_script(tmp_path, selection)
    assert result.returncode == 1, result.stdout + result.stderr
    assert ("re-running the 1 test(s)" in result.stdout) == reruns
    assert "passed when re-run alone" not in result.stdout
