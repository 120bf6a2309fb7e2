"""Layer: what a workspace declares (the Cgfile, its TOML positions, labels, targets)."""
