"""Capture a trainer's PPO step as a refppo dump (spec/dump-format.md).

``refppo.capture.adapters`` builds a dump from the peers' own containers (verl, OpenRLHF, TRL).
"""
