"""The client API's codec (pagedserve.v1 generate.proto): requests in, stream items, model info and KV state out.
The worker protocol has its own (pagedserve_common.wire)."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from pagedserve.v1 import generate_pb2

from pagedserve_common.defaults import TENANT_HEADER
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.sampling import SamplingParams
from pagedserve_common.wire import logprobs_to_pb, sampling_from_pb, with_defaults
from scheduler_svc.core.kv_snapshot import KVPoolSnapshot
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.auth import ApiKeys
from scheduler_svc.frontend.api import invalid, tenant_of as api_tenant_of
from scheduler_svc.frontend.inputs import GenerateInput
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.frontend.stream import StreamItem
from scheduler_svc.identity import NO_KEYS, Identity


@dataclass(slots=True)
class Undecodable:
    """A request message that did not parse: why, naming the string field when one holds bad UTF-8."""

    message: str
    field: str | None = None
    request_id: str = ""  # the message's request_id when that field itself is readable (for the log)


def lenient(message_type):
    """A request deserializer that never raises: the parsed message, or an Undecodable the servicer refuses with
    INVALID_ARGUMENT. NOTE: the generated one raises DecodeError inside grpc, which answers UNKNOWN and logs a
    traceback; proto3 refuses a string field that is not UTF-8."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            field = bad_utf8_field(data, message_type.DESCRIPTOR)
            rid = request_id_of(data, message_type.DESCRIPTOR)
            if field is not None:
                return Undecodable(f"{field} is not valid UTF-8 (a protobuf string must be)", field, rid)
            return Undecodable(f"the request is not a valid {message_type.DESCRIPTOR.full_name} message: {e}",
                               request_id=rid)
    return parse


def bad_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path (`messages[1].content`, `sampling.stop[0]`) of the first string field in the wire bytes `data` of
    a `descriptor` message that is not UTF-8, or None. A walk of the wire format: only length-delimited fields are
    looked into; a message too broken to walk gives None."""
    counts = {}
    try:
        for number, chunk in _length_delimited(data):
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + field.name
            if field.is_repeated:
                counts[number] = counts.get(number, -1) + 1
                name += f"[{counts[number]}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                if (found := bad_utf8_field(chunk, field.message_type, name + ".")) is not None:
                    return found
    except IndexError:
        return None
    return None


def request_id_of(data: bytes, descriptor: Descriptor) -> str:
    """The top-level `request_id` string in the wire bytes `data` of a `descriptor` message, when it has one that
    is valid UTF-8 (the last one, as protobuf reads it); '' otherwise. For the log of a message that did not
    parse."""
    field = descriptor.fields_by_name.get("request_id")
    found = ""
    try:
        for number, chunk in _length_delimited(data):
            if field is not None and number == field.number:
                found = chunk.decode("utf-8")
    except (IndexError, UnicodeDecodeError):
        return found
    return found


def _length_delimited(data: bytes):
    """(field number, bytes) of each length-delimited field of the wire bytes `data`, in order; the walk stops at
    a group (not in these protos) and raises IndexError where a varint runs past the end."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _varint(data, pos)
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            yield number, data[pos:pos + length]
            pos += length
        else:
            return


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def unknown_field(msg, prefix: str = "") -> tuple[str, int] | None:
    """(path of the message, number) of the first field in `msg` or a message within it that these protos do not
    know, or None. NOTE: protobuf keeps such fields silently: a newer client's field would be ignored."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        return prefix.rstrip("."), unknown[0].field_number
    for field, value in msg.ListFields():
        if field.type == FieldDescriptor.TYPE_MESSAGE and not field.message_type.GetOptions().map_entry:
            inner = ((f"{field.name}[{i}]", m) for i, m in enumerate(value)) if field.is_repeated \
                else ((field.name, value),)
            for name, m in inner:
                if (found := unknown_field(m, f"{prefix}{name}.")) is not None:
                    return found
    return None


def input_from_pb(pb: generate_pb2.GenerateRequest, limits: Limits,
                  defaults: SamplingParams | None = None) -> GenerateInput:
    """An input counts as set when present: prompt by presence (even empty), the lists when non-empty; an unset
    sampling field means `defaults`' value (--generation-config) when given.
    NOTE: list lengths are checked before any list is copied; prompt_token_ids stays the message's own container
    (the front end checks its length before copying it)."""
    if (found := unknown_field(pb)) is not None:
        where, number = found
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{where or 'GenerateRequest'}: field number {number} is not "
                          "in this server's generate.proto (a client built from newer protos?): refused, not "
                          "ignored", where.split(".")[0].split("[")[0] or None)
    sp = pb.sampling
    limits.check_counts(len(sp.stop), len(sp.stop_token_ids), len(pb.messages), len(sp.logit_bias), len(sp.bad_words),
                        len(sp.bad_words_token_ids), len(sp.allowed_token_ids))
    limits.check_bad_word_lengths(len(t.token_ids) for t in sp.bad_words_token_ids)
    if sp.HasField("structured_output"):
        _check_structured(sp.structured_output)
    return GenerateInput(prompt=pb.prompt if pb.HasField("prompt") else None,
                         prompt_token_ids=pb.prompt_token_ids or None,
                         messages=[{"role": m.role, "content": m.content} for m in pb.messages] or None,
                         sampling=with_defaults(sp, sampling_from_pb(sp), defaults or SamplingParams()),
                         stop=tuple(pb.sampling.stop),
                         request_id=pb.request_id, cache_salt=pb.cache_salt, bad_words=tuple(pb.sampling.bad_words),
                         include_stop_str_in_output=pb.sampling.include_stop_str_in_output,
                         skip_special_tokens=pb.sampling.skip_special_tokens
                         if pb.sampling.HasField("skip_special_tokens") else True,
                         echo=pb.echo, priority=pb.priority)


def identity_of(metadata, api_keys: ApiKeys | None = None) -> Identity:
    """The caller's Identity from its gRPC metadata: what its API key grants; without keys, NO_KEYS (every caller
    is trusted)."""
    if api_keys is None:
        return NO_KEYS
    return api_keys.identity_of([v for k, v in metadata or () if k == "authorization"])


def tenant_of(metadata, identity: Identity = NO_KEYS) -> str:
    """The request's tenant from its gRPC metadata and its caller's identity (frontend.api.tenant_of)."""
    return api_tenant_of([v for k, v in metadata or () if k == TENANT_HEADER], identity)


def _check_structured(so: generate_pb2.StructuredOutput) -> None:
    """A structured_output that is set must say what: an empty one, or json_object false, is refused (not free text)."""
    kind = so.WhichOneof("kind")
    if kind is None:
        raise invalid("structured_output", "structured_output is set but empty: set one of json_schema, json_object, "
                                           "regex, choice and grammar (or leave it unset for free text)")
    if kind == "json_object" and not so.json_object:
        raise invalid("structured_output", "structured_output.json_object must be true")


def item_to_pb(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
    pb = generate_pb2.GenerateResponse(request_id=request_id, index=item.index, token_ids=item.token_ids,
                                       text=item.text)
    for lp in item.logprobs:
        logprobs_to_pb(lp, pb.logprobs.add())
    if item.prompt_logprobs is not None:
        add = pb.prompt_logprobs.add
        for lp in item.prompt_logprobs:  # NOTE: None (the first position) stays an empty entry
            entry = add()
            if lp is not None:
                logprobs_to_pb(lp, entry)
    if item.finish_reason is not None:
        pb.finish_reason = int(item.finish_reason)
        pb.usage.prompt_tokens = item.prompt_tokens
        pb.usage.completion_tokens = item.completion_tokens
        pb.usage.cached_prompt_tokens = item.cached_prompt_tokens
    return pb


def model_info_to_pb(model_id: str, max_model_len: int, vocab_size: int, max_n: int,
                     workers: dict[str, WorkerRegistration]) -> generate_pb2.GetModelInfoResponse:
    pb = generate_pb2.GetModelInfoResponse(model_id=model_id, max_model_len=max_model_len, vocab_size=vocab_size,
                                           max_n=max_n)
    for worker_id, r in workers.items():
        pb.block_size = r.block_size
        pb.workers.add(worker_id=worker_id, num_blocks=r.num_blocks, block_size=r.block_size, dtype=r.dtype,
                       device=r.device, name=r.name)
    return pb


def kv_state_to_pb(snap: KVPoolSnapshot) -> generate_pb2.KVState:
    pb = generate_pb2.KVState(
        worker_id=snap.worker_id, block_size=snap.block_size, num_blocks=snap.num_blocks,
        ref_counts=snap.ref_counts, cached=snap.cached, kv_allocation=snap.kv_allocation, num_steps=snap.num_steps,
        num_waiting=snap.num_waiting, prefix_query_tokens=snap.prefix_query_tokens,
        prefix_hit_tokens=snap.prefix_hit_tokens, num_evictions=snap.num_evictions,
        num_preemptions=snap.num_preemptions, num_prefill_tokens=snap.num_prefill_tokens, time=snap.time,
        waiting_for_blocks=snap.waiting_for_blocks, kv_cache_dtype=snap.kv_cache_dtype,
        bytes_per_token=snap.bytes_per_token, num_kv_groups=snap.num_kv_groups)
    add = pb.sequences.add
    for s in snap.sequences:
        add(request_id=s.request_id, seq_id=s.seq_id, block_ids=s.block_ids, num_tokens=s.num_tokens,
            tenant=s.tenant)
    return pb
