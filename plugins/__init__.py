"""hf_accel's built-in backends. Each module is an ordinary plugin, registered through the `hf_accel`
entry-point group in setup.cfg exactly as a third-party plugin would be."""
