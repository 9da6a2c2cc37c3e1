"""Spec tests for the bounds of a worker's registration (scheduler_svc.fleet.check_registration): each field out of
bounds is INVALID_ARGUMENT naming the field and its bound; and for what it must serve (check_serves): the
scheduler's model with no shorter a context, else FAILED_PRECONDITION."""

import pytest

from pagedserve_common.config import MAX_WORKER_BLOCKS
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import MAX_NAME_CHARS, WorkerRegistration, default_name, name_error
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.fleet import check_registration, check_serves


def reg(num_blocks: int = 64, block_size: int = 16, max_model_len: int = 512, num_cpu_blocks: int = 0,
        name: str = "host:12", model_id: str = "m"):
    return WorkerRegistration(model_id, max_model_len, "cpu", KVGeometry(2, 2, 16, "float32", block_size), num_blocks,
                              num_cpu_blocks, name)


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
    (dict(name="x" * 8192), "name", "registration: name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx' (+8,152 "
                                    "characters) is out of bounds: it has 8,192 characters, more than 80"),
    (dict(name="h" * 79 + ":1"), "name", "it has 81 characters, more than 80"),
    (dict(name='w"} 1\nx{a="'), "name", "it has '\"', not one of A-Za-z0-9._:@/#-"),
    (dict(name="wörker:1"), "name", "it has 'ö'"),
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
    for name in ("", "h" * 78 + ":1", "pod-7f9c.ns_1:4194304", "user@host:1#2", "a/b:3"):
        check_registration(reg(name=name), MAX_WORKER_BLOCKS)


def test_a_worker_with_a_shorter_context_than_the_schedulers_is_refused_naming_both():
    with pytest.raises(EngineError) as e:
        check_serves(reg(max_model_len=4), "m", 512)
    assert (e.value.code, e.value.field) == (ErrorCode.FAILED_PRECONDITION, "max_model_len")
    assert "max_model_len 4 is below the scheduler's 512" in str(e.value)
    check_serves(reg(max_model_len=512), "m", 512)
    check_serves(reg(max_model_len=2**32 - 1), "m", 512)  # above the scheduler's: the scheduler's applies


def test_another_model_is_refused_and_quoted_short():
    with pytest.raises(EngineError) as e:
        check_serves(reg(model_id="other" * 1000), "m", 512)
    assert e.value.code == ErrorCode.FAILED_PRECONDITION and len(str(e.value)) < 300
    assert "differs from the scheduler's 'm'" in str(e.value)


@pytest.mark.parametrize("host, pid, name", [
    ("a1b2c3", 7, "a1b2c3:7"),
    ("n" * 63, 4_194_304, "n" * 63 + ":4194304"),  # a Kubernetes pod's longest host name, Linux's largest PID: whole
    ("h" * 100, 12, "h" * (MAX_NAME_CHARS - 3) + ":12"),  # longer than any Linux host name: its end goes
    ("my host\u00e9", 5, "my-host-:5"),
])
def test_a_workers_default_name_is_host_pid_within_the_bounds(host, pid, name):
    assert default_name(host, pid) == name and name_error(name) is None
