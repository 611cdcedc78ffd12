"""An example hf_accel plugin: the ``example`` attention backend (see ``plugin.py`` and ``attention.py``)."""

__version__ = "0.1.0"
