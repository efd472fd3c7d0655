"""refppo's half of :mod:`peers.group_estimators`: the parameters that reproduce each peer
estimator and refppo's advantages for them.

:data:`SETTINGS` maps each peer result key to refppo's core call, :data:`CONTRASTS` flips one
parameter (the peer must then differ), :data:`VIA_PRESET` names the keys also checked through
``refppo.pipeline.rollout.critic_free_advantages`` under ``--preset PEER --set advantage=EST``.
:func:`refppo_result` composes ``refppo.core.group`` (``[B, T]`` advantages, ``B, T`` from the
batch's mask) and :func:`preset_result` goes through the pipeline. refppo is imported inside the
functions only, so the peers' half (a side venv) can import this module's constants.
"""

from __future__ import annotations

from typing import Any

BETA, GAMMA = 0.05, 0.9
"""The KL coefficient in the token rewards (REINFORCE++) and the REINFORCE++ discount."""

# refppo parameters reproducing each peer key: (function, kwargs). "t" = token rewards input.
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "verl.grpo": ("group", {"estimator": "grpo", "eps": 1e-6, "singleton": "score"}),
    "verl.grpo_nostd": ("group", {"estimator": "dr-grpo", "singleton": "score"}),
    "verl.grpo_vectorized": ("group", {"estimator": "grpo", "eps": 1e-6, "singleton": "score"}),
    "verl.rloo": ("group", {"estimator": "rloo", "singleton": "score"}),
    "verl.rloo_vectorized": ("group", {"estimator": "rloo", "singleton": "zero"}),
    "verl.rpp_baseline": ("group", {"estimator": "reinforce++-baseline", "singleton": "score"}),
    "verl.rpp": ("rpp", {"gamma": GAMMA}),
    "skyrl.grpo": ("group", {"estimator": "grpo", "eps": 1e-6, "singleton": "score"}),
    "skyrl.grpo_nostd": ("group", {"estimator": "dr-grpo", "singleton": "score"}),
    "skyrl.rloo": ("group", {"estimator": "rloo", "singleton": "zero"}),
    "skyrl.rpp": ("rpp", {"gamma": GAMMA}),
    "openrlhf.group_norm": ("ogroup", {"estimator": "grpo", "eps": 1e-9}),
    "openrlhf.dr_grpo": ("ogroup", {"estimator": "dr-grpo"}),
    "openrlhf.rloo": ("ogroup", {"estimator": "rloo"}),
    "openrlhf.reinforce_baseline": (
        "ogroup",
        {"estimator": "reinforce++-baseline", "whiten_unbiased": False, "whiten_eps_form": "clamp"},
    ),
    "openrlhf.reinforce": ("orpp", {"gamma": GAMMA, "whiten_unbiased": False, "whiten_eps_form": "clamp"}),
    # issue #13 item 3: the further estimators and REINFORCE++ over masks with interior holes
    "verl.opo": ("group", {"estimator": "opo", "singleton": "score"}),
    "verl.gpg": ("group_z", {"estimator": "gpg", "singleton": "score"}),
    "verl.grpo_passk": ("group_ns", {"estimator": "grpo-passk", "eps": 1e-6, "singleton": "error"}),
    "verl.gdpo": ("gdpo", {"estimator": "grpo", "eps": 1e-6, "singleton": "score"}),
    "verl.rpp_holes": ("rpp_h", {"gamma": GAMMA, "holes": "skip"}),
    "openrlhf.flash_reinforce": ("ogroup", {"estimator": "flash-reinforce"}),
    "openrlhf.reinforce_holes": (
        "orpp_h",
        {"gamma": GAMMA, "whiten_unbiased": False, "whiten_eps_form": "clamp", "holes": "zero"},
    ),
}

# Each peer difference, flipped: the peer must then DIFFER from refppo on this batch (> 1e-6), which
# shows the parameter is needed (and that the batch exercises it).
CONTRASTS: dict[str, dict[str, Any]] = {
    "verl.grpo": {"singleton": "zero"},
    "verl.rloo": {"singleton": "zero"},
    "verl.rloo_vectorized": {"singleton": "score"},
    "skyrl.rloo": {"singleton": "score"},
    "verl.grpo_nostd": {"estimator": "grpo"},
    "verl.rpp_baseline": {"singleton": "zero"},
    "openrlhf.group_norm": {"unbiased_std": False},
    "openrlhf.reinforce_baseline": {"whiten_unbiased": True},
    "openrlhf.reinforce": {"whiten_unbiased": True},
    "openrlhf.rloo": {"estimator": "dr-grpo"},
    "verl.rpp": {"gamma": 1.0},
    "verl.opo": {"estimator": "dr-grpo"},
    "verl.gpg": {"estimator": "dr-grpo"},
    "verl.grpo_passk": {"scale_by_std": False},
    "verl.gdpo": {"unbiased_std": False},
    "verl.rpp_holes": {"holes": "zero"},
    "openrlhf.flash_reinforce": {"estimator": "dr-grpo"},
    "openrlhf.reinforce_holes": {"holes": "skip"},
}

# The peer keys that are also checked through the preset variant (``--preset PEER --set
# advantage=EST``): refppo.pipeline.rollout.critic_free_advantages under the preset's resolved conventions.
VIA_PRESET: dict[str, tuple[str, str]] = {
    "verl.opo": ("verl", "opo"),
    "verl.gpg": ("verl", "gpg"),
    "verl.grpo_passk": ("verl", "grpo-passk"),
    "openrlhf.flash_reinforce": ("openrlhf", "flash-reinforce"),
}


def refppo_result(key: str, x: dict[str, Any], override: dict[str, Any] | None = None) -> Any:
    """refppo's advantages ``[B, T]`` for the peer result ``key`` (its :data:`SETTINGS`, overridden)."""
    import torch

    from refppo.core.group import group_advantages, reinforce_pp_advantages
    from refppo.core.normalize import normalize

    kind, kw = SETTINGS[key]
    kw = {**kw, **(override or {})}
    m = x["mask"].bool()
    B, T = m.shape
    if kind == "group":
        return group_advantages(x["scores"], x["index"], m, **kw)
    if kind == "group_z":
        return group_advantages(x["score_tokens_z"].sum(1), x["index"], m, **kw)
    if kind == "group_ns":
        return group_advantages(x["scores"], x["index_ns"], m, **kw)
    if kind == "gdpo":  # GRPO per reward component (one here), then verl's masked_whiten
        return normalize(group_advantages(x["scores"], x["index"], m, **kw), m, "masked", unbiased=True)
    if kind == "rpp":
        return reinforce_pp_advantages(x["token_rewards"], m, **kw)
    if kind == "rpp_h":
        return reinforce_pp_advantages(x["token_rewards"], x["h_mask"].bool(), **kw)
    o_index = torch.arange(B) // 4  # OpenRLHF: rows sorted by prompt, n_samples_per_prompt = 4
    penalty = torch.where(m, -BETA * x["o_kl"], torch.zeros((), dtype=torch.float64))
    if kind == "ogroup":
        return group_advantages(x["o_scores"], o_index, m, token_penalty=penalty, **kw)
    if kind == "orpp_h":  # the score at the last valid token, −β·KL on the valid ones
        m = x["h_mask"].bool()
        penalty = torch.where(m, -BETA * x["o_kl"], torch.zeros((), dtype=torch.float64))
    last = m.sum(1) - 1 if kind == "orpp" else T - 1 - m.long().flip(1).argmax(1)
    onehot = torch.zeros(B, T, dtype=torch.float64).scatter(1, last.unsqueeze(1), 1.0)
    return reinforce_pp_advantages(onehot * x["o_scores"].unsqueeze(1) + penalty, m, **kw)


def preset_result(key: str, x: dict[str, Any]) -> Any:
    """refppo's raw advantages for ``key`` through the pipeline: ``--preset PEER --set advantage=EST``."""

    import torch

    from refppo.oracle.presets.registry import resolve_preset
    from refppo.pipeline.rollout import critic_free_advantages
    from refppo.pipeline.settings import FLAT, Convention, Hyperparams

    peer, est = VIA_PRESET[key]
    conv_d, _ = resolve_preset(peer, advantage=est)
    conv = Convention.from_dict({k: v for k, v in conv_d.items() if k in FLAT})
    m, f64 = x["mask"].bool(), torch.float64
    B, T = m.shape
    if peer == "verl":  # verl folds the token-level rewards (the score only here: β = 0)
        tl = x["score_tokens_z" if est == "gpg" else "score_tokens"]
        index = x["index_ns" if est == "grpo-passk" else "index"]
        scores, kl, hp = tl.sum(1), torch.zeros_like(tl), Hyperparams(kl_coef=0.0)
    else:  # OpenRLHF: the raw score, −β·KL as its return-to-go
        tl, index = torch.zeros(B, T, dtype=f64), torch.arange(B) // 4
        scores, kl, hp = x["o_scores"], torch.where(m, x["o_kl"], 0.0), Hyperparams(kl_coef=BETA)
    return critic_free_advantages(
        scores=scores, kl=kl, rewards=tl, mask=m, value_mask_=m, group_index=index, hp=hp, conv=conv
    )
