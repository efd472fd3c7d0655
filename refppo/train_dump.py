"""Old import path of the trainer's dump of one iteration: it lives in :mod:`refppo.train.dump`."""

from __future__ import annotations

from refppo.train.dump import dump_path, request, sidecar_conventions

__all__ = ["dump_path", "request", "sidecar_conventions"]
