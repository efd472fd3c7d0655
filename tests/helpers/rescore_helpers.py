"""Tiny checkpoints and a "trainer's scoring pass" for the re-scoring tests (nothing downloaded).

The trainer's pass is written here from the definitions, with plain transformers calls — never
through refppo's read-outs — so a wrong read-out in refppo cannot agree with it by construction.
Each bug of issue #11 is one flag of :func:`trainer_logprobs` / :func:`trainer_values`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from refppo.dump.write import write_dump
from refppo.models.tiny import Arch, tiny_config

VOCAB = 96
TAU = 0.7
PAD, EOS = 0, 2


def save_actor(tmp: Path, arch: Arch, *, seed: int = 0, dropout: float = 0.0, name: str = "actor") -> Path:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, VOCAB, hidden=32, layers=2, heads=2, dropout=dropout)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    d = tmp / name
    model.save_pretrained(d)
    return d


def save_token_critic(tmp: Path, arch: Arch, *, seed: int = 1) -> Path:
    """verl's kind of critic: ``AutoModelForTokenClassification`` with one label."""
    from transformers import AutoModelForTokenClassification

    cfg = tiny_config(arch, VOCAB, hidden=32, layers=2, heads=2, num_labels=1)
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(cfg)
    d = tmp / "critic"
    model.save_pretrained(d)
    return d


def save_reward(tmp: Path, arch: Arch, *, seed: int = 2, pad_is_eos: bool = False) -> Path:
    from transformers import AutoModelForSequenceClassification

    cfg = tiny_config(arch, VOCAB, hidden=32, layers=2, heads=2, num_labels=1)
    if pad_is_eos:
        cfg.pad_token_id = EOS
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg)
    d = tmp / "rm"
    model.save_pretrained(d)
    return d


def make_rows(B: int = 5, seed: int = 0) -> dict[str, Tensor]:
    """Left-padded prompts (lengths 1..5) + right-padded responses (lengths 2..6, most end in EOS)."""
    g = torch.Generator().manual_seed(seed)
    P, T = 5, 6
    p_len = [1, 5, 3, 2, 4][:B]
    r_len = [6, 2, 4, 5, 3][:B]
    ids = torch.full((B, P + T), PAD, dtype=torch.long)
    am = torch.zeros((B, P + T), dtype=torch.long)
    for b in range(B):
        ids[b, P - p_len[b] : P] = torch.randint(3, VOCAB, (p_len[b],), generator=g)
        am[b, P - p_len[b] : P] = 1
        resp = torch.randint(3, VOCAB, (r_len[b],), generator=g)
        if b % 2 == 0:
            resp[-1] = EOS
        ids[b, P : P + r_len[b]] = resp
        am[b, P : P + r_len[b]] = 1
    return {"input_ids": ids, "attention_mask": am, "response_mask": am[:, P:].clone()}


def _pos(am: Tensor) -> Tensor:
    return (am.cumsum(-1) - 1).clamp(min=0)


def trainer_logprobs(
    path: Path,
    rows: dict[str, Tensor],
    bug: str | None = None,
    *,
    tau: float = TAU,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> Tensor:
    """log softmax(logits/τ)[y_t] as a trainer computes it, with ``bug`` injected:
    ``no_temperature``, ``temperature_twice``, ``labels_off_by_one``, ``no_position_offset``,
    ``dropout``, or ``tau=...`` for another value."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path).to(device=device, dtype=dtype)
    model.train(bug == "dropout")
    ids, am = rows["input_ids"].to(device), rows["attention_mask"].to(device)
    T = rows["response_mask"].shape[1]
    P = ids.shape[1] - T
    kw = {} if bug == "no_position_offset" else {"position_ids": _pos(am)}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am, **kw).logits.float()
    start = P if bug == "labels_off_by_one" else P - 1
    lg = logits[:, start : start + T]
    if bug != "no_temperature":
        lg = lg / tau
    if bug == "temperature_twice":
        lg = lg / tau
    lp = torch.log_softmax(lg, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1).cpu()
    return torch.where(rows["response_mask"].bool(), lp, torch.ones(()))  # TRL-like junk on padding


def trainer_values(path: Path, rows: dict[str, Tensor], bug: str | None = None) -> Tensor:
    from transformers import AutoModelForTokenClassification

    model: Any = AutoModelForTokenClassification.from_pretrained(path).eval()
    ids, am = rows["input_ids"], rows["attention_mask"]
    T = rows["response_mask"].shape[1]
    P = ids.shape[1] - T
    with torch.no_grad():
        v = model(input_ids=ids, attention_mask=am, position_ids=_pos(am)).logits[..., 0]
    start = P if bug == "critic_late" else P - 1
    return v[:, start : start + T] * rows["response_mask"]


def trainer_scores(path: Path, rows: dict[str, Tensor], bug: str | None = None) -> Tensor:
    """The score at the last real token; ``pad_eos``: transformers' own pooling (last non-pad id);
    ``early``: one position before the last real token."""
    from transformers import AutoModelForSequenceClassification

    model: Any = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids, am = rows["input_ids"], rows["attention_mask"]
    with torch.no_grad():
        if bug == "pad_eos":
            return model(input_ids=ids, attention_mask=am, position_ids=_pos(am)).logits[:, 0]
        h = model.base_model(input_ids=ids, attention_mask=am, position_ids=_pos(am)).last_hidden_state
        per = model.score(h)[..., 0]
    last = torch.tensor([int(am[b].nonzero().max()) for b in range(ids.shape[0])])
    if bug == "early":
        last = last - 1
    return per[torch.arange(ids.shape[0]), last]


def write_rows(
    tmp: Path,
    rows: dict[str, Tensor],
    *,
    name: str = "step.safetensors",
    temperature: float = TAU,
    sampling: dict[str, Any] | None = None,
    **tensors: Tensor,
) -> Path:
    """A dump of inputs (the rows plus the given tensors; missing required keys filled with zeros);
    ``sampling``: more sidecar keys (``top_p``, ``top_k``, ``min_p``, ``logprobs_processed``)."""
    B, T = rows["response_mask"].shape
    data: dict[str, Any] = {**rows, **tensors}
    for k in ("old_logprobs", "ref_logprobs", "old_values"):
        data.setdefault(k, torch.zeros(B, T))
    data.setdefault("scores", torch.zeros(B))
    p = tmp / name
    write_dump(p, data, hparams={"temperature": temperature, **(sampling or {})})
    return p


# --- an inference engine's log-probs (issue #22 item 4), each from its definition -------------------


def save_sharp_actor(tmp: Path, arch: Arch, *, scale: float = 25.0, seed: int = 0) -> Path:
    """A tiny actor whose logits are spread like a trained LM's (std of a few nats, not ~0.1): the
    final norm's weight (and GPT-2's bias) times ``scale``, so every logit is multiplied by it."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, VOCAB, hidden=32, layers=2, heads=2)
    torch.manual_seed(seed)
    model: Any = AutoModelForCausalLM.from_config(cfg)
    norm = model.transformer.ln_f if arch == "gpt2" else model.model.norm
    with torch.no_grad():
        norm.weight.mul_(scale)
        if getattr(norm, "bias", None) is not None:
            norm.bias.mul_(scale)
    d = tmp / f"sharp-{arch}"
    model.save_pretrained(d)
    return d


def _warp(z: Tensor, tau: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> Tensor:
    """``z/τ`` through transformers' own ``TopKLogitsWarper``, ``TopPLogitsWarper``,
    ``MinPLogitsWarper`` (HF's order, ``generation/utils.py``); removed tokens at −∞."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = z / tau
    dummy = torch.zeros((x.shape[0], 1), dtype=torch.long)
    if top_k > 0:
        x = TopKLogitsWarper(top_k=top_k)(dummy, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p=top_p)(dummy, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p=min_p)(dummy, x)
    return x


def engine_rows(
    path: Path, *, tau: float = TAU, support: dict[str, Any] | None = None, seed: int = 0
) -> dict[str, Tensor]:
    """:func:`make_rows`' prompts and lengths, the responses SAMPLED token by token from the actor
    (each row unpadded, logits ``/τ``, transformers' warpers for ``support``), as an engine samples."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path).eval()
    rows = make_rows(seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    am, ids = rows["attention_mask"], rows["input_ids"].clone()
    T = rows["response_mask"].shape[1]
    P = ids.shape[1] - T
    for b in range(ids.shape[0]):
        seq = ids[b, :P][am[b, :P].bool()]
        for t in range(int(rows["response_mask"][b].sum())):
            with torch.no_grad():
                z = model(input_ids=seq.unsqueeze(0)).logits[:, -1].float()
            probs = torch.softmax(_warp(z, tau, **(support or {})), -1)
            y = torch.multinomial(probs[0], 1, generator=g)
            ids[b, P + t] = y[0]
            seq = torch.cat([seq, y])
    return {**rows, "input_ids": ids}


def engine_logprobs(
    path: Path,
    rows: dict[str, Tensor],
    *,
    tau: float = TAU,
    temperature_applied: bool = True,
    support: dict[str, Any] | None = None,
    logits_dtype: torch.dtype | None = None,
    forward_dtype: torch.dtype | None = None,
    shift: float = 0.0,
) -> Tensor:
    """The engine's reported log-probs of the sampled tokens, each row run unpadded, by definition:
    ``log softmax(x)[y] + shift`` with ``x = z/τ`` (``z`` if not ``temperature_applied``: the
    engine ignores τ); ``support``: ``x`` through transformers' own top-k / top-p / min-p warpers
    (filtered tokens at −∞, so the softmax renormalises over the kept support); ``logits_dtype``:
    ``z`` rounded to it first; ``forward_dtype``: the whole forward in it (``z`` back in float32).
    """
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path).eval()
    if forward_dtype is not None:
        model = model.to(forward_dtype)
    am, ids, rm = rows["attention_mask"], rows["input_ids"], rows["response_mask"]
    T = rm.shape[1]
    P = ids.shape[1] - T
    out = torch.ones(rm.shape)  # junk on padding
    for b in range(ids.shape[0]):
        seq = ids[b][am[b].bool()]
        n, p_len = int(rm[b].sum()), int(am[b, :P].sum())
        with torch.no_grad():
            z = model(input_ids=seq.unsqueeze(0)).logits[0, p_len - 1 : p_len - 1 + n].float()
        if logits_dtype is not None:
            z = z.to(logits_dtype).float()
        t = tau if temperature_applied else 1.0
        x = z / t if support is None else _warp(z, t, **support)
        lp = torch.log_softmax(x, -1).gather(-1, seq[p_len : p_len + n].unsqueeze(-1)).squeeze(-1)
        out[b, :n] = lp + shift
    return out


def engine_dump(
    actor: Path,
    tmp: Path,
    *,
    sidecar_tau: float = TAU,
    engine_tau: float = TAU,
    support: dict[str, Any] | None = None,
    sidecar: dict[str, Any] | None = None,
    **engine: Any,
) -> Path:
    """Rows sampled by the engine (τ = ``engine_tau``, the ``support`` filters), the trainer's
    ``old_logprobs`` at the sidecar's τ, the engine's ``rollout_logprobs`` by definition."""
    rows = engine_rows(actor, tau=engine_tau, support=support)
    eng = engine_logprobs(actor, rows, tau=engine_tau, support=support, **engine)
    return write_rows(
        tmp,
        rows,
        temperature=sidecar_tau,
        sampling={**(support or {}), **(sidecar or {})},
        old_logprobs=trainer_logprobs(actor, rows, tau=sidecar_tau),
        rollout_logprobs=eng,
    )
