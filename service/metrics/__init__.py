"""What an operator watches: Prometheus families, the gRPC timing interceptor, the HTTP listener.

``recorder`` (the ``ServiceMetrics`` families, fed by the engine's observer interface),
``rpc`` (the ``grpc_server_*`` interceptor), ``listener`` (the bounded HTTP server on the
metrics port), ``pages`` (``/healthz``, ``/readyz`` and the status page, ``status_page.html``).
Observes the engine and wraps the transport, so it may import both and the shared modules;
only the composition root (``service.server``) imports it.
"""
