"""Generate time: the patched generate path, the caches, the compiled decode step and the speculative loop."""
