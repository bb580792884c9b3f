"""Tensor parallelism: the sharding table, collectives, tails and their legality, the routed
input, the per-rank runner and warm-up tuning (DESIGN §4)."""
