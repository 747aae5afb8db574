"""flextensor's version, kept in the lowest layer so every part can read it without importing upwards."""

__version__ = "0.1.0"
