"""eyrie.stages.train.patches.lazy_imports: `import speculators` runs no model family but EAGLE-3; the others load,
register and reload speculators' schemas on first use, as if imported eagerly. A fresh interpreter each (the finder
acts only before speculators is imported)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = r"""
import json, sys
from eyrie.stages.train.patches import lazy_imports
installed = lazy_imports.install()
import speculators
from speculators.train.cli import main
from speculators.model import SpeculatorModel
from speculators.models.eagle3.core import Eagle3DraftModel
families = sorted(m for m in sys.modules if m.startswith("speculators.models.") and m.count(".") == 2)
before = sorted(SpeculatorModel.registry)
eagle_same = speculators.Eagle3DraftModel is Eagle3DraftModel
from speculators.models import DFlashSpeculatorConfig
import speculators.models.dflash.config as real
dflash_real = DFlashSpeculatorConfig is real.DFlashSpeculatorConfig
dflash_real = dflash_real and speculators.DFlashSpeculatorConfig is real.DFlashSpeculatorConfig
after_one = sorted(SpeculatorModel.registry)
lazy_imports.load_families_for("xpress")
try:
    speculators.NoSuchName
    missing = "no error"
except AttributeError as e:
    missing = str(e)
print(json.dumps(dict(installed=installed, families=families, before=before, eagle_same=eagle_same,
    dflash_real=dflash_real, after_one=after_one, after_all=sorted(SpeculatorModel.registry), missing=missing,
    all_ok=all(hasattr(speculators, n) for n in speculators.__all__))))
"""


def test_only_the_families_the_trainer_uses_are_imported_and_the_rest_load_on_first_use():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["installed"] is True
    # eagle3, and mtp only because speculators' CLI imports speculators.models.mtp.data
    assert "speculators.models.eagle3" in r["families"]
    for family in ("dflash", "dflash2", "dspark", "peagle", "xpress"):
        assert f"speculators.models.{family}" not in r["families"]
    assert r["before"] == ["eagle3", "mtp"]
    assert r["eagle_same"] and r["dflash_real"]
    assert "dflash" in r["after_one"]  # registered on first use
    assert {"dflash", "dflash2", "dspark", "eagle3", "mtp", "peagle", "xpress"} <= set(r["after_all"])
    assert "has no attribute 'NoSuchName'" in r["missing"]
    assert r["all_ok"]


def test_the_finder_stays_out_once_speculators_is_imported():
    probe = "import speculators\nfrom eyrie.stages.train.patches import lazy_imports\nprint(lazy_imports.install())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
