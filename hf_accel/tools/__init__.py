"""The `hf-accel` command and the benchmarks: tooling beside the library, which never imports it."""
