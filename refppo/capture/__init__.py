"""Capture one optimizer step of any PyTorch trainer as a v2 dump for ``refppo diff``.

:class:`StepRecorder` (see :mod:`refppo.capture.recorder`): ``record`` each micro-batch before its
backward, ``write`` once after the step's backward(s) on every rank; rank 0 writes one dump.
:mod:`refppo.capture.adapters` builds a dump from the peers' own containers (verl, OpenRLHF, TRL).
"""

from refppo.capture.recorder import CaptureError, StepRecorder

__all__ = ["CaptureError", "StepRecorder"]
