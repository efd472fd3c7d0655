"""The peer presets against the peers' OWN installed code, as dumps.

``tools/peers presets [--venv V] [--keep DIR] [--verbose]`` (``tests/peers/test_peer_validation.py``,
``tests/peers/test_holes_peers.py``). A ``files`` request of :mod:`peers.harness` per side venv:

1. The dump makers of :mod:`peers.makers` run in the side venvs built by
   ``tools/build_peer_venvs.sh``: ``verl-openrlhf`` (verl 0.9.1, OpenRLHF 0.11.2) and
   ``skyrl-areal`` (SkyRL-train 0.3.1, AReaL 1.0.4), each installed ``--no-deps`` with the inert
   stand-ins of :mod:`peers.stubs`, import nothing from refppo: they draw random right-padded
   batches (junk on the padding), compute every quantity with the peer's own functions (the
   docstring of each maker lists what is called and the one-line glue restated because the real
   caller wants Ray workers or batch objects) and write one dump + sidecar + the ``--set`` keys per
   case. ``trl`` (TRL 1.12.0) runs TRL's whole ``PPOTrainer.train`` (:mod:`peers.makers.trl_ppo`,
   captured with refppo's tracer ``refppo.capture.adapters.trl``: refppo is on that venv's path).
2. refppo's half runs ``refppo diff DUMP --preset <peer> --set ...`` on each dump
   (:func:`peers.checks.preset_case`), printing the verdict, the max error and the command that
   reproduces it. A case with a *control* (``NAME.control.json``: the option the case exercises
   flipped) also needs that diff NOT to match (else the case proves nothing).

Critic-free cases (issue #13: GRPO, Dr. GRPO, RLOO, REINFORCE++ and its baseline, no critic in the
dump; and verl's ``opo``, ``gpg``, ``grpo_passk`` and OpenRLHF's ``flash_reinforce``) come from
:mod:`peers.makers.critic_free`; their units are named ``PEER:critic-free`` and checked under
``--preset PEER`` with the case's ``--set advantage=...``. Multi-turn cases with holes come from
:mod:`peers.makers.holes` (called by each peer's maker). verl's GSPO steps (``policy_loss=gspo``,
verl's own ``compute_policy_loss_gspo``) come from :mod:`peers.makers.verl_gspo` (unit
``verl:gspo``). ``oat`` (oat-llm 0.2.4) runs ``PPOLearner.learning_step`` as installed
(:mod:`peers.makers.oat`; ``tests/peers/test_peer_oat.py``).
"""

from __future__ import annotations

from pathlib import Path

from peers.checks import preset_case
from peers.harness import Report, Unit, parser, root_of, run_venvs, selected, workdir

VENVS: dict[str, dict[str, Unit]] = {
    "verl-openrlhf": {
        "verl": Unit("verl", "peers.makers.verl_openrlhf:make_verl"),
        "openrlhf": Unit("openrlhf", "peers.makers.verl_openrlhf:make_openrlhf"),
        "verl:critic-free": Unit("verl", "peers.makers.critic_free:make_verl"),
        "verl:correction": Unit("verl", "peers.makers.verl_correction:make"),
        "openrlhf:critic-free": Unit("openrlhf", "peers.makers.critic_free:make_openrlhf"),
        "verl:gspo": Unit("verl", "peers.makers.verl_gspo:make"),
        "verl:kl-both": Unit("verl", "peers.makers.verl_kl_both:make"),
    },
    "skyrl-areal": {
        "skyrl": Unit("skyrl-train", "peers.makers.skyrl:make"),
        "areal": Unit("areal", "peers.makers.areal:make"),
        "areal:bootstrap": Unit("areal", "peers.makers.areal_bootstrap:make"),
        "skyrl:critic-free": Unit("skyrl-train", "peers.makers.critic_free_skyrl:make_skyrl"),
    },
    "trl": {"trl": Unit("trl", "peers.makers.trl_ppo:make_preset_cases")},
    "oat": {"oat": Unit("oat-llm", "peers.makers.oat:make")},
}
"""Side venv → unit (the preset before any ``:``) → (distribution, maker ``module:function``)."""
WITH_REFPPO = {"trl"}
"""Venvs whose makers import refppo (the capture adapter under test): the repository is on their path."""


def check_venvs(
    report: Report, venvs: dict[str, dict[str, Unit]], root: Path, work: Path, verbose: bool = False
) -> None:
    """Make each venv's dumps and check every case under its preset (:func:`preset_case`)."""
    for venv, units in venvs.items():
        runs = run_venvs(report, {venv: units}, root, work, with_refppo=venv in WITH_REFPPO)
        for unit, out, st in runs:
            for name in st["result"]:
                report.add(preset_case(unit, out, name, unit.split(":")[0], verbose))


def main(argv: list[str] | None = None) -> int:
    ap = parser("presets", __doc__, list(VENVS))
    ap.add_argument("--verbose", action="store_true", help="print every quantity's error")
    args = ap.parse_args(argv)
    report = Report("presets")
    with workdir(args.keep) as work:
        check_venvs(report, selected(args, VENVS), root_of(args), work, args.verbose)
    return report.finish(args.json_out)
