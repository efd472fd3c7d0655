"""Dump makers for ``tools/validate_presets.py``: each runs in a peer's side venv, imports nothing
from refppo, calls the peer's own installed functions and writes ``.pt`` dumps + sidecars."""
