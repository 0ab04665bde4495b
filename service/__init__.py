"""The gRPC service: transport (servicer), configuration, stream engine, metrics."""

__version__ = "0.1.0"
