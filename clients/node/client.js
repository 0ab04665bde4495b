'use strict';
// A small Node.js client for gqa.v1. The .proto is loaded at run time (no generated code).
//
//   const { GqaClient, tensor, toFloat32Array } = require('./client');
//   const client = new GqaClient('127.0.0.1:50051');
//   const out = await client.decodeStep({ query: tensor(q, [1, 4, 8]), ... });
//   const stream = await client.openStream({ num_query_heads: 4, ... });
//   const result = await stream.step(0, query, newKey, newValue);   // throws Refusal if refused
//   await stream.close();
//   const batch = await client.openBatch({ num_query_heads: 4, num_kv_heads: 2, head_dim: 8, num_layers: 2 });
//   await batch.add(7, { policy: 'EVICTION_POLICY_STRICT', window: 64 });
//   const res = await batch.step(0, [7], query, newKey, newValue);   // packed (N, ...) tensors
//
// Wire format (see docs/wire-format.md): a Tensor is little-endian, row-major bytes plus a
// dtype and a shape; float16 and bfloat16 travel as raw 16-bit words.

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const DEFAULT_PROTO_ROOT = process.env.GQA_PROTO_ROOT || path.resolve(__dirname, '..', '..', 'proto');
const PROTO_FILE = 'gqa/v1/gqa.proto';

// How protobufjs maps messages to JS objects. uint64 fields become Numbers: exact below 2**53,
// far above any token count or request id this client produces.
const LOADER_OPTIONS = {
  keepCase: true, // field names as in the .proto (request_id, new_key, ...)
  longs: Number,
  enums: String, // 'DTYPE_FLOAT32', 'EVICTION_POLICY_GREEDY'
  bytes: Buffer,
  defaults: true,
  oneofs: true, // decoded oneofs get a virtual `kind` naming the field that is set
};

const CODE_NAMES = Object.fromEntries(Object.entries(grpc.status).map(([name, code]) => [code, name]));

function loadPackage(protoRoot = DEFAULT_PROTO_ROOT) {
  const definition = protoLoader.loadSync(PROTO_FILE, { ...LOADER_OPTIONS, includeDirs: [protoRoot] });
  return grpc.loadPackageDefinition(definition).gqa.v1;
}

// ---------------------------------------------------------------------------------------------
// Tensors

// DTYPE_INT8 appears only in snapshots of int8 streams (codes), which restoreStream passes on as they are.
const ITEMSIZE = { DTYPE_FLOAT32: 4, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2 };

const scratch = new DataView(new ArrayBuffer(4));

function float32Bits(x) {
  scratch.setFloat32(0, x, true);
  return scratch.getUint32(0, true);
}

// bfloat16: the upper 16 bits of the float32, rounded to nearest even; NaN stays a quiet NaN.
function toBFloat16Bits(x) {
  const bits = float32Bits(x);
  if ((bits & 0x7fffffff) > 0x7f800000) return (bits >>> 16) | 0x0040;
  return ((bits + 0x7fff + ((bits >>> 16) & 1)) >>> 16) & 0xffff;
}

function fromBFloat16Bits(h) {
  scratch.setUint32(0, h << 16, true);
  return scratch.getFloat32(0, true);
}

// IEEE 754 binary16, round to nearest even, with subnormals, infinities and NaN.
function toFloat16Bits(x) {
  const bits = float32Bits(x);
  const sign = (bits >>> 16) & 0x8000;
  const exp = (bits >>> 23) & 0xff;
  let mant = bits & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00; // overflow -> infinity
  if (e <= 0) {
    if (e < -10) return sign; // underflows to zero
    mant |= 0x800000;
    const shift = 14 - e;
    const half = 1 << (shift - 1);
    const rest = mant & ((1 << shift) - 1);
    let m = mant >>> shift;
    if (rest > half || (rest === half && (m & 1))) m += 1;
    return sign | m;
  }
  let m = mant >>> 13;
  const rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (m & 1))) {
    m += 1;
    if (m === 0x400) {
      m = 0;
      e += 1;
      if (e >= 0x1f) return sign | 0x7c00;
    }
  }
  return sign | (e << 10) | m;
}

function fromFloat16Bits(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const e = (h >>> 10) & 0x1f;
  const m = h & 0x3ff;
  if (e === 0) return sign * m * 2 ** -24;
  if (e === 0x1f) return m ? NaN : sign * Infinity;
  return sign * (1 + m / 1024) * 2 ** (e - 15);
}

/**
 * A gqa.v1 Tensor message from numbers (a Float32Array, or any array-like of numbers),
 * row-major, with `shape` outermost first. dtype: 'DTYPE_FLOAT32' (default), 'DTYPE_FLOAT16'
 * or 'DTYPE_BFLOAT16'; half types are rounded to nearest even.
 */
function tensor(values, shape, dtype = 'DTYPE_FLOAT32') {
  const count = shape.reduce((a, b) => a * b, 1);
  if (values.length !== count) {
    throw new RangeError(`tensor: ${values.length} values do not fill shape [${shape.join(', ')}]`);
  }
  const itemsize = ITEMSIZE[dtype];
  if (!itemsize) throw new RangeError(`tensor: unknown dtype ${dtype}`);
  const data = Buffer.alloc(count * itemsize);
  for (let i = 0; i < count; i++) {
    if (dtype === 'DTYPE_FLOAT32') data.writeFloatLE(values[i], 4 * i);
    else if (dtype === 'DTYPE_FLOAT16') data.writeUInt16LE(toFloat16Bits(values[i]), 2 * i);
    else data.writeUInt16LE(toBFloat16Bits(values[i]), 2 * i);
  }
  return { dtype, shape: shape.slice(), data };
}

/** The values of a Tensor message as a Float32Array (half types widened exactly). */
function toFloat32Array(message) {
  const { dtype, data } = message;
  const itemsize = ITEMSIZE[dtype];
  if (!itemsize) throw new RangeError(`tensor: unknown dtype ${dtype}`);
  const count = data.length / itemsize;
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    if (dtype === 'DTYPE_FLOAT32') out[i] = data.readFloatLE(4 * i);
    else if (dtype === 'DTYPE_FLOAT16') out[i] = fromFloat16Bits(data.readUInt16LE(2 * i));
    else out[i] = fromBFloat16Bits(data.readUInt16LE(2 * i));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Errors

/** A step, rollback or snapshot the server refused in-band: the stream is unchanged and open. */
class Refusal extends Error {
  constructor(status, requestId) {
    super(`${CODE_NAMES[status.code] || status.code}: ${status.message}`);
    this.name = 'Refusal';
    this.code = status.code;
    this.codeName = CODE_NAMES[status.code] || String(status.code);
    this.details = status.message;
    this.requestId = requestId;
  }
}

/** Name of a gRPC status code number ('INVALID_ARGUMENT' for 3). */
function codeName(code) {
  return CODE_NAMES[code] || String(code);
}

// ---------------------------------------------------------------------------------------------
// The client

class GqaClient {
  constructor(address, { credentials = grpc.credentials.createInsecure(), options = {}, protoRoot } = {}) {
    const pkg = loadPackage(protoRoot);
    this.stub = new pkg.AttentionService(address, credentials, {
      'grpc.max_receive_message_length': 64 << 20,
      'grpc.max_send_message_length': 64 << 20,
      ...options,
    });
  }

  _unary(method, request, deadlineSeconds) {
    const deadline = new Date(Date.now() + deadlineSeconds * 1000);
    return new Promise((resolve, reject) => {
      this.stub[method](request, { deadline }, (err, response) => (err ? reject(err) : resolve(response)));
    });
  }

  /** The stateless step; rejects with a grpc ServiceError (err.code, err.details) on a bad request. */
  decodeStep(request, { deadlineSeconds = 30 } = {}) {
    return this._unary('DecodeStep', request, deadlineSeconds);
  }

  getServerInfo({ deadlineSeconds = 30 } = {}) {
    return this._unary('GetServerInfo', {}, deadlineSeconds);
  }

  /**
   * Opens a Decode stream. Resolves with a DecodeStream once the server answered `opened`;
   * rejects with the status that ended the RPC (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...).
   */
  openStream(open) {
    const stream = new DecodeStream(this.stub.Decode());
    return stream._open(open);
  }

  /**
   * Opens a stream from the chunks of `DecodeStream.snapshot()` (here or on another replica);
   * it continues exactly where the snapshot was taken.
   */
  restoreStream(chunks) {
    const stream = new DecodeStream(this.stub.Decode());
    return stream._restore(chunks);
  }

  /**
   * Opens a Batch session: many sequences, each with its own policy and length, one message
   * per layer for any subset of them. `open` is { backend, dtype, num_query_heads, num_kv_heads,
   * head_dim, num_layers }. Resolves with a BatchSession once the server answered `opened`;
   * rejects with the status that ended the RPC (INVALID_ARGUMENT, FAILED_PRECONDITION, ...).
   */
  openBatch(open) {
    const session = new BatchSession(this.stub.Batch());
    return session._open(open);
  }

  close() {
    this.stub.close();
  }
}

/**
 * One Decode stream. Requests may be pipelined: each call returns a promise settled by the
 * response carrying its request_id (the server answers in order).
 */
class DecodeStream {
  constructor(call) {
    this.call = call;
    this.nextId = 0;
    this.pending = new Map();
    this.ended = null; // the error that ended the RPC, once it has ended
    this.opened = null;
    this.status = null; // the final status, once the RPC has ended
    call.on('data', (response) => this._onResponse(response));
    call.on('error', (err) => this._fail(err));
    // 'error' (a status other than OK) comes before 'status', so `ended` keeps the real cause.
    call.on('status', (status) => {
      this.status = status;
      this._fail(Object.assign(new Error(`the stream ended: ${codeName(status.code)} ${status.details}`), status));
    });
  }

  _send(fields) {
    if (this.ended) return Promise.reject(this.ended);
    const requestId = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(requestId, { resolve, reject });
      this.call.write({ request_id: requestId, ...fields });
    });
  }

  async _open(open) {
    const response = await this._send({ open });
    this.opened = response.opened;
    return this;
  }

  async _restore(chunks) {
    if (this.ended) throw this.ended;
    const requestId = this.nextId++;
    const opened = new Promise((resolve, reject) => this.pending.set(requestId, { resolve, reject }));
    for (const chunk of chunks) this.call.write({ request_id: requestId, restore: chunk });
    this.opened = (await opened).opened;
    return this;
  }

  _onResponse(response) {
    const waiter = this.pending.get(response.request_id);
    if (!waiter) return;
    // A snapshot answers with several chunks; the last one settles the request with them all.
    if (response.kind === 'snapshot') {
      (waiter.chunks = waiter.chunks || []).push(response.snapshot);
      if (!response.snapshot.last) return;
      response.chunks = waiter.chunks;
    }
    this.pending.delete(response.request_id);
    const body = response[response.kind];
    if (response.kind === 'error') waiter.reject(new Refusal(body, response.request_id));
    else if (body && body.status && body.status.code !== 0) waiter.reject(new Refusal(body.status, response.request_id));
    else waiter.resolve(response);
  }

  _fail(err) {
    if (!this.ended) this.ended = err;
    for (const { reject } of this.pending.values()) reject(err);
    this.pending.clear();
  }

  /**
   * Appends one token to `layer` and attends. query (B, Hq, D), newKey and newValue (B, Hkv, D)
   * are Tensor messages (see `tensor`). Resolves with the StepResult; rejects with a Refusal
   * (in-band, stream still usable) or with the grpc error that ended the RPC.
   */
  async step(layer, query, newKey, newValue) {
    const response = await this._send({ step: { layer, query, new_key: newKey, new_value: newValue } });
    return response.step;
  }

  /** Drops the last `count` tokens of `layer` (or of every layer when layer is null). */
  async rollback(count, layer = null) {
    const rollback = layer === null ? { count, all_layers: true } : { count, layer };
    const response = await this._send({ rollback });
    return response.rollback;
  }

  /** The stream's complete state, as the list of SnapshotChunk messages restoreStream takes. */
  async snapshot() {
    const response = await this._send({ snapshot: {} });
    return response.chunks;
  }

  /** Half-closes the stream (frees its caches) and waits for the server to finish it. */
  close() {
    if (this.status) return Promise.resolve(this.status);
    return new Promise((resolve) => {
      this.call.on('status', resolve);
      this.call.end();
    });
  }

  /** Cancels the RPC at once. */
  cancel() {
    this.call.cancel();
  }
}

/**
 * One Batch session (see gqa.proto, `rpc Batch`). Requests may be pipelined; each call returns
 * a promise settled by the response carrying its request_id. Per-sequence refusals of a step,
 * remove or rollback are listed in the result's `refusals` (index, id, status); a refused add or
 * snapshot, or a step message refused as a whole, rejects with a Refusal. The session stays open
 * either way.
 */
class BatchSession {
  constructor(call) {
    this.call = call;
    this.nextId = 0;
    this.pending = new Map();
    this.ended = null;
    this.opened = null;
    this.status = null;
    call.on('data', (response) => this._onResponse(response));
    call.on('error', (err) => this._fail(err));
    call.on('status', (status) => {
      this.status = status;
      this._fail(Object.assign(new Error(`the session ended: ${codeName(status.code)} ${status.details}`), status));
    });
  }

  _send(fields, count = 1) {
    if (this.ended) return Promise.reject(this.ended);
    const requestId = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(requestId, { resolve, reject });
      const list = Array.isArray(fields) ? fields : [fields];
      for (const f of list) this.call.write({ request_id: requestId, ...f });
    });
  }

  async _open(open) {
    this.opened = await this._send({ open });
    return this;
  }

  _onResponse(response) {
    const waiter = this.pending.get(response.request_id);
    if (!waiter) return;
    const body = response[response.kind];
    if (response.kind === 'snapshot') {
      if (body.status.code !== 0) {
        this.pending.delete(response.request_id);
        waiter.reject(new Refusal(body.status, response.request_id));
        return;
      }
      (waiter.chunks = waiter.chunks || []).push(body.chunk);
      if (!body.chunk.last) return;
      this.pending.delete(response.request_id);
      waiter.resolve(waiter.chunks);
      return;
    }
    this.pending.delete(response.request_id);
    if (body && body.status && body.status.code !== 0) waiter.reject(new Refusal(body.status, response.request_id));
    else waiter.resolve(body);
  }

  _fail(err) {
    if (!this.ended) this.ended = err;
    for (const { reject } of this.pending.values()) reject(err);
    this.pending.clear();
  }

  /**
   * Adds sequence `id` (a Number below 2**53): { policy, window, capacity, sink_tokens, prefill }
   * as in OpenStream, prefill entries (1, Hkv, n, D). Resolves with BatchAdded; rejects with a
   * Refusal (RESOURCE_EXHAUSTED over the budget, INVALID_ARGUMENT for an id in use, ...).
   */
  add(id, fields = {}) {
    return this._send({ add: { id, ...fields } });
  }

  /** Adds sequence `id` from snapshot chunks (of a Decode stream with batch_size 1, or `snapshot`). */
  restore(id, chunks) {
    return this._send(chunks.map((chunk) => ({ add: { id, restore: chunk } })));
  }

  /**
   * One layer's token for sequences `ids`: query (N, Hq, D), newKey and newValue (N, Hkv, D)
   * Tensor messages, row i for ids[i]. Resolves with BatchStepResult: output (N, Hq, D) and the
   * per-sequence arrays (tokens_seen, resident, first_position, last_position, evicted_tokens,
   * rollback_reach) in the order of ids, and `refusals` for the sequences refused.
   */
  step(layer, ids, query, newKey, newValue) {
    return this._send({ step: { layer, ids, query, new_key: newKey, new_value: newValue } });
  }

  /** Ends sequences, freeing their bytes; resolves with BatchRemoved (ids, refusals). */
  remove(ids) {
    return this._send({ remove: { ids } });
  }

  /** Drops counts[i] tokens of ids[i], of `layer` or of every layer (null). */
  rollback(ids, counts, layer = null) {
    const rollback = layer === null ? { ids, counts, all_layers: true } : { ids, counts, layer };
    return this._send({ rollback });
  }

  /** Sequence `id`'s state as SnapshotChunk messages (`restore` here, or restoreStream). */
  snapshot(id) {
    return this._send({ snapshot: { id } });
  }

  /** Half-closes the session (every sequence is freed) and waits for the server to finish it. */
  close() {
    if (this.status) return Promise.resolve(this.status);
    return new Promise((resolve) => {
      this.call.on('status', resolve);
      this.call.end();
    });
  }

  cancel() {
    this.call.cancel();
  }
}

module.exports = {
  GqaClient,
  DecodeStream,
  BatchSession,
  Refusal,
  codeName,
  loadPackage,
  tensor,
  toFloat32Array,
  toFloat16Bits,
  fromFloat16Bits,
  toBFloat16Bits,
  fromBFloat16Bits,
  status: grpc.status,
};
