"""The seam mode (``[seam]``, issue #22 item 5): the rollout made by an engine in another precision,
with top-p log-probs, by a policy k iterations stale; the update reads its ``rollout_logprobs``
through the pipeline's ``rollout_correction`` stage.

Here: the config's checks, the sampler's log-probs against hand-worked values, the engine against
the trainer's own forward, the k-stale snapshots' versions, the corrected update against its naive
twin, a float32 engine that changes nothing, and resume. The dumps and ``refppo diff``, torchrun
and the demo: ``test_train_seam_run.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from refppo.models.batch import SequenceBatch, left_pad
from refppo.models.readout import response_logprobs
from refppo.models.roles import make_reference
from refppo.models.rollout import (
    RolloutConfig,
    generate_rollout,
    generate_rollout_logprobs,
    sampled_logprobs,
    score_rollout,
)
from refppo.models.tiny import tiny_actor, tiny_critic, tiny_gpt2
from refppo.pipeline.settings import Convention, Hyperparams
from refppo.pipeline.step import rollout_quantities
from refppo.train.config.seam import SeamConfig
from refppo.train.config.sections import ConfigError
from refppo.train.loop import Trainer
from refppo.train.runlog import deterministic, read_metrics
from refppo.train.seam import RolloutEngine
from refppo.train.tasks.presets import preset
from refppo.train.update import ppo_update
from refppo.train.update_config import Behaviour, MinibatchRecord, PPOUpdateConfig
from refppo.train.update_naive import ppo_update_naive

RUN = ("task.reward=rule", "task.sft_steps=3", "run.progress=false", "run.plot=false")
"""The TEST preset with the rule as reward (no reward model to train) and a short warm start."""
SEAM = ("seam.enabled=true",)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the float32 sums of the twin comparisons in a fixed order on any machine
    (as tests/train/test_models_ppo.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------ config
def test_the_seam_is_off_by_default_and_its_config_is_checked() -> None:
    cfg = preset("test")
    assert not cfg.seam.enabled and not cfg.ppo.convention.rollout.on
    on = preset("test", *SEAM, "seam.staleness=2", "ppo.rollout_is=token", "ppo.rollout_is_high=2")
    assert on.seam.staleness == 2 and on.ppo.convention.rollout.high == 2.0
    bad = {
        "ppo.rollout_is=token reads the behaviour": ("ppo.rollout_is=token",),
        r"seam.staleness=2 is set but seam.enabled=false": ("seam.staleness=2",),
        r"seam.dtype=float16, seam.logprobs=processed are set but seam.enabled=false": (
            "seam.dtype=float16",
            "seam.logprobs=processed",
            "rollout.top_p=0.9",
        ),
        r"seam.logprobs=processed renormalises": (*SEAM, "seam.logprobs=processed"),
        r"seam.dtype: expected one of": (*SEAM, "seam.dtype=int8"),
        r"seam.staleness: expected an integer >= 0": (*SEAM, "seam.staleness=-1"),
        r"seam.logprobs: expected one of": (*SEAM, "seam.logprobs=engine"),
    }
    for message, sets in bad.items():
        with pytest.raises(ConfigError, match=message):
            preset("test", *sets)
    assert preset("test", *SEAM, "seam.logprobs=processed", "rollout.top_p=0.8").seam.logprobs == "processed"


# ------------------------------------------------------------------------------- the sampler's side
def test_sampled_logprobs_raw_and_processed_hand_worked() -> None:
    """p = (0.5, 0.3, 0.2) at τ = 1, top_p = 0.6: the support is {0, 1} (mass before each entry
    0, 0.5 < 0.6; 0.8 is not), S = 0.8. Raw: log p_y; processed: log(p_y / S); the third token is
    outside the support (log 0 = −inf processed). At τ = 2 raw is log softmax(z/2)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    tokens = torch.tensor([0, 1, 2])
    cfg = RolloutConfig(top_p=0.6)
    raw = sampled_logprobs(logits, tokens, cfg, processed=False)
    proc = sampled_logprobs(logits, tokens, cfg, processed=True)
    assert raw.tolist() == pytest.approx([math.log(0.5), math.log(0.3), math.log(0.2)], abs=1e-6)
    assert proc[:2].tolist() == pytest.approx([math.log(0.625), math.log(0.375)], abs=1e-6)
    assert proc[2].item() == -math.inf
    hot = sampled_logprobs(logits, tokens, RolloutConfig(temperature=2.0), processed=False)
    z = [math.sqrt(0.5), math.sqrt(0.3), math.sqrt(0.2)]  # softmax(log p / 2) ∝ √p
    assert hot.tolist() == pytest.approx([math.log(v / sum(z)) for v in z], abs=1e-6)


def _prompts() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_gpt2(vocab_size=40, hidden=32, layers=2, heads=2, max_positions=32).eval()
    ids = torch.randint(3, 40, (6, 5))
    mask = torch.ones_like(ids)
    mask[:2, :2] = 0  # left padding
    return model, ids, mask


@pytest.mark.parametrize("top_p", [1.0, 0.7])
def test_the_engine_logprobs_are_the_sampler_and_equal_the_trainer_forward(top_p: float) -> None:
    """Same generator draws, same tokens as :func:`generate_rollout`; in float32 the raw log-probs
    equal the teacher-forced :func:`response_logprobs` (the trainer's forward; padding 0); in
    bfloat16 they differ by precision only (0 < gap < 0.05); processed = raw − log S ≥ raw."""
    model, ids, mask = _prompts()
    cfg = RolloutConfig(max_new_tokens=6, temperature=0.9, top_p=top_p, eos_token_id=2)
    plain = generate_rollout(model, ids, mask, cfg, torch.Generator().manual_seed(3))
    batch, raw = generate_rollout_logprobs(model, ids, mask, cfg, torch.Generator().manual_seed(3))
    assert torch.equal(batch.response_ids, plain.response_ids)
    assert torch.equal(batch.response_mask, plain.response_mask)
    with torch.no_grad():
        forward, _ = response_logprobs(model, batch, cfg.temperature)
    m = batch.response_mask
    assert bool((raw[~m] == 0).all())
    assert float((raw - forward).abs().max()) < 1e-5
    _, proc = generate_rollout_logprobs(
        model, ids, mask, cfg, torch.Generator().manual_seed(3), processed=True
    )
    if top_p < 1.0:
        assert bool((proc[m] >= raw[m] - 1e-6).all()) and float((proc - raw)[m].max()) > 1e-3
    else:
        assert float((proc - raw).abs().max()) < 1e-5
    half = RolloutEngine(SeamConfig(enabled=True, dtype="bfloat16"), model)
    hb, behaviour = half.rollout(model, ids, mask, cfg, torch.Generator().manual_seed(3), it=0)
    with torch.no_grad():
        fwd, _ = response_logprobs(model, hb, cfg.temperature)
    gap = float((behaviour.rollout_logprobs - fwd)[hb.response_mask].abs().max())
    assert 1e-5 < gap < 0.05, gap


def test_the_stale_engine_samples_with_the_policy_k_iterations_old() -> None:
    """k = 2: iteration it samples with version max(0, it − 2), and with that snapshot's weights
    (the engine's tokens equal a float32 copy of version v's own rollout)."""
    model, ids, mask = _prompts()
    cfg = RolloutConfig(max_new_tokens=4, eos_token_id=2)
    eng = RolloutEngine(SeamConfig(enabled=True, dtype="float32", staleness=2), model)
    kept: list[dict[str, torch.Tensor]] = []
    for it in range(5):
        kept.append({k: v.clone() for k, v in model.state_dict().items()})  # version it
        batch, b = eng.rollout(model, ids, mask, cfg, torch.Generator().manual_seed(it), it)
        v = max(0, it - 2)
        assert b.policy_version.tolist() == [v] * 6 and b.version == it
        ref = tiny_gpt2(vocab_size=40, hidden=32, layers=2, heads=2, max_positions=32).eval()
        ref.load_state_dict(kept[v])
        want = generate_rollout(ref, ids, mask, cfg, torch.Generator().manual_seed(it))
        assert torch.equal(batch.response_ids, want.response_ids), it
        with torch.no_grad():  # an "update": every version differs
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    assert eng.versions == [3, 4]


# ------------------------------------------------------------------------------------------ trainer
def _records(out: Path) -> list[dict[str, object]]:
    return [deterministic(r) for r in read_metrics(out / "metrics.jsonl")]


def test_a_float32_engine_without_correction_is_the_plain_run(tmp_path: Path) -> None:
    """seam.enabled with a float32, fresh (k = 0) engine and the correction off changes nothing:
    every metric of the plain run and its final weights bit for bit (the engine's weights are the
    policy's, its tokens the same draws); the seam metrics show a gap of float32 rounding only."""
    plain, seam = tmp_path / "plain", tmp_path / "seam"
    Trainer(preset("test", *RUN, f"run.out_dir={plain}")).train()
    Trainer(preset("test", *RUN, *SEAM, "seam.dtype=float32", f"run.out_dir={seam}")).train()
    a, b = _records(plain), _records(seam)
    for r in b:
        assert r.pop("rollout/seam_staleness") == 0.0
        assert abs(float(r.pop("rollout/seam_kl"))) < 1e-6  # type: ignore[arg-type]
        assert float(r.pop("rollout/seam_abs_log_ratio")) < 1e-6  # type: ignore[arg-type]
    assert a == b
    wa = load_file(plain / "checkpoints" / "iter_000002" / "policy.safetensors")
    wb = load_file(seam / "checkpoints" / "iter_000002" / "policy.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


STALE = (*RUN, *SEAM, "seam.staleness=2", "ppo.rollout_is=token", "ppo.rollout_is_high=2", "run.iterations=4")


def test_resume_with_the_seam_on_is_exact(tmp_path: Path) -> None:
    """k = 2, bfloat16 engine, token TIS: 4 iterations straight == 2, checkpoint, resume, 2 — every
    metric and the final policy and snapshots bit for bit; the checkpoint holds the k snapshots
    (versions 0, 1 after iteration 2) whose weights are the policy's of those iterations."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(preset("test", *STALE, "run.checkpoint_every=1", f"run.out_dir={straight}")).train()
    Trainer(preset("test", *STALE, "run.iterations=2", f"run.out_dir={split}")).train()
    resumed = Trainer(preset("test", *STALE, f"run.out_dir={split}"), resume=True)
    assert resumed.start_iteration == 2 and resumed.seam is not None
    assert resumed.seam.versions == [0, 1]
    resumed.train()
    a, b = _records(straight), _records(split)
    assert [r["rollout/seam_staleness"] for r in a] == [0.0, 1.0, 2.0, 2.0]
    assert a == b
    ck = straight / "checkpoints"
    for name in ("policy", "seam_stale_0", "seam_stale_1"):
        wa = load_file(ck / "iter_000004" / f"{name}.safetensors")
        wb = load_file(split / "checkpoints" / "iter_000004" / f"{name}.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), name
    # after iteration 4 the snapshots are versions 2 and 3: the policy after iterations 2 and 3
    for j, n in ((0, 2), (1, 3)):
        snap = load_file(ck / "iter_000004" / f"seam_stale_{j}.safetensors")
        pol = load_file(ck / f"iter_{n:06d}" / "policy.safetensors")
        assert all(torch.equal(snap[k], pol[k]) for k in snap), (j, n)


def test_seam_batch_is_a_sequence_batch() -> None:
    """The engine's batch type is the trainer's (the update selects rows of it)."""
    model, ids, mask = _prompts()
    eng = RolloutEngine(SeamConfig(enabled=True), model)
    batch, b = eng.rollout(model, ids, mask, RolloutConfig(max_new_tokens=3), torch.Generator(), it=0)
    assert isinstance(batch, SequenceBatch) and b.rollout_logprobs.dtype == torch.float32
    assert b.rollout_logprobs.shape == batch.response_mask.shape


# ------------------------------------------------------------------- the corrected update, naively
def _scored(conv: Convention, hp: Hyperparams) -> tuple[torch.nn.Module, torch.nn.Module, Any, Any, Tensor]:
    """Tiny actor and critic, a rollout of 4 rows (lengths 6, 2, 4, 1), its quantities, and behaviour
    log-probs: a bfloat16, perturbed engine's (``old`` + N(0, 0.3) on valid tokens, 0 on padding)."""
    actor = tiny_actor("gpt2", 40, seed=0, hidden=32)
    critic = tiny_critic("gpt2", 40, seed=1, hidden=32)
    pids, pm = left_pad([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], 0)
    batch = generate_rollout(
        actor, pids, pm, RolloutConfig(max_new_tokens=6), torch.Generator().manual_seed(4)
    )
    keep = batch.response_mask & (torch.arange(6) < torch.tensor([[6], [2], [4], [1]]))
    batch = SequenceBatch(batch.prompt_ids, batch.prompt_mask, batch.response_ids, keep)
    ref = make_reference(actor)
    with torch.no_grad():  # move the actor off the reference: KL terms non-zero
        for p in actor.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    scored = score_rollout(actor, ref, critic, lambda p, r: float(sum(r) % 7) / 7.0, batch)
    q = rollout_quantities(
        scores=scored.scores, old_logprobs=scored.old_logprobs, ref_logprobs=scored.ref_logprobs,
        old_values=scored.old_values, mask=batch.response_mask, hp=hp, conv=conv,
    )  # fmt: skip
    noise = 0.3 * torch.randn(scored.old_logprobs.shape, generator=torch.Generator().manual_seed(9))
    beh = torch.where(keep, scored.old_logprobs + noise, torch.zeros_like(noise))
    return actor, critic, scored, q, beh


@pytest.mark.parametrize(
    "flat",
    [
        {"rollout_is": "token", "rollout_is_low": 0.8, "rollout_is_high": 1.2},
        {"rollout_is": "sequence", "rollout_is_agg": "geometric", "rollout_is_mode": "mask",
         "rollout_is_low": 0.7, "rollout_is_high": 1.4},
    ],
    ids=["token-tis", "seq-geometric-mask"],
)  # fmt: skip
def test_the_trainers_corrected_update_equals_its_naive_twin(flat: dict[str, Any]) -> None:
    """``ppo_update`` with the engine's log-probs (``Behaviour``) equals ``ppo_update_naive`` (a
    snapshot network for π_old, prefix forwards, the ``rollout_correction`` stage's naive twin and
    the closed-form gradient scaled by w') step by step and in the final parameters; control: the
    naive update without the behaviour log-probs (the correction left off) does not."""
    conv, hp = Convention.of(**flat), Hyperparams(ent_coef=0.01)
    actor, critic, scored, q, beh = _scored(conv, hp)
    cfg = PPOUpdateConfig(ppo_epochs=1, num_minibatches=2, micro_batch_size=1, max_grad_norm=None)
    a1, c1, a2, c2, a3, c3 = (copy.deepcopy(m) for m in (actor, critic) * 3)
    recs: list[MinibatchRecord] = []
    opt1 = torch.optim.SGD([*a1.parameters(), *c1.parameters()], lr=0.05)
    pv = torch.zeros(4, dtype=torch.long)
    ppo_update(
        a1, c1, opt1, None, scored, q, hp=hp, conv=conv, cfg=cfg, generator=torch.Generator().manual_seed(0),
        on_minibatch=recs.append, behaviour=Behaviour(beh, pv, 1),
    )  # fmt: skip
    perms = [torch.cat([r.rows for r in recs])]
    opt2 = torch.optim.SGD([*a2.parameters(), *c2.parameters()], lr=0.05)
    steps = ppo_update_naive(
        a2, c2, opt2, None, scored, q, hp=hp, conv=conv, cfg=cfg, perms=perms, rollout_logprobs=beh
    )
    for r, s in zip(recs, steps, strict=True):
        for k in ("loss", "pg_loss", "vf_loss", "entropy", "actor_grad_norm"):
            assert abs(r.stats[k] - s.stats[k]) <= 1e-5 * max(1.0, abs(s.stats[k])), (
                k,
                r.stats[k],
                s.stats[k],
            )
    for p1, p2 in zip(
        [*a1.parameters(), *c1.parameters()], [*a2.parameters(), *c2.parameters()], strict=True
    ):
        torch.testing.assert_close(p1, p2, atol=1e-6, rtol=1e-5)
    off = Convention()
    opt3 = torch.optim.SGD([*a3.parameters(), *c3.parameters()], lr=0.05)
    ppo_update_naive(a3, c3, opt3, None, scored, q, hp=hp, conv=off, cfg=cfg, perms=perms)
    gap = max(
        float((p1 - p3).detach().abs().max()) for p1, p3 in zip(a1.parameters(), a3.parameters(), strict=True)
    )
    assert gap > 1e-4, gap


def test_snapshot_versions_from_a_checkpoint_are_checked() -> None:
    """A damaged ``state.json`` 'seam' entry is refused in one line, never read as other versions
    (a string's characters, a dict's keys, a negative or decreasing list)."""
    eng = RolloutEngine(SeamConfig(enabled=True, dtype="float32", staleness=2), _prompts()[0])
    eng.load_state_dict({"versions": [3, 4]})
    assert eng.versions == [3, 4]
    for bad in ("01", {"0": 1, "1": 2}, [-1, 0], [4, 3], [1.0, 2.0], [True, False]):
        with pytest.raises(ValueError, match="'versions' must be a non-decreasing list of integers >= 0"):
            eng.load_state_dict({"versions": bad})  # type: ignore[dict-item]  # the bad entries on purpose
    with pytest.raises(ValueError, match=r"3 snapshot versions for seam\.staleness=2"):
        eng.load_state_dict({"versions": [1, 2, 3]})
