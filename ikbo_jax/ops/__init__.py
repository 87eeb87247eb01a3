"""IKBO ops: one module per op, each with an XLA reference and kernel implementations."""
