"""The data plane every front end calls: admission, streams and sequences, the batcher, steps.

``engine`` (the ``Engine``: admission and budget, streams, sequences, restores), ``batcher``
(the queue and the compute pool every step goes through), ``plane`` (a Batch session's
sequences as one native call per message), ``report`` (the records and the observer interface
the engine, batcher and plane share), ``snapshot`` (the snapshot format), ``tensors`` (protobuf
tensors to and from torch). May import ``backends``, ``quant`` (through ``backends``) and the
shared modules (``config``, ``vocab``, ``errors``, ``api``); never the transport, metrics or
command line.
"""
