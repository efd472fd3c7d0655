"""The split of ``refppo/oracle/presets.py`` and ``tools/mutate.py`` (smalls): the old import paths
still give the same objects, and the preset table keeps its order (``--preset`` help, the
diagnosis' "as in preset ..." lists and ``sorted`` listings read it)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import mutate  # noqa: E402  (tools/ is not a package)
import mutate_ops  # noqa: E402
import mutate_run  # noqa: E402
import mutate_scope  # noqa: E402

from refppo.oracle import presets, presets_base, presets_table_a, presets_table_b  # noqa: E402


def test_presets_old_paths_and_order() -> None:
    assert list(presets.PRESETS) == ["refppo", "verl", "openrlhf", "trl", "deepspeed-chat", "skyrl", "areal"]
    assert presets.PRESETS == {**presets_table_a.PRESETS_A, **presets_table_b.PRESETS_B}
    assert presets.Preset is presets_base.Preset and presets.KlClamps is presets_base.KlClamps
    assert presets.PRESETS["verl"].kl_clamps is presets._verl_kl_clamps is presets_base._verl_kl_clamps
    assert presets.PRESETS["openrlhf"].kl_clamps("k3") == {
        "kl_log_ratio_clamp": (-10.0, None),
        "kl_value_clamp": 10.0,
    }
    assert all(presets.get_preset(n).name == n for n in presets.PRESETS)


def test_mutate_old_names_are_the_parts() -> None:
    assert mutate.Mutant is mutate_ops.Mutant and mutate.list_mutants is mutate_ops.list_mutants
    assert mutate.run_module is mutate_run.run_module and mutate.module_path is mutate_scope.module_path
    assert mutate.MODULES == mutate_scope.MODULES and mutate.EQUIVALENT.name == "mutate_equivalent.json"
