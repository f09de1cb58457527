"""Routing as data: traces, record and replay sessions over a model, the routing mode of a run, churn between two
routings, router margins, and the routing traces of inference engines (docs/design.md sections 4 and 5)."""
