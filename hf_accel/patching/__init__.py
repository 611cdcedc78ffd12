"""Patch time: the public API, the transaction of backend phases, verification, the report and the undo."""
