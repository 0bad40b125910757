"""``tools/gpu_tests.sh``: shards, and the one serial re-run of what ran out of memory in them (run here on fake gpu
tests): any other failure fails the run even where the test would pass alone."""

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
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes."


def first_run(name):
    marker = HERE / f"ran_{name}"
    if marker.exists():
        return False
    marker.touch()
    return True


@pytest.mark.gpu
def test_out_of_memory_on_its_first_run():
    """Like a test that ran out of memory beside the other shards."""
    if first_run("oom"):
        raise RuntimeError(OUT_OF_MEMORY)


@pytest.mark.gpu
def test_out_of_memory_every_run():
    raise RuntimeError(OUT_OF_MEMORY)


@pytest.mark.gpu
def test_wrong_value_on_its_first_run():
    """Like an intermittent wrong answer (a race): passes when re-run alone."""
    if first_run("value"):
        raise AssertionError("relative error 0.3 > 0.01")


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


NOT_RERUN = "failed, not out of memory (not re-run): test_fake.py::"
RERUN = "re-running the 1 test(s) that ran out of memory in the shards, alone on the card: test_fake.py::"
PASSED_ALONE = "passed when re-run alone (out of memory beside other shards): test_fake.py::"


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


def test_out_of_memory_that_passes_alone_passes_the_run_and_is_named(tmp_path):
    result = run_script(tmp_path, "out_of_memory_on_its_first_run or passes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 tests in 2 shards" in result.stdout
    assert RERUN + "test_out_of_memory_on_its_first_run" in result.stdout
    assert PASSED_ALONE + "test_out_of_memory_on_its_first_run" in result.stdout
    assert "1 passed" in (tmp_path / "logs" / "rerun.log").read_text()


@pytest.mark.parametrize(
    ("selection", "said", "not_said"),
    [
        ("always_fails or passes", [NOT_RERUN + "test_always_fails"], [RERUN, PASSED_ALONE]),
        ("wrong_value_on_its_first_run or passes", [NOT_RERUN + "test_wrong_value_on_its_first_run"], [RERUN]),
        ("out_of_memory_every_run or passes", [RERUN + "test_out_of_memory_every_run"], [NOT_RERUN, PASSED_ALONE]),
        (
            "wrong_value_on_its_first_run or out_of_memory_on_its_first_run",
            [NOT_RERUN + "test_wrong_value_on_its_first_run", PASSED_ALONE + "test_out_of_memory_on_its_first_run"],
            [],
        ),
        ("crashes or passes", [], [RERUN, NOT_RERUN, PASSED_ALONE]),
    ],
    ids=["fails-again", "fails-once", "out-of-memory-again", "fails-once-beside-out-of-memory", "crash"],
)
def test_a_failure_other_than_out_of_memory_or_a_second_one_fails_the_run(tmp_path, selection, said, not_said):
    result = run_script(tmp_path, selection)
    assert result.returncode == 1, result.stdout + result.stderr
    for line in said:
        assert line in result.stdout, result.stdout
    for line in not_said:
        assert line not in result.stdout, result.stdout
