"""The pure-torch twin of every kernel: same names and signatures, the executable spec (NUMERICS.md)."""
