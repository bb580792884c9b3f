"""Examples built on the tier, not part of the installed package: ``afd`` (a small decoder whose
MoE layers run on the tier, ``docs/afd.md``) and its demo, ``python -m examples.afd_demo``."""
