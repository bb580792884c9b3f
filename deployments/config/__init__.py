"""What the user asked for: the validated app/deployment spec, and its resolution against the
checkpoint. Pure: no Ray."""
