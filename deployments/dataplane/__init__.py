"""The tier's one data plane (design section 9.2): per-layer rows from a session's peers to the ranks
of its TP groups and back, over authenticated TCP connections with blocking waits.

``frames`` (messages and admission), ``errors`` (failure kinds and the one action table), ``host``
(rank 0 gathers, every rank forwards), ``peer`` (tickets and peers). Pure: no Ray, no torch.
"""
