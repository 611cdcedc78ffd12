"""`hf-accel bench` and its variants: steady state, start-up, memory, processes, attention, one step, identity."""
