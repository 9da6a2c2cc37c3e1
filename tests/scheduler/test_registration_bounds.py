"""Spec tests for the bounds of a worker's registration (scheduler_svc.fleet.check_registration): each field out of
bounds is INVALID_ARGUMENT naming the field and its bound."""

import pytest

from pagedserve_common.config import MAX_WORKER_BLOCKS
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.fleet import check_registration


def reg(num_blocks: int = 64, block_size: int = 16, max_model_len: int = 512, num_cpu_blocks: int = 0):
    return WorkerRegistration("m", max_model_len, "cpu", KVGeometry(2, 2, 16, "float32", block_size), num_blocks,
                              num_cpu_blocks)


@pytest.mark.parametrize("fields, field, message", [
    (dict(num_blocks=0), "num_blocks", "registration: num_blocks 0 is out of bounds: it must be in 1 .. 4,194,304 "
                                       "(--max-worker-blocks)"),
    (dict(num_blocks=2**32 - 1), "num_blocks", "num_blocks 4,294,967,295 is out of bounds"),
    (dict(num_blocks=10_000_000), "num_blocks", "num_blocks 10,000,000 is out of bounds"),
    (dict(num_cpu_blocks=10_000_000), "num_cpu_blocks", "num_cpu_blocks 10,000,000 is out of bounds: it must be in "
                                                        "0 .. 4,194,304"),
    (dict(max_model_len=0), "max_model_len", "max_model_len 0 is out of bounds: it must be >= 1"),
    (dict(block_size=4), "kv_geometry.block_size", "kv_geometry.block_size 4 is not a power of two from 8 to 256"),
    (dict(block_size=24), "kv_geometry.block_size", "kv_geometry.block_size 24 is not"),
    (dict(block_size=2**31), "kv_geometry.block_size", "kv_geometry.block_size 2,147,483,648 is not"),
])
def test_a_field_out_of_bounds_is_refused_by_name(fields, field, message):
    with pytest.raises(EngineError) as e:
        check_registration(reg(**fields), MAX_WORKER_BLOCKS)
    assert (e.value.code, e.value.field) == (ErrorCode.INVALID_ARGUMENT, field) and message in str(e.value)


def test_bounds_that_hold_pass():
    for r in (reg(), reg(num_blocks=MAX_WORKER_BLOCKS, num_cpu_blocks=MAX_WORKER_BLOCKS), reg(block_size=8),
              reg(block_size=256), reg(max_model_len=2**32 - 1)):  # above the scheduler's: the scheduler's applies
        check_registration(r, MAX_WORKER_BLOCKS)
    check_registration(reg(num_blocks=10_000_000), 10_000_000)  # the flag moves the bound
