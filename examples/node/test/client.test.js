// Tests of the example client and CLI against a live pagedserve (tests/service/test_node_client.py sets them up).
'use strict';

const {test, describe, before, after} = require('node:test');
const assert = require('node:assert/strict');
const {spawn} = require('node:child_process');
const fs = require('node:fs');
const http = require('node:http');
const path = require('node:path');
const {connect, generate, getModelInfo, describeError, normalizeResponse, grpc} = require('../client');

// PAGEDSERVE_SERVER: the scheduler's host:port. PAGEDSERVE_METRICS: host:port of its Prometheus metrics.
// PAGEDSERVE_EXPECTED: a JSON file of the Python client's greedy outputs: {model_id, vocab_size, max_model_len,
// cases: [{name, prompt | prompt_token_ids | messages, sampling, token_ids, text}]}.
// PAGEDSERVE_WORKER_PID (optional): the pid of the server's only worker, which the cancel test pauses.
const {PAGEDSERVE_SERVER: SERVER, PAGEDSERVE_METRICS: METRICS, PAGEDSERVE_EXPECTED} = process.env;
const WORKER_PID = Number(process.env.PAGEDSERVE_WORKER_PID) || 0;
const LIVE = Boolean(SERVER && METRICS && PAGEDSERVE_EXPECTED);
const SKIP_LIVE = LIVE ? false : 'needs PAGEDSERVE_SERVER, PAGEDSERVE_METRICS and PAGEDSERVE_EXPECTED';
const HANG_GUARD_MS = 120_000; // a wait's bound: only a guard against a hang, never a measure of speed
const CLI = path.join(__dirname, '..', 'generate.js');

/** The request of an expected case: its one input field and its sampling parameters. */
function requestOf(c, sampling = c.sampling) {
  const input = ['prompt', 'prompt_token_ids', 'messages'].find((k) => c[k] !== undefined);
  return {[input]: c[input], sampling};
}

/** GET /metrics as text. */
function scrape() {
  return new Promise((resolve, reject) => {
    http.get(`http://${METRICS}/metrics`, (res) => {
      let body = '';
      res.setEncoding('utf8');
      res.on('data', (chunk) => { body += chunk; });
      res.on('end', () => resolve(body));
    }).on('error', reject);
  });
}

/** The sum of a metric's samples (every label set), as tests/support/service.py's Service.metric does. */
function metric(text, name) {
  return text.split('\n')
    .filter((line) => line.startsWith(name) && [' ', '{'].includes(line[name.length]))
    .reduce((sum, line) => sum + Number(line.slice(line.lastIndexOf(' ') + 1)), 0);
}

/** Polls the metrics until no request runs and no KV block is held (cached prefix blocks may stay), or 120 s. */
async function waitUntilIdle() {
  const deadline = Date.now() + HANG_GUARD_MS;
  for (;;) {
    const text = await scrape();
    const state = {running: metric(text, 'pagedserve_requests_running'),
      used: metric(text, 'pagedserve_kv_blocks_used')};
    if ((state.running === 0 && state.used === 0) || Date.now() > deadline) return state;
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** GetKVState of the first worker: the scheduler's own state, between two steps. */
function kvState(client) {
  return new Promise((resolve, reject) => {
    client.GetKVState({}, {deadline: Date.now() + 60_000}, (err, state) => (err ? reject(err) : resolve(state)));
  });
}

/** The ids of the requests holding KV blocks on the first worker. */
async function liveRequestIds(client) {
  return ((await kvState(client)).sequences ?? []).map((s) => s.request_id);
}

/** No request runs or waits on the worker and no step is in flight (every plan sent has been answered), as
 * tests/support/service.py's Service.worker_idle: scraped first, so answered then <= answered now <= planned. */
async function workerIdle(client) {
  const text = await scrape();
  const state = await kvState(client);
  // NOTE: per-worker series are labelled with the name the worker registered with (HOST:PID), not its id
  const {workers} = await getModelInfo(client, {deadline: Date.now() + 60_000});
  const name = workers.find((w) => w.workerId === state.worker_id)?.name;
  const answered = metric(text.split('\n').filter((l) => l.includes(`worker="${name}"`)).join('\n'),
    'pagedserve_step_seconds_count');
  return !(state.sequences ?? []).length && !Number(state.num_waiting ?? 0) &&
    answered === Number(state.num_steps ?? 0);
}

/** Polls `cond` (async) until it holds; fails after HANG_GUARD_MS. */
async function waitFor(cond, what) {
  const deadline = Date.now() + HANG_GUARD_MS;
  while (!(await cond())) {
    assert.ok(Date.now() < deadline, `timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** Runs the CLI; resolves to {code, signal, stdout, stderr}. `onStdout(child)` is called at its first output. */
function runCli(args, {onStdout} = {}) {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [CLI, ...args], {env: {...process.env, PAGEDSERVE_SERVER: SERVER}});
    let stdout = '';
    let stderr = '';
    const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
    child.stdout.setEncoding('utf8').on('data', (chunk) => {
      if (!stdout && onStdout) onStdout(child);
      stdout += chunk;
    });
    child.stderr.setEncoding('utf8').on('data', (chunk) => { stderr += chunk; });
    child.on('error', reject);
    child.on('close', (code, signal) => {
      clearTimeout(timer);
      resolve({code, signal, stdout, stderr});
    });
  });
}

test('absent fields read as their proto3 defaults', () => {
  assert.deepEqual(normalizeResponse({}), {requestId: '', index: 0, tokenIds: [], text: '',
    finishReason: 'FINISH_REASON_UNSPECIFIED', usage: null, logprobs: []});
  assert.deepEqual(normalizeResponse({index: 1, usage: {completion_tokens: 3}}).usage,
    {promptTokens: 0, completionTokens: 3, cachedPromptTokens: 0});
});

test('describeError explains every status', () => {
  for (const [name, code] of Object.entries(grpc.status)) {
    if (typeof code !== 'number' || code === grpc.status.OK) continue;
    const text = describeError({code, details: 'DETAILS'});
    assert.match(text, /DETAILS/, name);
    if (name !== 'UNKNOWN') assert.doesNotMatch(text, /^unknown error/, name);
  }
  assert.equal(describeError({code: grpc.status.INVALID_ARGUMENT, details: 'top_k must be >= 0'}),
    'invalid request: top_k must be >= 0');
  assert.match(describeError({code: grpc.status.UNAVAILABLE, details: 'the server is draining: no new requests'}),
    /draining/);
  assert.match(describeError({code: grpc.status.UNAVAILABLE, details: 'no worker is attached yet'}), /no worker/);
  assert.match(describeError({code: grpc.status.UNAVAILABLE, details: 'connect ECONNREFUSED'}), /not reachable/);
  assert.match(describeError({code: grpc.status.RESOURCE_EXHAUSTED, details: 'full'}), /retry later/);
  assert.match(describeError(new Error('boom')), /boom/);
});

describe('against a live server', {skip: SKIP_LIVE}, () => {
  let client;
  let expected;
  before(() => {
    expected = JSON.parse(fs.readFileSync(PAGEDSERVE_EXPECTED, 'utf8'));
    client = connect(SERVER);
  });
  after(() => client?.close());

  test('GetModelInfo describes the served model', async () => {
    const info = await getModelInfo(client);
    assert.equal(info.modelId, expected.model_id);
    assert.equal(info.vocabSize, 49152);
    assert.equal(info.maxModelLen, expected.max_model_len);
    assert.ok(info.blockSize > 0 && info.maxN >= 1);
    assert.ok(info.workers.length >= 1 && info.workers.every((w) => w.numBlocks > 0));
  });

  test('streamed greedy tokens equal the Python client\'s', async (t) => {
    assert.ok(expected.cases.some((c) => c.prompt !== undefined));
    assert.ok(expected.cases.some((c) => c.prompt_token_ids !== undefined));
    for (const c of expected.cases) {
      await t.test(c.name, async () => {
        let messages = 0;
        const {requestId, samples} = await generate(client, requestOf(c), {onMessage: () => { messages += 1; }});
        assert.equal(samples.length, 1);
        assert.deepEqual(samples[0].tokenIds, c.token_ids);
        assert.equal(samples[0].text, c.text);
        assert.equal(samples[0].finishReason, 'FINISH_REASON_LENGTH');
        assert.equal(samples[0].usage.completionTokens, c.token_ids.length);
        assert.ok(samples[0].usage.promptTokens > 0);
        assert.ok(messages > 1, 'streamed, not sent at once');
        assert.ok(requestId);
      });
    }
  });

  test('n=2 at temperature 0: both samples are the greedy output', async () => {
    const c = expected.cases.find((x) => x.prompt !== undefined);
    const {samples} = await generate(client, requestOf(c, {...c.sampling, n: 2}));
    assert.equal(samples.length, 2);
    for (const s of samples) {
      assert.deepEqual(s.tokenIds, c.token_ids);
      assert.equal(s.text, c.text);
      assert.equal(s.finishReason, 'FINISH_REASON_LENGTH');
    }
  });

  // NOTE: the worker is paused (SIGSTOP) from before the request until after the cancel: the tiny model makes its
  // ~500 tokens in about a second, and on a loaded machine the request could end before this test cancels it.
  test('a cancel frees the request\'s KV blocks', {skip: WORKER_PID ? false : 'needs PAGEDSERVE_WORKER_PID'},
    async () => {
      const c = expected.cases.find((x) => x.prompt_token_ids !== undefined);
      const maxTokens = expected.max_model_len - c.prompt_token_ids.length; // as long as the server allows
      const controller = new AbortController();
      // From a moment the worker is idle: a plan still in flight would hold back the request's admission.
      await waitFor(() => workerIdle(client), 'the worker idle');
      process.kill(WORKER_PID, 'SIGSTOP');
      try {
        const call = generate(client, requestOf(c, {max_tokens: maxTokens, temperature: 0, ignore_eos: true}),
          {signal: controller.signal});
        // Admitted: it holds blocks, its first step in flight on the paused worker.
        await waitFor(async () => (await liveRequestIds(client)).length === 1, 'the request admitted');
        controller.abort();
        await assert.rejects(call, (err) => {
          assert.equal(err.code, grpc.status.CANCELLED, describeError(err));
          return true;
        });
        // The scheduler drops it and frees its blocks at once, with the worker still paused.
        await waitFor(async () => (await liveRequestIds(client)).length === 0, 'its blocks freed');
      } finally {
        process.kill(WORKER_PID, 'SIGCONT');
      }
      assert.deepEqual(await waitUntilIdle(), {running: 0, used: 0}); // the gauges, after the worker's next step
    });

  test('INVALID_ARGUMENT names the field, and the server keeps serving', async (t) => {
    const bad = [
      ['prompt and prompt_token_ids both set', {prompt: 'Hello', prompt_token_ids: [1, 2, 3]}, 'prompt_token_ids'],
      ['top_k -5', {prompt: 'Hello', sampling: {top_k: -5}}, 'top_k'],
      // A negative number in a uint32 field wraps to 2^32 - 1 on the wire: over max_model_len.
      ['max_tokens -1', {prompt: 'Hello', sampling: {max_tokens: -1}}, 'max_tokens'],
      ['stop_token_ids out of the vocabulary', {prompt: 'Hello', sampling: {stop_token_ids: [1_000_000_000]}},
        'stop_token_ids'],
    ];
    for (const [name, request, field] of bad) {
      await t.test(name, async () => {
        await assert.rejects(generate(client, request), (err) => {
          assert.equal(err.code, grpc.status.INVALID_ARGUMENT, describeError(err));
          assert.match(err.details, new RegExp(`\\b${field}\\b`));
          assert.ok(describeError(err).startsWith('invalid request: '));
          return true;
        });
      });
    }
    const c = expected.cases[0];
    const {samples} = await generate(client, requestOf(c));
    assert.deepEqual(samples[0].tokenIds, c.token_ids);
    assert.deepEqual(await waitUntilIdle(), {running: 0, used: 0});
  });

  test('CLI: streams the text and ends with the finish reason', async () => {
    const prompt = 'The capital of France is';
    const want = await generate(client, {prompt, sampling: {max_tokens: 8, temperature: 0}});
    const r = await runCli([prompt, '--server', SERVER, '--max-tokens', '8', '--temperature', '0']);
    assert.equal(r.code, 0, r.stderr);
    assert.ok(r.stdout.length > 0);
    assert.equal(r.stdout, want.samples[0].text);
    assert.match(r.stderr, /finish_reason: (length|stop)/);
  });

  test('CLI: --chat sends the prompt as a user message', async () => {
    const r = await runCli(['Say hello.', '--max-tokens', '4', '--temperature', '0', '--chat']);
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stderr, /finish_reason/);
  });

  test('CLI: a bad value exits 1 with the server\'s explanation', async () => {
    const r = await runCli(['Hello', '--server', SERVER, '--max-tokens', '0']);
    assert.equal(r.code, 1, r.stderr);
    assert.match(r.stderr, /invalid request/);
    assert.match(r.stderr, /max_tokens/);
    assert.equal(r.stdout, '');
  });

  test('CLI: a server that is not there exits 1 saying so', async () => {
    const r = await runCli(['Hello', '--server', '127.0.0.1:1']);
    assert.equal(r.code, 1, r.stderr);
    assert.match(r.stderr, /not reachable/);
  });

  test('CLI: Ctrl-C cancels the call, says so and exits 130', async () => {
    const r = await runCli(['Once upon a time', '--max-tokens', '400', '--temperature', '0', '--ignore-eos'],
      {onStdout: (child) => child.kill('SIGINT')});
    assert.equal(r.code, 130, r.stderr);
    assert.match(r.stderr, /cancelled/);
    assert.deepEqual(await waitUntilIdle(), {running: 0, used: 0});
  });
});
