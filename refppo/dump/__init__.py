"""The dump: one PPO step's tensors on disk (the contract is spec/dump-format.md).

=========== ===================================================================================
module      what it holds
=========== ===================================================================================
keys        the one key schema: the known keys, the peers' tensor aliases, "did you mean"
write       ``write_dump`` (from inside any trainer), atomic, with its JSON sidecar
files       reading the file (``weights_only`` ``.pt``, ``.npz`` without pickles) and its sidecar
load        validating a dump into a :class:`refppo.dump.load.Dump`: one-line errors
step        a v2 dump's step layout: ranks, micro-batches, ``separate_critic``
sequences   the re-scoring keys ``input_ids``/``attention_mask``/``position_ids`` ``[B, P+T]``
tolerances  the oracle's tolerances by the dump's precision
residency   pages of compared keys and the C heap handed back to the OS
=========== ===================================================================================

``from refppo.dump.write import write_dump`` is the trainer-side entry point.
"""

from refppo.dump.write import write_dump

__all__ = ["write_dump"]
