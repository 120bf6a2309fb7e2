"""Layer: the key and one producer per key axis (toolchain fold, layout digest pair)."""
