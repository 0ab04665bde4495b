"""The gRPC front ends: bytes in, the engine's calls, bytes out.

``servicer`` (the gqa.v1 service: ``Decode``, ``DecodeStep``, snapshots, server information),
``decode_step`` (a Decode step's checks and reply bytes), ``session`` (a Decode stream's
read-ahead and close), ``batch_rpc`` (the ``Batch`` stream's handler), ``batch_session`` (one
Batch session's requests), ``batch_reply`` (a Batch step's reply bytes), ``bytes_in_place``
(a reply's ``bytes`` written in place before it is sent), ``wire`` (step requests read from
their bytes), ``statuses`` (the one mapping of an exception to a gRPC
status), ``security`` (TLS, the bearer token, the status interceptor), ``handlers`` (what kind of
gRPC handler a method has). May import the engine (``service.engine``) and the shared modules;
never ``backends`` (the engine owns every cache) and never the metrics.
"""
