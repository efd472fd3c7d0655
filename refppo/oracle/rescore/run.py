"""One re-scoring run: the dump's rows checked against each model, re-scored through
:class:`refppo.oracle.rescore.readouts.Rescorer` and compared with the dump key of its role.

A mismatch is handed to :func:`refppo.oracle.rescore.diagnose.diagnose_item`. With the actor and
a dump holding ``rollout_logprobs``, the engine's log-probs are compared with the actor's re-score
as well (:func:`refppo.oracle.rescore.engine.compare_engine`, one more item, role ``engine``).
The checkpoints are loaded here (:func:`load_models`; transformers is imported only then, when a
model flag is given). Before any forward pass the dump's token ids must lie in the model's
vocabulary and its positions in a learned position table (a raw ``IndexError`` deep inside the
model otherwise).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from refppo.dump.load import Dump
from refppo.dump.sequences import RescoreError, sequence_batch
from refppo.errors import DumpError
from refppo.models.batch import position_ids_from_mask
from refppo.oracle.rescore.diagnose import diagnose_item
from refppo.oracle.rescore.engine import ENGINE_KEY, compare_engine
from refppo.oracle.rescore.readouts import (
    LOGPROB_ROLES,
    RescoreItem,
    Rescorer,
    Variant,
    _learned_positions,
    compare_mask,
    compare_rescore,
    precision_stats,
    temperature_of,
    tolerance_for,
)


def rescore_dump(
    dump: Dump,
    models: dict[str, nn.Module],
    keys: dict[str, str],
    *,
    device: str = "cpu",
    ratio_eps: float = 0.01,
    diagnose: bool = True,
) -> list[RescoreItem]:
    """Re-score the dump with each role's model in ``models`` and compare with ``keys[role]``."""
    if not dump.has("input_ids"):
        raise DumpError(
            f"{dump.path}: re-scoring needs input_ids and attention_mask [B, P+T] in the dump "
            "(spec/dump-format.md, 'Re-scoring keys')"
        )
    check_device(device)
    dev = torch.device(device)
    batch = sequence_batch(dump.tensors, dump.mask).to(dev)
    tau = temperature_of(dump)
    items = []
    for role, model in models.items():
        key = keys[role]
        if not dump.has(key):
            raise DumpError(f"{dump.path}: --{role} is given but the dump has no {key} to compare with")
        _check_ids_fit(dump, role, model)
        model.to(dev)
        r = Rescorer(role, model, batch, dev)
        dtype = next(model.parameters()).dtype
        tol = tolerance_for(dump, dtype)
        cmp = compare_mask(dump, role)
        ref = r.run(Variant(tau))
        item = RescoreItem(role, key, compare_rescore(key, dump.tensors[key], ref, cmp, tol))
        if role in LOGPROB_ROLES:
            item.precision = _precision_report(r, dump, key, ref, ratio_eps, tau)
        if not item.ok and diagnose:
            diagnose_item(item, r, dump, ref, tol, tau)
        items.append(item)
        if role == "actor" and dump.has(ENGINE_KEY):
            if key == "old_logprobs":
                items.append(compare_engine(r, dump, ref, tol, tau, ratio_eps, diagnose=diagnose))
            else:
                item.notes.append(
                    f"{ENGINE_KEY} not compared: with --actor-key {key} the actor is the update-step policy, "
                    "not the one that sampled"
                )
    return items


def check_device(device: str) -> None:
    """One line for a device this machine does not have (torch raises an AssertionError for CUDA)."""
    try:
        kind = torch.device(device).type
    except RuntimeError as exc:
        raise RescoreError(f"--device {device}: {exc}") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise RescoreError(f"--device {device}: CUDA is not available on this machine")


def _check_ids_fit(dump: Dump, role: str, model: nn.Module) -> None:
    """Token ids below the model's vocabulary size and position ids within its positions (an
    embedding lookup out of range is a raw IndexError deep inside the model otherwise)."""
    cfg = getattr(model, "config", None) or getattr(getattr(model, "model", None), "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    ids = dump.tensors["input_ids"]
    if vocab is not None and int(ids.max()) >= int(vocab):
        rows = sorted({int(b) for b in (ids >= int(vocab)).nonzero()[:, 0].tolist()})[:8]
        raise DumpError(
            f"{dump.path}: input_ids: ids up to {int(ids.max())} in rows {rows}, but the --{role} "
            f"model's vocabulary has {int(vocab)} tokens (another tokenizer or checkpoint?)"
        )
    _check_positions_fit(dump, role, model)


def _check_positions_fit(dump: Dump, role: str, model: nn.Module) -> None:
    """Positions fed to a model with a learned absolute position table (GPT-2's ``wpe``) must be
    rows of it. Rotary models (Llama, Qwen2) compute their angles for any position, so
    ``max_position_embeddings`` is no limit there and nothing is refused. Checked: the positions
    the re-score feeds, ``clamp(cumsum(attention_mask) − 1, 0)``
    (:func:`refppo.models.batch.position_ids_from_mask`), always; and the dump's ``position_ids`` when
    given (the diagnosis feeds them; a table that cannot hold the trainer's positions is not the
    trainer's model). The diagnosis skips its ``arange(P+T)`` hypothesis when that does not fit."""
    table = _learned_positions(model)
    if table is None:
        return
    checked = [("attention_mask", position_ids_from_mask(dump.tensors["attention_mask"]))]
    if dump.has("position_ids"):
        checked.append(("position_ids", dump.tensors["position_ids"]))
    name, n_pos = table
    for key, pos in checked:
        if int(pos.max()) < n_pos:
            continue
        rows = sorted({int(b) for b in (pos >= n_pos).nonzero()[:, 0].tolist()})[:8]
        what = "positions" if key == "position_ids" else "real tokens give positions"
        raise DumpError(
            f"{dump.path}: {key}: {what} up to {int(pos.max())} in rows {rows}, but the --{role} model's "
            f"learned position table ({name}) has {n_pos} positions (0..{n_pos - 1})"
        )


def _precision_report(
    r: Rescorer, dump: Dump, key: str, ref32: Tensor, eps: float, tau: float
) -> dict[str, dict[str, float]]:
    """Statistics of the dump against refppo's re-score, and of a bf16 re-score of the same rows."""
    d = dump.tensors[key]
    out = {f"dump_vs_{_dt(r)}": precision_stats(d, ref32, dump.mask, eps)}
    if _dt(r) != "bfloat16":
        ref16 = r.in_dtype(torch.bfloat16).run(Variant(tau))
        out["dump_vs_bfloat16"] = precision_stats(d, ref16, dump.mask, eps)
        out[f"bfloat16_vs_{_dt(r)}"] = precision_stats(ref16, ref32, dump.mask, eps)
    return out


def _dt(r: Rescorer) -> str:
    return str(next(r.model.parameters()).dtype).replace("torch.", "")


SCORING_DTYPES: dict[str, torch.dtype | None] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "checkpoint": None,
}
"""``--dtype``: the re-scoring precision (default float32; ``checkpoint``: as stored — transformers
5 loads a bf16 checkpoint in bf16)."""


def load_models(
    actor: str | None,
    ref: str | None,
    critic: str | None,
    reward_model: str | None,
    dtype: str = "float32",
) -> dict[str, nn.Module]:
    """Each given local checkpoint directory, loaded for its role (eval mode), cast to ``dtype``."""
    from refppo.dump.sequences import check_model_dir, load_causal_lm, load_value_model
    from refppo.models.loading import load_reward_model

    loaders: dict[str, tuple[str | None, Callable[[str], nn.Module]]] = {
        "actor": (actor, lambda p: load_causal_lm("actor", p)),
        "ref": (ref, lambda p: load_causal_lm("ref", p)),
        "critic": (critic, load_value_model),
        "reward-model": (
            reward_model,
            lambda p: load_reward_model(check_model_dir("reward-model", p)).eval(),
        ),
    }
    cast = SCORING_DTYPES[dtype]
    models = {role: load(path) for role, (path, load) in loaders.items() if path is not None}
    return {role: (m if cast is None else m.to(cast)) for role, m in models.items()}
