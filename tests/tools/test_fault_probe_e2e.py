"""tools/fault_probe_e2e.py: real train.py processes killed during an s3:// upload and started twice on one run
directory (the script's docstring says what each probe checks)."""
import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import fault_probe_e2e  # noqa: E402


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


@pytest.mark.extended  # in make test: test_storage_s3 (a killed upload quarantined, SIGTERM and resume via a bucket)
@pytest.mark.skipif(any(_missing(m) for m in ("moto", "s3fs")), reason="needs moto[server] and s3fs")
def test_a_kill_during_an_s3_upload_resumes_from_the_previous_step(tmp_path):
    print(fault_probe_e2e.probe_kill_during_upload(str(tmp_path)))


@pytest.mark.extended  # test_run_lock covers the refusal (train.py's one line, exit code 2) in make test
def test_a_second_trainer_on_a_live_run_directory_is_refused_and_the_first_finishes(tmp_path):
    print(fault_probe_e2e.probe_two_trainers(str(tmp_path)))
