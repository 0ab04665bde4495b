"""Attention and KV-cache storage, one module per backend, selected by name (see ``registry``).

Nothing here imports ``grpc`` or ``prometheus_client``.
"""
