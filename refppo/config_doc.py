"""Old import path of the config keys' documentation: it lives in :mod:`refppo.config.doc`."""

from __future__ import annotations

from refppo.config.doc import config_keys, describe_config, field_docs, plain, sections

__all__ = ["config_keys", "describe_config", "field_docs", "plain", "sections"]
