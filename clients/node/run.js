#!/usr/bin/env node
'use strict';
// Command-line driver for the Node client; prints one JSON object per line.
//
//   node clients/node/run.js --address 127.0.0.1:50051 --mode info
//   node clients/node/run.js --address 127.0.0.1:50051 --mode examples [--examples FILE]
//   node clients/node/run.js --address 127.0.0.1:50051 --mode stream --steps 100 --policy greedy
//   node clients/node/run.js --address 127.0.0.1:50051 --mode batch --sequences 6 --steps 20
//
// `batch` adds sequences of mixed policies (none, strict, greedy, sink in turn) and prefill
// lengths to one Batch session, steps changing subsets of them, then restores a snapshot of
// one as a new sequence and probes the in-band refusals (unknown id, duplicate id).
// `stream` is deterministic for a given --seed and prints every tensor it sends and receives
// (flat, row-major) so that another program can check the outputs.

const fs = require('fs');
const path = require('path');
const { parseArgs } = require('util');
const { GqaClient, Refusal, codeName, tensor, toFloat32Array } = require('./client');

const POLICIES = { none: 'EVICTION_POLICY_NONE', strict: 'EVICTION_POLICY_STRICT', greedy: 'EVICTION_POLICY_GREEDY', sink: 'EVICTION_POLICY_SINK' };
const DTYPES = { float32: 'DTYPE_FLOAT32', float16: 'DTYPE_FLOAT16', bfloat16: 'DTYPE_BFLOAT16' };

const { values: args } = parseArgs({
  options: {
    address: { type: 'string', default: '127.0.0.1:50051' },
    mode: { type: 'string', default: 'stream' },
    examples: { type: 'string', default: path.resolve(__dirname, '..', '..', 'tests', 'data', 'examples.json') },
    steps: { type: 'string', default: '100' },
    policy: { type: 'string', default: 'greedy' },
    window: { type: 'string', default: '8' },
    capacity: { type: 'string', default: '12' },
    sinks: { type: 'string', default: '0' },
    batch: { type: 'string', default: '2' },
    heads: { type: 'string', default: '4' },
    'kv-heads': { type: 'string', default: '2' },
    'head-dim': { type: 'string', default: '8' },
    layers: { type: 'string', default: '2' },
    prefill: { type: 'string', default: '5' },
    dtype: { type: 'string', default: 'float32' },
    backend: { type: 'string', default: '' },
    seed: { type: 'string', default: '1' },
    sequences: { type: 'string', default: '6' },
    'probe-errors': { type: 'boolean', default: false },
    'restore-check': { type: 'boolean', default: false },
    help: { type: 'boolean', short: 'h', default: false },
  },
});

function emit(object) {
  process.stdout.write(JSON.stringify(object) + '\n');
}

// A flat view of a tensor for printing: shape plus row-major values.
function dump(message) {
  return { dtype: message.dtype, shape: message.shape.map(Number), data: Array.from(toFloat32Array(message)) };
}

function flatten(nested) {
  const shape = [];
  for (let level = nested; Array.isArray(level); level = level[0]) shape.push(level.length);
  return { shape, values: Float32Array.from(nested.flat(Infinity)) };
}

function fromNested(nested) {
  const { shape, values } = flatten(nested);
  return tensor(values, shape);
}

// mulberry32: a tiny seeded generator, so a run is reproducible across machines.
function generator(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomTensor(next, shape, dtype) {
  const count = shape.reduce((a, b) => a * b, 1);
  const values = new Float32Array(count);
  for (let i = 0; i < count; i++) values[i] = 4 * next() - 2;
  return tensor(values, shape, dtype);
}

function percentile(sorted, q) {
  const k = Math.min(sorted.length - 1, Math.max(0, Math.round((q / 100) * (sorted.length - 1))));
  return sorted[k];
}

function statusLine(call, err) {
  return { kind: 'status', call, code: err.code, code_name: codeName(err.code), details: err.details };
}

async function runInfo(client) {
  emit({ kind: 'info', info: await client.getServerInfo() });
}

async function runExamples(client) {
  const examples = JSON.parse(fs.readFileSync(args.examples, 'utf8'));
  for (const [index, example] of examples.entries()) {
    const input = example.input;
    const request = {
      query: fromNested(input.query),
      new_key: fromNested(input.new_key),
      new_value: fromNested(input.new_value),
      key_cache: fromNested(input.key_cache),
      value_cache: fromNested(input.value_cache),
      num_query_heads: input.num_query_heads,
      num_kv_heads: input.num_kv_heads,
    };
    const started = process.hrtime.bigint();
    const response = await client.decodeStep(request);
    const latencyUs = Number(process.hrtime.bigint() - started) / 1e3;
    emit({
      kind: 'example',
      index,
      output: dump(response.output),
      new_key_cache: dump(response.new_key_cache),
      new_value_cache: dump(response.new_value_cache),
      latency_us: latencyUs,
    });
  }
  // A malformed request: a query whose bytes do not fill its shape ends the call with a status.
  const bad = fromNested(examples[0].input.query);
  bad.data = bad.data.subarray(0, bad.data.length - 2);
  try {
    await client.decodeStep({ query: bad, num_query_heads: 1, num_kv_heads: 1 });
    emit({ kind: 'unexpected', call: 'DecodeStep', message: 'a malformed request was accepted' });
  } catch (err) {
    emit(statusLine('DecodeStep', err));
  }
}

async function runStream(client) {
  const steps = Number(args.steps);
  const B = Number(args.batch);
  const Hq = Number(args.heads);
  const Hkv = Number(args['kv-heads']);
  const D = Number(args['head-dim']);
  const layers = Number(args.layers);
  const prefillTokens = Number(args.prefill);
  const dtype = DTYPES[args.dtype];
  if (!dtype) throw new RangeError(`--dtype: expected one of ${Object.keys(DTYPES).join(', ')}`);
  if (!POLICIES[args.policy]) throw new RangeError(`--policy: expected one of ${Object.keys(POLICIES).join(', ')}`);
  const next = generator(Number(args.seed));

  // Layer 0 starts from a prefill of `prefillTokens` positions; the other layers start empty.
  const prefill = prefillTokens > 0
    ? [{ layer: 0, key: randomTensor(next, [B, Hkv, prefillTokens, D], dtype), value: randomTensor(next, [B, Hkv, prefillTokens, D], dtype) }]
    : [];
  const open = {
    backend: args.backend,
    dtype,
    batch_size: B,
    num_query_heads: Hq,
    num_kv_heads: Hkv,
    head_dim: D,
    num_layers: layers,
    policy: POLICIES[args.policy],
    window: Number(args.window),
    capacity: Number(args.capacity),
    sink_tokens: Number(args.sinks),
    prefill,
  };

  let stream;
  try {
    stream = await client.openStream(open);
  } catch (err) {
    emit(statusLine('Decode/open', err));
    return;
  }
  emit({
    kind: 'opened',
    opened: stream.opened,
    prefill: prefill.map((p) => ({ layer: p.layer, key: dump(p.key), value: dump(p.value) })),
  });

  const latencies = [];
  for (let i = 0; i < steps; i++) {
    const layer = i % layers;
    const query = randomTensor(next, [B, Hq, D], dtype);
    const newKey = randomTensor(next, [B, Hkv, D], dtype);
    const newValue = randomTensor(next, [B, Hkv, D], dtype);
    const started = process.hrtime.bigint();
    let result;
    try {
      // One step in flight at a time, so the latency is the round trip of one step.
      result = await stream.step(layer, query, newKey, newValue);
    } catch (err) {
      if (err instanceof Refusal) {
        emit({ kind: 'refused', step: i, layer, code: err.code, code_name: err.codeName, details: err.details });
        continue;
      }
      throw err;
    }
    const latencyUs = Number(process.hrtime.bigint() - started) / 1e3;
    latencies.push(latencyUs);
    emit({
      kind: 'step',
      step: i,
      layer,
      query: dump(query),
      new_key: dump(newKey),
      new_value: dump(newValue),
      output: dump(result.output),
      tokens_seen: result.tokens_seen,
      resident: result.resident,
      first_position: result.first_position,
      last_position: result.last_position,
      evicted_tokens: result.evicted_tokens,
      compute_ns: result.compute_ns,
      latency_us: latencyUs,
    });
  }

  if (args['restore-check']) {
    // Snapshot the stream, restore the snapshot as a second stream, and send both the same
    // next steps: the outputs must agree.
    const chunks = await stream.snapshot();
    const copy = await client.restoreStream(chunks);
    emit({ kind: 'restored', chunks: chunks.length, opened: copy.opened });
    for (let i = steps; i < steps + 4; i++) {
      const layer = i % layers;
      const query = randomTensor(next, [B, Hq, D], dtype);
      const newKey = randomTensor(next, [B, Hkv, D], dtype);
      const newValue = randomTensor(next, [B, Hkv, D], dtype);
      const [a, b] = await Promise.all([stream.step(layer, query, newKey, newValue), copy.step(layer, query, newKey, newValue)]);
      emit({
        kind: 'step', step: i, layer, query: dump(query), new_key: dump(newKey), new_value: dump(newValue),
        output: dump(a.output), restored_output: dump(b.output), tokens_seen: a.tokens_seen, resident: a.resident,
        first_position: a.first_position, last_position: a.last_position, evicted_tokens: a.evicted_tokens,
        compute_ns: a.compute_ns, latency_us: null,
      });
    }
    await copy.close();
  }

  if (args['probe-errors']) {
    // In-band: a step to a layer that does not exist is refused and the stream goes on.
    const query = randomTensor(next, [B, Hq, D], dtype);
    const kv = randomTensor(next, [B, Hkv, D], dtype);
    try {
      await stream.step(layers, query, kv, kv);
      emit({ kind: 'unexpected', message: 'a step to a missing layer was accepted' });
    } catch (err) {
      if (!(err instanceof Refusal)) throw err;
      emit({ kind: 'refused', step: null, layer: layers, code: err.code, code_name: err.codeName, details: err.details });
    }
    // Ending the RPC: a second `open` breaks the protocol, and the status ends the stream.
    try {
      await stream._send({ open });
      emit({ kind: 'unexpected', message: 'a second open was accepted' });
    } catch (err) {
      emit(statusLine('Decode', err));
    }
  } else {
    await stream.close();
  }

  const sorted = latencies.slice().sort((a, b) => a - b);
  emit({
    kind: 'summary',
    steps: latencies.length,
    p50_us: percentile(sorted, 50),
    p90_us: percentile(sorted, 90),
    p99_us: percentile(sorted, 99),
  });
  process.stderr.write(`${latencies.length} steps: p50 ${percentile(sorted, 50).toFixed(0)} us, ` +
    `p90 ${percentile(sorted, 90).toFixed(0)} us, p99 ${percentile(sorted, 99).toFixed(0)} us per step\n`);
}

// The policy of the i-th sequence in `batch` mode: the four policies in turn.
function batchPolicy(i, window) {
  const kinds = [
    { policy: 'EVICTION_POLICY_NONE', capacity: 4 * window + 64 },
    { policy: 'EVICTION_POLICY_STRICT', window },
    { policy: 'EVICTION_POLICY_GREEDY', window, capacity: window + 3 },
    { policy: 'EVICTION_POLICY_SINK', window, sink_tokens: 2 },
  ];
  return kinds[i % kinds.length];
}

async function runBatch(client) {
  const steps = Number(args.steps);
  const count = Number(args.sequences);
  const Hq = Number(args.heads);
  const Hkv = Number(args['kv-heads']);
  const D = Number(args['head-dim']);
  const layers = Number(args.layers);
  const window = Number(args.window);
  const dtype = DTYPES[args.dtype];
  if (!dtype) throw new RangeError(`--dtype: expected one of ${Object.keys(DTYPES).join(', ')}`);
  const next = generator(Number(args.seed));

  let session;
  try {
    session = await client.openBatch({ backend: args.backend, dtype, num_query_heads: Hq, num_kv_heads: Hkv, head_dim: D,
      num_layers: layers });
  } catch (err) {
    emit(statusLine('Batch/open', err));
    return;
  }
  emit({ kind: 'batch_opened', opened: session.opened });

  // Sequence ids 100, 101, ...; the i-th gets a prefill of i tokens on layer 0.
  const ids = Array.from({ length: count }, (_, i) => 100 + i);
  for (const [i, id] of ids.entries()) {
    const fields = batchPolicy(i, window);
    const prefill = i > 0
      ? [{ layer: 0, key: randomTensor(next, [1, Hkv, i, D], dtype), value: randomTensor(next, [1, Hkv, i, D], dtype) }]
      : [];
    const added = await session.add(id, { ...fields, prefill });
    emit({ kind: 'added', id, fields, tokens_seen: added.tokens_seen, bytes_reserved: added.bytes_reserved,
      prefill: prefill.map((p) => ({ layer: p.layer, key: dump(p.key), value: dump(p.value) })) });
  }

  const latencies = [];
  const stepOnce = async (i, layer, subset) => {
    const n = subset.length;
    const query = randomTensor(next, [n, Hq, D], dtype);
    const newKey = randomTensor(next, [n, Hkv, D], dtype);
    const newValue = randomTensor(next, [n, Hkv, D], dtype);
    const started = process.hrtime.bigint();
    const result = await session.step(layer, subset, query, newKey, newValue);
    latencies.push(Number(process.hrtime.bigint() - started) / 1e3);
    emit({
      kind: 'batch_step', step: i, layer, ids: subset, query: dump(query), new_key: dump(newKey), new_value: dump(newValue),
      output: dump(result.output), tokens_seen: result.tokens_seen, resident: result.resident,
      first_position: result.first_position, last_position: result.last_position,
      evicted_tokens: result.evicted_tokens, rollback_reach: result.rollback_reach,
      refusals: result.refusals.map((r) => ({ index: r.index, id: r.id, code: r.status.code, code_name: codeName(r.status.code) })),
    });
    return { query, newKey, newValue, result };
  };
  for (let i = 0; i < steps; i++) {
    // a changing subset, so the sequences' lengths drift apart
    const subset = ids.filter((_, j) => (i + j) % 3 !== 0);
    await stepOnce(i, i % layers, subset.length ? subset : ids);
  }

  // Snapshot the first sequence, restore it as a new one, and step both with the same token.
  const chunks = await session.snapshot(ids[0]);
  const copyId = 999;
  const restored = await session.restore(copyId, chunks);
  emit({ kind: 'batch_restored', from: ids[0], id: copyId, chunks: chunks.length, tokens_seen: restored.tokens_seen });
  const query = randomTensor(next, [1, Hq, D], dtype);
  const kv = randomTensor(next, [1, Hkv, D], dtype);
  const a = await session.step(0, [ids[0]], query, kv, kv);
  const b = await session.step(0, [copyId], query, kv, kv);
  emit({ kind: 'batch_restore_check', same: Buffer.compare(a.output.data, b.output.data) === 0 });

  // In-band refusals: an unknown id and an id twice are refused alone; the others are computed.
  const probe = await session.step(1 % layers, [ids[1], 12345, ids[2], ids[2]], randomTensor(next, [4, Hq, D], dtype),
    randomTensor(next, [4, Hkv, D], dtype), randomTensor(next, [4, Hkv, D], dtype));
  emit({ kind: 'batch_probe', tokens_seen: probe.tokens_seen,
    refusals: probe.refusals.map((r) => ({ index: r.index, id: r.id, code: r.status.code, code_name: codeName(r.status.code) })) });
  const removed = await session.remove([copyId, 4242]);
  emit({ kind: 'batch_removed', ids: removed.ids, refusals: removed.refusals.map((r) => ({ id: r.id, code: r.status.code })) });
  try {
    await session.add(ids[0], { policy: 'EVICTION_POLICY_STRICT', window });
    emit({ kind: 'unexpected', message: 'a duplicate add was accepted' });
  } catch (err) {
    if (!(err instanceof Refusal)) throw err;
    emit({ kind: 'refused', call: 'add', code: err.code, code_name: err.codeName, details: err.details });
  }
  await session.close();

  const sorted = latencies.slice().sort((x, y) => x - y);
  emit({ kind: 'summary', steps: latencies.length, p50_us: percentile(sorted, 50), p90_us: percentile(sorted, 90),
    p99_us: percentile(sorted, 99) });
}

async function main() {
  if (args.help) {
    process.stdout.write('usage: run.js --address HOST:PORT --mode info|examples|stream|batch [--steps N --policy greedy ' +
      '--window W --capacity C --layers L --prefill N --dtype float32 --seed S --probe-errors --restore-check ' +
      '--sequences N]\n');
    return;
  }
  const client = new GqaClient(args.address);
  try {
    if (args.mode === 'info') await runInfo(client);
    else if (args.mode === 'examples') await runExamples(client);
    else if (args.mode === 'stream') await runStream(client);
    else if (args.mode === 'batch') await runBatch(client);
    else throw new RangeError(`--mode: expected info, examples, stream or batch, got ${args.mode}`);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  process.stderr.write(`gqa node client: ${err.stack || err}\n`);
  process.exitCode = 1;
});
