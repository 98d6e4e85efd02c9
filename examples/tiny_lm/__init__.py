"""The reference task: a small decoder-only transformer over byte-level tokens."""
