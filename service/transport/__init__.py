"""The gRPC front ends: bytes in, the engine's calls, bytes out.

``servicer`` (``Decode``, snapshots, health), ``batch_rpc`` (the ``Batch`` stream),
``session`` (a Decode stream's read-ahead and close), ``wire`` (step messages read and written
as bytes), ``handlers`` (what kind of gRPC handler a method has), ``security`` (TLS, the bearer
token and the status-sanitising interceptors). May import the engine (``service.engine``) and
the shared modules; never ``backends`` (the engine owns every cache) and never the metrics.
"""
