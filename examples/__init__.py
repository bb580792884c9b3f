"""Examples built on the tier, not part of the installed package: ``afd`` (a small decoder whose
MoE layers run on the tier, ``docs/afd.md``), its weights (``synthetic_decoder``: what
``scripts/make_checkpoint.py --decoder`` writes) and its demo, ``python -m examples.afd_demo``; ``rows``
(a stand-in attention worker whose attention is a lookup, for ``scripts/demo.py``'s cohort)."""
