"""The live Ray cluster: what it has (inspection, public Ray API) and where TP groups run."""
