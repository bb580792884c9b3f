"""Planning before anything runs: bytes per rank (``memory``) and time estimates (``cost``)."""
