#!/usr/bin/env node
// pagedserve CLI: stream one generation to stdout; Ctrl-C cancels it; errors are explained on stderr.
'use strict';

const {parseArgs} = require('node:util');
const {connect, generate, describeError} = require('./client');

const USAGE = `usage: node generate.js "PROMPT" [--server HOST:PORT] [--max-tokens N] [--temperature T] [--chat]
                                  [--ignore-eos]
  --server       the scheduler's address (default: $PAGEDSERVE_SERVER or 127.0.0.1:50051)
  --max-tokens   new tokens at most (default: the server's, 16)
  --temperature  0 is greedy (default: the server's, 1.0)
  --chat         send the prompt as one user message, rendered with the model's chat template
  --ignore-eos   keep generating past the model's end-of-sequence token`;

function usageError(message) {
  process.stderr.write(`${message}\n${USAGE}\n`);
  process.exit(2);
}

function parse(argv) {
  let parsed;
  try {
    parsed = parseArgs({args: argv, allowPositionals: true, options: {
      'server': {type: 'string', default: process.env.PAGEDSERVE_SERVER || '127.0.0.1:50051'},
      'max-tokens': {type: 'string'},
      'temperature': {type: 'string'},
      'chat': {type: 'boolean', default: false},
      'ignore-eos': {type: 'boolean', default: false},
      'help': {type: 'boolean', short: 'h', default: false},
    }});
  } catch (e) {
    usageError(e.message);
  }
  const {values, positionals} = parsed;
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (positionals.length !== 1) usageError('give exactly one PROMPT');
  const prompt = positionals[0];
  const sampling = {};
  // Range checks are the server's job (INVALID_ARGUMENT names the field); only the syntax is checked here.
  if (values['max-tokens'] !== undefined) {
    sampling.max_tokens = Number(values['max-tokens']);
    if (!Number.isInteger(sampling.max_tokens)) usageError('--max-tokens takes an integer');
  }
  if (values.temperature !== undefined) {
    sampling.temperature = Number(values.temperature);
    if (values.temperature.trim() === '' || Number.isNaN(sampling.temperature)) {
      usageError('--temperature takes a number');
    }
  }
  if (values['ignore-eos']) sampling.ignore_eos = true;
  const request = values.chat ? {messages: [{role: 'user', content: prompt}], sampling} : {prompt, sampling};
  return {server: values.server, request};
}

async function main() {
  const {server, request} = parse(process.argv.slice(2));
  const client = connect(server);
  const controller = new AbortController();
  let interrupted = false;
  let wroteText = false; // so that a message after streamed text starts on its own line
  process.on('SIGINT', () => {
    if (interrupted) process.exit(130); // a second Ctrl-C: do not wait for the cancel to go through
    interrupted = true;
    controller.abort(); // call.cancel(): the server aborts the request and frees its KV blocks
  });
  try {
    const {samples} = await generate(client, request, {
      signal: controller.signal,
      onMessage: (msg) => { // n is 1: every message is sample 0's
        if (!msg.text) return;
        process.stdout.write(msg.text);
        wroteText = true;
      },
    });
    const {finishReason = null, usage = null} = samples[0] ?? {};
    const u = usage ?? {promptTokens: 0, completionTokens: 0, cachedPromptTokens: 0};
    // stdout holds exactly the generated text; the summary (and the line break after the text) go to stderr.
    const reason = (finishReason ?? 'FINISH_REASON_UNSPECIFIED').replace('FINISH_REASON_', '').toLowerCase();
    process.stderr.write(`${wroteText ? '\n' : ''}[finish_reason: ${reason}, ` +
      `prompt_tokens: ${u.promptTokens}, completion_tokens: ${u.completionTokens}, ` +
      `cached_prompt_tokens: ${u.cachedPromptTokens}]\n`);
    if (interrupted) process.exitCode = 130; // Ctrl-C came as the last message arrived
  } catch (err) {
    if (interrupted) {
      process.stderr.write(`${wroteText ? '\n' : ''}cancelled\n`);
      process.exitCode = 130;
    } else {
      process.stderr.write(`${wroteText ? '\n' : ''}${describeError(err)}\n`);
      process.exitCode = 1;
    }
  } finally {
    // Closing (instead of process.exit) lets the cancellation and stdout flush before node exits.
    client.close();
  }
}

main();
