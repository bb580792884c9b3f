"""The live Ray cluster: what it has (inspection, public Ray API), where TP groups run, and a
private local one with Serve (``local``)."""
