"""The gRPC service: the transport, the engine, the metrics and the command line, by folder (README "Code map")."""

__version__ = "0.1.0"
