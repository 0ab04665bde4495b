"""The ``gqa-serve`` command line: parsing, the sub-commands and what they run.

``main`` (the entry point, ``python -m service.cli``, and ``step``), ``commands`` (``serve``
and ``demo``), ``common`` (flags and helpers the commands share), ``demo`` and ``loadgen`` (what
the ``demo`` and ``bench`` commands run, through the Python client). May import the composition root (``service.server``),
the shared modules (``config``, ``vocab``, ``errors``), the Python client (``gqa_client``) and
``backends.reference``; nothing under ``service/`` imports this folder.
"""
