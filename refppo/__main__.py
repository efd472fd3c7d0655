"""``python -m refppo ...`` (also what ``torchrun -m refppo train ...`` runs)."""

from refppo.cli import main

raise SystemExit(main())
