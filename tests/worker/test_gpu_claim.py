"""--device cuda:auto: workers sharing a lock folder each claim a different GPU, and a dead worker's claim frees."""

import os
import subprocess
import sys
import time

import pytest

from worker_svc import gpu_claim
from worker_svc.gpu_claim import claim_gpu


@pytest.fixture(autouse=True)
def release_claims():
    yield
    while gpu_claim._held:
        os.close(gpu_claim._held.pop())


def test_claims_take_the_lowest_free_gpu_until_none_is_left(tmp_path):
    assert [claim_gpu(3, tmp_path) for _ in range(3)] == [0, 1, 2]
    assert (tmp_path / "gpu1.lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(RuntimeError, match="all 3 GPUs are claimed"):
        claim_gpu(3, tmp_path)


def test_no_visible_gpu_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="no CUDA device is visible"):
        claim_gpu(0, tmp_path)


def test_another_process_holds_its_claim_until_it_dies(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from worker_svc.gpu_claim import claim_gpu; "
                               f"print(claim_gpu(2, {str(tmp_path)!r}), flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "0"
        assert claim_gpu(2, tmp_path) == 1
        os.close(gpu_claim._held.pop())
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 120  # NOTE: a hang guard only, never a measure of speed
    while True:  # the kernel drops a dead process's lock
        try:
            assert claim_gpu(2, tmp_path) == 0
            break
        except RuntimeError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
