"""Tracing a JAX function to our IR (:mod:`.trace`): loops (:mod:`.loops`), the keys that name
inputs (:mod:`.keys`), and the report of what cannot be traced (:mod:`.unsupported`)."""
