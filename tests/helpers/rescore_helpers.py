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
    **tensors: Tensor,
) -> Path:
    """A dump of inputs (the rows plus the given tensors; missing required keys filled with zeros)."""
    B, T = rows["response_mask"].shape
    data: dict[str, Any] = {**rows, **tensors}
    for k in ("old_logprobs", "ref_logprobs", "old_values"):
        data.setdefault(k, torch.zeros(B, T))
    data.setdefault("scores", torch.zeros(B))
    p = tmp / name
    write_dump(p, data, hparams={"temperature": temperature})
    return p
