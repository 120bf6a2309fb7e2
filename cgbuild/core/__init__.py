"""Layer 0: what every other layer stands on (canonical encoding, errors, codes, platform facts, files)."""
