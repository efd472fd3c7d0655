"""The dump: one PPO step's tensors on disk (the contract is spec/dump-format.md).

=========== ===================================================================================
module      what it holds
=========== ===================================================================================
keys        the one key schema: the known keys, the peers' tensor aliases, "did you mean"
write       ``write_dump`` (from inside any trainer), atomic, with its JSON sidecar
load        reading and validating a dump: one-line errors, ``weights_only`` ``.pt``, residency
sequences   the re-scoring keys ``input_ids``/``attention_mask``/``position_ids`` ``[B, P+T]``
=========== ===================================================================================

``from refppo.dump.write import write_dump`` is the trainer-side entry point.
"""

from refppo.dump.write import write_dump

__all__ = ["write_dump"]
