"""The Any-Precision (AP) checkpoint format: layout, quantizers, reader and writer (docs/format.md)."""
