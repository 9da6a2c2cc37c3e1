// pagedserve Node.js client: loads protos/ at run time, streams Generate, calls GetModelInfo, explains errors.
'use strict';

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

// The repository's protos/ folder: the .proto files are the API's single source of truth (no generated code).
const PROTOS_DIR = path.resolve(__dirname, '..', '..', 'protos');
const PROTO_FILE = path.join(PROTOS_DIR, 'pagedserve', 'v1', 'generate.proto');

// keepCase: field names as in the .proto (prompt_token_ids, not promptTokenIds), in requests and responses.
// longs: String: 64-bit fields (SamplingParams.seed) as decimal strings, so no precision is lost above 2^53.
// enums: String: finish_reason as its name, e.g. "FINISH_REASON_LENGTH".
// defaults: false: a field the server did not send (proto3 does not send defaults) is absent from the decoded
//   object rather than filled in; read it as its default (index 0, no token_ids, ...): see normalizeResponse.
// oneofs: true: set virtual oneof fields (also the synthetic ones of proto3 `optional` fields).
const LOADER_OPTIONS = {keepCase: true, longs: String, enums: String, defaults: false, oneofs: true,
  includeDirs: [PROTOS_DIR]};

const packageDefinition = protoLoader.loadSync(PROTO_FILE, LOADER_OPTIONS);
const pagedserve = grpc.loadPackageDefinition(packageDefinition).pagedserve.v1;

/** A Generation client for `address` ("host:port"); plaintext unless `credentials` are given. */
function connect(address, credentials = grpc.credentials.createInsecure()) {
  return new pagedserve.Generation(address, credentials);
}

/** One decoded GenerateResponse with every absent field read as its proto3 default. */
function normalizeResponse(msg) {
  const usage = msg.usage ? {
    promptTokens: msg.usage.prompt_tokens ?? 0,
    completionTokens: msg.usage.completion_tokens ?? 0,
    cachedPromptTokens: msg.usage.cached_prompt_tokens ?? 0,
  } : null;
  return {
    requestId: msg.request_id ?? '',
    index: msg.index ?? 0, // sample 0's messages carry no index at all
    tokenIds: msg.token_ids ?? [],
    text: msg.text ?? '',
    finishReason: msg.finish_reason ?? 'FINISH_REASON_UNSPECIFIED', // absent: the sample goes on
    usage,
    logprobs: msg.logprobs ?? [],
  };
}

/**
 * Streams one generation. `request` is a GenerateRequest as a plain object with the .proto's field names, e.g.
 * {prompt: 'Hello', sampling: {max_tokens: 32, temperature: 0}}. `onMessage(msg)` sees each normalized message as
 * it arrives; aborting `signal` cancels the call (the server then frees the request's KV blocks) and the promise
 * rejects with a CANCELLED error. `deadline` (a Date or ms since the epoch) bounds the whole call.
 * Resolves to {requestId, samples: [{tokenIds, text, finishReason, usage}]}, samples indexed as in the stream.
 * Rejects with the gRPC error (err.code, err.details); describeError(err) explains it.
 */
function generate(client, request, {onMessage, signal, deadline} = {}) {
  return new Promise((resolve, reject) => {
    const call = client.Generate(request, deadline === undefined ? {} : {deadline});
    const onAbort = () => call.cancel();
    if (signal) {
      if (signal.aborted) onAbort();
      else signal.addEventListener('abort', onAbort, {once: true});
    }
    let requestId = '';
    const samples = [];
    call.on('data', (raw) => {
      const msg = normalizeResponse(raw);
      requestId = msg.requestId || requestId;
      const sample = samples[msg.index] ??= {tokenIds: [], text: '', finishReason: null, usage: null};
      sample.tokenIds.push(...msg.tokenIds);
      sample.text += msg.text;
      if (msg.finishReason !== 'FINISH_REASON_UNSPECIFIED') sample.finishReason = msg.finishReason;
      if (msg.usage) sample.usage = msg.usage;
      if (onMessage) onMessage(msg);
    });
    // A stream ends with exactly one of 'end' (status OK) or 'error' (any other status, cancellation included).
    call.on('end', () => {
      signal?.removeEventListener('abort', onAbort);
      resolve({requestId, samples});
    });
    call.on('error', (err) => {
      signal?.removeEventListener('abort', onAbort);
      reject(err);
    });
  });
}

/** Resolves to the served model's description, every absent field read as its default. */
function getModelInfo(client, {deadline} = {}) {
  return new Promise((resolve, reject) => {
    client.GetModelInfo({}, deadline === undefined ? {} : {deadline}, (err, info) => {
      if (err) return reject(err);
      resolve({
        modelId: info.model_id ?? '',
        maxModelLen: info.max_model_len ?? 0,
        blockSize: info.block_size ?? 0,
        vocabSize: info.vocab_size ?? 0,
        maxN: info.max_n ?? 0,
        workers: (info.workers ?? []).map((w) => ({
          workerId: w.worker_id ?? '', numBlocks: w.num_blocks ?? 0, blockSize: w.block_size ?? 0,
          dtype: w.dtype ?? '', device: w.device ?? '', name: w.name ?? '',
        })),
      });
    });
  });
}

/** A one-line, human explanation of an error from generate() or getModelInfo() (any Error works). */
function describeError(err) {
  if (!err || typeof err.code !== 'number') return `error: ${err?.message ?? err}`;
  const details = err.details || err.message || '';
  const s = grpc.status;
  switch (err.code) {
    case s.INVALID_ARGUMENT: // the details name the field at fault
      return `invalid request: ${details}`;
    case s.UNAVAILABLE:
      if (/draining|shut down/i.test(details)) {
        return `server unavailable: it is shutting down (draining) and takes no new requests; retry on another ` +
          `server or after it restarts (${details})`;
      }
      if (/no worker/i.test(details)) {
        return `server unavailable: no worker is attached to the scheduler; retry when one is (${details})`;
      }
      return `server not reachable: is the scheduler running at that address? (${details})`;
    case s.RESOURCE_EXHAUSTED:
      return `server busy: its request queue is full; retry later (${details})`;
    case s.ALREADY_EXISTS:
      return `a request with this request_id is already running; choose another id (${details})`;
    case s.CANCELLED:
      return `cancelled: the call was cancelled before it finished (${details})`;
    case s.DEADLINE_EXCEEDED:
      return `deadline exceeded: the call did not finish in time; the server aborted the request (${details})`;
    case s.UNAUTHENTICATED:
      return `unauthenticated: the server wants credentials this client did not send (${details})`;
    case s.PERMISSION_DENIED:
      return `permission denied: the credentials do not allow this call (${details})`;
    case s.FAILED_PRECONDITION:
      return `failed precondition: the server is not in a state to serve this call (${details})`;
    case s.UNIMPLEMENTED:
      return `unimplemented: the server does not serve this method; is it a pagedserve scheduler of a ` +
        `matching API version? (${details})`;
    case s.INTERNAL:
      return `internal server error (a bug; see the server's log): ${details}`;
    case s.NOT_FOUND:
      return `not found: ${details}`;
    case s.ABORTED:
      return `aborted: ${details}`;
    case s.OUT_OF_RANGE:
      return `out of range: ${details}`;
    case s.DATA_LOSS:
      return `data loss: ${details}`;
    default: // UNKNOWN, or a code this client does not know
      return `unknown error (status ${s[err.code] ?? err.code}): ${details}`;
  }
}

module.exports = {connect, generate, getModelInfo, describeError, normalizeResponse, grpc, PROTOS_DIR};
