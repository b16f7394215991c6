"""PagedWeight for SGLang: MoE expert weights as any-precision bit-planes with run-time bitwidths."""

__version__ = "0.1.0"
