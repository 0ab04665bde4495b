"""The data plane every front end calls: admission, streams and sequences, the batcher, steps.

``engine`` (the ``Engine``: admission against the budget, opening, stepping and closing
streams, the reaper), ``stream`` (a stream's record, its configuration's checks, its caches'
building), ``batcher`` (the queue and the compute pool every step goes through),
``placement`` (whether a step or a message runs on the event loop or on the workers),
``plane`` (a Batch session's sequences as one native call per message), ``stateless`` (the
stateless ``DecodeStep``), ``report`` (the records and the observer interface the engine,
batcher and plane share), ``snapshot`` (the snapshot format), ``tensors`` (protobuf tensors
to and from torch). May import ``backends`` and the shared modules (``config``, ``vocab``, ``errors``,
``api``); never the transport, the metrics or the command line.
"""
